"""Raw archive format v1: one zip per screen attempt, written member by member, sealed last.

Layout: this module is the one place member names are built (``episode_member`` and friends,
``PROTOCOL_NAME`` ..., ``MANIFEST_NAME``); the screen driver writes an episode with
``ArchiveWriter.add_episode`` and readers find one with ``episode_members`` / ``episodes()``.

Writer: one open file; every member is appended with the central directory and end record
rewritten after it and fsynced, so the file is a valid zip after each member and an
interrupted screen leaves a readable partial archive (no ``manifest.json``: "incomplete").
Appending costs O(1) zip parsing: nothing is re-read. ``seal`` writes ``manifest.json`` last,
holding the SHA-256 and size of every other member, and returns the SHA-256 of the whole file.

Reader: never extracts to disk. Members are read into memory in chunks under a per-member and
a per-reader byte bound; unsafe names, symlink entries, pickled arrays and CRC errors are
refused with ``ArchiveError``. ``verify`` never raises for a hostile member: it returns one
``Problem(member, kind, message)`` per problem, naming the member in ``member``.

Pure Python + numpy (see docs/archive.md for the format).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import math
import os
import re
import stat
import struct
import weakref
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from core.canonical import canonical_json, sha256_hex
from core.errors import ArchiveError
from core.text import one_line

FORMAT_VERSION = 1

# Bounds of what a reader accepts (docs/archive.md, "Bounds"). Cheap checks come first: the file
# size and the end record's counts are read before zipfile parses the directory, a member's
# declared size before it is read, an array's header before its data. Together they make the
# worst legal archive audit within the time and memory stated in docs/benchmarks.md.
MAX_ARCHIVE_BYTES = 1 << 30  # the file
MAX_MEMBERS = 3 * 100_000 + 5  # 3 members per planned episode (core.protocol MAX_EPISODES) + 5
MAX_DIRECTORY_BYTES = 64 << 20  # the central directory
MAX_JSON_BYTES = 16 << 20  # one JSON member, uncompressed (16 MiB of `[{},{},...]` parse to ~400 MB)
MAX_ARRAY_BYTES = 256 << 20  # one .npy member
MAX_TOTAL_BYTES = 640 << 20  # every member together, uncompressed (the audit keeps the logits: RSS ~ this + 350 MiB)
# JSON members together, uncompressed: parsing, the canonical check and the ledger checks cost
# ~0.4 s per MiB (with the recompression check) on the 2-core box (docs/benchmarks.md, "Worst legal archive"); arrays ~0.01.
MAX_JSON_TOTAL_BYTES = 48 << 20
_MAX_NPY_HEADER = 1 << 16

_CHUNK = 1 << 20
# Fixed timestamp and attributes: identical records give a byte-identical archive.
_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_REGULAR_FILE_ATTR = (stat.S_IFREG | 0o644) << 16
_NAME_CHARS = re.compile(r"[A-Za-z0-9._/-]+")
_SUPPORTED_COMPRESSION = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
# Errors that reading a damaged or hostile zip member may raise inside zipfile/zlib/numpy.
_READ_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    OSError,
    RuntimeError,
    NotImplementedError,
    ValueError,
    KeyError,
    OverflowError,
)


# ----------------------------------------------------------------------------- layout
# Every member name of a raw archive is built here and nowhere else (docs/archive.md, "Members").

PROTOCOL_NAME = "protocol.json"
PLAN_NAME = "plan.json"
WORKER_NAME = "worker.json"
VERDICTS_NAME = "verdicts.json"
MANIFEST_NAME = "manifest.json"

_EPISODE_RECORD = re.compile(r"episodes/([0-9]{5,})\.json")


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


@dataclass(frozen=True)
class EpisodeMembers:
    """The member names of one episode; whether each is present is the archive's business."""

    index: int
    record: str
    logits: str
    trace: str
    forced: str


def episode_members(index: int) -> EpisodeMembers:
    return EpisodeMembers(index, episode_member(index), logits_member(index), trace_member(index),
                          forced_member(index))


# ----------------------------------------------------------------------------- problems

# What verify() can find. Every kind but "too-large" (the archive as a whole) names a member:
# the one that is missing, extra, altered, unreadable, unsafe, duplicated, a symlink or of the
# wrong size; "incomplete" and "manifest" name manifest.json.
PROBLEM_KINDS = ("incomplete", "manifest", "too-large", "duplicate", "unsafe", "symlink", "extra", "size",
                 "unreadable", "altered", "missing", "layout")


@dataclass(frozen=True)
class Problem:
    """One finding of ``ArchiveReader.verify``.

    ``member`` is the name exactly as the zip entry or the manifest holds it (None only for
    "too-large"); ``message`` is the one printable line packbench has always printed for it
    (audit digests cover it, so its text never changes).
    """

    member: str | None
    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in PROBLEM_KINDS:
            raise ValueError(f"problem kind {self.kind!r} is not one of {', '.join(PROBLEM_KINDS)}")

    def __str__(self) -> str:
        return self.message


# ----------------------------------------------------------------------------- helpers


