"""The runtime half of every condition kind, one module per kind, named as its declaration in
core/conditions/ (`ConditionKind`: parameters, tier, estimate, refusals).

`RUNTIMES` maps each kind's name to its runtime (`LoaderRuntime` for packbench's loader
policies over the CPU-first model, a `CompetitorRuntime` for a kind with a model of its own);
tests/engine/test_policy_registry.py proves it has exactly the kinds of core's `CONDITIONS`.
The worker reaches a kind only through it. docs/engine.md, "Adding a condition kind", walks
through a new one.
"""

from packbench.core.conditions import CONDITIONS
from packbench.engine.conditions import (accelerate, dense_stream, early_forecast, expert_cache, expert_forecast,
                                         flexgen, host_experts, llama_cpp, packet, phase_switched, quantized, resident,
                                         row_retention, sparse_extents, zero_inference)
from packbench.engine.conditions.base import ConditionRuntime, LoaderRuntime
from packbench.engine.policies.base import LoaderPolicy

RUNTIMES: dict[str, ConditionRuntime] = {
    "resident": resident.RUNTIME,
    "dense-stream": dense_stream.RUNTIME,
    "sparse-extents": sparse_extents.RUNTIME,
    "packet": packet.RUNTIME,
    "phase-switched": phase_switched.RUNTIME,
    "row-retention": row_retention.RUNTIME,
    "early-forecast": early_forecast.RUNTIME,
    "expert-cache": expert_cache.RUNTIME,
    "expert-forecast": expert_forecast.RUNTIME,
    "quantized": quantized.RUNTIME,
    "accelerate": accelerate.RUNTIME,
    "zero-inference": zero_inference.RUNTIME,
    "host-experts": host_experts.RUNTIME,
    "flexgen": flexgen.RUNTIME,
    "llama-cpp": llama_cpp.RUNTIME,
}


def loader_policy(name: str, **params) -> LoaderPolicy:
    """A fresh loader policy of kind `name` (a ValueError for a kind that is not a loader)."""
    runtime = RUNTIMES[name]
    if not isinstance(runtime, LoaderRuntime):
        raise ValueError(f"{name} is not a loader policy (it runs a model of its own); use one of "
                         f"{', '.join(n for n, r in RUNTIMES.items() if isinstance(r, LoaderRuntime))}")
    return runtime.policy(**params)


# The loader policies' builders that run on every model family (OPT rows, and an MoE model's
# experts through the expert version of the same name), by name: a view of RUNTIMES (benches and
# tests iterate it over OPT models). The kinds for MoE models alone (expert-cache,
# expert-forecast) build MoE policies and are left out; RUNTIMES holds them.
POLICIES = {name: runtime.policy for name, runtime in RUNTIMES.items()
            if isinstance(runtime, LoaderRuntime) and "opt" in CONDITIONS[name].families}
