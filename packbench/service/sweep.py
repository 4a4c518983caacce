"""Sweeps: one frozen protocol per point of a product of field values, queued under one sweep id.

`submit PROTOCOL --sweep prefix_tokens=32,64 --sweep dtype=float32,bfloat16` freezes four
protocols (each its own SHA-256, named `<name>[prefix_tokens=32,dtype=float32]` and so on) and
queues one screen of each; every screen records the sweep id and the values its protocol took
(db/labels.py), so `report --sweep ID` can plot each figure against the swept field. No torch
and no Ray here, as in service/submit.py.
"""

from __future__ import annotations

import copy
import itertools
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from packbench.core.canonical import canonical_json
from packbench.core.errors import ProtocolError
from packbench.core.protocol import FrozenProtocol, freeze, load
from packbench.core.protocol.freeze import parse_value
from packbench.core.text import show

# Points one sweep may queue, as many as one submit's replicas (service/submit.py MAX_REPLICAS): they
# go in one transaction, and `--sweep a=1,...,100 --sweep b=1,...,100 --sweep c=...` must not freeze
# and queue a million protocols (1,024 points took 8 s to plan).
MAX_POINTS = 1000


@dataclass(frozen=True)
class Axis:
    """One swept field: a dotted protocol path (list items by index, e.g. conditions.1.params.gather)
    and the values it takes, in the order given."""

    field: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Point:
    """One protocol of a sweep: the values of every swept field, and the protocol they freeze to."""

    values: dict[str, Any]
    frozen: FrozenProtocol


def parse_axes(specs: Sequence[str]) -> list[Axis]:
    """["prefix_tokens=32,64"] as [Axis("prefix_tokens", (32, 64))]; each value is read as YAML
    (32 an int, 0.5 a float, true a bool, anything else a string); one line naming a bad spec."""
    axes: list[Axis] = []
    for spec in specs:
        field, sep, values = spec.partition("=")
        field = field.strip()
        if not sep or not field or not values.strip():
            raise ProtocolError(f"--sweep {spec!r} is not FIELD=V1,V2,...; write e.g. --sweep prefix_tokens=32,64")
        if field == "name":  # each point's name is made of its values (point_name): a swept name was dropped
            raise ProtocolError("--sweep name: each point is named for its values (NAME[field=value,...]); sweep "
                                "another field, or label the screens with --name")
        if any(a.field == field for a in axes):
            raise ProtocolError(f"--sweep {field} is given twice; list all its values in one --sweep {field}=V1,V2")
        # The protocol file's loader: `[`, `*a`, `!!bool maybe` or `2001-13-45` exited 70 under yaml.safe_load
        parsed = tuple(parse_value(v.strip(), f"--sweep {field}") if v.strip() else "" for v in values.split(","))
        for value in parsed:
            _plain(value, field)
        if len(set(map(repr, parsed))) != len(parsed):
            raise ProtocolError(f"--sweep {spec!r} repeats a value; give each value once")
        axes.append(Axis(field, parsed))
    count = 1
    for a in axes:
        count *= len(a.values)
    if count > MAX_POINTS:
        raise ProtocolError(f"--sweep: {' x '.join(str(len(a.values)) for a in axes)} = {count} points, more than "
                            f"{MAX_POINTS}; sweep fewer values (or split the sweep)")
    return axes


def _plain(value: Any, field: str) -> None:
    """A point's value is stored as JSON (db/labels.py set_sweep): one YAML reads as a date or
    bytes (`2001-01-01`, `!!binary`) is refused here, before any point is frozen or queued."""
    try:
        canonical_json(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"--sweep {field}: {show(value)} is a YAML {type(value).__name__}, not a protocol value; "
                            f"quote it if it is text") from None