def file_sha256(path: Path) -> str:
    """SHA-256 hex of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def _is_symlink(info: zipfile.ZipInfo) -> bool:
    return stat.S_ISLNK(info.external_attr >> 16)


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


def _manifest_shape_problem(manifest: Any) -> str | None:
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


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-standard JSON constant {token}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r} (another parser may keep the other value)")
    return out


def _loads(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


def _canonical_loads(data: bytes) -> Any:
    """Parse a JSON member and insist on its one documented byte form (core.canonical)."""
    obj = _loads(data)
    if canonical_json(obj) != data:
        raise ValueError("not canonical JSON (sorted keys, compact, UTF-8, as core.canonical writes it)")
    return obj


def expected_method(name: str) -> int | None:
    """The compression the writer uses for a member: ``.npy`` arrays STORED (never a bomb),
    ``.json`` DEFLATED; None (either) for other names (add_bytes / add_array of other names)."""
    if name.endswith(".npy"):
        return zipfile.ZIP_STORED
    if name.endswith(".json"):
        return zipfile.ZIP_DEFLATED
    return None


# ----------------------------------------------------------------------------- zip records

# The writer emits the zip records itself, byte for byte what Python's zipfile writes for the
# same member (tests/core/test_archive.py compares both), so that it can keep the central
# directory in memory instead of re-parsing it for every member (APPNOTE.TXT 4.3; field order
# of zipfile.structFileHeader / structCentralDir / structEndArchive[64][Locator]).
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
_ZIP64_LIMIT = (1 << 31) - 1  # zipfile.ZIP64_LIMIT: a size or offset past it needs a zip64 field
_COUNT_LIMIT = 0xFFFF  # entries the classic end record can count
_VERSION, _ZIP64_VERSION = 20, 45  # "version needed to extract", as zipfile writes them
_UNIX = 3
_MAX_END_RECORDS = _END64.size + _LOCATOR64.size + _END.size
_MIN_ROOM = 1 << 20
_DOS_DATE = (_DATE_TIME[0] - 1980) << 9 | _DATE_TIME[1] << 5 | _DATE_TIME[2]
_DOS_TIME = _DATE_TIME[3] << 11 | _DATE_TIME[4] << 5 | _DATE_TIME[5] // 2


def _local_header(name: bytes, *, method: int, crc: int, csize: int, size: int, zip64: bool) -> bytes:
    """A local file header. ``zip64`` as zipfile decides it before writing: size * 1.05 > limit."""
    extra = b""
    version = _VERSION
    if zip64:
        extra = struct.pack("<HHQQ", 1, 16, size, csize)
        size = csize = 0xFFFFFFFF
        version = _ZIP64_VERSION
    return _LOCAL.pack(b"PK\x03\x04", version, 0, 0, method, _DOS_TIME, _DOS_DATE, crc, csize, size,
                       len(name), len(extra)) + name + extra


def _central_entry(name: bytes, *, method: int, crc: int, csize: int, size: int, offset: int,
                   version: int) -> bytes:
    """A central directory entry; ``version`` is the local header's (zipfile reuses it)."""
    values = []
    if size > _ZIP64_LIMIT or csize > _ZIP64_LIMIT:
        values += [size, csize]
        size = csize = 0xFFFFFFFF
    if offset > _ZIP64_LIMIT:
        values.append(offset)
        offset = 0xFFFFFFFF
    extra = b""
    if values:
        extra = struct.pack("<HH" + "Q" * len(values), 1, 8 * len(values), *values)
        version = _ZIP64_VERSION
    return _CENTRAL.pack(b"PK\x01\x02", version, _UNIX, version, 0, 0, method, _DOS_TIME, _DOS_DATE, crc,
                         csize, size, len(name), len(extra), 0, 0, 0, _REGULAR_FILE_ATTR, offset) + name + extra


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """End of central directory, preceded by the zip64 end record and locator when needed."""
    out = b""
    if count > _COUNT_LIMIT or cd_offset > _ZIP64_LIMIT or cd_size > _ZIP64_LIMIT:
        out = (_END64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
               + _LOCATOR64.pack(b"PK\x06\x07", 0, cd_offset + cd_size, 1))
        count, cd_size, cd_offset = min(count, 0xFFFF), min(cd_size, 0xFFFFFFFF), min(cd_offset, 0xFFFFFFFF)
    return out + _END.pack(b"PK\x05\x06", 0, 0, count, count, cd_size, cd_offset, 0)


