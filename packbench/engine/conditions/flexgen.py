"""`flexgen`'s runtime: FlexGen's OptLM under the condition's placement policy (engine/flexgen.py
`FlexGenModel`), built when its episode needs it and dropped (never shelved: its weights are placed
by the policy, and a condition with another policy is another model) when another condition takes
the device. CUDA only: a CPU worker refuses it at check time, before any episode."""

from collections.abc import Sequence

from packbench.core.protocol import Condition
from packbench.engine.conditions.base import CompetitorRuntime, Holder
from packbench.engine.flexgen import FlexGenModel, FlexGenUnavailable, library, refusal


class FlexGenRuntime(CompetitorRuntime):
    record_key = "offload"  # core/record.py: FlexGen's policy, the allowance's arithmetic behind it, what placement cost
    unavailable = FlexGenUnavailable

    def build(self, holder: Holder, params: dict) -> FlexGenModel:
        from packbench.engine.worker import DEFAULT_MODEL_CACHE

        return FlexGenModel(holder.path, dtype=holder.dtype, device=holder.device, params=params,
                            allowance_bytes=holder.allowance, context_bytes=holder.context,
                            capacity=holder.capacity, batch=holder.batch,
                            cache=getattr(holder, "model_cache", None) or DEFAULT_MODEL_CACHE,
                            archived=holder.placement)

    def identity(self, params: dict):
        return tuple(sorted(params.items()))  # the placement is the model: another policy, another build

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        why = refusal(holder.device, holder.dtype)  # CUDA and float16 only: one line, before any episode
        if why is not None:
            raise FlexGenUnavailable(why)
        library()  # missing: one line with the fix
        super().check(holder, conditions)


RUNTIME = FlexGenRuntime()