def grid(axes: Sequence[Axis]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the first axis varying slowest."""
    return [dict(zip((a.field for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def with_value(body: Mapping[str, Any], field: str, value: Any) -> dict:
    """A deep copy of `body` with the dotted `field` set to `value`. A mapping on its way that
    the file leaves out (or leaves empty) is made; a list item must exist."""
    out = copy.deepcopy(dict(body))
    *parents, leaf = field.split(".")
    node: Any = out
    for i, key in enumerate(parents):
        node = _child(node, key, ".".join(parents[:i + 1]), field)
    if isinstance(node, list):
        if not (_index(leaf) and int(leaf) < len(node)):
            raise ProtocolError(f"--sweep {field}: {'.'.join(parents)} has {len(node)} items; index one of them")
        node[int(leaf)] = value
    elif isinstance(node, dict):
        node[leaf] = value
    else:
        raise ProtocolError(f"--sweep {field}: {'.'.join(parents)} holds a value, not fields")
    return out


def _child(node: Any, key: str, where: str, field: str) -> Any:
    if isinstance(node, dict):
        # A mapping the file leaves out (a condition's params, placement) is made: validation names
        # a key that is no field, and the docs' own `conditions.1.params.gather` fits the quickstart.
        if node.get(key) is None:
            node[key] = {}
        return node[key]
    if isinstance(node, list) and _index(key) and int(key) < len(node):
        return node[int(key)]
    raise ProtocolError(f"--sweep {field}: the protocol has no {where}; sweep a field the file has (e.g. "
                        f"prefix_tokens, dtype, conditions.1.params.gather)")


def _index(key: str) -> bool:
    """A list index: ASCII digits ("²".isdigit() holds, and int("²") raised ValueError), few of them,
    written once (`conditions.01` would be a second axis over `conditions.1`, the later one winning)."""
    return key.isascii() and key.isdigit() and len(key) <= 9 and key == str(int(key))


def point_name(name: str, values: Mapping[str, Any]) -> str:
    return f"{name}[{','.join(f'{k}={v}' for k, v in values.items())}]"


def points(path: Path, axes: Sequence[Axis]) -> list[Point]:
    """Freeze one protocol per point of the axes' product, in grid order. The file itself is
    validated first (its own errors are its own); a point that fails validation is named with
    the values that made it fail."""
    load(path)  # the base protocol is valid (and has no duplicate keys) before anything is swept
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    out = []
    for values in grid(axes):
        body = dict(raw)
        for field, value in values.items():
            body = with_value(body, field, value)
        body["name"] = point_name(str(raw["name"]), values)
        try:
            frozen = freeze(body, source=Path(path))
        except ProtocolError as e:
            raise ProtocolError(f"sweep point {', '.join(f'{k}={v}' for k, v in values.items())}: {e}") from None
        out.append(Point(values, frozen))
    return out


def new_sweep_id() -> str:
    return "sw-" + secrets.token_hex(5)


def submit_sweep(store, path: Path, axes: Sequence[Axis], **submit: Any) -> tuple[str, list[tuple[int, Point]]]:
    """Freeze every point (all before any is queued: a bad point queues nothing), then queue one
    screen of each with `submit`'s options (priority, max_attempts, gpu_type, name, note, tags) and
    the sweep recorded on each, in one transaction (an error or an interrupt part-way queues
    nothing). Returns the sweep id and (screen id, point) in grid order."""
    from packbench.service.submit import check_frozen, check_queue_options, screen_columns

    name, note, tags = submit.pop("name", None), submit.pop("note", None), submit.pop("tags", None)
    options = {"priority": 0, "max_attempts": 3, "gpu_type": None, **submit}
    check_queue_options(**options)
    store.check_labels(name=name, note=note, tags=tags or {})
    frozen = points(path, axes)
    for point in frozen:
        check_frozen(point.frozen)
    sweep_id = new_sweep_id()
    ids = store.create_sweep(sweep_id, [
        ({"sha256": p.frozen.sha256, "name": p.frozen.name, "canonical_json": p.frozen.canonical.decode()},
         screen_columns(p.frozen, **options), p.values) for p in frozen], name=name, note=note, tags=tags)
    return sweep_id, list(zip(ids, frozen))


def resolve_sweep(store, ref: str) -> str:
    """A sweep id as given, or for 'latest' the sweep of the newest screen that is part of one."""
    from packbench.core.errors import PackbenchError

    if ref != "latest":
        return ref
    found = store.latest_sweep()
    if found is None:
        raise PackbenchError("there is no sweep yet; queue one with `packbench submit PROTOCOL --sweep FIELD=V1,V2`")
    return found


@dataclass(frozen=True)
class SweepPoint:
    """One screen of a sweep as `report --sweep` plots it: its point, status and per-condition figures."""

    screen_id: int
    values: dict[str, Any]
    status: str
    protocol_sha256: str
    # condition -> decode_ms_per_token (median over scored ok episodes, and its _min and _max), bytes_per_token
    figures: dict[str, dict[str, float | None]]
    verdicts: list[dict[str, Any]]  # gate, condition, phase, passed


def sweep_points(store, sweep_id: str) -> list[SweepPoint]:
    """The sweep's screens in the order they were queued (grid order), each from its latest attempt."""
    from packbench.core.errors import PackbenchError
    from packbench.service.history import screen_figures

    screens = sorted(store.find_screens(sweep_id=sweep_id), key=lambda s: s.id)
    if not screens:
        raise PackbenchError(f"no sweep {sweep_id!r}; `packbench screens list` shows each screen's sweep")
    out = []
    for s in screens:
        attempt = store.latest_attempt(s.id)
        episodes = store.episodes(attempt.id) if attempt is not None else []
        timed, _ = screen_figures(episodes, metrics=("decode_ms_per_token",))
        figures = {}
        for c, metrics in timed.items():
            scored = [e for e in episodes if e.condition == c and e.role == "scored" and e.status == "ok"]
            tokens = sum(e.n_tokens for e in scored)
            moved = sum(e.h2d_weight_bytes + e.h2d_index_bytes for e in scored)
            decode = metrics["decode_ms_per_token"]
            figures[c] = {"decode_ms_per_token": decode["median"], "decode_ms_per_token_min": decode["min"],
                          "decode_ms_per_token_max": decode["max"],
                          "bytes_per_token": moved / tokens if tokens else None}
        verdicts = [{"gate": v.gate, "condition": v.condition, "phase": v.phase, "passed": v.passed}
                    for v in (store.verdicts(attempt.id) if attempt is not None else [])]
        out.append(SweepPoint(s.id, s.point, s.status, store.protocol(s.protocol_id).sha256, figures, verdicts))
    return out