def _write_at(fd: int, parts: tuple, offset: int) -> None:
    """Write ``parts`` back to back at ``offset``: one pwritev, looping only on a short write."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    try:
        while views:
            n = os.pwritev(fd, views, offset)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
    finally:
        for v in views:
            v.release()


# ----------------------------------------------------------------------------- writer


class ArchiveWriter:
    """Append-only writer of one raw archive. Not thread-safe: use from one thread.

    Write scheme (docs/archive.md): one file descriptor stays open and the central directory
    is kept in memory as bytes, so nothing is re-read or re-parsed. The file is
    ``[members][room][central directory][end record]``: a member goes into the room at the end
    of the member data, its entry and a new end record go over the old end record, then fsync.
    The file is a valid zip listing every member after each append; ``seal`` closes the room.

    Why the room: rewriting the whole directory after every member (the first version of this
    writer) is O(members) bytes per append. On the 2-core CPU box of docs/benchmarks.md, 10,000
    members of 4 KiB took a median of 0.62 ms each over the first 500 and 1.09 ms over the last
    1,000 (a 640 kB directory rewritten and fsynced each time); a 100,000-episode protocol writes
    ~300,000 members, a 19 MB directory per append. With the room an append writes its member
    plus ~64 B, and a directory move (geometric, see _room) ~320 B per member on average. The
    old writer reopened the zip and re-parsed its directory for every member: 9.7 ms per member
    at 500 members, 32 ms at 2,000.
    """

    def __init__(self, path: Path, *, format_version: int = FORMAT_VERSION):
        if format_version != FORMAT_VERSION:
            raise ArchiveError(
                f"archive format_version {format_version!r} is not supported; "
                f"write format_version {FORMAT_VERSION}"
            )
        self.path = Path(path)
        self.format_version = format_version
        self.members: dict[str, dict] = {}
        self.sha256: str | None = None  # set by seal()
        self.manifest_sha256: str | None = None  # SHA-256 of manifest.json's bytes, set by seal()
        self._broken: str | None = None
        self._end = 0  # where the next local header goes: the end of the member data
        self._cd_at = 0  # where the central directory starts (>= _end; the bytes between are room)
        self._count = 0  # zip entries written, manifest included
        self._central = bytearray()  # every central directory entry so far, in write order
        self._tail = b""  # the end record(s) last written; the file ends with them
        self._size = 0  # the file's size after our last write
        self._stamp: tuple[int, int, int] | None = None  # (st_dev, st_ino, st_mtime_ns) then
        self._hash = hashlib.sha256()  # of every byte before the central directory
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, flags, 0o666)  # exclusive create: never overwrite, even racing
        except FileExistsError:
            if not self.path.parent.is_dir():
                raise ArchiveError(f"could not create archive {self.path}: {self.path.parent} is not a directory; "
                                   f"write archives to a directory") from None
            raise ArchiveError(
                f"an archive already exists at {self.path}; results are never overwritten: "
                f"write this attempt to a new path"
            ) from None
        except OSError as e:
            raise ArchiveError(f"could not create archive {self.path} ({e}); check disk space and permissions") from None
        self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            # An empty but valid zip (its end record alone): the attempt exists from the first moment.
            self._tail = _end_records(0, 0, 0)
            _write_at(self._fd, (self._tail,), 0)
            os.fsync(self._fd)
            _fsync_dir(self.path.parent)  # and so does its directory entry
            st = os.fstat(self._fd)
            self._size, self._stamp = len(self._tail), (st.st_dev, st.st_ino, st.st_mtime_ns)
        except OSError as e:
            self._fail(f"{type(e).__name__}: {e}")  # closes it
            # The file is ours (exclusive create) and holds no zip: removed, so a full disk leaves
            # no empty archive behind for every later audit to trip on.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise ArchiveError(
                f"could not create archive {self.path} ({e}); check disk space and permissions"
            ) from None

    @property
    def sealed(self) -> bool:
        return self.sha256 is not None

    def close(self) -> None:
        """Release the file without sealing it (an interrupted attempt keeps what it wrote)."""
        self._closer()

    def add_json(self, name: str, obj: Any) -> None:
        self._check_name(name)
        self._write(name, self._json_bytes(name, obj), zipfile.ZIP_DEFLATED)

    def add_array(self, name: str, arr: np.ndarray) -> None:
        self._check_name(name)
        self._write(name, self._array_bytes(name, arr), zipfile.ZIP_STORED)

    def add_bytes(self, name: str, data: bytes) -> None:
        self._check_name(name)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArchiveError(
                f"member {name} must be bytes, got {type(data).__name__}; "
                f"use add_json or add_array for structured data"
            )
        # The exact layout fixes each member's method by its name (arrays STORED, the rest DEFLATED).
        method = expected_method(name)
        self._write(name, bytes(data), zipfile.ZIP_DEFLATED if method is None else method)

    def add_episode(self, record: dict, logits: np.ndarray | None = None,
                    trace: np.ndarray | None = None, forced: np.ndarray | None = None) -> EpisodeMembers:
        """Write one finished episode: its record (``episodes/NNNNN.json``, NNNNN being
        ``record["plan_index"]``), then its logits, memory trace and teacher-forced logits when
        given (None skips).

        Everything is checked before the first byte is written, so a refused episode leaves no
        member behind; each member is on disk (fsynced) when this returns.
        """
        self._check_writable()
        index = record.get("plan_index") if isinstance(record, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ArchiveError(
                f"an episode record needs an int plan_index >= 0 (got {index!r}); "
                f"pass the record the worker returned for its plan entry"
            )
        names = episode_members(index)
        parts = [(names.record, self._json_bytes(names.record, record), zipfile.ZIP_DEFLATED)]
        for name, arr in ((names.logits, logits), (names.trace, trace), (names.forced, forced)):
            if arr is not None:
                parts.append((name, self._array_bytes(name, arr), zipfile.ZIP_STORED))
        for name, _, _ in parts:
            self._check_name(name)
        # One fsync for the episode, after its last member: a crash before it leaves a valid zip
        # holding a prefix of the members (each write keeps the file a zip), and the record is
        # durable when this returns, as before. Three fsyncs an episode (record, logits, trace)
        # cost the driver about 2 ms on the shared 2-core box (docs/benchmarks.md, queue path).
        for i, (name, data, method) in enumerate(parts):
            self._write(name, data, method, sync=i == len(parts) - 1)
        return names

    def seal(self, manifest: dict) -> str:
        """Write manifest.json last; return the SHA-256 hex of the whole archive file."""
        self._check_writable()
        if not isinstance(manifest, dict):
            raise ArchiveError(
                f"the manifest of {self.path} must be a dict, got {type(manifest).__name__}"
            )
        if "members" in manifest:
            raise ArchiveError(
                f"the manifest for {self.path} must not carry 'members'; the writer fills it in"
            )
        if manifest.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ArchiveError(
                f"the manifest for {self.path} says format_version "
                f"{manifest['format_version']!r}; drop the key or set it to {FORMAT_VERSION}"
            )
        full = {
            **manifest,
            "format_version": FORMAT_VERSION,
            "members": {name: dict(entry) for name, entry in self.members.items()},
        }
        try:
            data = canonical_json(full)
        except (TypeError, ValueError) as e:
            raise ArchiveError(
                f"the manifest for {self.path} is not canonical JSON ({e}); "
                f"pass plain data without NaN/Infinity"
            ) from None
        self._append(MANIFEST_NAME, data, zipfile.ZIP_DEFLATED, last=True)
        self.manifest_sha256 = sha256_hex(data)
        # The member bytes were hashed as they were written; the directory is in memory.
        digest = self._hash.copy()
        digest.update(self._central)
        digest.update(self._tail)
        self.sha256 = digest.hexdigest()
        self.close()
        return self.sha256

    # -- internals

    def _check_writable(self) -> None:
        if self._broken is not None:
            raise ArchiveError(
                f"archive {self.path} is unusable after a failed write ({self._broken}); "
                f"keep it as an interrupted attempt and start a new one"
            )
        if self.sealed:
            raise ArchiveError(
                f"archive {self.path} is already sealed; a sealed archive is never appended to"
            )
        if not self._closer.alive:
            raise ArchiveError(
                f"archive {self.path} was closed without sealing; it stays an interrupted "
                f"attempt: write a new one"
            )

    def _check_name(self, name: str) -> None:
        self._check_writable()
        why = name_problem(name)
        if why is not None:
            raise ArchiveError(
                f"member name {name!r} {why}; use a relative POSIX path of [A-Za-z0-9._/-]"
            )
        if name == MANIFEST_NAME:
            raise ArchiveError(
                f"member name {MANIFEST_NAME} is reserved for the manifest; seal() writes it"
            )
        if name in self.members:
            raise ArchiveError(
                f"member {name} is already in archive {self.path}; each member is written once"
            )

    @staticmethod
    def _json_bytes(name: str, obj: Any) -> bytes:
        try:
            return canonical_json(obj)
        except (TypeError, ValueError) as e:
            raise ArchiveError(
                f"member {name} is not canonical JSON ({e}); pass plain data without NaN/Infinity"
            ) from None

    @staticmethod
    def _array_bytes(name: str, arr: np.ndarray) -> bytes:
        if not isinstance(arr, np.ndarray):
            raise ArchiveError(
                f"member {name} must be a numpy ndarray, got {type(arr).__name__}; "
                f"convert it with np.asarray first"
            )
        if arr.dtype.hasobject:
            raise ArchiveError(
                f"member {name} has object dtype {arr.dtype}, which would need pickle; "
                f"store a numeric array instead"
            )
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        return buf.getvalue()

    def _write(self, name: str, data: bytes, compress_type: int, *, sync: bool = True) -> None:
        self._append(name, data, compress_type, sync=sync)
        self.members[name] = {"sha256": sha256_hex(data), "size": len(data)}

    def _append(self, name: str, data: bytes, compress_type: int, *, last: bool = False, sync: bool = True) -> None:
        self._check_unchanged(name)
        raw_name = name.encode("ascii")  # name_problem() admits [A-Za-z0-9._/-] only
        if compress_type == zipfile.ZIP_DEFLATED:
            # zipfile's compressor at its default level: the same bytes zipfile would write.
            packer = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
            payload = packer.compress(data) + packer.flush()
        else:
            payload = data
        size, csize, crc = len(data), len(payload), zlib.crc32(data)
        zip64 = size * 1.05 > _ZIP64_LIMIT  # decided before compressing, as zipfile does
        if not zip64 and csize > _ZIP64_LIMIT:
            raise ArchiveError(
                f"member {name} compresses to {csize} bytes, past the zip32 limit its header was "
                f"sized for; store it uncompressed (add_array) or split it"
            )
        header = _local_header(raw_name, method=compress_type, crc=crc, csize=csize, size=size, zip64=zip64)
        entry = _central_entry(raw_name, method=compress_type, crc=crc, csize=csize, size=size,
                               offset=self._end, version=_ZIP64_VERSION if zip64 else _VERSION)
        try:
            self._commit(header, payload, entry, name, last=last, sync=sync)
        except OSError as e:
            self._fail(f"{type(e).__name__}: {e}")
            raise ArchiveError(
                f"could not append member {name} to archive {self.path} ({e}); check disk space, "
                f"permissions and who else touches the file, then rerun as a new attempt"
            ) from None

    def _commit(self, header: bytes, payload: bytes, entry: bytes, name: str, *, last: bool,
                sync: bool = True) -> None:
        """Put one member on disk and list it in the central directory; fsync (unless `sync` is
        False: a member followed by another of the same episode, add_episode).

        The member goes to the end of the member data, into the room left before the central
        directory; its entry and a new end record overwrite the old end record. When the member
        does not fit, the directory moves past it, leaving room for about a quarter more data
        (see _room). ``last`` (the manifest) closes the room instead: directory right after the
        member, file truncated, so a sealed archive is laid out exactly as zipfile writes one.
        """
        member_end = self._end + len(header) + len(payload)
        old_size, old_central = self._size, len(self._central)
        self._central += entry
        count = self._count + 1
        if last:
            cd_at = member_end
        elif member_end <= self._cd_at:
            cd_at = self._cd_at
        else:
            cd_at = member_end + _room(member_end, len(self._central))
        tail = _end_records(count, cd_at, len(self._central))
        size = cd_at + len(self._central) + len(tail)
        with memoryview(self._central) as central:
            if last:
                # One write, then the truncation: a crash between them leaves the unsealed zip
                # readable unless the compact directory overlapped the old one (see docs/archive.md).
                _write_at(self._fd, (header, payload, central, tail), self._end)
                if size < old_size:
                    os.ftruncate(self._fd, size)
            elif cd_at == self._cd_at:
                # The member lands in the room (nothing reads it yet), then the directory grows
                # by its entry: at every moment the file is the old zip or the new one.
                _write_at(self._fd, (header, payload), self._end)
                _write_at(self._fd, (central[old_central:], tail), cd_at + old_central)
            else:
                # The directory moves first, past the old end of file: the file stays a valid zip
                # (the new entry points at a header still being written) until the member lands.
                _write_at(self._fd, (central, tail), cd_at)
                _write_at(self._fd, (header, payload), self._end)
        if sync:
            os.fsync(self._fd)
        st = os.fstat(self._fd)
        if st.st_size != size:
            self._fail("archive changed behind the writer")
            raise ArchiveError(
                f"archive {self.path} is {st.st_size} bytes after writing member {name}, this writer "
                f"wrote {size}: something else writes to it; keep it for inspection and rerun the "
                f"screen as a new attempt"
            )
        self._hash.update(header)
        self._hash.update(payload)
        self._end, self._cd_at, self._count, self._tail, self._size = member_end, cd_at, count, tail, size
        self._stamp = (st.st_dev, st.st_ino, st.st_mtime_ns)

    def _check_unchanged(self, name: str) -> None:
        """O(1) guard: the path still names our file, with the size and mtime of our last
        write, still ending in the end record we wrote. The old writer re-parsed the whole
        central directory here; that was the cost that grew with every member."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._fail("file vanished")
            raise ArchiveError(
                f"archive {self.path} disappeared while being written; "
                f"check what removed it and rerun the screen"
            ) from None
        except OSError as e:
            self._fail(f"{type(e).__name__}: {e}")
            raise ArchiveError(
                f"could not append member {name} to archive {self.path} ({e}); check disk space, "
                f"permissions and who else touches the file, then rerun as a new attempt"
            ) from None
        ours = (st.st_dev, st.st_ino) == self._stamp[:2]
        if ours and st.st_size == self._size and st.st_mtime_ns == self._stamp[2]:
            if os.pread(self._fd, len(self._tail), self._size - len(self._tail)) == self._tail:
                return
        if ours and st.st_size < self._size:
            self._fail("torn or truncated file")
            raise ArchiveError(
                f"could not append member {name} to archive {self.path} (the file is {st.st_size} "
                f"bytes, this writer left {self._size}: truncated or torn); check disk space, "
                f"permissions and who else touches the file, then rerun as a new attempt"
            )
        self._fail("archive changed behind the writer")
        raise ArchiveError(
            f"archive {self.path} no longer holds exactly the members this writer "
            f"wrote; something else modified it: keep it for inspection and rerun "
            f"the screen as a new attempt"
        )

    def _fail(self, why: str) -> None:
        self._broken = why
        self.close()


