"""Field checks shared by the protocol schema: each names the field path and what is allowed.

Every failure is a `ProtocolError("protocol field `a.b`: ...")`, one line that names the fix.
"""

from __future__ import annotations

import math
from typing import Any

from packbench.core.errors import ProtocolError
from packbench.core.text import one_line, show


def fail(path: str, message: str) -> None:
    raise ProtocolError(one_line(f"protocol field `{path}`: {message}"))  # a key may hold a newline


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def mapping_field(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """Check `value` is a mapping with only `allowed` keys (key -> required)."""
    if not isinstance(value, dict):
        if not path:  # the whole document
            raise ProtocolError(f"a protocol is a mapping of fields (name:, model:, ...), got {shown(value)}")
        fail(path, f"expected a mapping, got {shown(value)}")
    for key in value:
        if key not in allowed:
            name = key if isinstance(key, str) and len(key) <= 60 else shown(key)
            fail(join_path(path, name), f"unknown field; allowed fields are {', '.join(sorted(allowed))}" if allowed
                 else f"unknown field; `{path}` takes none (write `{path.rpartition('.')[2]}: {{}}`)")
    for key, required in allowed.items():
        if required and key not in value:
            fail(join_path(path, key), "is required")
    return value


def optional_mapping_field(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """A gate written as `name:` (null) or `name: {}` means: the gate with its defaults."""
    return mapping_field({} if value is None else value, path, allowed=allowed)


def shown(value: Any) -> str:
    return show(value, 60)  # built to 60 characters: a hostile value is never rendered whole


def int_field(value: Any, path: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        fail(path, f"{shown(value)} is not an integer {bound}")
    return value


def number_field(value: Any, path: str, *, minimum: float, exclusive: bool = False,
                 maximum: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > minimum if exclusive else value >= minimum)
    ok = ok and (maximum is None or value < maximum)
    if not ok:
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        if maximum is not None:
            bound += f" and < {maximum}"
        fail(path, f"{shown(value)} is not a finite number {bound}")
    return float(value)


def bool_field(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        fail(path, f"{shown(value)} is not allowed; use true or false")
    return value


def choice_field(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(show(c, 60) if len(c) > 60 else c for c in choices[:MAX_CHOICES_SHOWN])
        more = f" (and {len(choices) - MAX_CHOICES_SHOWN} more)" if len(choices) > MAX_CHOICES_SHOWN else ""
        fail(path, f"{shown(value)} is not allowed; use one of {listed}{more}")
    return value


MAX_CHOICES_SHOWN = 40  # an error names choices, it does not print a hostile list whole


MAX_STRING = 4096  # PATH_MAX: the longest path a file system takes; a name is far shorter


def string_field(value: Any, path: str, what: str, *, max_chars: int = MAX_STRING) -> str:
    if not isinstance(value, str) or not value.strip():
        fail(path, f"{shown(value)} is not allowed; expected {what}")
    if len(value) > max_chars:  # stored in every screen row and printed by `screens list`
        fail(path, f"{len(value)} characters, more than {max_chars}; expected {what}")
    if "\x00" in value:  # PostgreSQL refuses NUL in text and no file system has it in a path: refused on both databases
        fail(path, f"{shown(value)} holds a NUL character; expected {what}")
    return value


def token_lists_field(ids: Any, path: str) -> list[list[int]]:
    if not isinstance(ids, list) or not ids:
        fail(path, f"{shown(ids)} is not allowed; expected a non-empty list of token-id lists")
    for i, prompt in enumerate(ids):
        if not isinstance(prompt, list) or not prompt:
            fail(f"{path}[{i}]", f"{shown(prompt)} is not allowed; expected a non-empty list of token ids")
        for j, t in enumerate(prompt):
            int_field(t, f"{path}[{i}][{j}]", minimum=0, maximum=(1 << 31) - 1)  # a vocabulary index
    return ids
