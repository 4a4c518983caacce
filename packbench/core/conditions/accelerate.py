"""`accelerate`: Hugging Face accelerate's big-model offload (a competitor, tier exact), on OPT and
on MoE checkpoints (stock transformers' modules either way); its runtime is
engine/conditions/accelerate.py over engine/accelerate.py."""

from typing import Any, Mapping

from packbench.core.conditions.base import MODE_PARAM, CallInputs, Competitor, ConditionKind
from packbench.core.errors import PlacementDoesNotFit

LIBRARY = "accelerate"
# Its hooks copy in Python on every call: nothing to capture, so mode eager only.
CAPTURE_REFUSAL = "accelerate's hooks copy each offloaded weight from pageable host memory in Python on every call"


def replay_max_memory(recorded: Mapping[str, Any], *, allowance: int, reserve: int) -> int:
    """The device budget an archived episode's `offload` gave accelerate (`max_memory_bytes`: its
    device map follows from it), to place the model again as the archive did on a worker that must
    keep `reserve` bytes of the `allowance` for its own context, holdings, KV cache and margin (a
    re-execution). PlacementDoesNotFit (one line) where the allowance less that is smaller."""
    archived = recorded.get("max_memory_bytes")
    if type(archived) is not int or archived < 0:
        raise ValueError("the archived offload has no max_memory_bytes (a non-negative integer) to place by")
    if allowance - reserve < archived:
        raise PlacementDoesNotFit(f"the archived accelerate placement gave the device {archived >> 20} MiB of "
                                  f"weights, this worker has {max(0, allowance - reserve) >> 20} MiB of the allowance "
                                  f"left beside its context, holdings, KV cache and margin ({reserve >> 20} MiB)")
    return archived


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """The parameters beyond the allowance, whole layers every call (an upper estimate: not per layer)."""
    shape = call.shape
    return float(max(0, shape.param_count() * (call.row_bytes // shape.hidden) - call.allowance_bytes))


KIND = ConditionKind(
    name="accelerate",
    summary="accelerate's offload: whole layers beyond the allowance copied every call",
    params={"mode": MODE_PARAM},  # device_map, max_memory = the allowance
    h2d_bytes=h2d_bytes,
    since=6,
    competitor=Competitor(library=lambda params: LIBRARY, fastest_mode=lambda params: "eager",
                          capture_refusal=lambda params: CAPTURE_REFUSAL),
    families=("opt", "moe"),
)
