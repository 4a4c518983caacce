"""`host-experts`' runtime: Fiddler-style expert offload, packbench's implementation
(engine/moe/host_experts.py `HostExperts`). It runs on the worker's CPU-first MoE model itself,
whose experts already live in host memory: no model of its own is built, nothing is parked, and
entering it makes the device part the CPU-first model's again with a fresh `HostExperts` policy."""

from collections.abc import Sequence

from packbench.core.errors import PackbenchError
from packbench.core.protocol import Condition
from packbench.engine.conditions.base import CompetitorRuntime, Entered, Holder
from packbench.engine.moe.host_experts import HostExperts


class HostExpertsUnavailable(PackbenchError):
    """The loaded checkpoint is not an MoE model (one line, with the fix)."""


class HostExpertsRuntime(CompetitorRuntime):
    unavailable = HostExpertsUnavailable

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        """An OPT checkpoint is refused before any episode (submit refuses it first: core/moe.py
        family_refusal); the model just read is dropped."""
        if not hasattr(holder.model, "experts_modules"):
            holder.drop_model()
            raise self.unavailable(f"condition {conditions[0].name}: host-experts computes an MoE model's experts on "
                                   f"the host, and {holder.path} is not an MoE checkpoint; drop the condition")
        super().check(holder, conditions)

    def enter(self, holder: Holder, policy: str, params: dict) -> Entered:
        holder.release_competitor()
        holder.unpark()
        holder.model.use_policy(HostExperts(hot=params.get("hot", 0)))
        return Entered(holder.model, "eager")


RUNTIME = HostExpertsRuntime()
