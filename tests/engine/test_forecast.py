"""early-forecast's decisions on hand-built activity sequences."""

import torch

from packbench.engine.policies.host_gather import forecast_split


def replay(calls: list[list[int]]) -> list[tuple[list[int], int, int]]:
    """Per call: (remainder sent after fc1, rows wasted, rows copied) with the previous call's
    active set as the forecast, as EarlyForecast does per layer (the first call has none)."""
    out, previous = [], None
    for active in calls:
        a = torch.tensor(active, dtype=torch.int64)
        if previous is None:
            out.append((active, 0, len(active)))
        else:
            remainder, wasted = forecast_split(previous, a)
            out.append((remainder.tolist(), wasted, previous.numel() + remainder.numel()))
        previous = a
    return out


def test_a_perfect_forecast_sends_no_remainder():
    assert replay([[1, 4, 9], [1, 4, 9]])[1] == ([], 0, 3)


def test_misses_are_completed_and_waste_is_counted():
    # call 2 keeps 4, drops 1 and 9 (wasted), adds 7 (remainder)
    assert replay([[1, 4, 9], [4, 7]])[1] == ([7], 2, 4)


def test_every_active_row_is_covered():
    calls = [[0, 2, 5], [2, 3], [], [3, 8, 9], [0, 9]]
    previous = None
    for active, (remainder, wasted, copied) in zip(calls, replay(calls)):
        forecast = set() if previous is None else set(previous)
        assert set(active) <= forecast | set(remainder)
        assert wasted == len(forecast - set(active))
        assert copied - wasted == len(active)  # copied = demand + waste, the ledger's identity
        previous = active


def test_fc1_hooks_exist_only_while_a_policy_starts_early(tiny):
    from packbench.engine.model import CpuFirstModel

    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    hooked = lambda: [len(fc1._forward_pre_hooks) for fc1 in model._fc1]  # noqa: E731
    model.use("packet")
    assert set(hooked()) == {0}
    model.use("early-forecast")
    assert set(hooked()) == {1}
    model.use("early-forecast")  # a fresh policy, still one hook per layer
    assert set(hooked()) == {1}
    model.use("dense-stream")  # issues the next layer's copy at fc1
    assert set(hooked()) == {1}
    model.use("resident")
    assert set(hooked()) == {0}
