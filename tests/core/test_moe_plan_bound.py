"""core/moe.py's `call_bytes_bound` (the `bound` column of `protocol plan` on an MoE model) against
what the engine's forecast rule moves, counted by hand.

Bug caught: `expert-forecast` was said to move "at least" `call_bytes`' estimate in every call.
The estimate is min(E, k x tokens) experts a layer, the demand only of a one-token call; in a longer
call (every prefill, a decode at batch > 1) tokens share experts, and a forecast that guessed right
moves fewer. A screen (qwen3-moe-tiny, 12-token prompts) planned 1,179,648 B "at least" for the
prefill and moved 1,081,344."""

from packbench.core.expert_cache import forecast_step
from packbench.core.moe import MoeShape, call_bytes, call_bytes_bound


def test_a_forecast_moves_less_than_the_estimate_in_a_call_of_two_tokens():
    shape = MoeShape.of("mixtral-tiny", layers=1)  # 8 experts, top 2
    eb = shape.expert_bytes("float32")
    # Two tokens, both routed to experts 0 and 1, and the forecast right: 2 experts prefetched, no
    # miss left to fetch, so 2 experts move (engine/moe/cache.py: prefetched + misses not brought).
    f = forecast_step([0, 1], cached=(), routed=[0, 1])
    moved = len(f.prefetched) + len({0, 1} - set(f.used))
    estimate = call_bytes(shape, "float32", "expert-forecast", tokens=2, phase="decode")
    assert moved * eb == 2 * eb < estimate == 4 * eb
    assert call_bytes_bound("expert-forecast", {}, tokens=2) != "at least"
    assert call_bytes_bound("expert-forecast", {}, tokens=2) == "about"


def test_a_forecast_of_one_token_moves_at_least_the_estimate():
    # One token: its k experts are distinct, the estimate is the demand, and a wrong forecast adds.
    shape = MoeShape.of("mixtral-tiny", layers=1)
    eb = shape.expert_bytes("float32")
    f = forecast_step([5, 6], cached=(), routed=[0, 1])  # both wrong: 2 wasted, 2 misses fetched
    moved = len(f.prefetched) + len({0, 1} - set(f.used))
    assert moved * eb >= call_bytes(shape, "float32", "expert-forecast", tokens=1, phase="decode") == 2 * eb
    assert call_bytes_bound("expert-forecast", {}, tokens=1) == "at least"
    assert call_bytes_bound("packet", {}, tokens=64) == "at most"
    assert call_bytes_bound("expert-cache", {"capacity": 2, "forecast": "on"}, tokens=1) == "about"