def _room(member_end: int, central: int) -> int:
    """Bytes to leave free for members before a moved central directory.

    A quarter of the member data so far (at least 1 MiB) makes moves geometric: the k-th move
    copies a directory of ~64 B x n_k entries with n_k growing by 1.25x, so all moves together
    write ~5 x 64 B per member, whatever the count. The room also exceeds the directory plus its
    end records, so a moved directory never overlaps the old one. The room is left unwritten (a
    hole, where the file system has them) but for the old directory it replaced, until members
    fill it; seal() closes it.
    """
    return max(_MIN_ROOM, member_end // 4, central + _MAX_END_RECORDS)


def _fsync_dir(path: Path) -> None:
    """Make a new directory entry durable; a no-op where directories cannot be fsynced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- reader


def _locate_end(f, size: int) -> tuple[int, int, int, int]:
    """(entry count, central directory size, its start as the end record states it, bytes of the
    end records incl. any comment) read from the file's tail, before zipfile parses anything."""
    if size < _END.size:
        raise ValueError("too short for a zip end record")
    back = min(size, _END.size + 0xFFFF)
    f.seek(size - back)
    buf = f.read(back)
    i = buf.rfind(b"PK\x05\x06")
    while i >= 0:
        if i + _END.size <= len(buf):
            _, _, _, _, count, cd_size, cd_offset, comment = _END.unpack_from(buf, i)
            if i + _END.size + comment == len(buf):
                break
        i = buf.rfind(b"PK\x05\x06", 0, i)
    if i < 0:
        raise ValueError("no zip end record")
    end_at = size - back + i
    tail = size - end_at
    if end_at >= _LOCATOR64.size:
        f.seek(end_at - _LOCATOR64.size)
        loc = f.read(_LOCATOR64.size)
        if loc[:4] == b"PK\x06\x07":
            _, _, at64, _ = _LOCATOR64.unpack(loc)
            if 0 <= at64 <= size - _END64.size:
                f.seek(at64)
                rec = f.read(_END64.size)
                if rec[:4] == b"PK\x06\x06":
                    fields = _END64.unpack(rec)
                    count, cd_size, cd_offset = fields[7], fields[8], fields[9]
                    tail = size - at64
    return count, cd_size, cd_offset, tail


class ArchiveReader:
    """Bounded, in-memory reader of a raw archive. Use as a context manager or call close()."""

    def __init__(
        self,
        path: Path,
        *,
        max_member_bytes: int = MAX_ARRAY_BYTES,
        max_total_bytes: int = MAX_TOTAL_BYTES,
        max_archive_bytes: int = MAX_ARCHIVE_BYTES,
        max_json_bytes: int = MAX_JSON_BYTES,
        max_json_total_bytes: int = MAX_JSON_TOTAL_BYTES,
    ):
        self.path = Path(path)
        self.max_member_bytes = int(max_member_bytes)
        self.max_total_bytes = int(max_total_bytes)
        self.max_json_bytes = min(int(max_json_bytes), self.max_member_bytes)
        self.max_json_total_bytes = int(max_json_total_bytes)
        self.bytes_read = 0  # uncompressed bytes handed out by read_* so far
        if not self.path.is_file():
            raise ArchiveError(
                f"no archive at {self.path}; check the path (archives are written by the screen "
                f"that owns them)"
            )
        self.size = self.path.stat().st_size
        if self.size > max_archive_bytes:
            # Before hashing or parsing: a huge file costs nothing to refuse.
            raise ArchiveError(
                f"{self.path} is {self.size} bytes, over the bound of {max_archive_bytes} for a raw archive; "
                f"raise max_archive_bytes if the archive is trusted"
            )
        self._raw = open(self.path, "rb")
        try:
            count, cd_size, _, tail = _locate_end(self._raw, self.size)
        except (ValueError, struct.error, OSError) as e:
            self._raw.close()
            raise ArchiveError(
                f"{self.path} is not a readable zip archive ({e}); point at a raw archive written by packbench"
            ) from None
        if count > MAX_MEMBERS or cd_size > MAX_DIRECTORY_BYTES:
            self._raw.close()
            raise ArchiveError(
                f"{self.path} declares {count} members in a {cd_size}-byte directory, over the bounds of "
                f"{MAX_MEMBERS} members and {MAX_DIRECTORY_BYTES} bytes; it is not a raw archive packbench reads"
            )
        try:
            self._zf = zipfile.ZipFile(self._raw, "r")
        except Exception as e:  # hostile bytes reach zipfile's parser: any failure means "not ours"
            self._raw.close()
            raise ArchiveError(
                f"{self.path} is not a readable zip archive ({one_line(str(e))}); "
                f"point at a raw archive written by packbench"
            ) from None
        self._tail_bytes = tail
        self._infos: list[zipfile.ZipInfo] = self._zf.infolist()
        self.names: list[str] = [info.filename for info in self._infos]
        self._by_name: dict[str, list[zipfile.ZipInfo]] = {}
        for info in self._infos:
            self._by_name.setdefault(info.filename, []).append(info)

        self.manifest: dict | None = None
        self._manifest_problem: Problem | None = None
        self._data_at: dict[int, int] = {}  # id(info) -> where its data starts, when its local header is exact
        try:
            self._layout: list[Problem] = self._check_layout()
        except (struct.error, OverflowError, ValueError, OSError) as e:
            # Values no writer record can hold (a size past its field, a name past 64 KiB): not our layout.
            self._data_at.clear()
            self._layout = [Problem(None, "layout", f"layout: the zip records hold values the writer never writes "
                                                    f"({one_line(str(e))[:200]})")]
        self._load_manifest()

    @property
    def complete(self) -> bool:
        """manifest.json present, readable and parseable as a v1 manifest."""
        return self.manifest is not None

    def close(self) -> None:
        self._zf.close()
        self._raw.close()

    def __enter__(self) -> "ArchiveReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public reads

    def read_bytes(self, name: str) -> bytes:
        return bytes(self._read(name))

    def _read(self, name: str, *, limit: int | None = None, check_first=None) -> bytearray:
        """A member's bytes in one buffer of its declared size, under every bound."""
        info = self._lookup(name)
        budget = self.max_total_bytes - self.bytes_read
        if info.file_size > budget:
            raise ArchiveError(
                f"reading member {name} ({info.file_size} bytes) would pass this reader's total "
                f"bound of {self.max_total_bytes} bytes; raise max_total_bytes if the archive "
                f"is trusted"
            )
        bound = min(self.max_member_bytes if limit is None else limit, budget)
        # One buffer of the declared size (checked against the bounds above): no list of chunks
        # joined into a second copy. A member that yields more than declared fails in _chunks.
        buf = bytearray(min(info.file_size, bound))
        at = 0
        try:
            for chunk in self._chunks(info, bound):
                if check_first is not None and at == 0:
                    check_first(chunk, info.file_size)
                if at + len(chunk) > len(buf):
                    raise _MemberError(name, f"yields more than the {info.file_size} bytes it declares",
                                       "the archive is damaged: run verify()")
                buf[at:at + len(chunk)] = chunk
                at += len(chunk)
            if check_first is not None and at == 0:
                check_first(b"", info.file_size)
        except _MemberError as e:
            raise ArchiveError(f"member {name} of archive {self.path} {e.phrase}; {e.fix}") from None
        del buf[at:]
        self.bytes_read += at
        return buf

    def read_json(self, name: str) -> Any:
        """A JSON member in its one canonical byte form (no duplicate keys, no NaN)."""
        data = bytes(self._read(name, limit=self.max_json_bytes))
        try:
            return _canonical_loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ArchiveError(
                f"member {name} of archive {self.path} is not valid JSON ({one_line(str(e))[:200]}); "
                f"the archive is damaged: run verify()"
            ) from None

    def read_array(self, name: str, *, dtype: str | None = None, ndim: int | None = None) -> np.ndarray:
        """A .npy member; its header is checked (and ``dtype``, e.g. '<f4', and ``ndim`` when
        given) on the first chunk, before the data is read."""
        def check(first: bytes, size: int) -> None:
            _npy_header(first, size, dtype=dtype, ndim=ndim)

        data = self._read(name, check_first=check)
        try:
            return _load_npy(data)
        except _MemberError as e:
            raise ArchiveError(f"member {name} of archive {self.path} {e.phrase}; {e.fix}") from None

    def episodes(self) -> list[EpisodeMembers]:
        """The episodes whose record member (``episodes/NNNNN.json``) this archive holds, in
        index order. Names only: whether a member can be trusted is what ``verify`` says."""
        held = []
        for name in self._by_name:
            m = _EPISODE_RECORD.fullmatch(name)
            if m is not None and episode_member(int(m.group(1))) == name:
                held.append(episode_members(int(m.group(1))))
        return sorted(held, key=lambda e: e.index)

    # -- verification

    def verify(self) -> list[Problem]:
        """Every problem found, one ``Problem`` each; [] means intact. ``member`` names the
        member concerned (the auditor trusts exactly the members no problem names)."""
        problems: list[Problem] = []
        if MANIFEST_NAME not in self._by_name:
            problems.append(Problem(MANIFEST_NAME, "incomplete",
                                    f"archive incomplete: no {MANIFEST_NAME} (interrupted screen?)"))
        elif self._manifest_problem is not None:
            problems.append(self._manifest_problem)

        declared_total = sum(info.file_size for info in self._infos)
        declared_json = sum(info.file_size for info in self._infos if not info.filename.endswith(".npy"))
        if declared_total > self.max_total_bytes:
            problems.append(Problem(
                None, "too-large",
                f"archive too large: its members declare {declared_total} bytes in total, "
                f"the bound is {self.max_total_bytes} (raise max_total_bytes if trusted)"
            ))
            return _distinct(problems)
        if declared_json > self.max_json_total_bytes:
            problems.append(Problem(
                None, "too-large",
                f"archive too large: its JSON members declare {declared_json} bytes in total, "
                f"the bound is {self.max_json_total_bytes} (raise max_json_total_bytes if trusted)"
            ))
            return _distinct(problems)
        problems += self._layout

        listed: dict[str, dict] = self.manifest["members"] if self.manifest else {}
        seen: set[str] = set()
        for info in self._infos:
            name = info.filename
            shown = _show(name)
            if name in seen:
                problems.append(Problem(name, "duplicate", f"duplicate member {shown}"))
                continue
            seen.add(name)
            why = _entry_name_problem(info)
            if why is not None:
                problems.append(Problem(name, "unsafe", f"unsafe member name {shown} ({why})"))
                continue
            if _is_symlink(info):
                problems.append(Problem(name, "symlink", f"symlink member {shown}"))
                continue
            if name == MANIFEST_NAME:
                continue  # checked while loading; its hash cannot be listed inside itself
            if self.manifest is not None and name not in listed:
                problems.append(Problem(name, "extra", f"extra member {shown}"))
                continue
            entry = listed.get(name)
            if entry is not None and entry["size"] != info.file_size:
                # Before reading: a manifest (or zip directory) that lies about sizes is named.
                problems.append(Problem(
                    name, "size",
                    f"size mismatch for member {shown}: manifest says {entry['size']}, "
                    f"archive holds {info.file_size}"
                ))
                continue
            digest = hashlib.sha256()
            size = 0
            limit = self.max_member_bytes if name.endswith(".npy") else self.max_json_bytes
            try:
                for chunk in self._chunks(info, limit, exact=True):
                    digest.update(chunk)
                    size += len(chunk)
            except _MemberError as e:
                problems.append(Problem(name, "unreadable", f"unreadable member {shown}: {e.cause}"))
                continue
            if entry is None:
                continue  # incomplete archive: readable is all we can say
            if size != entry["size"]:
                problems.append(Problem(
                    name, "size",
                    f"size mismatch for member {shown}: manifest says {entry['size']}, "
                    f"archive holds {size}"
                ))
            elif digest.hexdigest() != entry["sha256"]:
                problems.append(Problem(name, "altered", f"altered member {shown} (sha256 mismatch)"))

        for name in listed:
            shown = _show(name)
            if name not in self._by_name:
                why = name_problem(name)
                if why is not None:
                    problems.append(Problem(
                        name, "unsafe", f"unsafe member name {shown} (listed in {MANIFEST_NAME}; {why})"))
                else:
                    problems.append(Problem(name, "missing", f"missing member {shown}"))
        return _distinct(problems)

    # -- internals

    def _check_layout(self) -> list[Problem]:
        """Every byte of the file against the one layout the writer produces (docs/archive.md,
        "Exact layout"): local headers equal to what the writer would write for the central
        directory's entry, members back to back from byte 0, the directory right after the
        last member (an unsealed archive may keep the writer's room before it), the directory
        entries and end record exactly the writer's, no comment, nothing after the end record.
        Only reads headers: O(members) small preads."""
        out: list[Problem] = []
        sealed = MANIFEST_NAME in self._by_name
        fd = self._raw.fileno()
        pos = 0
        expected_cd = bytearray()
        for info in self._infos:
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
            zip64 = info.file_size * 1.05 > _ZIP64_LIMIT
            header = _local_header(raw, method=info.compress_type, crc=info.CRC, csize=info.compress_size,
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
                self._data_at[id(info)] = at + len(header)
            pos = max(pos, at + len(header) + info.compress_size)
            expected_cd += _central_entry(raw, method=info.compress_type, crc=info.CRC, csize=info.compress_size,
                                          size=info.file_size, offset=at,
                                          version=_ZIP64_VERSION if zip64 else _VERSION)
        if sealed and self._infos[-1].filename != MANIFEST_NAME:
            out.append(Problem(None, "layout", f"layout: {MANIFEST_NAME} is not the last member (the writer seals last)"))
        cd_at = self.size - self._tail_bytes - len(expected_cd)
        if cd_at < pos or (sealed and cd_at != pos):
            if cd_at > pos:
                out.append(Problem(None, "layout", f"layout: {cd_at - pos} bytes between the last member and the "
                                                   f"central directory belong to no member (offset {pos})"))
            else:
                out.append(Problem(None, "layout", "layout: the central directory is not where the members end"))
        try:
            actual_cd = os.pread(fd, len(expected_cd), cd_at) if cd_at >= 0 else b""
            actual_tail = os.pread(fd, self._tail_bytes + 1, self.size - self._tail_bytes)
        except OSError:
            actual_cd = actual_tail = b""
        if actual_cd != expected_cd:
            out.append(Problem(None, "layout", "layout: the central directory holds fields, bytes or entries the "
                                               "writer never writes"))
        tail = _end_records(len(self._infos), cd_at, len(expected_cd))
        if actual_tail != tail:
            comment = len(self._zf.comment)
            why = f"a zip comment of {comment} bytes" if comment else "bytes the writer never writes"
            out.append(Problem(None, "layout", f"layout: the end of central directory record holds {why}"))
        return out

    def _load_manifest(self) -> None:
        infos = self._by_name.get(MANIFEST_NAME)
        if not infos:
            return
        if len(infos) > 1:
            self._manifest_problem = Problem(
                MANIFEST_NAME, "duplicate", f"duplicate member {MANIFEST_NAME}: cannot tell which is real")
            return
        info = infos[0]
        if _is_symlink(info):
            self._manifest_problem = Problem(MANIFEST_NAME, "symlink", f"symlink member {MANIFEST_NAME}")
            return
        try:
            data = b"".join(self._chunks(info, self.max_json_bytes, exact=True))
        except _MemberError as e:
            self._manifest_problem = Problem(
                MANIFEST_NAME, "unreadable", f"unreadable member {MANIFEST_NAME}: {e.cause}")
            return
        try:
            manifest = _canonical_loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            self._manifest_problem = Problem(
                MANIFEST_NAME, "manifest", f"unparseable member {MANIFEST_NAME}: {one_line(str(e))[:200]}")
            return
        why = _manifest_shape_problem(manifest)
        if why is not None:
            self._manifest_problem = Problem(MANIFEST_NAME, "manifest", f"malformed member {MANIFEST_NAME}: {why}")
            return
        self.manifest = manifest

    def _lookup(self, name: str) -> zipfile.ZipInfo:
        why = name_problem(name)
        if why is not None:
            raise ArchiveError(
                f"refusing unsafe member name {name!r} in archive {self.path} ({why}); "
                f"v1 names are relative POSIX paths of [A-Za-z0-9._/-]"
            )
        infos = self._by_name.get(name)
        if not infos:
            raise ArchiveError(
                f"no member {name} in archive {self.path}; list reader.names for what it holds"
            )
        if len(infos) > 1:
            raise ArchiveError(
                f"member {name} appears {len(infos)} times in archive {self.path}; "
                f"the archive is hostile or damaged: run verify()"
            )
        info = infos[0]
        if info.orig_filename != info.filename:
            raise ArchiveError(
                f"refusing unsafe member name {info.orig_filename!r} in archive {self.path} "
                f"(contains a NUL byte); the archive is hostile or damaged"
            )
        if _is_symlink(info):
            raise ArchiveError(
                f"refusing symlink member {name} in archive {self.path}; "
                f"raw archives hold regular files only"
            )
        return info

    def _chunks(self, info: zipfile.ZipInfo, limit: int, *, exact: bool = False) -> Iterator[bytes]:
        """Yield the member's bytes, never more than ``limit`` in total; raise _MemberError.
        ``exact`` (verify): a DEFLATE member must also be the very stream the writer's zlib
        produces for its content (see _exact_chunks)."""
        name = info.filename
        if info.file_size > limit:
            raise _MemberError(
                name,
                f"declares {info.file_size} bytes, over the bound of {limit}",
                "raise max_member_bytes if the archive is trusted",
            )
        if info.compress_type not in _SUPPORTED_COMPRESSION:
            raise _MemberError(
                name,
                f"uses unsupported compression method {info.compress_type}",
                "raw archives use STORED or DEFLATED only",
            )
        if info.flag_bits & 0x1:
            raise _MemberError(name, "is encrypted", "raw archives are never encrypted")
        data_at = self._data_at.get(id(info))
        if data_at is not None:
            yield from self._exact_chunks(info, data_at, limit, recompress=exact)
            return
        total = 0
        try:
            with self._zf.open(info, "r") as f:
                while True:
                    # Ask for at most one byte past the bound, so an inflating member stops early.
                    chunk = f.read(min(_CHUNK, limit - total + 1))
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > limit:
                        raise _MemberError(
                            name,
                            f"inflates past the bound of {limit} bytes",
                            "the archive is hostile or damaged",
                        )
                    yield chunk
        except _MemberError:
            raise
        except Exception as e:  # hostile bytes may trip any parser path: report, never crash
            kind = "zlib.error" if isinstance(e, zlib.error) else type(e).__name__
            cause = one_line(f"{kind}: {e}")
            raise _MemberError(
                name, f"cannot be read ({cause})", "the archive is damaged: run verify()", cause
            ) from None
        if total != info.file_size:
            raise _MemberError(
                name,
                f"holds {total} bytes but its zip entry declares {info.file_size}",
                "the archive is damaged: run verify()",
            )

    def _exact_chunks(self, info: zipfile.ZipInfo, data_at: int, limit: int, *,
                      recompress: bool = False) -> Iterator[bytes]:
        """Read a member whose local header is exactly the writer's, straight from the file:
        its compressed bytes must be one whole DEFLATE stream (or the STORED bytes), with nothing
        after the stream's end, the CRC and size of the directory.

        With ``recompress`` the content is deflated again as the writer does (zlib, default
        level, raw stream) and must give the stored bytes exactly: a DEFLATE stream has bits no
        content depends on (the padding of its last byte, unused code lengths), so without this
        a flipped bit there would change the file but not one member hash."""
        name = info.filename

        def fail(cause: str) -> _MemberError:
            return _MemberError(name, f"cannot be read ({cause})", "the archive is damaged: run verify()", cause)

        fd = self._raw.fileno()
        inflate = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
        packer = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15) if recompress and inflate else None
        stored, again = hashlib.sha256(), hashlib.sha256()
        remaining, at, total, crc = info.compress_size, data_at, 0, 0

        def emit(chunk: bytes) -> bytes:
            nonlocal total, crc
            total += len(chunk)
            if total > limit:
                raise _MemberError(name, f"inflates past the bound of {limit} bytes", "the archive is hostile or damaged")
            crc = zlib.crc32(chunk, crc)
            if packer is not None:
                again.update(packer.compress(chunk))
            return chunk

        try:
            while remaining:
                raw = os.pread(fd, min(_CHUNK, remaining), at)
                if not raw:
                    raise fail("the file ends inside the member")
                at += len(raw)
                remaining -= len(raw)
                if packer is not None:
                    stored.update(raw)
                if inflate is None:
                    yield emit(raw)
                    continue
                buf = raw
                while buf:
                    if inflate.eof:
                        raise fail(f"{len(buf) + remaining} bytes after the end of its DEFLATE stream")
                    out = inflate.decompress(buf, min(_CHUNK, limit - total + 1))
                    buf = inflate.unconsumed_tail
                    if out:
                        yield emit(out)
                    elif buf:
                        raise fail("the DEFLATE stream makes no progress")
            if inflate is not None:
                while not inflate.eof:
                    out = inflate.decompress(b"", min(_CHUNK, limit - total + 1))
                    if not out:
                        raise fail("truncated DEFLATE stream")
                    yield emit(out)
                if inflate.unused_data:
                    raise fail(f"{len(inflate.unused_data)} bytes after the end of its DEFLATE stream")
        except zlib.error as e:
            raise fail(one_line(f"zlib.error: {e}")) from None
        except OSError as e:
            raise fail(one_line(f"{type(e).__name__}: {e}")) from None
        if total != info.file_size:
            raise _MemberError(name, f"holds {total} bytes but its zip entry declares {info.file_size}",
                               "the archive is damaged: run verify()")
        if crc != info.CRC:
            raise fail(f"BadZipFile: Bad CRC-32 for file {name!r}")
        if packer is not None:
            again.update(packer.flush())
            if again.digest() != stored.digest():
                if not stock_deflate():
                    raise fail(f"its DEFLATE stream cannot be checked here: this Python's zlib "
                               f"({zlib.ZLIB_RUNTIME_VERSION}) does not deflate as stock zlib does; audit with a "
                               f"Python built on stock zlib")
                raise fail("its DEFLATE stream is not the one the writer's zlib (default level) makes of its "
                           "content: bits the member hash does not cover were changed")


# Stock zlib's raw default-level deflate of a fixed text (the same from zlib 1.2.x to 1.3.x). A
# Python on another deflate implementation (zlib-ng, say) makes other, valid streams: it cannot
# check that a DEFLATE member is the writer's stream, and says so instead of calling it altered.
_DEFLATE_PROBE = b"".join(b"packbench %d " % i for i in range(2000)) + bytes(range(256)) * 8
_DEFLATE_PROBE_SHA256 = "f38761d811e04531ed9a5c3e07eb90e130460ec82062796b557f3d158a7313bb"


@functools.cache
def stock_deflate() -> bool:
    """Whether this Python's zlib deflates as stock zlib (the writer's reference) does."""
    packer = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
    out = packer.compress(_DEFLATE_PROBE) + packer.flush()
    return hashlib.sha256(out).hexdigest() == _DEFLATE_PROBE_SHA256


class _MemberError(Exception):
    """Internal: a member could not be read.

    ``phrase`` is a verb phrase completing "member NAME ...", ``cause`` the short cause used in
    verify()'s "unreadable member NAME: cause" line, ``fix`` the advice.
    """

    def __init__(self, name: str, phrase: str, fix: str, cause: str | None = None):
        super().__init__(phrase)
        self.name = name
        self.phrase = phrase
        self.fix = fix
        self.cause = cause if cause is not None else phrase


def _npy_header_fields(fp: io.BytesIO) -> tuple:
    """(shape, fortran_order, dtype) of a .npy header at `fp`; raises what numpy raises."""
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fp)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(fp)
    raise ValueError(f"unsupported .npy version {version}")


