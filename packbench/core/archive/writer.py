"""The raw archive writer: one zip per screen attempt, written member by member, sealed last.

One open file; every member is appended with the central directory and end record rewritten
after it and fsynced, so the file is a valid zip after each member and an interrupted screen
leaves a readable partial archive (no ``manifest.json``: "incomplete"). Appending costs O(1) zip
parsing: nothing is re-read. ``seal`` writes ``manifest.json`` last, holding the SHA-256 and size
of every other member, and returns the SHA-256 of the whole file.

File I/O by design (pwritev, fsync, ftruncate): the archive is the evidence, durable before the
database row (docs/architecture.md, "Evidence before the record").
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import weakref
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from packbench.core.archive.layout import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    EpisodeMembers,
    episode_members,
    expected_method,
    name_problem,
)
from packbench.core.archive.zipformat import (
    MAX_END_RECORDS,
    VERSION,
    ZIP64_LIMIT,
    ZIP64_VERSION,
    central_entry,
    end_records,
    local_header,
)
from packbench.core.canonical import canonical_json, sha256_hex
from packbench.core.errors import ArchiveError, ArchiveStorageError

_MIN_ROOM = 1 << 20


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
            raise ArchiveStorageError(f"could not create archive {self.path} ({e}); check disk space and permissions") from None
        self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            # An empty but valid zip (its end record alone): the attempt exists from the first moment.
            self._tail = end_records(0, 0, 0)
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
            raise ArchiveStorageError(
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
                    trace: np.ndarray | None = None, forced: np.ndarray | None = None, *,
                    active: bytes | None = None) -> EpisodeMembers:
        """Write one finished episode: its logits, memory trace, teacher-forced logits and trace
        file of active sets (``active``: core/trace.py's bytes) when given (None skips), then its
        record (``episodes/NNNNN.json``, NNNNN being ``record["plan_index"]``) last.

        The record goes last so that an archive cut off inside an episode (a kill, a full disk)
        never holds the record of an episode without every member written before it. Before, the
        record went first: a disk that filled at the memory trace left record and logits, which
        `db reconcile` took for a whole episode and inserted as a row, and the audit of a GPU run
        (whose trace backs its sampled peak) then disagreed over the missing trace.

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
        parts = []
        for name, arr in ((names.logits, logits), (names.trace, trace), (names.forced, forced)):
            if arr is not None:
                parts.append((name, self._array_bytes(name, arr), zipfile.ZIP_STORED))
        if active is not None:  # a zip of its own, deflated inside: stored as it is
            if not isinstance(active, bytes):
                raise ArchiveError(f"member {names.active} must be the bytes of a trace file, got "
                                   f"{type(active).__name__}")
            parts.append((names.active, active, zipfile.ZIP_STORED))
        parts.append((names.record, self._json_bytes(names.record, record), zipfile.ZIP_DEFLATED))  # last
        for name, _, _ in parts:
            self._check_name(name)
        # One fsync for the episode, after its last member: a crash before it leaves a valid zip
        # holding a prefix of the members (each write keeps the file a zip), and the record is
        # durable when this returns, as before. Three fsyncs an episode (record, logits, trace)
        # cost the driver about 2 ms on the shared 2-core box (docs/experiments/queue.md, the queue path).
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
        zip64 = size * 1.05 > ZIP64_LIMIT  # decided before compressing, as zipfile does
        if not zip64 and csize > ZIP64_LIMIT:
            raise ArchiveError(
                f"member {name} compresses to {csize} bytes, past the zip32 limit its header was "
                f"sized for; store it uncompressed (add_array) or split it"
            )
        header = local_header(raw_name, method=compress_type, crc=crc, csize=csize, size=size, zip64=zip64)
        entry = central_entry(raw_name, method=compress_type, crc=crc, csize=csize, size=size,
                              offset=self._end, version=ZIP64_VERSION if zip64 else VERSION)
        try:
            self._commit(header, payload, entry, name, last=last, sync=sync)
        except OSError as e:
            raise self._append_failed(name, e) from None

    def _append_failed(self, name: str, e: OSError) -> ArchiveError:
        """Mark the writer failed; the one-line error for a member that could not be appended."""
        self._fail(f"{type(e).__name__}: {e}")
        return ArchiveStorageError(f"could not append member {name} to archive {self.path} ({e}); check disk space, "
                            f"permissions and who else touches the file, then rerun as a new attempt")

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
        tail = end_records(count, cd_at, len(self._central))
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
            raise self._append_failed(name, e) from None
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
    return max(_MIN_ROOM, member_end // 4, central + MAX_END_RECORDS)


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
