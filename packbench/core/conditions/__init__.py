"""Condition kinds: what a protocol's `policy` may name, one module per kind.

Each module here declares one kind, torch-free (`ConditionKind`, base.py): its parameters and
defaults, tier, first schema, byte estimate and, for a competitor, library, modes and refusals.
`CONDITIONS` is the one table of kinds: the protocol schema validates against it, `protocol
plan` and core/estimate.py estimate through it, the report reads its tiers, the worker runs
each kind through the runtime of the same name in engine/conditions/ (builder and lifecycle),
and docs/engine.md says how to add one.

Layer rule: core. Imports nothing outside core (no torch): validation runs on any machine.
"""

from packbench.core.conditions import (accelerate, dense_stream, early_forecast, expert_cache, expert_forecast,
                                       flexgen, host_experts, llama_cpp, packet, phase_switched, quantized,
                                       resident, row_retention, sparse_extents, zero_inference)
from packbench.core.conditions.base import MAX_INT_PARAM, ConditionKind

FAMILY_NAMES = {"opt": "OPT", "moe": "MoE"}  # base.MODEL_FAMILIES as the docs' table names them

# Loaders first, in the order every earlier packbench listed them; then the loaders for MoE models
# alone; then the competitors.
CONDITIONS: dict[str, ConditionKind] = {m.KIND.name: m.KIND for m in (
    resident, dense_stream, sparse_extents, packet, phase_switched, row_retention, early_forecast,
    expert_cache, expert_forecast, quantized, accelerate, zero_inference, host_experts, flexgen, llama_cpp)}


def kinds_table() -> str:
    """The kinds as a Markdown table (docs/engine.md holds it verbatim; a test compares): name,
    what it does, parameters with their defaults, the model families it runs on, tier, first
    schema, and how its byte estimate bounds the truth."""
    def param(kind: ConditionKind, name: str, p) -> str:
        default = "required" if p.default is None else f"default {p.default}"
        default += "".join(f", {d[name]} from schema {s}" for s, d in sorted(kind.schema_defaults.items()) if name in d)
        if hasattr(p, "choices"):
            return f"`{name}`: {' / '.join(p.choices)} ({default}{f'; sayable from schema {p.since}' if p.since > 1 else ''})"
        if p.optional:
            default = "omitted: chosen on the worker"
        if p.maximum != MAX_INT_PARAM:
            return f"`{name}`: integer in [{p.minimum}, {p.maximum}] ({default})"
        return f"`{name}`: integer >= {p.minimum} ({default})"

    rows = ["| kind | what it does | parameters | models | tier | schema | estimate |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, kind in CONDITIONS.items():
        params = "; ".join(param(kind, n, p) for n, p in kind.params.items()) or "none"
        role = " (competitor)" if kind.competitor is not None else ""
        models = ", ".join(FAMILY_NAMES[f] for f in kind.families)
        rows.append(f"| `{name}`{role} | {kind.summary} | {params} | {models} | {kind.tier} | {kind.since} | {kind.bound} |")
    return "\n".join(rows) + "\n"
