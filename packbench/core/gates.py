"""Gates: pure functions from episode records to verdicts. They fail closed on missing data.

An episode, as the gates read it, is the worker's record (fields: core/record.py) plus `logits` (a
float32 (calls, vocab) array, a batch's (sequences, calls, vocab), or None when missing): plan_index, condition, role, prompt,
status, tokens, wall_s, first_logit_since_entry_s, h2d_weight_bytes, h2d_index_bytes,
phases.{prefill,decode}.{calls, h2d_bytes, call_s}, memory.{peak_allocated_bytes,
peak_reserved_bytes, peak_sampled_bytes, ...}. `compute_verdicts` adds `repetition` from the
plan. Any field a gate needs that is missing, None or malformed makes that verdict FAIL and its
detail say why; a gate never raises on a record.

A verdict is a plain dict (see `verdict`): value, threshold and interval are floats (as a
database column returns them), so stored and recomputed verdicts compare exactly.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from packbench.core.fidelity import of_episode
from packbench.core.plan import plan
from packbench.core.protocol import FidelityBounds, Protocol, expand
from packbench.core.registry import exact_reference, weights_of

PEAKS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_sampled_bytes")


def verdict(gate: str, condition: str, *, passed: bool, value: float | None, threshold: float | None,
            episodes: list[int], detail: str, phase: str = "all",
            interval: list[float] | None = None) -> dict:
    return {"gate": gate, "condition": condition, "phase": phase, "passed": bool(passed),
            "value": None if value is None else float(value),
            "threshold": None if threshold is None else float(threshold),
            "interval": None if interval is None else [float(interval[0]), float(interval[1])],
            "episodes": sorted(set(episodes)), "detail": detail}


# ----------------------------------------------------------------------------- record access


def _ok(e: Any) -> bool:
    return isinstance(e, dict) and e.get("status") == "ok"


def _field(e: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(e, dict):
            return None
        e = e.get(key)
    return e


def _count(e: Any, *path: str) -> int | None:
    """An integer >= 0 at `path`, else None (bools are not counts)."""
    v = _field(e, *path)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _seconds(e: Any, *path: str) -> float | None:
    """A finite number >= 0 at `path`, else None."""
    v = _field(e, *path)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return float(v) if ok else None


def _index(e: dict) -> int:
    i = e.get("plan_index")
    return i if isinstance(i, int) else -1


def _of(episodes: list[dict], condition: str) -> list[dict]:
    """The condition's episodes (warmups included) in plan order."""
    return sorted((e for e in episodes if isinstance(e, dict) and e.get("condition") == condition), key=_index)


def _exact_le(value: float | Fraction, bound: float) -> bool:
    """value <= bound in exact arithmetic; the bound is read as the decimal the protocol wrote."""
    return Fraction(value) <= Fraction(str(bound))


# ----------------------------------------------------------------------------- faithfulness


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float | None:
    """max |a - b| in float64 (exact for float32/16 inputs), None when either holds a non-finite
    value. Row blocks of ~2**20 values: a (1300, 50272) pair once took ~2 GiB of temporaries in
    one expression; the maximum does not depend on the blocking."""
    step = max(1, (1 << 20) // max(a.shape[1], 1))
    worst = 0.0
    for lo in range(0, a.shape[0], step):
        x, y = a[lo:lo + step], b[lo:lo + step]
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            return None
        worst = max(worst, float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max(initial=0.0)))
    return worst


