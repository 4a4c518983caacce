"""The raw archive reader: bounded, in memory, never extracting to disk.

Members are read into memory in chunks under a per-member and a per-reader byte bound; unsafe
names, symlink entries, pickled arrays and CRC errors are refused with ``ArchiveError``.
``verify`` (core/archive/verify.py) never raises for a hostile member: it returns one
``Problem`` per problem. Reads files only (open, pread); numpy parses arrays without pickle.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from packbench.core.archive.bounds import over_bound_line
from packbench.core.archive.layout import MANIFEST_NAME, EpisodeMembers, episode_index, episode_members, name_problem
from packbench.core.archive.problems import Problem, MemberError
from packbench.core.archive.verify import layout_problems, manifest_shape_problem, verify
from packbench.core.archive.zipformat import is_symlink, locate_end, stock_deflate
from packbench.core.canonical import canonical_json
from packbench.core.errors import ArchiveError
from packbench.core.text import one_line

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
# ~0.4 s per MiB (with the recompression check) on the 2-core box (docs/experiments/storage-audit.md, "Worst legal archive"); arrays ~0.01.
MAX_JSON_TOTAL_BYTES = 48 << 20
_MAX_NPY_HEADER = 1 << 16

_CHUNK = 1 << 20


class ArchiveTooLarge(ArchiveError):
    """A file over the reader's size bound (MAX_ARCHIVE_BYTES or the one given): refused before it
    is hashed or parsed. `line(target)` names the `packbench audit` command that reads it: its
    `--max-mib` admits the file and the JSON members' total bound besides (`admit`), since deflated
    JSON members hold more bytes uncompressed than in the file and `--max-mib` is the total-member
    bound too."""

    def __init__(self, path: Path, size: int, bound: int) -> None:
        self.path, self.size, self.bound = Path(path), int(size), int(bound)
        self.admit = self.size + MAX_JSON_TOTAL_BYTES
        super().__init__(self.line())

    def line(self, target: str | None = None, *, path: Path | str | None = None) -> str:
        return over_bound_line(self.path if path is None else path, self.size, self.bound, target=target,
                               admit=self.admit)


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


def file_sha256(path: Path) -> str:
    """SHA-256 hex of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


