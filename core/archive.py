"""Raw archive format v1: one zip per screen attempt, written member by member, sealed last.

Writer: every ``add_*`` call opens the zip in append mode, writes exactly one member, closes
and fsyncs it, so an interrupted screen leaves a readable partial archive (no
``manifest.json``: "incomplete"). ``seal`` writes ``manifest.json`` last, holding the SHA-256
and size of every other member, and returns the SHA-256 of the whole archive file.

Reader: never extracts to disk. Members are read into memory in chunks under a per-member and
a per-reader byte bound; unsafe names, symlink entries, pickled arrays and CRC errors are
refused with ``ArchiveError``. ``verify`` never raises for a hostile member: it returns one
line per problem, each naming the member.

Pure Python + numpy (see docs/archive.md for the format).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from core.canonical import canonical_json, sha256_hex
from core.errors import ArchiveError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

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


def _one_line(text: str) -> str:
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-standard JSON constant {token}")


def _loads(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)


# ----------------------------------------------------------------------------- writer


class ArchiveWriter:
    """Append-only writer of one raw archive. Not thread-safe: use from one thread."""

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
        self._broken: str | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            f = open(self.path, "xb")  # exclusive create: never overwrite, even racing
        except FileExistsError:
            raise ArchiveError(
                f"an archive already exists at {self.path}; results are never overwritten: "
                f"write this attempt to a new path"
            ) from None
        with f:
            with zipfile.ZipFile(f, "w"):
                pass  # an empty but valid zip: the attempt exists from the first moment
            f.flush()
            os.fsync(f.fileno())

    @property
    def sealed(self) -> bool:
        return self.sha256 is not None

    def add_json(self, name: str, obj: Any) -> None:
        self._check_name(name)
        try:
            data = canonical_json(obj)
        except (TypeError, ValueError) as e:
            raise ArchiveError(
                f"member {name} is not canonical JSON ({e}); pass plain data without NaN/Infinity"
            ) from None
        self._write(name, data, zipfile.ZIP_DEFLATED)

    def add_array(self, name: str, arr: np.ndarray) -> None:
        self._check_name(name)
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
        self._write(name, buf.getvalue(), zipfile.ZIP_STORED)

    def add_bytes(self, name: str, data: bytes) -> None:
        self._check_name(name)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArchiveError(
                f"member {name} must be bytes, got {type(data).__name__}; "
                f"use add_json or add_array for structured data"
            )
        self._write(name, bytes(data), zipfile.ZIP_DEFLATED)

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
        self._append(MANIFEST_NAME, data, zipfile.ZIP_DEFLATED)
        self.sha256 = file_sha256(self.path)
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

    def _write(self, name: str, data: bytes, compress_type: int) -> None:
        self._append(name, data, compress_type)
        self.members[name] = {"sha256": sha256_hex(data), "size": len(data)}

    def _append(self, name: str, data: bytes, compress_type: int) -> None:
        info = zipfile.ZipInfo(name, date_time=_DATE_TIME)
        info.create_system = 3  # unix, so external_attr carries the mode
        info.external_attr = _REGULAR_FILE_ATTR
        info.compress_type = compress_type
        try:
            with open(self.path, "r+b") as f:
                # zipfile's append mode silently starts a second zip at the end of a file it
                # cannot parse; check first that the file still holds exactly what we wrote.
                with zipfile.ZipFile(f, "r") as current:
                    on_disk = current.namelist()
                if on_disk != list(self.members):
                    self._broken = "archive changed behind the writer"
                    raise ArchiveError(
                        f"archive {self.path} no longer holds exactly the members this writer "
                        f"wrote; something else modified it: keep it for inspection and rerun "
                        f"the screen as a new attempt"
                    )
                f.seek(0)
                with zipfile.ZipFile(f, "a") as zf:
                    zf.writestr(info, data, compress_type=compress_type)
                f.flush()
                os.fsync(f.fileno())
        except FileNotFoundError:
            self._broken = "file vanished"
            raise ArchiveError(
                f"archive {self.path} disappeared while being written; "
                f"check what removed it and rerun the screen"
            ) from None
        except (OSError, zipfile.BadZipFile) as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise ArchiveError(
                f"could not append member {name} to archive {self.path} ({e}); check disk space, "
                f"permissions and who else touches the file, then rerun as a new attempt"
            ) from None


# ----------------------------------------------------------------------------- reader


class ArchiveReader:
    """Bounded, in-memory reader of a raw archive. Use as a context manager or call close()."""

    def __init__(
        self,
        path: Path,
        *,
        max_member_bytes: int = 1 << 30,
        max_total_bytes: int = 8 << 30,
    ):
        self.path = Path(path)
        self.max_member_bytes = int(max_member_bytes)
        self.max_total_bytes = int(max_total_bytes)
        self.bytes_read = 0  # uncompressed bytes handed out by read_* so far
        if not self.path.is_file():
            raise ArchiveError(
                f"no archive at {self.path}; check the path (archives are written by the screen "
                f"that owns them)"
            )
        try:
            self._zf = zipfile.ZipFile(self.path, "r")
        except Exception as e:  # hostile bytes reach zipfile's parser: any failure means "not ours"
            raise ArchiveError(
                f"{self.path} is not a readable zip archive ({_one_line(str(e))}); "
                f"point at a raw archive written by packbench"
            ) from None
        self._infos: list[zipfile.ZipInfo] = self._zf.infolist()
        self.names: list[str] = [info.filename for info in self._infos]
        self._by_name: dict[str, list[zipfile.ZipInfo]] = {}
        for info in self._infos:
            self._by_name.setdefault(info.filename, []).append(info)

        self.manifest: dict | None = None
        self._manifest_problem: str | None = None
        self._load_manifest()

    @property
    def complete(self) -> bool:
        """manifest.json present, readable and parseable as a v1 manifest."""
        return self.manifest is not None

    def close(self) -> None:
        self._zf.close()

    def __enter__(self) -> "ArchiveReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public reads

    def read_bytes(self, name: str) -> bytes:
        info = self._lookup(name)
        budget = self.max_total_bytes - self.bytes_read
        if info.file_size > budget:
            raise ArchiveError(
                f"reading member {name} ({info.file_size} bytes) would pass this reader's total "
                f"bound of {self.max_total_bytes} bytes; raise max_total_bytes if the archive "
                f"is trusted"
            )
        parts = []
        try:
            for chunk in self._chunks(info, min(self.max_member_bytes, budget)):
                parts.append(chunk)
        except _MemberError as e:
            raise ArchiveError(f"member {name} of archive {self.path} {e.phrase}; {e.fix}") from None
        data = b"".join(parts)
        self.bytes_read += len(data)
        return data

    def read_json(self, name: str) -> Any:
        data = self.read_bytes(name)
        try:
            return _loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ArchiveError(
                f"member {name} of archive {self.path} is not valid JSON ({e}); "
                f"the archive is damaged: run verify()"
            ) from None

    def read_array(self, name: str) -> np.ndarray:
        data = self.read_bytes(name)
        try:
            return _load_npy(data)
        except _MemberError as e:
            raise ArchiveError(f"member {name} of archive {self.path} {e.phrase}; {e.fix}") from None

    # -- verification

    def verify(self) -> list[str]:
        """Every problem found, one line each naming the member; [] means intact."""
        problems: list[str] = []
        if MANIFEST_NAME not in self._by_name:
            problems.append(f"archive incomplete: no {MANIFEST_NAME} (interrupted screen?)")
        elif self._manifest_problem is not None:
            problems.append(self._manifest_problem)

        declared_total = sum(info.file_size for info in self._infos)
        if declared_total > self.max_total_bytes:
            problems.append(
                f"archive too large: its members declare {declared_total} bytes in total, "
                f"the bound is {self.max_total_bytes} (raise max_total_bytes if trusted)"
            )
            return [_one_line(p) for p in problems]

        listed: dict[str, dict] = self.manifest["members"] if self.manifest else {}
        seen: set[str] = set()
        for info in self._infos:
            name = info.filename
            shown = _show(name)
            if name in seen:
                problems.append(f"duplicate member {shown}")
                continue
            seen.add(name)
            why = _entry_name_problem(info)
            if why is not None:
                problems.append(f"unsafe member name {shown} ({why})")
                continue
            if _is_symlink(info):
                problems.append(f"symlink member {shown}")
                continue
            if name == MANIFEST_NAME:
                continue  # checked while loading; its hash cannot be listed inside itself
            if self.manifest is not None and name not in listed:
                problems.append(f"extra member {shown}")
                continue
            entry = listed.get(name)
            if entry is not None and entry["size"] != info.file_size:
                # Before reading: a manifest (or zip directory) that lies about sizes is named.
                problems.append(
                    f"size mismatch for member {shown}: manifest says {entry['size']}, "
                    f"archive holds {info.file_size}"
                )
                continue
            digest = hashlib.sha256()
            size = 0
            try:
                for chunk in self._chunks(info, self.max_member_bytes):
                    digest.update(chunk)
                    size += len(chunk)
            except _MemberError as e:
                problems.append(f"unreadable member {shown}: {e.cause}")
                continue
            if entry is None:
                continue  # incomplete archive: readable is all we can say
            if size != entry["size"]:
                problems.append(
                    f"size mismatch for member {shown}: manifest says {entry['size']}, "
                    f"archive holds {size}"
                )
            elif digest.hexdigest() != entry["sha256"]:
                problems.append(f"altered member {shown} (sha256 mismatch)")

        for name in listed:
            shown = _show(name)
            if name not in self._by_name:
                why = name_problem(name)
                if why is not None:
                    problems.append(f"unsafe member name {shown} (listed in {MANIFEST_NAME}; {why})")
                else:
                    problems.append(f"missing member {shown}")
        return list(dict.fromkeys(_one_line(p) for p in problems))

    # -- internals

    def _load_manifest(self) -> None:
        infos = self._by_name.get(MANIFEST_NAME)
        if not infos:
            return
        if len(infos) > 1:
            self._manifest_problem = f"duplicate member {MANIFEST_NAME}: cannot tell which is real"
            return
        info = infos[0]
        if _is_symlink(info):
            self._manifest_problem = f"symlink member {MANIFEST_NAME}"
            return
        try:
            data = b"".join(self._chunks(info, self.max_member_bytes))
        except _MemberError as e:
            self._manifest_problem = f"unreadable member {MANIFEST_NAME}: {e.cause}"
            return
        try:
            manifest = _loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            self._manifest_problem = f"unparseable member {MANIFEST_NAME}: {e}"
            return
        why = _manifest_shape_problem(manifest)
        if why is not None:
            self._manifest_problem = f"malformed member {MANIFEST_NAME}: {why}"
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

    def _chunks(self, info: zipfile.ZipInfo, limit: int) -> Iterator[bytes]:
        """Yield the member's bytes, never more than ``limit`` in total; raise _MemberError."""
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
            cause = _one_line(f"{kind}: {e}")
            raise _MemberError(
                name, f"cannot be read ({cause})", "the archive is damaged: run verify()", cause
            ) from None
        if total != info.file_size:
            raise _MemberError(
                name,
                f"holds {total} bytes but its zip entry declares {info.file_size}",
                "the archive is damaged: run verify()",
            )


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


def _load_npy(data: bytes) -> np.ndarray:
    """Parse a .npy payload without pickle, checking the header against the payload length."""
    fp = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy version {version}")
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
    fp.seek(0)
    try:
        arr = np.load(fp, allow_pickle=False)
    except _READ_ERRORS as e:
        raise _MemberError("", f"is not a loadable .npy array ({e})", "the archive is damaged") from None
    if not isinstance(arr, np.ndarray):
        raise _MemberError("", "is not a .npy array", "the archive is damaged")
    return arr