def faithfulness(episodes: list[dict], *, reference: str, condition: str, tolerance: float = 0.0) -> dict:
    """Logits and tokens of every episode of `condition` (warmups included) against the first
    scored reference episode of the same prompt. For the reference itself, its other episodes
    (warmups, later repetitions) are compared with it: the reference must first reproduce itself.

    value = the largest absolute logit difference seen (0.0 means bit-identical values).
    """
    refs: dict[Any, dict] = {}
    for e in _of(episodes, reference):
        if e.get("role") == "scored":
            refs.setdefault(e.get("prompt"), e)
    canonical = {id(e) for e in refs.values()}
    if condition == reference:
        mine = [e for e in _of(episodes, reference) if id(e) not in canonical]
    else:
        mine = _of(episodes, condition)
    if not mine:
        what = ("no reference warmup or repetition to repeat against" if condition == reference
                else "no episodes")
        return verdict("faithfulness", condition, passed=False, value=None, threshold=tolerance,
                       episodes=[], detail=f"fail closed: {what}")
    worst, used, problems = 0.0, [], []
    for e in mine:
        ref = refs.get(e.get("prompt"))
        used.append(_index(e))
        if ref is None or not _ok(ref):
            problems.append(f"episode {_index(e)}: no usable reference for prompt {e.get('prompt')}")
            continue
        used.append(_index(ref))
        if not _ok(e) or e.get("logits") is None or ref.get("logits") is None:
            problems.append(f"episode {_index(e)}: failed or missing logits")
            continue
        a, b = np.asarray(e["logits"]), np.asarray(ref["logits"])
        if a.shape != b.shape or a.ndim not in (2, 3) or a.dtype.kind != "f" or b.dtype.kind != "f":
            problems.append(f"episode {_index(e)}: logits {a.dtype}{a.shape} vs reference {b.dtype}{b.shape}")
            continue
        # (calls, vocab), or a batch's (sequences, calls, vocab): every sequence is compared
        diff = _max_abs_diff(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
        if diff is None:
            problems.append(f"episode {_index(e)}: non-finite logits")
            continue
        worst = max(worst, diff)
        tokens, ref_tokens = e.get("tokens"), ref.get("tokens")
        if not isinstance(tokens, list) or not isinstance(ref_tokens, list):
            problems.append(f"episode {_index(e)}: missing tokens")
        elif tokens != ref_tokens:
            problems.append(f"episode {_index(e)}: tokens differ from reference episode {_index(ref)}")
    passed = not problems and worst <= tolerance
    detail = "; ".join(problems) if problems else (
        f"{len(mine)} episodes, max |logit diff| {worst!r} <= {tolerance!r}" if passed
        else f"max |logit diff| {worst!r} > tolerance {tolerance!r}")
    return verdict("faithfulness", condition, passed=passed, value=None if problems else worst,
                   threshold=tolerance, episodes=used, detail=detail)


# ----------------------------------------------------------------------------- fidelity

# bound -> (figure of core.fidelity.Fidelity, "max" or "min": which side the figure must stay on)
FIDELITY_FIGURES = {"max_mean_kl": ("mean_kl", "max"), "max_p99_kl": ("p99_kl", "max"), "min_top1": ("top1", "min"),
                    "max_abs_logit": ("max_abs_logit", "max"), "min_divergence_step": ("divergence_step", "min")}


def _meets(bound: str, fid: Any, threshold: float) -> bool:
    """Exactly: a KL or logit figure <= its bound, top-1 agreement (a fraction) >= its bound, the
    first divergence >= its bound (never diverging meets every bound)."""
    if bound == "min_top1":
        return Fraction(fid.top1_agree, fid.positions) >= Fraction(str(threshold))
    if bound == "min_divergence_step":
        return fid.divergence_step is None or fid.divergence_step >= threshold
    return _exact_le(getattr(fid, FIDELITY_FIGURES[bound][0]), threshold)


def fidelity(episodes: list[dict], *, reference: str, bounds: FidelityBounds) -> dict:
    """Every scored episode of an approximate condition meets every declared threshold: its
    logits teacher-forced on the reference's tokens against the reference episode's logits
    (core/fidelity.py), its free-running tokens against the reference's.

    value = the worst figure of the first declared threshold (FIDELITY_BOUNDS order), against
    that threshold; the detail gives the worst of every declared one. A divergence that never
    happens is worst as `none` (it meets every bound).
    """
    condition = bounds.condition
    declared = [(b, getattr(bounds, b)) for b in FIDELITY_FIGURES if getattr(bounds, b) is not None]
    by_index = {_index(e): e for e in episodes if isinstance(e, dict)}
    mine = [e for e in _of(episodes, condition) if e.get("role") == "scored"]
    first, threshold = declared[0]
    if not mine:
        return verdict("fidelity", condition, passed=False, value=None, threshold=threshold, episodes=[],
                       detail="fail closed: no scored episodes")
    used, problems, figures = [], [], []
    for e in mine:
        used.append(_index(e))
        if isinstance(e.get("forced_from"), int):
            used.append(e["forced_from"])
        try:
            figures.append((e, of_episode(e, by_index, reference=reference)))
        except ValueError as why:
            problems.append(f"episode {_index(e)}: {why}")
    if problems:
        return verdict("fidelity", condition, passed=False, value=None, threshold=threshold, episodes=used,
                       detail="fail closed: " + "; ".join(problems[:5]))
    failed, worst_of = [], {}
    for bound, limit in declared:
        figure, side = FIDELITY_FIGURES[bound]
        for e, fid in figures:
            if not _meets(bound, fid, limit):
                failed.append(f"episode {_index(e)} {figure} {_figure(getattr(fid, figure))}")
        values = [getattr(fid, figure) for _, fid in figures]
        if figure == "divergence_step":
            diverged = [v for v in values if v is not None]
            worst_of[bound] = min(diverged) if diverged else None
        else:
            worst_of[bound] = max(values) if side == "max" else min(values)
    words = [f"{FIDELITY_FIGURES[b][0]} worst {_figure(worst_of[b])} (bound {'<=' if b.startswith('max') else '>='} "
             f"{limit!r})" for b, limit in declared]
    value = worst_of[first]
    detail = f"{len(figures)} episodes against {reference}: " + "; ".join(words)
    if failed:
        detail += "; outside: " + ", ".join(failed[:5])
    return verdict("fidelity", condition, passed=not failed, value=None if value is None else float(value),
                   threshold=threshold, episodes=used, detail=detail)


def _figure(v: Any) -> str:
    return "never" if v is None else repr(v)


# ----------------------------------------------------------------------------- resources, capacity


def resources(episodes: list[dict], *, condition: str, allowance_bytes: int) -> dict:
    """Every episode of `condition` (warmups included) kept its sampled, allocated and reserved
    GPU peaks within the allowance. value = the largest peak. A missing peak fails closed (on
    the CPU nothing samples a GPU, so no resource claim is made there).
    """
    mine = _of(episodes, condition)
    if not mine:
        return verdict("resources", condition, passed=False, value=None, threshold=allowance_bytes,
                       episodes=[], detail="fail closed: no episodes")
    worst, problems = 0, []
    for e in mine:
        if not _ok(e):
            problems.append(f"episode {_index(e)} status {e.get('status')!r}")
            continue
        for key in PEAKS:
            v = _count(e, "memory", key)
            if v is None:
                problems.append(f"episode {_index(e)} has no memory.{key}")
            else:
                worst = max(worst, v)
    if problems:
        return verdict("resources", condition, passed=False, value=None, threshold=allowance_bytes,
                       episodes=[_index(e) for e in mine], detail="fail closed: " + "; ".join(problems[:5]))
    passed = worst <= allowance_bytes  # integers: exact
    return verdict("resources", condition, passed=passed, value=worst, threshold=allowance_bytes,
                   episodes=[_index(e) for e in mine],
                   detail=f"largest peak {worst} B {'<=' if passed else '>'} allowance {allowance_bytes} B "
                          f"over {len(mine)} episodes")


def capacity(episodes: list[dict], *, condition: str, start: dict | None, allowance_bytes: int) -> dict:
    """`condition` served the model although its parameter bytes exceed the allowance, starting
    CPU-first: start.param_bytes > allowance, start.cpu_first is true, the worker imposed the
    protocol's allowance (start.allowance_bytes), and every episode of the condition is ok.
    value = parameter bytes.
    """
    mine = _of(episodes, condition)
    used = [_index(e) for e in mine]
    problems = []
    param = _count(start, "param_bytes")
    cpu_first = _field(start, "cpu_first")
    imposed = _count(start, "allowance_bytes")
    if not isinstance(start, dict):
        problems.append("no worker start record")
    else:
        if param is None:
            problems.append("start has no param_bytes")
        if not isinstance(cpu_first, bool):
            problems.append("start has no cpu_first flag")
        if imposed is None:
            problems.append("start has no allowance_bytes")
        elif imposed != allowance_bytes:
            problems.append(f"the worker imposed {imposed} B, the protocol allows {allowance_bytes} B")
    if not mine:
        problems.append("no episodes")
    bad = [_index(e) for e in mine if not _ok(e)]
    if bad:
        problems.append(f"episodes {bad} did not finish")
    if problems:
        return verdict("capacity", condition, passed=False, value=param, threshold=allowance_bytes,
                       episodes=used, detail="fail closed: " + "; ".join(problems))
    assert param is not None
    if not cpu_first:
        return verdict("capacity", condition, passed=False, value=param, threshold=allowance_bytes,
                       episodes=used, detail="the start was not CPU-first: no capacity claim")
    passed = param > allowance_bytes
    return verdict("capacity", condition, passed=passed, value=param, threshold=allowance_bytes, episodes=used,
                   detail=f"parameters {param} B {'exceed' if passed else 'fit'} the allowance {allowance_bytes} B; "
                          f"CPU-first start; {len(mine)} episodes ok")


# ----------------------------------------------------------------------------- paired comparisons


def paired_episodes(episodes: list[dict], condition: str,
                    control: str) -> tuple[list[tuple[dict, dict]], list[str], list[int]]:
    """Scored episodes of `condition` and `control` paired by (repetition, prompt).

    Returns the pairs in key order, the reasons some key has no usable pair, and every plan
    index looked at.
    """
    def by_key(name: str) -> tuple[dict, set]:
        out: dict[tuple, dict] = {}
        dup: set = set()
        for e in _of(episodes, name):
            if e.get("role") != "scored":
                continue
            key = (e.get("repetition") or 0, e.get("prompt"))
            if key in out:
                dup.add(key)
            out[key] = e
        return out, dup

    mine, dup_mine = by_key(condition)
    ctrl, dup_ctrl = by_key(control)
    used = [_index(e) for e in mine.values()] + [_index(e) for e in ctrl.values()]
    bad, pairs = [], []
    # Numeric (repetition, prompt) order: the bootstrap's draws are tied to this order.
    for key in sorted(set(mine) | set(ctrl), key=lambda k: [(0, x) if isinstance(x, int) else (1, repr(x)) for x in k]):
        a, b = mine.get(key), ctrl.get(key)
        where = f"repetition {key[0]} prompt {key[1]}"
        if key in dup_mine or key in dup_ctrl:
            bad.append(f"{where}: more than one scored episode")
        elif a is None or b is None:
            bad.append(f"{where}: no {condition if a is None else control} episode")
        elif not _ok(a) or not _ok(b):
            bad.append(f"{where}: an episode did not finish")
        else:
            pairs.append((a, b))
    if not mine and not ctrl:
        bad.append("no scored episodes")
    return pairs, bad, used


def _h2d(e: dict, phase: str) -> int | None:
    if phase == "all":
        w, i = _count(e, "h2d_weight_bytes"), _count(e, "h2d_index_bytes")
        return None if w is None or i is None else w + i
    return _count(e, "phases", phase, "h2d_bytes")


def seconds_of(e: dict, phase: str) -> float | None:
    """Whole-episode wall time, or one phase's forward-call time (its calls interleave with host
    work, so a phase has no wall of its own; call_s is recomputed from the ledger on audit)."""
    return _seconds(e, "wall_s") if phase == "all" else _seconds(e, "phases", phase, "call_s")


def acquisition(episodes: list[dict], *, condition: str, control: str, max_ratio: float,
                phase: str = "all") -> dict:
    """Host-to-device bytes (weights + indices; one phase's with `phase`) of `condition` over
    `control`, scored episodes paired by (repetition, prompt). Passes when bytes <= max_ratio x
    control bytes, compared exactly in integers and fractions (a float ratio at the boundary
    must not decide a verdict).
    """
    pairs, bad, used = paired_episodes(episodes, condition, control)
    values = [(_h2d(a, phase), _h2d(b, phase)) for a, b in pairs]
    missing = [f"episode {_index(a if x is None else b)} has no {phase} H2D byte count"
               for (a, b), (x, y) in zip(pairs, values) if x is None or y is None]
    if bad or missing:
        return verdict("acquisition", condition, phase=phase, passed=False, value=None, threshold=max_ratio,
                       episodes=used, detail=f"fail closed: {'; '.join(bad + missing)}")
    num = sum(x for x, _ in values)
    den = sum(y for _, y in values)
    if den == 0:
        return verdict("acquisition", condition, phase=phase, passed=False, value=None, threshold=max_ratio,
                       episodes=used, detail=f"fail closed: control {control} moved 0 bytes")
    passed = _exact_le(Fraction(num, den), max_ratio)
    return verdict("acquisition", condition, phase=phase, passed=passed, value=num / den, threshold=max_ratio,
                   episodes=used, detail=f"{num} B / {den} B over {len(pairs)} pairs vs {control}")


def bootstrap_ratio(num: list[float], den: list[float], *, confidence: float, resamples: int,
                    seed: int) -> tuple[float, float]:
    """Percentile interval of sum(num*)/sum(den*) over `resamples` resamples of the pairs.

    Deterministic on every machine: pair indices are PCG64(seed)'s raw 64-bit outputs modulo
    the number of pairs (NumPy keeps bit-generator streams stable across versions), sums run
    sequentially (cumsum, no reordering), and the bounds are order statistics, not interpolated:
    lo = sorted[floor(a R)], hi = sorted[ceil((1 - a) R) - 1] with a = (1 - confidence) / 2.
    """
    n, r = len(num), int(resamples)
    gen = np.random.PCG64(seed)
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    ratios = np.empty(r, dtype=np.float64)
    # Rows are drawn in blocks of ~2**20 draws: the same raw stream in the same order as one
    # (r, n) draw (bit for bit), but memory stays ~40 MB whatever r x n is. One (r, n) draw of a
    # protocol with resamples 10**9 asked for terabytes and died with a traceback.
    step = max(1, (1 << 20) // max(n, 1))
    for lo_row in range(0, r, step):
        k = min(step, r - lo_row)
        idx = (gen.random_raw(size=(k, n)) % np.uint64(n)).astype(np.intp)
        ratios[lo_row:lo_row + k] = np.cumsum(a[idx], axis=1)[:, -1] / np.cumsum(b[idx], axis=1)[:, -1]
    ratios = np.sort(ratios)
    alpha = (1 - Fraction(str(confidence))) / 2
    lo = min(max(math.floor(alpha * r), 0), r - 1)
    hi = min(max(math.ceil((1 - alpha) * r) - 1, 0), r - 1)
    return float(ratios[lo]), float(ratios[hi])


def runtime(episodes: list[dict], *, condition: str, control: str, max_ratio: float, phase: str = "all",
            confidence: float = 0.95, resamples: int = 10000, seed: int = 0) -> dict:
    """Time of `condition` over `control`, scored episodes paired by (repetition, prompt): the
    whole episode's wall_s, or with `phase` that phase's forward-call seconds (phases.*.call_s).

    value = sum of times / sum of control times; the verdict is decided on the UPPER bound of a
    paired bootstrap interval (`bootstrap_ratio`): passed when hi <= max_ratio.
    """
    pairs, bad, used = paired_episodes(episodes, condition, control)
    values = [(seconds_of(a, phase), seconds_of(b, phase)) for a, b in pairs]
    missing = [f"episode {_index(a if x is None else b)} has no {'wall' if phase == 'all' else phase + ' call'} time"
               for (a, b), (x, y) in zip(pairs, values) if x is None or y is None]
    zero = [f"control episode {_index(b)} took 0 s" for (a, b), (x, y) in zip(pairs, values) if y == 0.0]
    if bad or missing or zero:
        return verdict("runtime", condition, phase=phase, passed=False, value=None, threshold=max_ratio,
                       episodes=used, detail=f"fail closed: {'; '.join(bad + missing + zero)}")
    num = [x for x, _ in values]
    den = [y for _, y in values]
    point = math.fsum(num) / math.fsum(den)
    lo, hi = bootstrap_ratio(num, den, confidence=confidence, resamples=resamples, seed=seed)
    passed = _exact_le(hi, max_ratio)
    return verdict("runtime", condition, phase=phase, passed=passed, value=point, threshold=max_ratio,
                   interval=[lo, hi], episodes=used,
                   detail=f"{math.fsum(num)!r} s / {math.fsum(den)!r} s over {len(pairs)} pairs vs {control}; "
                          f"{confidence:g} bootstrap upper bound {hi!r} {'<=' if passed else '>'} {max_ratio!r}")


# ----------------------------------------------------------------------------- useful latency


def useful_latency(episodes: list[dict], *, condition: str, max_first_episode_s: float,
                   max_cold_start_s: float) -> dict:
    """The condition's first episode (warmups included: the first use) took at most
    max_first_episode_s (wall_s), and the worker's cold start (the smallest
    first_logit_since_entry_s of any finished episode: worker entry to the first logit) took at
    most max_cold_start_s. value = the first episode's seconds; the detail names the cold start
    and which condition's episode gave it (it is not that condition's own cold latency).
    """
    mine = _of(episodes, condition)
    problems: list[str] = []
    first_s = None
    used = []
    if not mine:
        problems.append("no episodes")
    else:
        first = mine[0]
        used.append(_index(first))
        first_s = _seconds(first, "wall_s") if _ok(first) else None
        if first_s is None:
            problems.append(f"first episode {_index(first)} did not finish or has no wall_s")
    finished = sorted((e for e in episodes if _ok(e)), key=_index)
    colds = [(_seconds(e, "first_logit_since_entry_s"), _index(e), e.get("condition")) for e in finished]
    lacking = [i for s, i, _ in colds if s is None]
    if lacking:
        problems.append(f"episodes {lacking[:5]} have no first_logit_since_entry_s")
    elif not colds:
        problems.append("no finished episode gives a cold start")
    if problems:
        return verdict("useful_latency", condition, passed=False, value=first_s, threshold=max_first_episode_s,
                       episodes=used, detail="fail closed: " + "; ".join(problems))
    cold, cold_index, cold_condition = min(colds, key=lambda c: (c[0], c[1]))
    used.append(cold_index)
    first_ok = _exact_le(first_s, max_first_episode_s)
    cold_ok = _exact_le(cold, max_cold_start_s)
    return verdict("useful_latency", condition, passed=first_ok and cold_ok, value=first_s,
                   threshold=max_first_episode_s, episodes=used,
                   detail=f"first episode {first_s!r} s {'<=' if first_ok else '>'} {max_first_episode_s!r} s; "
                          f"cold start {cold!r} s (worker entry to the first {cold_condition} logit, episode "
                          f"{cold_index}) {'<=' if cold_ok else '>'} {max_cold_start_s!r} s")


# ----------------------------------------------------------------------------- all of them


def planned_episodes(protocol: Protocol | dict, episodes: list[dict]) -> list[dict]:
    """The records that are episodes of this protocol's plan, each with its `repetition`.

    A record whose plan_index is not planned, whose condition/role/prompt differ from its plan
    entry, or that shares its plan_index with another record is left out: the gates then see
    missing data and fail closed (the auditor names such records separately).
    """
    entries = {e["index"]: e for e in plan(protocol)}
    seen: dict[int, int] = {}
    for rec in episodes:
        if isinstance(rec, dict) and isinstance(rec.get("plan_index"), int):
            seen[rec["plan_index"]] = seen.get(rec["plan_index"], 0) + 1
    out = []
    for rec in episodes:
        if not isinstance(rec, dict):
            continue
        i = rec.get("plan_index")
        entry = entries.get(i) if isinstance(i, int) and not isinstance(i, bool) else None
        if entry is None or seen[i] > 1:
            continue
        if any(rec.get(k) != entry[k] for k in ("condition", "role", "prompt")):
            continue
        out.append({**rec, "repetition": entry["repetition"]})
    return out


def _faithful(p: Protocol, eps: list[dict], name: str, tolerance: float) -> dict:
    """faithfulness of `name` against its exact reference (core.registry.exact_reference): the
    protocol's, or the dense-stream of its weights (an int8 packet against the int8
    dense-stream), which the verdict's detail then names."""
    conditions = {c.name: (c.policy, c.params) for c in p.conditions}
    ref = exact_reference(conditions, p.reference, name) or p.reference
    v = faithfulness(eps, reference=ref, condition=name, tolerance=tolerance)
    if ref != p.reference:
        v["detail"] = f"against {ref!r} (weights {weights_of(*conditions[name])}): {v['detail']}"
    return v


def compute_verdicts(protocol: Protocol | dict, episodes: list[dict], *, start: dict | None = None) -> list[dict]:
    """Every verdict the frozen protocol declares, sorted by (gate, condition, phase).

    `episodes` are the worker's records with `logits`; `start` is the worker's start record
    (worker.json "start": param_bytes, cpu_first, allowance_bytes, ...), needed by capacity.
    """
    p = expand(protocol)
    eps = planned_episodes(p, episodes)
    names = p.condition_names
    gates = p.gates
    allowance = p.allowance_bytes
    out: list[dict] = []
    if gates.faithfulness_tolerance is not None:  # exact conditions only: fidelity judges the approximate ones
        out += [_faithful(p, eps, name, gates.faithfulness_tolerance) for name in names if p.tier(name) == "exact"]
    out += [fidelity(eps, reference=p.reference, bounds=b) for b in gates.fidelity]
    if gates.resources:
        out += [resources(eps, condition=name, allowance_bytes=allowance) for name in names]
    if gates.capacity:
        out += [capacity(eps, condition=name, start=start, allowance_bytes=allowance) for name in names]
    for g in gates.acquisition:
        out += [acquisition(eps, condition=name, control=g.control, max_ratio=g.max_ratio, phase=g.phase)
                for name in names if name != g.control]
    for g in gates.runtime:
        out += [runtime(eps, condition=name, control=g.control, max_ratio=g.max_ratio, phase=g.phase,
                        confidence=g.confidence, resamples=g.resamples, seed=g.seed)
                for name in names if name != g.control]
    if gates.useful_latency is not None:
        u = gates.useful_latency
        out += [useful_latency(eps, condition=name, max_first_episode_s=u.max_first_episode_s,
                               max_cold_start_s=u.max_cold_start_s) for name in names]
    return sorted(out, key=lambda v: (v["gate"], v["condition"], v["phase"]))
