"""The runtime half of a condition kind: how a worker builds, holds and releases what its
episodes run on. The declaration half (parameters, tier, estimate, refusals) is
core/conditions/<same module>.py.

Two shapes cover every kind so far:

- `LoaderRuntime`: one of packbench's own loader policies over the worker's CPU-first model.
  Entering it releases any competitor, moves the CPU-first model's device part back
  (`unpark`) and activates a fresh policy from `policy(**params)`.
- `CompetitorRuntime`: a model of the kind's own, built CPU-first from the same checkpoint
  (`build`), held on the device alone while its episodes run (the CPU-first model parked on
  the host meanwhile), then shelved on the host where it can be or dropped.

The worker (engine/worker.py) only calls `check`, `prepare` and `enter` and reads
`record_key` / `start_key`; it never asks which kind it holds. `Holder` is what a runtime
may ask of the worker: the single owner of the device's state (which model it holds, what is
parked or shelved).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from packbench.core.protocol import Condition
from packbench.core.registry import resolved_params, stack_refusal
from packbench.engine.policies.base import LoaderPolicy


class Holder(Protocol):
    """What a runtime may use of the worker: the loaded checkpoint and the device's one owner."""

    model: Any  # engine.model.CpuFirstModel
    mode: str  # the screen's engine mode
    device: torch.device
    path: Path
    dtype: torch.dtype
    allowance: int  # the protocol's allowance, bytes
    context: int  # the CUDA context's bytes
    capacity: int  # prefix + continuation tokens of an episode
    batch: int  # sequences decoded together (the protocol's batch)
    # The archived `offload` section a re-execution hands over for this episode: a competitor
    # places itself as the archive says instead of choosing again at this worker's context (None).
    placement: dict | None

    def hold(self, policy: str, params: dict, runtime: CompetitorRuntime) -> tuple[Any, str]: ...
    def release_competitor(self) -> None: ...
    def unpark(self) -> None: ...
    def drop_model(self) -> None: ...
    def lift_allowance(self) -> None: ...


class Entered(NamedTuple):
    """What an episode runs on: the model, its engine mode, and the figures of building it
    (None for a loader: its buffers are charged through the policy). A tuple, unpacked where it
    is received: nothing but the episode's own names may hold the model (a failed episode's
    model must be gone before the device is freed)."""

    model: Any
    mode: str
    built: dict | None = None


class ConditionRuntime(Protocol):
    """One condition kind on a worker."""

    # The episode-record field its build figures go to, and the start-record field its load-time
    # figures go to (always present, empty when the protocol names none); None: it has none.
    record_key: str | None
    start_key: str | None

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        """Refuse the screen at load, before any episode (a missing library, a refused mode)."""

    def prepare(self, holder: Holder, conditions: Sequence[Condition]) -> dict | None:
        """Build what the kind's episodes need once per screen; the start-record figures or None."""

    def enter(self, holder: Holder, policy: str, params: dict) -> Entered:
        """Make the device hold what condition (`policy`, `params`) runs on, fresh for an episode."""


@dataclass(frozen=True)
class LoaderRuntime:
    """A packbench loader policy over the worker's CPU-first model. `policy(**params)` makes a
    fresh policy (keyword-only parameters, exactly the kind's, with its defaults);
    `lifts_allowance(params)` says an episode runs without the protocol's device cap (resident's
    `allowance: unbounded`, re-imposed after the episode as after every one); `graph_safe(policy)`
    says mode graph may capture the active policy's decode step on CUDA (engine/graph.py)."""

    policy: Callable[..., LoaderPolicy]
    lifts_allowance: Callable[[dict], bool] = lambda params: False
    graph_safe: Callable[[Any], bool] = lambda policy: False
    record_key: str | None = None
    start_key: str | None = None

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        pass  # packbench's own loaders need no library and capture wherever the engine mode says

    def prepare(self, holder: Holder, conditions: Sequence[Condition]) -> dict | None:
        return None  # a fresh policy per episode: nothing to build ahead

    def enter(self, holder: Holder, policy: str, params: dict) -> Entered:
        holder.release_competitor()
        holder.unpark()
        if holder.device.type == "cuda" and self.lifts_allowance(params):
            holder.lift_allowance()
        holder.model.use_policy(self.policy(**params))
        return Entered(holder.model, holder.mode)


class CompetitorRuntime:
    """A kind that runs a model of its own (a competitor). Subclasses give `build`, and may
    give `identity` (what else than the policy, dtype and checkpoint tells two built models
    apart), `check` and `prepare`. `unavailable` is the error a refused condition raises.

    Lifecycle: built (`build`, at `prepare` or at its first episode) -> held on the device alone
    while its episodes run (`Holder.hold`, the CPU-first model parked) -> released when another
    condition takes the device: shelved on the host where its model says `can_shelve` (then
    `shelve()`, and `unshelve()` when its condition runs again), else dropped and rebuilt. The
    model offers what the episode loop reads (`device`, `recorder`, `mode`, `new_cache`,
    `forward`) and `stats.as_dict()`, its build figures (`device_bytes` among them)."""

    record_key: str | None = None
    start_key: str | None = None
    unavailable: type[Exception] = RuntimeError

    def build(self, holder: Holder, params: dict) -> Any:
        raise NotImplementedError

    def identity(self, params: dict) -> Any:
        return None

    def check(self, holder: Holder, conditions: Sequence[Condition]) -> None:
        """A mode that failed on the measured CUDA stack is refused before any episode (the model
        just read is dropped); on the CPU nothing is captured, so nothing is refused."""
        for c in conditions:
            fails = stack_refusal(c.policy, c.resolved_params)
            if fails and holder.device.type == "cuda":
                holder.drop_model()
                raise self.unavailable(f"condition {c.name}: mode {c.resolved_params['mode']} cannot run on this "
                                       f"CUDA stack: {fails}; freeze the condition with mode compile")

    def prepare(self, holder: Holder, conditions: Sequence[Condition]) -> dict | None:
        return None

    def enter(self, holder: Holder, policy: str, params: dict) -> Entered:
        model, state = holder.hold(policy, params, self)
        built = {**model.stats.as_dict(), "state": state}
        if state == "shelved":  # the move back and the graphs made again, outside the episode's wall
            built["unshelve_s"] = model.unshelve_s
        # The mode frozen in the condition (schema 6), else eager.
        return Entered(model, resolved_params(policy, params)["mode"], built)