class ArchiveReader:
    """Bounded, in-memory reader of a raw archive. Use as a context manager or call close()."""

    def __init__(
        self,
        path: Path,
        *,
        max_member_bytes: int = MAX_ARRAY_BYTES,
        max_total_bytes: int = MAX_TOTAL_BYTES,
        max_archive_bytes: int | None = None,
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
        bound = MAX_ARCHIVE_BYTES if max_archive_bytes is None else int(max_archive_bytes)  # the bound as it is now
        if self.size > bound:
            # Before hashing or parsing: a huge file costs nothing to refuse.
            raise ArchiveTooLarge(self.path, self.size, bound)
        self._raw = open(self.path, "rb")
        try:
            count, cd_size, _, tail = locate_end(self._raw, self.size)
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
        self._infos: list[zipfile.ZipInfo] = self._zf.infolist()
        self.names: list[str] = [info.filename for info in self._infos]
        self._by_name: dict[str, list[zipfile.ZipInfo]] = {}
        for info in self._infos:
            self._by_name.setdefault(info.filename, []).append(info)

        self.manifest: dict | None = None
        self._manifest_problem: Problem | None = None
        self._data_at: dict[int, int] = {}  # id(info) -> where its data starts, when its local header is exact
        try:
            self._layout, self._data_at = layout_problems(self._raw.fileno(), self.size, tail, self._infos,
                                                          self._zf.comment)
        except (struct.error, OverflowError, ValueError, OSError) as e:
            # Values no writer record can hold (a size past its field, a name past 64 KiB): not our layout.
            self._data_at = {}
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
                    raise MemberError(name, f"yields more than the {info.file_size} bytes it declares",
                                      "the archive is damaged: run verify()")
                buf[at:at + len(chunk)] = chunk
                at += len(chunk)
            if check_first is not None and at == 0:
                check_first(b"", info.file_size)
        except MemberError as e:
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
        except MemberError as e:
            raise ArchiveError(f"member {name} of archive {self.path} {e.phrase}; {e.fix}") from None

    def episodes(self) -> list[EpisodeMembers]:
        """The episodes whose record member (``episodes/NNNNN.json``) this archive holds, in
        index order. Names only: whether a member can be trusted is what ``verify`` says."""
        held = [episode_index(name) for name in self._by_name]
        return sorted((episode_members(i) for i in held if i is not None), key=lambda e: e.index)

    def verify(self) -> list[Problem]:
        """Every problem found, one ``Problem`` each; [] means intact. ``member`` names the
        member concerned (the auditor trusts exactly the members no problem names)."""
        return verify(self)

    # -- verification

    def _load_manifest(self) -> None:
        infos = self._by_name.get(MANIFEST_NAME)
        if not infos:
            return
        if len(infos) > 1:
            self._manifest_problem = Problem(
                MANIFEST_NAME, "duplicate", f"duplicate member {MANIFEST_NAME}: cannot tell which is real")
            return
        info = infos[0]
        if is_symlink(info):
            self._manifest_problem = Problem(MANIFEST_NAME, "symlink", f"symlink member {MANIFEST_NAME}")
            return
        try:
            data = b"".join(self._chunks(info, self.max_json_bytes, exact=True))
        except MemberError as e:
            self._manifest_problem = Problem(
                MANIFEST_NAME, "unreadable", f"unreadable member {MANIFEST_NAME}: {e.cause}")
            return
        try:
            manifest = _canonical_loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            self._manifest_problem = Problem(
                MANIFEST_NAME, "manifest", f"unparseable member {MANIFEST_NAME}: {one_line(str(e))[:200]}")
            return
        why = manifest_shape_problem(manifest)
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
        if is_symlink(info):
            raise ArchiveError(
                f"refusing symlink member {name} in archive {self.path}; "
                f"raw archives hold regular files only"
            )
        return info

    def _chunks(self, info: zipfile.ZipInfo, limit: int, *, exact: bool = False) -> Iterator[bytes]:
        """Yield the member's bytes, never more than ``limit`` in total; raise MemberError.
        ``exact`` (verify): a DEFLATE member must also be the very stream the writer's zlib
        produces for its content (see _exact_chunks)."""
        name = info.filename
        if info.file_size > limit:
            raise MemberError(
                name,
                f"declares {info.file_size} bytes, over the bound of {limit}",
                "raise max_member_bytes if the archive is trusted",
            )
        if info.compress_type not in _SUPPORTED_COMPRESSION:
            raise MemberError(
                name,
                f"uses unsupported compression method {info.compress_type}",
                "raw archives use STORED or DEFLATED only",
            )
        if info.flag_bits & 0x1:
            raise MemberError(name, "is encrypted", "raw archives are never encrypted")
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
                        raise MemberError(
                            name,
                            f"inflates past the bound of {limit} bytes",
                            "the archive is hostile or damaged",
                        )
                    yield chunk
        except MemberError:
            raise
        except Exception as e:  # hostile bytes may trip any parser path: report, never crash
            kind = "zlib.error" if isinstance(e, zlib.error) else type(e).__name__
            cause = one_line(f"{kind}: {e}")
            raise MemberError(
                name, f"cannot be read ({cause})", "the archive is damaged: run verify()", cause
            ) from None
        if total != info.file_size:
            raise MemberError(
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

        def fail(cause: str) -> MemberError:
            return MemberError(name, f"cannot be read ({cause})", "the archive is damaged: run verify()", cause)

        fd = self._raw.fileno()
        inflate = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
        packer = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15) if recompress and inflate else None
        stored, again = hashlib.sha256(), hashlib.sha256()
        remaining, at, total, crc = info.compress_size, data_at, 0, 0

        def emit(chunk: bytes) -> bytes:
            nonlocal total, crc
            total += len(chunk)
            if total > limit:
                raise MemberError(name, f"inflates past the bound of {limit} bytes", "the archive is hostile or damaged")
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
                    if inflate.eof:  # the stream ended in an earlier read: its rest is unused_data
                        raise fail(f"{len(inflate.unused_data) + len(buf) + remaining} bytes after the end of its "
                                   f"DEFLATE stream")
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
            raise MemberError(name, f"holds {total} bytes but its zip entry declares {info.file_size}",
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
        raise MemberError("", f"is not a .npy array ({one_line(str(e))[:200]})", "the archive is damaged") from None
    if got.hasobject:
        raise MemberError("", f"is a pickled object array (dtype {got}), refused",
                          "raw archives hold numeric arrays only; the archive is hostile or damaged")
    if dtype is not None and (got.str != dtype or fortran):
        raise MemberError("", f"is a {'Fortran-order ' if fortran else ''}{got.str} array, the format says C-order "
                              f"{dtype} (docs/archive.md)", "the archive was not written by packbench")
    if ndim is not None and len(shape) != ndim:
        raise MemberError("", f"has {len(shape)} dimensions, the format says {ndim}", "the archive is damaged")
    expected = math.prod(shape) * got.itemsize
    held = size - fp.tell()
    if held != expected:
        raise MemberError("", f"declares shape {shape} of {got} ({expected} bytes) but holds {held} data bytes",
                          "the archive is damaged")


def _load_npy(data: bytes | bytearray) -> np.ndarray:
    """Parse a .npy payload without pickle, checking the header against the payload length."""
    fp = io.BytesIO(bytes(memoryview(data)[:_MAX_NPY_HEADER + 16]))  # the header only: no copy of the data
    try:
        shape, fortran, dtype = _npy_header_fields(fp)
    except _READ_ERRORS as e:
        raise MemberError("", f"is not a .npy array ({e})", "the archive is damaged") from None
    if dtype.hasobject:
        raise MemberError(
            "",
            f"is a pickled object array (dtype {dtype}), refused",
            "raw archives hold numeric arrays only; the archive is hostile or damaged",
        )
    expected = math.prod(shape) * dtype.itemsize
    held = len(data) - fp.tell()
    if held != expected:
        raise MemberError(
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
        raise MemberError("", f"is not a loadable .npy array ({e})", "the archive is damaged") from None
    return arr
