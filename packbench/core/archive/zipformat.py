"""The zip records of a raw archive, byte for byte what Python's zipfile writes.

The writer emits these records itself (so that it can keep the central directory in memory
instead of re-parsing it for every member) and the reader checks every byte of a file against
them (docs/archive.md, "Exact layout"); tests/core/test_archive.py compares both with zipfile.
Pure: bytes in, bytes out; ``locate_end`` reads from an open file.
"""

from __future__ import annotations

import functools
import hashlib
import stat
import struct
import zipfile
import zlib

# Fixed timestamp and attributes: identical records give a byte-identical archive.
_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_REGULAR_FILE_ATTR = (stat.S_IFREG | 0o644) << 16

# APPNOTE.TXT 4.3; field order of zipfile.structFileHeader / structCentralDir / structEndArchive[64][Locator].
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
ZIP64_LIMIT = (1 << 31) - 1  # zipfile.ZIP64_LIMIT: a size or offset past it needs a zip64 field
_COUNT_LIMIT = 0xFFFF  # entries the classic end record can count
VERSION, ZIP64_VERSION = 20, 45  # "version needed to extract", as zipfile writes them
_UNIX = 3
MAX_END_RECORDS = _END64.size + _LOCATOR64.size + _END.size
_DOS_DATE = (_DATE_TIME[0] - 1980) << 9 | _DATE_TIME[1] << 5 | _DATE_TIME[2]
_DOS_TIME = _DATE_TIME[3] << 11 | _DATE_TIME[4] << 5 | _DATE_TIME[5] // 2


def local_header(name: bytes, *, method: int, crc: int, csize: int, size: int, zip64: bool) -> bytes:
    """A local file header. ``zip64`` as zipfile decides it before writing: size * 1.05 > limit."""
    extra = b""
    version = VERSION
    if zip64:
        extra = struct.pack("<HHQQ", 1, 16, size, csize)
        size = csize = 0xFFFFFFFF
        version = ZIP64_VERSION
    return _LOCAL.pack(b"PK\x03\x04", version, 0, 0, method, _DOS_TIME, _DOS_DATE, crc, csize, size,
                       len(name), len(extra)) + name + extra


def central_entry(name: bytes, *, method: int, crc: int, csize: int, size: int, offset: int,
                  version: int) -> bytes:
    """A central directory entry; ``version`` is the local header's (zipfile reuses it)."""
    values = []
    if size > ZIP64_LIMIT or csize > ZIP64_LIMIT:
        values += [size, csize]
        size = csize = 0xFFFFFFFF
    if offset > ZIP64_LIMIT:
        values.append(offset)
        offset = 0xFFFFFFFF
    extra = b""
    if values:
        extra = struct.pack("<HH" + "Q" * len(values), 1, 8 * len(values), *values)
        version = ZIP64_VERSION
    return _CENTRAL.pack(b"PK\x01\x02", version, _UNIX, version, 0, 0, method, _DOS_TIME, _DOS_DATE, crc,
                         csize, size, len(name), len(extra), 0, 0, 0, _REGULAR_FILE_ATTR, offset) + name + extra


def end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """End of central directory, preceded by the zip64 end record and locator when needed."""
    out = b""
    if count > _COUNT_LIMIT or cd_offset > ZIP64_LIMIT or cd_size > ZIP64_LIMIT:
        out = (_END64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
               + _LOCATOR64.pack(b"PK\x06\x07", 0, cd_offset + cd_size, 1))
        count, cd_size, cd_offset = min(count, 0xFFFF), min(cd_size, 0xFFFFFFFF), min(cd_offset, 0xFFFFFFFF)
    return out + _END.pack(b"PK\x05\x06", 0, 0, count, count, cd_size, cd_offset, 0)


def locate_end(f, size: int) -> tuple[int, int, int, int]:
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


def is_symlink(info: zipfile.ZipInfo) -> bool:
    return stat.S_ISLNK(info.external_attr >> 16)


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
