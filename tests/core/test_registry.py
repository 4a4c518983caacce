"""core.registry: one source of policy parameters, dtypes, shapes and the synthetic-model check."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import packbench.core.protocol as protocol
from packbench.core.errors import PackbenchError, ProtocolError
from packbench.core.registry import (
    DTYPE_NAMES,
    POLICY_PARAMS,
    SHAPES,
    SYNTH_SHAPES,
    SynthArgumentError,
    check_param,
    param_default,
    synth_spec,
)

ROOT = Path(__file__).resolve().parents[2]
GOOD = dict(shape="tiny", dtype="float16", sparsity=0.9, seed=0)


def test_protocol_reexports_the_registry():
    for name in ("POLICY_PARAMS", "POLICY_NAMES", "DTYPE_NAMES", "SYNTH_SHAPES", "IntParam", "ChoiceParam"):
        assert getattr(protocol, name) is getattr(sys.modules["packbench.core.registry"], name), name


def test_registry_and_condition_kinds_import_no_torch():
    """Validation runs without torch: the registry, every condition kind's declaration and the
    estimate import none (a kind's torch half lives in engine/conditions/)."""
    code = ("import sys, packbench.core.registry, packbench.core.conditions, packbench.core.estimate, "
            "packbench.core.protocol; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})


def test_shapes_are_the_synth_shapes():
    assert SYNTH_SHAPES == tuple(SHAPES) and DTYPE_NAMES == ("float32", "float16", "bfloat16")
    assert all(set(dims) == {"hidden", "ffn", "layers", "heads", "vocab", "max_positions"} for dims in SHAPES.values())


def test_frozen_meanings_do_not_move():
    # A protocol's `packet` without params froze (schema 1) as the host gather; block_rows's
    # default is filled into frozen bodies; row-retention has never had a default.
    assert param_default("packet", "gather") == "host"
    assert param_default("sparse-extents", "block_rows") == 128
    assert param_default("row-retention", "rows_per_layer") is None


def test_check_param_names_what_is_allowed():
    assert check_param("sparse-extents", "block_rows", 16) == 16
    with pytest.raises(ValueError, match=r"block_rows must be an integer in \[1, 2147483647\], got 0"):
        check_param("sparse-extents", "block_rows", 0)
    with pytest.raises(ValueError, match=r"rows_per_layer must be an integer in \[1, 2147483647\], got True"):
        check_param("row-retention", "rows_per_layer", True)
    with pytest.raises(ValueError, match="gather must be one of host, device, mapped, got 'gpu'"):
        check_param("packet", "gather", "gpu")  # mapped: an MoE model's expert gather
    with pytest.raises(ValueError, match="gather must be one of host, device, got 'mapped'"):
        check_param("early-forecast", "gather", "mapped")
    assert set(POLICY_PARAMS) == set(protocol.POLICY_NAMES)


def test_synth_spec_fills_defaults_and_normalises_numbers():
    assert synth_spec(**GOOD) == {**GOOD, "hot_fraction": 0.0, "hot_bias": 0.0}
    spec = synth_spec(**GOOD, hot_fraction=0, hot_bias=-2)
    assert (type(spec["hot_fraction"]), type(spec["hot_bias"])) == (float, float)


@pytest.mark.parametrize("arg, value, reason, line", [
    ("shape", "opt-9b", "'opt-9b' is not allowed; use one of " + ", ".join(SYNTH_SHAPES),
     "unknown --shape 'opt-9b'; use one of tiny, opt-125m"),
    ("dtype", "float8", "'float8' is not allowed; use one of float32, float16, bfloat16",
     "unknown --dtype 'float8'; use one of float32"),
    ("sparsity", 1.0, "1.0 is not a finite number > 0.0 and < 1.0", "--sparsity 1.0 is not a finite number > 0.0"),
    ("sparsity", math.nan, "nan is not a finite number > 0.0 and < 1.0", "--sparsity nan is not"),
    ("seed", -1, "-1 is not an integer in [0, 9223372036854775807]", "--seed -1 is not an integer in [0, "),
    ("seed", 2**64, "18446744073709551616 is not an integer in [0, 9223372036854775807]", "--seed 18446744073709551616 is not"),
    ("seed", True, "True is not an integer in [0, 9223372036854775807]", "--seed True is not"),
    ("hot_fraction", 1.0, "1.0 is not a finite number >= 0.0 and < 1.0", "--hot-fraction 1.0 is not"),
    ("hot_bias", math.inf, "inf is not a finite number >= -1000.0 and < 1000.0", "--hot-bias inf is not a finite number"),
])
def test_synth_spec_names_the_bad_argument_and_what_it_allows(arg, value, reason, line):
    with pytest.raises(SynthArgumentError) as e:
        synth_spec(**{**GOOD, arg: value})
    assert e.value.arg == arg and e.value.reason == reason
    assert e.value.line("--" + arg.replace("_", "-")).startswith(line)
    assert isinstance(e.value, ValueError) and isinstance(e.value, PackbenchError)
    assert str(e.value) == e.value.line(arg)


def quickstart_with(model: dict) -> dict:
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"] = model
    return body


def test_protocol_reports_synth_errors_through_the_registry():
    with pytest.raises(ProtocolError, match=r"^protocol field `model.synth.sparsity`: 0.0 is not a finite number > 0.0"):
        protocol.validate(quickstart_with({"synth": {**GOOD, "sparsity": 0.0}}))
    assert protocol.validate(quickstart_with({"synth": GOOD}))["model"] == {"synth": synth_spec(**GOOD)}
