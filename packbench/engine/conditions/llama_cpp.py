"""`llama-cpp`'s runtime: llama.cpp on the GGUF conversion of the worker's MoE checkpoint, its
placement chosen from the allowance or frozen in the condition (engine/llama_cpp.py `LlamaCppModel`),
built when its episode needs it and dropped (never shelved: its device memory is llama.cpp's, and
another placement is another model) when another condition takes the device."""

from collections.abc import Sequence

from packbench.core.protocol import Condition
from packbench.engine.conditions.base import CompetitorRuntime, Holder
from packbench.engine.config import read_config
from packbench.engine.llama_cpp import LlamaCppModel, LlamaCppUnavailable, library, refusal


class LlamaCppRuntime(CompetitorRuntime):
    record_key = "offload"  # core/record.py: the placement, the allowance's arithmetic behind it, what it cost
    unavailable = LlamaCppUnavailable

    def build(self, holder: Holder, params: dict) -> LlamaCppModel:
        from packbench.engine.worker import DEFAULT_MODEL_CACHE

        return LlamaCppModel(holder.path, dtype=holder.dtype, device=holder.device, params=params,
                             allowance_bytes=holder.allowance, context_bytes=holder.context,
                             capacity=holder.capacity, batch=holder.batch,
                             cache=getattr(holder, "model_cache", None) or DEFAULT_MODEL_CACHE,
                             archived=holder.placement)

    def identity(self, params: dict):
        return tuple(sorted(params.items()))  # the placement is the model: another n_cpu_moe, another build

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        """A missing or CPU-only llama-cpp-python on a GPU worker, or a model it cannot convert, is
        refused before any episode (the model just read is dropped)."""
        library()  # missing: one line with the fix
        why = refusal(holder.device, read_config(holder.path))
        if why is not None:
            holder.drop_model()
            raise LlamaCppUnavailable(f"condition {conditions[0].name}: {why}")
        super().check(holder, conditions)


RUNTIME = LlamaCppRuntime()
