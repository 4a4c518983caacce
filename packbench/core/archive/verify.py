"""Verification of a raw archive: every problem found, as one ``Problem`` each.

``verify(reader)`` (``ArchiveReader.verify``) never raises for a hostile member: it returns one
``Problem(member, kind, message)`` per problem, naming the member in ``member``. Its steps: is
the manifest there and well formed, do the members' declared sizes fit the reader's bounds, is
every byte laid out as the writer lays it (``layout_problems``, run once when the reader opens
the file), and does each member match its manifest entry. Reads the archive through the reader
(its bounded member streams) and ``os.pread`` of headers; writes nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from typing import TYPE_CHECKING, Any

from packbench.core.archive.bounds import over_bound_line
from packbench.core.archive.layout import FORMAT_VERSION, MANIFEST_NAME, expected_method, name_problem
from packbench.core.archive.problems import Problem, MemberError
from packbench.core.archive.zipformat import (
    VERSION,
    ZIP64_LIMIT,
    ZIP64_VERSION,
    central_entry,
    end_records,
    is_symlink,
    local_header,
)
from packbench.core.text import one_line

if TYPE_CHECKING:
    from packbench.core.archive.reader import ArchiveReader


def _entry_name_problem(info: zipfile.ZipInfo) -> str | None:
    # zipfile truncates a name at a NUL byte; the original is what the archive holds.
    if info.orig_filename != info.filename:
        return "contains a NUL byte"
    return name_problem(info.filename)


def _valid_member_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and set(entry) == {"sha256", "size"}
        and isinstance(entry["sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) is not None
        and isinstance(entry["size"], int)
        and not isinstance(entry["size"], bool)
        and entry["size"] >= 0
    )


def manifest_shape_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return "not a JSON object"
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        return f"format_version is {version!r}, this reader understands {FORMAT_VERSION}"
    members = manifest.get("members")
    if not isinstance(members, dict):
        return "'members' is missing or not an object"
    for name, entry in members.items():
        if name == MANIFEST_NAME:
            return "'members' lists manifest.json itself"
        if not _valid_member_entry(entry):
            return f"entry for {name!r} is not {{sha256: 64 hex digits, size: int >= 0}}"
    return None


def _show(name: str) -> str:
    """A member name as it may appear in a one-line message (hostile names are escaped)."""
    return name if name.isprintable() else ascii(name)


def _distinct(problems: list[Problem]) -> list[Problem]:
    """Problems with one-line messages, the first of each message kept (as verify() always did)."""
    out: dict[str, Problem] = {}
    for p in problems:
        message = one_line(p.message)
        out.setdefault(message, Problem(p.member, p.kind, message))
    return list(out.values())



def verify(reader: ArchiveReader) -> list[Problem]:
    """Every problem of the archive ``reader`` holds, one ``Problem`` each; [] means intact.
    ``member`` names the member concerned (the auditor trusts exactly the members no problem
    names)."""
    problems = _manifest_presence(reader)
    too_large = _too_large(reader)
    if too_large is not None:
        return _distinct(problems + [too_large])
    problems += reader._layout
    listed: dict[str, dict] = reader.manifest["members"] if reader.manifest else {}
    seen: set[str] = set()
    for info in reader._infos:
        name = info.filename
        if name in seen:
            problems.append(Problem(name, "duplicate", f"duplicate member {_show(name)}"))
            continue
        seen.add(name)
        found = _member_problem(reader, info, listed)
        if found is not None:
            problems.append(found)
    problems += _unheld_problems(reader, listed)
    return _distinct(problems)


def _manifest_presence(reader: ArchiveReader) -> list[Problem]:
    """manifest.json is absent (an interrupted screen), or what loading it found."""
    if MANIFEST_NAME not in reader._by_name:
        return [Problem(MANIFEST_NAME, "incomplete", f"archive incomplete: no {MANIFEST_NAME} (interrupted screen?)")]
    if reader._manifest_problem is not None:
        return [reader._manifest_problem]
    return []


def _too_large(reader: ArchiveReader) -> Problem | None:
    """The members' declared sizes together against the reader's bounds, before any is read."""
    declared_total = sum(info.file_size for info in reader._infos)
    declared_json = sum(info.file_size for info in reader._infos if not info.filename.endswith(".npy"))
    if declared_total > reader.max_total_bytes:
        return Problem(
            None, "too-large",
            "archive too large: " + over_bound_line(reader.path, declared_total, reader.max_total_bytes,
                                                    what="declares members of",
                                                    target=getattr(reader, "audit_target", None))
        )
    if declared_json > reader.max_json_total_bytes:
        return Problem(
            None, "too-large",
            f"archive too large: its JSON members declare {declared_json} bytes in total, "
            f"the bound is {reader.max_json_total_bytes} (raise max_json_total_bytes if trusted)"
        )
    return None


def _member_problem(reader: ArchiveReader, info: zipfile.ZipInfo, listed: dict[str, dict]) -> Problem | None:
    """The first problem of one zip entry (seen once): its name, its kind, its manifest entry,
    its bytes (read in full, as the writer's exact stream) against the entry's size and SHA-256."""
    name = info.filename
    shown = _show(name)
    why = _entry_name_problem(info)
    if why is not None:
        return Problem(name, "unsafe", f"unsafe member name {shown} ({why})")
    if is_symlink(info):
        return Problem(name, "symlink", f"symlink member {shown}")
    if name == MANIFEST_NAME:
        return None  # checked while loading; its hash cannot be listed inside itself
    if reader.manifest is not None and name not in listed:
        return Problem(name, "extra", f"extra member {shown}")
    entry = listed.get(name)
    if entry is not None and entry["size"] != info.file_size:
        # Before reading: a manifest (or zip directory) that lies about sizes is named.
        return Problem(
            name, "size",
            f"size mismatch for member {shown}: manifest says {entry['size']}, "
            f"archive holds {info.file_size}"
        )
    digest = hashlib.sha256()
    size = 0
    limit = reader.max_member_bytes if name.endswith(".npy") else reader.max_json_bytes
    try:
        for chunk in reader._chunks(info, limit, exact=True):
            digest.update(chunk)
            size += len(chunk)
    except MemberError as e:
        return Problem(name, "unreadable", f"unreadable member {shown}: {e.cause}")
    if entry is None:
        return None  # incomplete archive: readable is all we can say
    if size != entry["size"]:
        return Problem(
            name, "size",
            f"size mismatch for member {shown}: manifest says {entry['size']}, "
            f"archive holds {size}"
        )
    if digest.hexdigest() != entry["sha256"]:
        return Problem(name, "altered", f"altered member {shown} (sha256 mismatch)")
    return None


def _unheld_problems(reader: ArchiveReader, listed: dict[str, dict]) -> list[Problem]:
    """Members the manifest lists that the zip does not hold: missing, or never a valid name."""
    out = []
    for name in listed:
        shown = _show(name)
        if name not in reader._by_name:
            why = name_problem(name)
            if why is not None:
                out.append(Problem(
                    name, "unsafe", f"unsafe member name {shown} (listed in {MANIFEST_NAME}; {why})"))
            else:
                out.append(Problem(name, "missing", f"missing member {shown}"))
    return out


def layout_problems(fd: int, size: int, tail_bytes: int, infos: list[zipfile.ZipInfo],
                    comment: bytes) -> tuple[list[Problem], dict[int, int]]:
    """Every byte of the file against the one layout the writer produces (docs/archive.md,
    "Exact layout"): local headers equal to what the writer would write for the central
    directory's entry, members back to back from byte 0, the directory right after the
    last member (an unsealed archive may keep the writer's room before it), the directory
    entries and end record exactly the writer's, no comment, nothing after the end record.
    Only reads headers: O(members) small preads. Returns the problems and, for every member
    whose local header is exactly the writer's, where its data starts (by ``id(info)``)."""
    out: list[Problem] = []
    data_at: dict[int, int] = {}
    sealed = any(info.filename == MANIFEST_NAME for info in infos)
    pos = 0
    expected_cd = bytearray()
    for info in infos:
        shown = _show(info.filename)
        try:
            raw = info.orig_filename.encode("ascii")
        except UnicodeEncodeError:
            out.append(Problem(info.filename, "layout", f"layout: member {shown} has a non-ASCII name"))
            raw = info.orig_filename.encode("utf-8", "replace")
        if expected_method(info.filename) not in (None, info.compress_type):
            out.append(Problem(info.filename, "layout",
                               f"layout: member {shown} uses compression method {info.compress_type}, the writer "
                               f"uses {expected_method(info.filename)} for it"))
        at = info.header_offset
        if at != pos:
            what = f"{at - pos} bytes before member {shown} belong to no member" if at > pos else \
                f"member {shown} overlaps the member before it"
            out.append(Problem(info.filename if at < pos else None, "layout", f"layout: {what} (offset {pos})"))
        zip64 = info.file_size * 1.05 > ZIP64_LIMIT
        header = local_header(raw, method=info.compress_type, crc=info.CRC, csize=info.compress_size,
                              size=info.file_size, zip64=zip64)
        try:
            actual = os.pread(fd, len(header), at) if at >= 0 else b""
        except OSError:
            actual = b""
        if actual != header:
            out.append(Problem(info.filename, "layout",
                               f"layout: the local header of member {shown} disagrees with the central directory "
                               f"(a streaming unzipper would read something else)"))
        else:
            data_at[id(info)] = at + len(header)
        pos = max(pos, at + len(header) + info.compress_size)
        expected_cd += central_entry(raw, method=info.compress_type, crc=info.CRC, csize=info.compress_size,
                                     size=info.file_size, offset=at,
                                     version=ZIP64_VERSION if zip64 else VERSION)
    if sealed and infos[-1].filename != MANIFEST_NAME:
        out.append(Problem(None, "layout", f"layout: {MANIFEST_NAME} is not the last member (the writer seals last)"))
    cd_at = size - tail_bytes - len(expected_cd)
    if cd_at < pos or (sealed and cd_at != pos):
        if cd_at > pos:
            out.append(Problem(None, "layout", f"layout: {cd_at - pos} bytes between the last member and the "
                                               f"central directory belong to no member (offset {pos})"))
        else:
            out.append(Problem(None, "layout", "layout: the central directory is not where the members end"))
    try:
        actual_cd = os.pread(fd, len(expected_cd), cd_at) if cd_at >= 0 else b""
        actual_tail = os.pread(fd, tail_bytes + 1, size - tail_bytes)
    except OSError:
        actual_cd = actual_tail = b""
    if actual_cd != expected_cd:
        out.append(Problem(None, "layout", "layout: the central directory holds fields, bytes or entries the "
                                           "writer never writes"))
    tail = end_records(len(infos), cd_at, len(expected_cd))
    if actual_tail != tail:
        why = f"a zip comment of {len(comment)} bytes" if comment else "bytes the writer never writes"
        out.append(Problem(None, "layout", f"layout: the end of central directory record holds {why}"))
    return out, data_at