def _npy_header(first: bytes, size: int, *, dtype: str | None = None, ndim: int | None = None) -> None:
    """Check a .npy header from the member's first chunk before its data is read: a small
    member that declares a huge array, another dtype or byte order than asked, a Fortran-order
    or pickled array is refused here, having allocated nothing."""
    fp = io.BytesIO(first[:_MAX_NPY_HEADER + 16])
    try:
        shape, fortran, got = _npy_header_fields(fp)
    except _READ_ERRORS as e:
        raise _MemberError("", f"is not a .npy array ({one_line(str(e))[:200]})", "the archive is damaged") from None
    if got.hasobject:
        raise _MemberError("", f"is a pickled object array (dtype {got}), refused",
                           "raw archives hold numeric arrays only; the archive is hostile or damaged")
    if dtype is not None and (got.str != dtype or fortran):
        raise _MemberError("", f"is a {'Fortran-order ' if fortran else ''}{got.str} array, the format says C-order "
                               f"{dtype} (docs/archive.md)", "the archive was not written by packbench")
    if ndim is not None and len(shape) != ndim:
        raise _MemberError("", f"has {len(shape)} dimensions, the format says {ndim}", "the archive is damaged")
    expected = math.prod(shape) * got.itemsize
    held = size - fp.tell()
    if held != expected:
        raise _MemberError("", f"declares shape {shape} of {got} ({expected} bytes) but holds {held} data bytes",
                           "the archive is damaged")


