"""Field checks shared by the protocol schema: each names the field path and what is allowed.

Every failure is a `ProtocolError("protocol field `a.b`: ...")`, one line that names the fix.
"""

from __future__ import annotations

import math
from typing import Any

from packbench.core.errors import ProtocolError
from packbench.core.text import one_line, show


def _fail(path: str, message: str) -> None:
    raise ProtocolError(one_line(f"protocol field `{path}`: {message}"))  # a key may hold a newline


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _mapping(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """Check `value` is a mapping with only `allowed` keys (key -> required)."""
    if not isinstance(value, dict):
        if not path:  # the whole document
            raise ProtocolError(f"a protocol is a mapping of fields (name:, model:, ...), got {_show(value)}")
        _fail(path, f"expected a mapping, got {_show(value)}")
    for key in value:
        if key not in allowed:
            name = key if isinstance(key, str) and len(key) <= 60 else _show(key)
            _fail(_join(path, name), f"unknown field; allowed fields are {', '.join(sorted(allowed))}" if allowed
                  else f"unknown field; `{path}` takes none (write `{path.rpartition('.')[2]}: {{}}`)")
    for key, required in allowed.items():
        if required and key not in value:
            _fail(_join(path, key), "is required")
    return value


def _optional_mapping(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """A gate written as `name:` (null) or `name: {}` means: the gate with its defaults."""
    return _mapping({} if value is None else value, path, allowed=allowed)


def _show(value: Any) -> str:
    return show(value, 60)  # built to 60 characters: a hostile value is never rendered whole


def _int(value: Any, path: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        _fail(path, f"{_show(value)} is not an integer {bound}")
    return value


def _number(value: Any, path: str, *, minimum: float, exclusive: bool = False, maximum: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > minimum if exclusive else value >= minimum)
    ok = ok and (maximum is None or value < maximum)
    if not ok:
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        if maximum is not None:
            bound += f" and < {maximum}"
        _fail(path, f"{_show(value)} is not a finite number {bound}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"{_show(value)} is not allowed; use true or false")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        _fail(path, f"{_show(value)} is not allowed; use one of {', '.join(choices)}")
    return value


MAX_STRING = 4096  # PATH_MAX: the longest path a file system takes; a name is far shorter


def _string(value: Any, path: str, what: str, *, max_chars: int = MAX_STRING) -> str:
    if not isinstance(value, str) or not value.strip():
        _fail(path, f"{_show(value)} is not allowed; expected {what}")
    if len(value) > max_chars:  # stored in every screen row and printed by `screens list`
        _fail(path, f"{len(value)} characters, more than {max_chars}; expected {what}")
    if "\x00" in value:  # PostgreSQL refuses NUL in text and no file system has it in a path: refused on both databases
        _fail(path, f"{_show(value)} holds a NUL character; expected {what}")
    return value


def _token_lists(ids: Any, path: str) -> list[list[int]]:
    if not isinstance(ids, list) or not ids:
        _fail(path, f"{_show(ids)} is not allowed; expected a non-empty list of token-id lists")
    for i, prompt in enumerate(ids):
        if not isinstance(prompt, list) or not prompt:
            _fail(f"{path}[{i}]", f"{_show(prompt)} is not allowed; expected a non-empty list of token ids")
        for j, t in enumerate(prompt):
            _int(t, f"{path}[{i}][{j}]", minimum=0, maximum=(1 << 31) - 1)  # a vocabulary index
    return ids
