"""Raw archive format v1: one zip per screen attempt, written member by member, sealed last.

The one home of the archive (docs/archive.md for the format):

- ``layout.py``: every member name (``PROTOCOL_NAME`` ... ``MANIFEST_NAME``, ``episode_member``
  and friends) and the JSON of plan.json and worker.json, built (``plan_json``,
  ``worker_json``) and parsed (``plan_entries``, ``plan_prompts``, ``worker_parts``). Pure.
- ``writer.py``: ``ArchiveWriter``, append-only, fsynced per episode, sealed by the manifest.
- ``reader.py``: ``ArchiveReader``, bounded and in memory, never extracting to disk.
- ``verify.py``: ``ArchiveReader.verify``'s steps; one ``Problem`` (``problems.py``) per finding.
- ``zipformat.py``: the zip records the writer emits and the reader checks, byte for byte.

The writer and the reader do file I/O by design, and live in ``core`` so that the driver
(service), the worker's tests and an auditor on any node share them with no torch, Ray or
SQLAlchemy. Pure Python + numpy.
"""

from packbench.core.archive.layout import (
    FIXED_MEMBERS,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PLAN_NAME,
    PROTOCOL_NAME,
    VERDICTS_NAME,
    WORKER_NAME,
    WORKER_PARTS,
    EpisodeMembers,
    active_sets_member,
    episode_index,
    episode_member,
    episode_members,
    expected_method,
    forced_member,
    logits_member,
    name_problem,
    plan_entries,
    plan_json,
    plan_prompts,
    trace_member,
    worker_json,
    worker_parts,
)
from packbench.core.archive.problems import PROBLEM_KINDS, Problem
from packbench.core.archive.reader import (
    MAX_ARCHIVE_BYTES,
    MAX_ARRAY_BYTES,
    MAX_DIRECTORY_BYTES,
    MAX_JSON_BYTES,
    MAX_JSON_TOTAL_BYTES,
    MAX_MEMBERS,
    MAX_TOTAL_BYTES,
    ArchiveReader,
    ArchiveTooLarge,
    file_sha256,
)
from packbench.core.archive.bounds import mib_to_admit, over_bound_line
from packbench.core.archive.writer import ArchiveWriter
from packbench.core.archive.zipformat import stock_deflate

__all__ = [
    "FIXED_MEMBERS", "FORMAT_VERSION", "MANIFEST_NAME", "PLAN_NAME", "PROTOCOL_NAME", "VERDICTS_NAME", "WORKER_NAME",
    "WORKER_PARTS", "EpisodeMembers", "active_sets_member", "episode_index", "episode_member", "episode_members", "expected_method",
    "forced_member", "logits_member", "name_problem", "plan_entries", "plan_json", "plan_prompts", "trace_member",
    "worker_json", "worker_parts", "PROBLEM_KINDS", "Problem", "MAX_ARCHIVE_BYTES", "MAX_ARRAY_BYTES",
    "MAX_DIRECTORY_BYTES", "MAX_JSON_BYTES", "MAX_JSON_TOTAL_BYTES", "MAX_MEMBERS", "MAX_TOTAL_BYTES",
    "ArchiveReader", "ArchiveTooLarge", "file_sha256", "mib_to_admit", "over_bound_line", "ArchiveWriter", "stock_deflate",
]
