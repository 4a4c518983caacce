"""`zero-inference`'s runtime: DeepSpeed ZeRO-3 parameter offload (engine/zero_inference.py
`ZeroInferenceModel`), built when its episode needs it and dropped (never shelved: its partitions
and hooks belong to one DeepSpeed engine) when another condition takes the device."""

from collections.abc import Sequence

from packbench.core.protocol import Condition
from packbench.engine.conditions.base import CompetitorRuntime, Holder
from packbench.engine.zero_inference import ZeroInferenceModel, ZeroInferenceUnavailable, library


class ZeroInferenceRuntime(CompetitorRuntime):
    record_key = "offload"  # core/record.py: the DeepSpeed configuration and what partitioning cost
    unavailable = ZeroInferenceUnavailable

    def build(self, holder: Holder, params: dict) -> ZeroInferenceModel:
        return ZeroInferenceModel(holder.path, dtype=holder.dtype, device=holder.device,
                                  allowance_bytes=holder.allowance, context_bytes=holder.context,
                                  capacity=holder.capacity, batch=holder.batch, archived=holder.placement)

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        library(holder.device)  # missing or bound to another accelerator: one line with the fix, before any episode
        super().check(holder, conditions)


RUNTIME = ZeroInferenceRuntime()
