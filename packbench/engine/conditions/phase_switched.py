"""`phase-switched`'s runtime: dense prefill, exact packets in decode, gathered on the host (one
mask readback per layer) or by the device (engine/policies/host_gather.py, device_gather.py)."""

from packbench.core.registry import check_param, param_default
from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.moe.policies import ExpertMappedPhaseSwitched
from packbench.engine.policies.base import LoaderPolicy
from packbench.engine.policies.device_gather import DevicePhaseSwitched
from packbench.engine.policies.host_gather import PhaseSwitched

# `mapped` is an MoE model's (the schema and submit refuse it for OPT).
PHASE_SWITCHED_GATHERS: dict[str, type[LoaderPolicy]] = {"host": PhaseSwitched, "device": DevicePhaseSwitched,
                                                         "mapped": ExpertMappedPhaseSwitched}


def phase_switched(*, gather: str = param_default("phase-switched", "gather")) -> LoaderPolicy:
    """A fresh `phase-switched` policy."""
    return PHASE_SWITCHED_GATHERS[check_param("phase-switched", "gather", gather)]()


# DevicePhaseSwitched is captured: its decode is DevicePacket's gather.
RUNTIME = LoaderRuntime(policy=phase_switched, graph_safe=lambda policy: policy.gather in ("device", "mapped"))
