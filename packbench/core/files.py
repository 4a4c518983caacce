"""Small files read whole, and bounded where they are read: a path given by a user may be a
directory, a FIFO, a device or a file of gigabytes, and each is refused before it is read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


class NotReadable(ValueError):
    """A file that is not a regular file, or larger than the reader's limit (`too_large`): the
    message says which."""

    def __init__(self, reason: str, *, too_large: bool = False) -> None:
        super().__init__(reason)
        self.too_large = too_large


def read_bounded(path: Path, *, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; NotReadable("is a FIFO
    ...") for anything else, before any byte is read: a directory, a FIFO (an ordinary open
    would wait for a writer), a device (/dev/zero never ends), a socket, or a file over `limit`
    (by its size, and the read stops at `limit` + 1 bytes for a file that grows or, like
    /proc's, says 0). OSError (missing, no permission) passes to the caller."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO opens at once; then fstat says what it is
    try:
        mode = os.fstat(fd)
        for test, kind in _KINDS:
            if test(mode.st_mode):
                raise NotReadable(f"is {kind}, not a regular file")
        if mode.st_size > limit:
            raise NotReadable(f"is {mode.st_size} bytes, more than the {size_text(limit)} limit", too_large=True)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise NotReadable(f"holds more than the {size_text(limit)} limit", too_large=True)
    return data


NOT_AN_OBJECT = "is not a JSON object"  # read_json_object's reason for JSON that is no object


def read_json_object(path: Path, *, limit: int) -> dict:
    """The JSON object in the small regular file `path` (read whole by `read_bounded`). A file
    that cannot be one raises ValueError saying why in a few words: NotReadable (a FIFO, a
    device, over `limit`), not UTF-8, not JSON, nested too deep, or JSON that is no object.
    OSError (missing, no permission) passes to the caller."""
    data = read_bounded(path, limit=limit)
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deep") from None
    except NotReadable:
        raise
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
        raise ValueError(str(e).splitlines()[0][:120] if str(e) else type(e).__name__) from None
    if not isinstance(value, dict):
        raise ValueError(NOT_AN_OBJECT)
    return value


def size_text(n: int) -> str:
    """`64 MiB` for whole mebibytes, else `16 bytes`."""
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"
