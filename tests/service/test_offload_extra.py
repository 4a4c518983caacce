"""Submit refuses a `zero-inference` condition where deepspeed is not installed: one line naming
the condition and the `[offload]` extra (not the `[lowbit]` one, which would not bring it). Runs in
the default suite, with or without deepspeed installed."""

import importlib.util

import pytest

from packbench.core.errors import ProtocolError
from packbench.core.protocol import freeze
from packbench.service.submit import check_libraries


def _frozen(policy: str, model):
    return freeze({"name": "peers", "model": {"path": str(model)}, "dtype": "float32",
                   "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8, "continuation_tokens": 2,
                   "conditions": [{"policy": "dense-stream"}, {"policy": policy}], "reference": "dense-stream",
                   "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}})


def test_missing_deepspeed_is_refused_with_the_offload_extra(monkeypatch, tiny):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ProtocolError) as e:
        check_libraries(_frozen("zero-inference", tiny).protocol)
    msg = str(e.value)
    assert "\n" not in msg and "conditions[1].policy" in msg and "zero-inference" in msg
    assert msg.endswith("pip install --no-build-isolation 'packbench[offload]'"), msg


def test_a_present_deepspeed_is_not_refused(monkeypatch, tiny):
    """The lookup is by the kind's library name (a lookup of the policy's name would always miss)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "deepspeed" else real(name, *a))
    check_libraries(_frozen("zero-inference", tiny).protocol)


def test_an_allowance_below_deepspeeds_minimum_is_refused_at_validate_naming_the_allowance_it_needs(tiny):
    """validate/plan/submit (check_family) refuse a zero-inference condition whose allowance cannot
    hold the token embedding gathered beside the KV cache and activations, in one line naming the
    allowance that would do; the torch-free minimum is the worker's own (engine ZeroBudget.needed on
    the CPU, where there is no context), so the two never disagree about a protocol."""
    import torch

    from packbench.core.conditions.zero_inference import allowance_refusal, minimum_allowance
    from packbench.engine.checkpoint import build_weights
    from packbench.engine.config import read_config
    from packbench.engine.opt_weights import stock_model
    from packbench.engine.zero_inference import budget
    from packbench.service.submit import check_family

    config = read_config(tiny)
    need = minimum_allowance(config, dtype="float32", capacity=10, batch=1)
    w = build_weights(tiny, dtype=torch.float32)
    engine = budget(stock_model(w, vars(w.config)), w.config, dtype=torch.float32, allowance=0, context=0, held=0,
                    capacity=10, batch=1, cuda=False)
    assert need == engine.needed
    check_family(_frozen("zero-inference", tiny))  # 64 MiB holds a tiny model
    refusal = allowance_refusal(config, dtype="float32", capacity=10, batch=1, allowance_bytes=need - 1)
    assert refusal and "\n" not in refusal and f"at least {-(-need // (1 << 20))} MiB" in refusal
    assert allowance_refusal(config, dtype="float32", capacity=10, batch=1, allowance_bytes=need) is None


def test_validate_refuses_zero_inference_on_an_opt_125m_under_64_mib(checkpoint_125m):
    """The refusal reaches the protocol: OPT-125m's token embedding alone (38.6M float32 values,
    147 MiB) is over 64 MiB, so the protocol is refused before anything is queued."""
    from packbench.service.submit import check_family

    with pytest.raises(ProtocolError, match=r"allowance_mib.*zero-inference needs an allowance of at least \d+ MiB") as e:
        check_family(_frozen("zero-inference", checkpoint_125m))
    assert "\n" not in str(e.value)
    check_family(_frozen("accelerate", checkpoint_125m))  # only zero-inference is refused


def _synth(policy: str, *, dtype: str = "float32", params: dict | None = None, allowance_mib: int = 64):
    return freeze({"name": "peers", "model": {"synth": {"shape": "opt-125m", "dtype": dtype, "seed": 0}},
                   "dtype": dtype, "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
                   "continuation_tokens": 2,
                   "conditions": [{"policy": "dense-stream"}, {"policy": policy, **({"params": params} if params else {})}],
                   "reference": "dense-stream", "warmups": 1, "allowance_mib": allowance_mib,
                   "gates": {"faithfulness": {}}})


@pytest.mark.parametrize("frozen, match", [
    (lambda: _synth("zero-inference"), r"`allowance_mib`: condition policy zero-inference needs an allowance of at least"),
    (lambda: _synth("flexgen"), r"`dtype`: condition flexgen \(flexgen\) runs in float16 only"),
    (lambda: _synth("flexgen", dtype="float16", params={"w_gpu_percent": 100}, allowance_mib=200),
     r"`conditions\[1\]\.params\.w_gpu_percent`: condition policy flexgen with w_gpu_percent 100 needs"),
])
def test_the_offloading_peers_refusals_hold_for_a_synthetic_opt_shape(frozen, match):
    """check_family returned at once for a `model.synth` protocol, so validate and submit queued a
    synthetic OPT-125m zero-inference screen under 64 MiB (its embedding alone is 147 MiB) and flexgen
    in float32 or at a placement over the allowance; each then failed on the worker instead."""
    from packbench.service.submit import check_family

    with pytest.raises(ProtocolError, match=match) as e:
        check_family(frozen())
    assert "\n" not in str(e.value)
    check_family(_synth("accelerate"))  # only the peers that cannot run are refused
