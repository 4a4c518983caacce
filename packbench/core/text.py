"""Text from protocols, archives and the database, made safe for a terminal or a one-line message.

`one_line` escapes what a terminal would act on (newlines, other control characters, the
bidirectional overrides that reorder a row, zero-width characters); `show` is a value's repr
cut to a length, built piece by piece, so a hostile value (an alias-expanded list of a billion
items, a 5,000-digit integer) costs no more than the characters shown.
"""

from __future__ import annotations

from typing import Any


def one_line(text: str) -> str:
    """`text` with every non-printable character written as its escape (`\\n`, `\\u202e`)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


ERROR_LINE_LIMIT = 1000  # characters: past any message packbench writes of its own, a dozen rows of a terminal


def error_line(text: str, limit: int = ERROR_LINE_LIMIT) -> str:
    """`text` as one line (`one_line`) of at most `limit` characters: a longer one keeps its start
    (the cause) and its end (the fix) and says how many characters between were cut. An error
    quoting its input (`--tag`, `--since`, an unknown command) printed a megabyte value whole."""
    text = one_line(text)
    if len(text) <= limit:
        return text
    keep = limit - 40  # room for the marker, ` ...[1,048,576 characters cut]... `
    head = keep * 2 // 3
    return f"{text[:head]} ...[{len(text) - keep:,} characters cut]... {text[len(text) - (keep - head):]}"


def counted(n: int, noun: str) -> str:
    """`1 episode`, `2 episodes`: a count with its noun (plural by an added s)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def show(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters with `...`; never renders more than it shows."""
    parts: list[str] = []
    budget = [limit + 1]  # characters still wanted: one more than fit says "cut here"
    _repr_into(value, parts, budget, depth=0)
    text = "".join(parts)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_MAX_DEPTH = 32  # deeper than any field a protocol or record has: shown as `...`


def _emit(parts: list[str], budget: list[int], text: str) -> bool:
    """Append `text` (cut to the budget); False once the budget is spent."""
    parts.append(text[:budget[0]])
    budget[0] -= len(text)
    return budget[0] > 0


def _repr_into(value: Any, parts: list[str], budget: list[int], *, depth: int) -> bool:
    if depth > _MAX_DEPTH:
        return _emit(parts, budget, "...")
    if isinstance(value, str):
        return _emit(parts, budget, repr(value[:budget[0] + 1]))
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        digits = int(value.bit_length() * 0.30103) + 1  # ~log10(2) per bit; repr() refuses past 4300 digits
        return _emit(parts, budget, f"<an integer of about {digits} digits>")
    if isinstance(value, (list, tuple, dict)):
        opening, closing = "{}" if isinstance(value, dict) else "()" if isinstance(value, tuple) else "[]"
        if not _emit(parts, budget, opening):
            return False
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        for i, (key, item) in enumerate(items):
            if i and not _emit(parts, budget, ", "):
                return False
            if isinstance(value, dict):
                if not (_repr_into(key, parts, budget, depth=depth + 1) and _emit(parts, budget, ": ")):
                    return False
            if not _repr_into(item, parts, budget, depth=depth + 1):
                return False
        return _emit(parts, budget, ("," if isinstance(value, tuple) and len(value) == 1 else "") + closing)
    if isinstance(value, (bytes, bytearray)):
        return _emit(parts, budget, repr(bytes(value[:budget[0] + 1])))
    return _emit(parts, budget, repr(value)[:budget[0] + 1])
