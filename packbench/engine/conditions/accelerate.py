"""`accelerate`'s runtime: Hugging Face accelerate's big-model offload (engine/accelerate.py
`AcceleratedModel`), built when its episode needs it with `max_memory` from the allowance, and
dropped (never shelved) when another condition takes the device."""

from collections.abc import Sequence

from packbench.core.protocol import Condition
from packbench.engine.accelerate import AcceleratedModel, AccelerateUnavailable, library
from packbench.engine.conditions.base import CompetitorRuntime, Holder


class AccelerateRuntime(CompetitorRuntime):
    record_key = "offload"  # core/record.py: what accelerate placed where, and its cost
    unavailable = AccelerateUnavailable

    def build(self, holder: Holder, params: dict) -> AcceleratedModel:
        return AcceleratedModel(holder.path, dtype=holder.dtype, device=holder.device,
                                allowance_bytes=holder.allowance, context_bytes=holder.context,
                                capacity=holder.capacity, batch=holder.batch, archived=holder.placement)

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        library()  # not installed: AccelerateUnavailable, one line with the fix, before any episode
        super().check(holder, conditions)


RUNTIME = AccelerateRuntime()
