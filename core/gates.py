"""Gates: pure functions from episode records to verdicts. They fail closed on missing data.

An episode, as the gates read it: a dict with plan_index, condition, role, prompt, status,
tokens, h2d_weight_bytes, h2d_index_bytes and `logits` (a float32 (calls, vocab) array, or None
when it is missing). A verdict is a plain dict (see `verdict`).
"""

from fractions import Fraction

import numpy as np


def verdict(gate: str, condition: str, *, passed: bool, value: float | None, threshold: float | None,
            episodes: list[int], detail: str, phase: str = "all",
            interval: list[float] | None = None) -> dict:
    return {"gate": gate, "condition": condition, "phase": phase, "passed": bool(passed),
            "value": value, "threshold": threshold, "interval": interval,
            "episodes": sorted(episodes), "detail": detail}


def _ok(e: dict) -> bool:
    return e.get("status") == "ok"


def faithfulness(episodes: list[dict], *, reference: str, condition: str, tolerance: float = 0.0) -> dict:
    """Logits and tokens of every episode of `condition` (warmups included) against the scored
    reference episode of the same prompt. For the reference itself, its warmups are compared
    with its scored episodes: the reference must first reproduce itself.

    value = the largest absolute logit difference seen (0.0 means bit-identical values).
    """
    refs = {e["prompt"]: e for e in episodes if e["condition"] == reference and e["role"] == "scored"}
    if condition == reference:
        mine = [e for e in episodes if e["condition"] == reference and e["role"] == "warmup"]
    else:
        mine = [e for e in episodes if e["condition"] == condition]
    if not mine:
        what = "no reference warmup to repeat against" if condition == reference else "no episodes"
        return verdict("faithfulness", condition, passed=False, value=None, threshold=tolerance,
                       episodes=[], detail=f"fail closed: {what}")
    worst, used, problems = 0.0, [], []
    for e in mine:
        ref = refs.get(e["prompt"])
        used.append(e["plan_index"])
        if ref is None or not _ok(ref):
            problems.append(f"episode {e['plan_index']}: no usable reference for prompt {e['prompt']}")
            continue
        used.append(ref["plan_index"])
        if not _ok(e) or e.get("logits") is None or ref.get("logits") is None:
            problems.append(f"episode {e['plan_index']}: failed or missing logits")
            continue
        a, b = np.asarray(e["logits"]), np.asarray(ref["logits"])
        if a.shape != b.shape:
            problems.append(f"episode {e['plan_index']}: logits shape {a.shape} != reference {b.shape}")
            continue
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            problems.append(f"episode {e['plan_index']}: non-finite logits")
            continue
        worst = max(worst, float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0.0)))
        if list(e["tokens"]) != list(ref["tokens"]):
            problems.append(f"episode {e['plan_index']}: tokens differ from reference episode {ref['plan_index']}")
    passed = not problems and worst <= tolerance
    detail = "; ".join(problems) if problems else (
        f"{len(mine)} episodes, max |logit diff| {worst!r} <= {tolerance!r}" if passed
        else f"max |logit diff| {worst!r} > tolerance {tolerance!r}")
    return verdict("faithfulness", condition, passed=passed, value=None if problems else worst,
                   threshold=tolerance, episodes=sorted(set(used)), detail=detail)


def _h2d(e: dict) -> int:
    return int(e["h2d_weight_bytes"]) + int(e["h2d_index_bytes"])


def acquisition(episodes: list[dict], *, condition: str, control: str, max_ratio: float) -> dict:
    """Host-to-device bytes (weights + indices) of `condition` over `control`, scored episodes
    paired by prompt. Passes when bytes <= max_ratio x control bytes, compared exactly in
    integers and fractions (a float ratio at the boundary must not decide a verdict).
    """
    scored = [e for e in episodes if e["role"] == "scored"]
    mine = {e["prompt"]: e for e in scored if e["condition"] == condition}
    ctrl = {e["prompt"]: e for e in scored if e["condition"] == control}
    prompts = sorted(set(mine) | set(ctrl))
    bad = [p for p in prompts if p not in mine or p not in ctrl or not _ok(mine[p]) or not _ok(ctrl[p])]
    used = [mine[p]["plan_index"] for p in prompts if p in mine] + [ctrl[p]["plan_index"] for p in prompts if p in ctrl]
    if not prompts or bad:
        return verdict("acquisition", condition, passed=False, value=None, threshold=max_ratio, episodes=used,
                       detail=f"fail closed: prompts without a successful pair: {bad or 'no scored episodes'}")
    num = sum(_h2d(mine[p]) for p in prompts)
    den = sum(_h2d(ctrl[p]) for p in prompts)
    if den == 0:
        return verdict("acquisition", condition, passed=False, value=None, threshold=max_ratio, episodes=used,
                       detail=f"fail closed: control {control} moved 0 bytes")
    passed = Fraction(num) <= Fraction(str(max_ratio)) * den
    return verdict("acquisition", condition, passed=passed, value=num / den, threshold=max_ratio, episodes=used,
                   detail=f"{num} B / {den} B over {len(prompts)} prompts vs {control}")


def compute_verdicts(body: dict, episodes: list[dict]) -> list[dict]:
    """Every verdict the frozen protocol declares, in a stable order."""
    out: list[dict] = []
    names = [c["name"] for c in body["conditions"]]
    gates = body["gates"]
    if "faithfulness" in gates:
        for name in names:
            out.append(faithfulness(episodes, reference=body["reference"], condition=name,
                                    tolerance=gates["faithfulness"]["tolerance"]))
    if "acquisition" in gates:
        control = gates["acquisition"]["control"]
        for name in names:
            if name != control:
                out.append(acquisition(episodes, condition=name, control=control,
                                       max_ratio=gates["acquisition"]["max_ratio"]))
    return sorted(out, key=lambda v: (v["gate"], v["condition"], v["phase"]))
