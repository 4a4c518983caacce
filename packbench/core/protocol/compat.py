"""Schema 1, what packbench 0.1 froze: the rule that keeps every old hash.

A protocol is frozen in the LOWEST schema that expresses its meaning. `schema1_form` says
whether schema 1 can express a full schema-2 form, and gives that schema-1 body if so.
"""

from __future__ import annotations

SCHEMA1_POLICIES = ("resident", "dense-stream", "packet")


def schema1_form(full: dict) -> dict | None:
    """The schema-1 body with the same meaning as `full`, or None when schema 1 cannot say it."""
    gates = full["gates"]
    acq = gates.get("acquisition", [{"phase": "all"}])
    expressible = (
        "path" in full["model"] and "sha256" not in full["model"]
        and ("token_ids" in full["prompts"] or "generator" in full["prompts"])
        and all(c["policy"] in SCHEMA1_POLICIES and not c["params"] for c in full["conditions"])
        and len(set(full["warmups"].values())) == 1
        and full["repetitions"] == 1 and full["order"] == "alternating" and full["baseline_first"]
        and full["recording"]
        and "placement" not in full and "engine" not in full and "batch" not in full
        and "passes" not in full and "trace" not in full
        and set(gates) <= {"faithfulness", "acquisition"}
        and len(acq) == 1 and acq[0]["phase"] == "all"
    )
    if not expressible:
        return None
    v1_gates: dict[str, dict] = {}
    if "faithfulness" in gates:
        v1_gates["faithfulness"] = dict(gates["faithfulness"])
    if "acquisition" in gates:
        v1_gates["acquisition"] = {"control": acq[0]["control"], "max_ratio": acq[0]["max_ratio"]}
    return {
        "schema": 1, "name": full["name"], "model": dict(full["model"]), "dtype": full["dtype"],
        "prompts": full["prompts"], "prefix_tokens": full["prefix_tokens"],
        "continuation_tokens": full["continuation_tokens"],
        "conditions": [{"name": c["name"], "policy": c["policy"]} for c in full["conditions"]],
        "reference": full["reference"], "warmups": next(iter(full["warmups"].values())),
        "allowance_mib": full["allowance_mib"], "gates": v1_gates,
    }
