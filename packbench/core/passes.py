"""The measurement's own cost: what a separate-passes episode's record must hold, and what a
screen's records say the recording cost (a protocol's `passes`, schema 7).

With `passes: separate` the worker runs each episode twice (engine/passes.py): a timing pass
with the ledger and the sampler off, then a recording pass with them on. Its record holds the
timing pass's times (`wall_s`, every call's `wall_s`, `first_logit_since_entry_s`), the recording
pass's counts, memory and energy, and `passes`: both walls and the recording pass's call times.
`pass_problems` is what the auditor checks of that; `overhead` is what the report shows.

Pure Python: the auditor and the report read archives with no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any


def _time(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def pass_problems(record: dict, *, separate: bool) -> list[str]:
    """Why a finished episode's `passes` is not what its protocol asked for ([] when it is).

    Separate passes: `passes` holds both walls (finite times >= 0) and one recording call time per
    call of the ledger; the timing wall is the record's `wall_s` (the time gates read it), and the
    recording wall covers its own calls. Passes together: the record has no `passes`."""
    passes = record.get("passes")
    if not separate:
        return [] if passes is None else ["passes figures on an episode of a protocol whose passes run together"]
    if not isinstance(passes, dict):
        return ["separate passes but no recording pass figures (passes is missing or not a mapping)"]
    out = [f"separate passes but passes.{key} {passes.get(key)!r} is not a finite time >= 0"
           for key in ("timing_wall_s", "recording_wall_s") if not _time(passes.get(key))]
    calls, recorded = record.get("calls"), passes.get("recording_call_s")
    if (not isinstance(recorded, list) or not all(map(_time, recorded))
            or (isinstance(calls, list) and len(recorded) != len(calls))):
        out.append("separate passes but passes.recording_call_s is not one finite time >= 0 per call")
    if out:
        return out
    if type(passes["timing_wall_s"]) is not type(record.get("wall_s")) or passes["timing_wall_s"] != record["wall_s"]:
        out.append(f"passes.timing_wall_s {passes['timing_wall_s']!r} is not wall_s {record.get('wall_s')!r}: "
                   f"the episode's times are the timing pass's")
    took = sum(recorded)  # in call order, as the worker's own sums
    if passes["recording_wall_s"] < took:
        out.append(f"passes.recording_wall_s {passes['recording_wall_s']!r} is below the {took!r} s its "
                   f"recording calls took")
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def overhead(records: Iterable[dict]) -> dict[str, dict]:
    """Per condition, over its finished scored episodes that carry `passes`: how many (`n`), the
    median timing and recording walls, the median of each episode's recording wall over its timing
    wall (`ratio`: the recording's own cost, paired on the same prompt), and the median decode
    call in each pass (`timing_decode_s`, `recording_decode_s`). Malformed figures are skipped
    (the auditor names them)."""
    out: dict[str, dict] = {}
    for r in records:
        passes = r.get("passes")
        if r.get("status") != "ok" or r.get("role") != "scored" or not isinstance(passes, dict):
            continue
        t, w, calls = passes.get("timing_wall_s"), passes.get("recording_wall_s"), r.get("calls")
        if not (_time(t) and _time(w) and t > 0 and isinstance(calls, list)):
            continue
        recorded = passes.get("recording_call_s")
        row = out.setdefault(str(r.get("condition")), {"timing": [], "recording": [], "ratio": [], "td": [], "rd": []})
        row["timing"].append(t)
        row["recording"].append(w)
        row["ratio"].append(w / t)
        if isinstance(recorded, list) and len(recorded) == len(calls):
            for call, rec_s in zip(calls, recorded):
                if isinstance(call, dict) and call.get("phase") == "decode" and _time(call.get("wall_s")) and _time(rec_s):
                    row["td"].append(call["wall_s"])
                    row["rd"].append(rec_s)
    return {c: {"n": len(v["ratio"]), "timing_wall_s": _median(v["timing"]), "recording_wall_s": _median(v["recording"]),
                "ratio": _median(v["ratio"]), "timing_decode_s": _median(v["td"]),
                "recording_decode_s": _median(v["rd"])} for c, v in out.items()}
