"""The engine's policy constructors agree with core.registry (what protocols validate against),
and every policy's buffers live exactly from activate to deactivate."""

import inspect

import pytest
import torch

from packbench.core.conditions import CONDITIONS
from packbench.core.registry import POLICY_PARAMS, SCHEMA3_DEFAULTS, ChoiceParam, IntParam
from packbench.engine.model import CpuFirstModel
from packbench.engine.conditions import POLICIES
from packbench.engine.conditions.packet import PACKET_GATHERS
from packbench.engine.moe.policies import ExpertPolicy
from packbench.engine.policies.base import LoaderPolicy
from packbench.engine.policies.device_gather import DevicePacket
from packbench.engine.policies.host_gather import Packet


def constructions(name: str):
    """(params, what they test) for `name`: the registry's defaults, then every choice and minimum."""
    spec = POLICY_PARAMS[name]
    required = {k: p.minimum for k, p in spec.items() if isinstance(p, IntParam) and p.default is None}
    yield required
    for key, param in spec.items():
        values = param.choices if isinstance(param, ChoiceParam) else (param.minimum,)
        for value in values:
            yield {**required, key: value}


def test_the_engine_has_exactly_the_registry_policies():
    # The expert-only kinds (expert-cache, expert-forecast) build MoE policies: tests/engine/test_moe_cache.py.
    assert list(POLICIES) == [n for n in POLICY_PARAMS if "opt" in CONDITIONS[n].families]


@pytest.mark.parametrize("name", list(POLICIES))
def test_constructor_parameters_are_the_registry_parameters(name):
    params = inspect.signature(POLICIES[name]).parameters
    assert list(params) == list(POLICY_PARAMS[name]), name
    for key, p in params.items():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, (name, key)
        default = POLICY_PARAMS[name][key].default
        assert p.default == (inspect.Parameter.empty if default is None else default), (name, key)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registry_value_constructs_a_policy_of_that_name(name):
    for params in constructions(name):
        policy = POLICIES[name](**params)
        # `gather: mapped` is an MoE model's (the schema refuses it for OPT): it builds the expert
        # policy of the same name, which CpuFirstMoE runs (would catch it building an OPT loader).
        kind = ExpertPolicy if params.get("gather") == "mapped" else LoaderPolicy
        assert isinstance(policy, kind) and policy.name == name, params
        assert policy.device_bytes() == 0 and policy.pinned_bytes() == 0, params  # nothing held yet


def test_packet_gathers_are_the_registry_choices():
    assert tuple(PACKET_GATHERS) == POLICY_PARAMS["packet"]["gather"].choices
    assert type(POLICIES["packet"]()) is Packet  # a schema-1/2 `packet` without params: gather host
    assert type(POLICIES["packet"](**SCHEMA3_DEFAULTS["packet"])) is DevicePacket  # a schema-3 one
    assert type(POLICIES["packet"](gather="device")) is DevicePacket
    for gather in PACKET_GATHERS:  # the class says where it gathers (read by code that must know)
        assert POLICIES["packet"](gather=gather).gather == gather


@pytest.mark.parametrize("name, params, fragment", [
    ("packet", {"gather": "gpu"}, "gather must be one of host, device"),
    ("sparse-extents", {"block_rows": 0}, "block_rows must be an integer in \\[1, 2147483647\\]"),
    ("row-retention", {"rows_per_layer": -1}, "rows_per_layer must be an integer in \\[1, 2147483647\\]"),
    # Bug: Resident kept any `allowance` and ran held (only "unbounded" lifts the cap), so a
    # misspelt "unbouned" silently measured the other condition.
    ("resident", {"allowance": "unbouned"}, "allowance must be one of held, unbounded"),
])
def test_bad_values_are_refused_naming_what_is_allowed(name, params, fragment):
    with pytest.raises(ValueError, match=fragment):
        POLICIES[name](**params)


def test_row_retention_has_no_engine_default():
    with pytest.raises(TypeError):
        POLICIES["row-retention"]()


# Device and pinned bytes on the CPU (tiny, float32: hidden 64, ffn 256, 2 layers), as charged
# before issue 9 moved the buffers: workspace 64 KiB, one row packet 256 x (8 + 256) B.
WORKSPACE, PACKET = 64 * 256 * 4, 256 * (8 + 64 * 4)
CHARGED = {
    ("resident", ()): 2 * WORKSPACE,
    ("dense-stream", ()): 2 * WORKSPACE,  # double-buffered since issue 11 (one workspace before)
    ("sparse-extents", (("block_rows", 16),)): WORKSPACE + PACKET,
    ("packet", ()): WORKSPACE + PACKET,
    ("packet", (("gather", "device"),)): WORKSPACE + 2 * 4,
    ("phase-switched", ()): WORKSPACE + PACKET,
    ("phase-switched", (("gather", "device"),)): 2 * WORKSPACE + 2 * 4,  # dense-stream's two, the counts
    ("row-retention", (("rows_per_layer", 48),)): WORKSPACE + PACKET + 2 * 48 * 64 * 4,
    ("early-forecast", ()): WORKSPACE + 2 * PACKET,
    # two workspaces, the forecast (2 layers x 256 int8) and the counts (4 x 2 int32)
    ("early-forecast", (("gather", "device"),)): 2 * WORKSPACE + 2 * 256 + 4 * 2 * 4,
}


def test_buffers_exist_from_activate_to_deactivate_and_are_charged(tiny):
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    assert {name for name, _ in CHARGED} == set(POLICIES)
    for (name, params), device_bytes in CHARGED.items():
        policy = POLICIES[name](**dict(params))
        policy.activate(model.host, model.device, model.recorder)
        assert (policy.device_bytes(), policy.pinned_bytes()) == (device_bytes, 0), name  # pinned: CUDA only
        policy.deactivate()
        assert policy.device_bytes() == 0 and not [v for v in vars(policy).values() if isinstance(v, torch.Tensor)]
        assert getattr(policy, "buffers", None) is None, name
