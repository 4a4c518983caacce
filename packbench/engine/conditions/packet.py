"""`packet`'s runtime: exact active rows, gathered on the host or by the device, as the
checkpoint holds them or quantized to int8 rows (engine/policies/host_gather.py,
device_gather.py, int8.py)."""

from packbench.core.registry import check_param, param_default
from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.moe.policies import ExpertMappedPacket
from packbench.engine.policies.base import LoaderPolicy
from packbench.engine.policies.device_gather import DevicePacket
from packbench.engine.policies.host_gather import Packet
from packbench.engine.policies.int8 import Int8DevicePacket, Int8Packet

# Its gathers: a plain table whose keys are the kind's `gather` choices; the int8 weight format
# has its own, with the same keys.
# `mapped` is an MoE model's (its expert packet; the schema and submit refuse it for OPT).
PACKET_GATHERS: dict[str, type[LoaderPolicy]] = {"host": Packet, "device": DevicePacket, "mapped": ExpertMappedPacket}
INT8_PACKET_GATHERS: dict[str, type[LoaderPolicy]] = {"host": Int8Packet, "device": Int8DevicePacket}
PACKET_WEIGHTS: dict[str, dict[str, type[LoaderPolicy]]] = {"dtype": PACKET_GATHERS, "int8": INT8_PACKET_GATHERS}


def packet(*, gather: str = param_default("packet", "gather"),
           weights: str = param_default("packet", "weights")) -> LoaderPolicy:
    """A fresh `packet` policy."""
    by_gather = PACKET_WEIGHTS[check_param("packet", "weights", weights)]
    return by_gather[check_param("packet", "gather", gather)]()


# DevicePacket and its int8 twin are captured (one Triton kernel each); the host gather reads a mask back.
RUNTIME = LoaderRuntime(policy=packet, graph_safe=lambda policy: policy.gather in ("device", "mapped"))
