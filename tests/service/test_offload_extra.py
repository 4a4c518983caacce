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
    assert msg.endswith("pip install 'packbench[offload]'"), msg


def test_a_present_deepspeed_is_not_refused(monkeypatch, tiny):
    """The lookup is by the kind's library name (a lookup of the policy's name would always miss)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "deepspeed" else real(name, *a))
    check_libraries(_frozen("zero-inference", tiny).protocol)
