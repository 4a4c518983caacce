"""Prompt files (token_file / text_file): read, parse and split, shared by freezing and planning."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from packbench.core.errors import ProtocolError
from packbench.core.protocol.fields import fail, token_lists_field

TEXT_SEPARATOR = "---"  # a line holding only this separates prompts in a text_file
# A prompt file holds at most MAX_PROMPT_TOKENS (2**21) ids, ~16 MiB as JSON; text is longer per
# token (~4-5 bytes of English each). Past this a file is refused by its size, before it is read.
MAX_PROMPT_FILE_BYTES = 64 << 20

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
            raise NotReadable(f"is {mode.st_size} bytes, more than the {_size(limit)} limit", too_large=True)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise NotReadable(f"holds more than the {_size(limit)} limit", too_large=True)
    return data


def _where(field: str) -> str:
    """`--prompts` for a command's option, "protocol field `prompts.token_file`" for a protocol's."""
    return field if field.startswith("--") else f"protocol field `{field}`"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def split_texts(text: str) -> list[str]:
    """The prompts of a text_file: blocks separated by lines holding only `---`, stripped."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip() == TEXT_SEPARATOR:
            blocks.append("\n".join(current))
            current = []
        else:
            current.append(line)
    blocks.append("\n".join(current))
    return [b.strip() for b in blocks if b.strip()]


def read_prompt_file(kind: str, path: Path, *, field: str) -> tuple[bytes, list]:
    """Bytes and parsed prompts of a token_file (id lists) or text_file (texts)."""
    try:
        data = read_bounded(Path(path), limit=MAX_PROMPT_FILE_BYTES)
    except NotReadable as e:
        raise ProtocolError(f"{_where(field)}: {path} {e}; give a {kind.replace('_', ' ')} of prompts "
                            f"(a regular file of at most {_size(MAX_PROMPT_FILE_BYTES)})") from None
    except OSError as e:
        raise ProtocolError(f"{_where(field)}: cannot read {path} ({e.strerror})"
                            + ("" if field.startswith("--") else "; paths are relative to the protocol file")) from None
    if kind == "token_file":
        try:
            ids = json.loads(data.decode("utf-8"))
        except RecursionError:
            raise ProtocolError(f"protocol field `{field}`: {path} nests its lists too deeply; "
                                f"write a list of token-id lists") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise ProtocolError(f"protocol field `{field}`: {path} is not JSON ({e}); "
                                f"write a list of token-id lists") from None
        return data, token_lists_field(ids, f"{field} ({Path(path).name})")
    try:
        texts = split_texts(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProtocolError(f"protocol field `{field}`: {path} is not UTF-8 text") from None
    if not texts:
        fail(field, f"{path} holds no text; write prompts separated by `{TEXT_SEPARATOR}` lines")
    return data, texts
