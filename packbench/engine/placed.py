"""A folder a node's workers build once and share: the model cache's synthetic checkpoints
(engine/worker.py), FlexGen's converted layouts (engine/flexgen.py) and llama.cpp's GGUF conversions
(engine/llama_cpp.py).

Several workers of a host may build the same folder at once: each writes a private one and renames
it into place (atomic); a loser drops its copy and uses the winner's. A folder found there that is
not whole (a half-written or damaged one) is moved aside (atomic, so no other worker reads it) and
removed, since a node's cache holds copies of tens of GB.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable


def files_key(files: list[Path], *extra: str) -> str:
    """16 hex digits naming a cache entry made from `files` (their names, sizes and modification
    times: a rewritten checkpoint gets a new entry) and `extra` (how it was made, a dtype say)."""
    listed = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files] + list(extra)
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]


def place_once(out: Path, build: Callable[[Path], None], *, whole: Callable[[Path], bool]) -> Path:
    """`out`, built by `build(tmp)` into a private folder beside it unless `whole(out)` already.
    Whatever `build` raises propagates, its partial folder removed first (a full or read-only cache
    would otherwise keep the space it took)."""
    if whole(out):
        return out
    if out.exists():
        aside = out.with_name(f"{out.name}.damaged-{os.getpid()}-{time.time_ns()}")
        try:
            out.rename(aside)
        except OSError:
            pass  # another worker moved it aside first
        shutil.rmtree(aside, ignore_errors=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(out)
    except OSError:
        if not whole(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another worker placed it meanwhile: use theirs
    return out
