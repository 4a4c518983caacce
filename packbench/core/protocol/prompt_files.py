"""Prompt files (token_file / text_file): read, parse and split, shared by freezing and planning."""

from __future__ import annotations

import json
from pathlib import Path

from packbench.core.errors import ProtocolError
from packbench.core.files import NotReadable, read_bounded, size_text
from packbench.core.protocol.fields import fail, token_lists_field

TEXT_SEPARATOR = "---"  # a line holding only this separates prompts in a text_file
# A prompt file holds at most MAX_PROMPT_TOKENS (2**21) ids, ~16 MiB as JSON; text is longer per
# token (~4-5 bytes of English each). Past this a file is refused by its size, before it is read.
MAX_PROMPT_FILE_BYTES = 64 << 20


def _where(field: str) -> str:
    """`--prompts` for a command's option, "protocol field `prompts.token_file`" for a protocol's."""
    return field if field.startswith("--") else f"protocol field `{field}`"


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
                            f"(a regular file of at most {size_text(MAX_PROMPT_FILE_BYTES)})") from None
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