def _load_npy(data: bytes | bytearray) -> np.ndarray:
    """Parse a .npy payload without pickle, checking the header against the payload length."""
    fp = io.BytesIO(bytes(memoryview(data)[:_MAX_NPY_HEADER + 16]))  # the header only: no copy of the data
    try:
        shape, fortran, dtype = _npy_header_fields(fp)
    except _READ_ERRORS as e:
        raise _MemberError("", f"is not a .npy array ({e})", "the archive is damaged") from None
    if dtype.hasobject:
        raise _MemberError(
            "",
            f"is a pickled object array (dtype {dtype}), refused",
            "raw archives hold numeric arrays only; the archive is hostile or damaged",
        )
    expected = math.prod(shape) * dtype.itemsize
    held = len(data) - fp.tell()
    if held != expected:
        raise _MemberError(
            "",
            f"declares shape {shape} of {dtype} ({expected} bytes) but holds {held} data bytes",
            "the archive is damaged",
        )
    try:
        # A view of the member's buffer, not np.load's copy of it: an array member costs its
        # size once. Never pickle: object dtypes were refused above.
        flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=fp.tell())
        arr = flat.reshape(shape, order="F" if fortran else "C")
    except _READ_ERRORS as e:
        raise _MemberError("", f"is not a loadable .npy array ({e})", "the archive is damaged") from None
    return arr
