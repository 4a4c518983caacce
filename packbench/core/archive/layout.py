"""The raw archive's layout: every member name, and the JSON of plan.json and worker.json.

This module is the one place a member name is spelled (docs/archive.md, "Members") and the one
place plan.json and worker.json are built and parsed: the screen driver builds them with
``plan_json`` / ``worker_json``; the auditor, re-execution and the CLI read them with
``plan_entries`` / ``plan_prompts`` / ``worker_parts``. Pure: no I/O.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from typing import Any

FORMAT_VERSION = 1

PROTOCOL_NAME = "protocol.json"
PLAN_NAME = "plan.json"
WORKER_NAME = "worker.json"
VERDICTS_NAME = "verdicts.json"
MANIFEST_NAME = "manifest.json"
# The members every archive of a screen may hold besides its episodes' (written in this order,
# the manifest last).
FIXED_MEMBERS = (PROTOCOL_NAME, PLAN_NAME, WORKER_NAME, VERDICTS_NAME, MANIFEST_NAME)

_EPISODE_RECORD = re.compile(r"episodes/([0-9]{5,})\.json")
_NAME_CHARS = re.compile(r"[A-Za-z0-9._/-]+")


# ----------------------------------------------------------------------------- episode members


def episode_member(index: int) -> str:
    """The record of planned episode ``index`` (5 digits, so names sort in plan order)."""
    return f"episodes/{index:05d}.json"


def logits_member(index: int) -> str:
    """The float32 [calls, vocab] logits of episode ``index``."""
    return f"logits/{index:05d}.npy"


def forced_member(index: int) -> str:
    """The float32 [calls, vocab] logits of approximate episode ``index`` teacher-forced on the
    reference's tokens (core/fidelity.py); only approximate episodes have one."""
    return f"forced/{index:05d}.npy"


def trace_member(index: int) -> str:
    """The [samples, 2] memory trace of episode ``index``."""
    return f"traces/{index:05d}.npy"


def active_sets_member(index: int) -> str:
    """The trace file of active sets of episode ``index`` (docs/traces.md; a protocol's
    ``trace: true``): a zip of its own, kept as it is."""
    return f"active/{index:05d}.trace"


@dataclass(frozen=True)
class EpisodeMembers:
    """The member names of one episode; whether each is present is the archive's business."""

    index: int
    record: str
    logits: str
    trace: str
    forced: str
    active: str = ""  # the trace of active sets (active_sets_member)


def episode_members(index: int) -> EpisodeMembers:
    return EpisodeMembers(index, episode_member(index), logits_member(index), trace_member(index),
                          forced_member(index), active_sets_member(index))


def episode_index(name: str) -> int | None:
    """The plan index whose record ``name`` is (``episodes/NNNNN.json`` exactly as
    ``episode_member`` spells it), else None."""
    m = _EPISODE_RECORD.fullmatch(name)
    if m is not None and episode_member(int(m.group(1))) == name:
        return int(m.group(1))
    return None


# ----------------------------------------------------------------------------- name rules


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a valid v1 member name, or None when it is.

    Valid: a relative POSIX path of ``[A-Za-z0-9._/-]`` only, no leading ``/``, no empty,
    ``.`` or ``..`` segment (so no trailing ``/`` either). This excludes backslashes, drive
    letters (``C:``), NUL bytes and every other character.
    """
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    if "\\" in name:
        return "contains a backslash"
    if "\x00" in name:
        return "contains a NUL byte"
    if re.match(r"[A-Za-z]:", name):
        return "starts with a drive letter"
    if name.startswith("/"):
        return "is absolute"
    if _NAME_CHARS.fullmatch(name) is None:
        return "has characters outside [A-Za-z0-9._/-]"
    for segment in name.split("/"):
        if segment == "..":
            return "contains a '..' segment"
        if segment in ("", "."):
            return "has an empty or '.' segment"
    return None


def expected_method(name: str) -> int | None:
    """The compression the writer uses for a member: ``.npy`` arrays and ``.trace`` files (zips
    deflated inside) STORED (never a bomb), ``.json`` DEFLATED; None (either) for other names
    (add_bytes / add_array of other names)."""
    if name.endswith((".npy", ".trace")):
        return zipfile.ZIP_STORED
    if name.endswith(".json"):
        return zipfile.ZIP_DEFLATED
    return None


# ----------------------------------------------------------------------------- plan.json, worker.json

# worker.json's parts: the worker's environment (device, versions), its start record (the
# model's load: parameter bytes, checkpoint digest, times), the checkpoint directory the
# screen named (None: a model.synth the worker generated) and the source freeze (core/source.py).
WORKER_PARTS = ("environment", "start", "model_dir", "source_freeze")


def plan_json(entries: list[dict], prompts: list[list[int]]) -> dict:
    """plan.json: the planned episodes (core/plan.py ``plan``) and the prompts' token ids."""
    return {"entries": entries, "prompts": prompts}


def plan_entries(plan: Any) -> list[dict] | None:
    """plan.json's entries as stored; None when it holds no list of entry objects."""
    got = plan.get("entries") if isinstance(plan, dict) else None
    if not isinstance(got, list) or not all(isinstance(e, dict) for e in got):
        return None
    return got


def plan_prompts(plan: dict) -> Any:
    """plan.json's prompts as stored (unchecked: one list of token ids per prompt when well
    formed). ``plan`` is the parsed plan.json object."""
    return plan.get("prompts")


def worker_json(*, environment: dict | None, start: dict, model_dir: str | None, source_freeze: dict) -> dict:
    """worker.json: what the worker said about itself once its model was loaded (WORKER_PARTS)."""
    return {"environment": environment, "start": start, "model_dir": model_dir, "source_freeze": source_freeze}


def worker_parts(worker: Any) -> dict[str, Any]:
    """The WORKER_PARTS a parsed worker.json holds, as stored ({} when it is not an object)."""
    if not isinstance(worker, dict):
        return {}
    return {k: worker[k] for k in WORKER_PARTS if k in worker}
