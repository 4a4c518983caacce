"""Screen labels on the command line: `--tag K=V` parsing, `screens tag`, and the tag filter
that `results` and `screens list` share (db/labels.py stores them)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from packbench.cli.common import DbUrl, Json, open_store
from packbench.core.errors import PackbenchError
from packbench.core.text import one_line

Tags = Annotated[Optional[list[str]], typer.Option(
    "--tag", help="KEY=VALUE, repeatable: screens carrying every one (VALUE * matches any value of KEY).")]
Name = Annotated[Optional[str], typer.Option("--name", help="A screen name (one line).")]
Note = Annotated[Optional[str], typer.Option("--note", help="Free text kept with the screen.")]


def parse_tags(values: list[str] | None, option: str = "--tag") -> dict[str, str]:
    """["team=infra", "box=ci"] as {"team": "infra", "box": "ci"}; one line naming a bad one."""
    out: dict[str, str] = {}
    for text in values or []:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise PackbenchError(f"{option} {text!r} is not KEY=VALUE; write e.g. {option} team=infra")
        if key.strip() in out:
            raise PackbenchError(f"{option} {key.strip()} is given twice; give each key once")
        out[key.strip()] = value
    return out


def tagged(store, values: list[str] | None) -> set[int] | None:
    """The ids of the screens carrying every `--tag`; None when no --tag was given."""
    tags = parse_tags(values)
    return store.tagged_screens(tags) if tags else None


def screens_tag(
    screen: Annotated[str, typer.Argument(help="Screen id, or `latest`.")],
    tag: Annotated[Optional[list[str]], typer.Option("--tag", help="KEY=VALUE to set, repeatable.")] = None,
    untag: Annotated[Optional[list[str]], typer.Option("--untag", help="A tag KEY to drop, repeatable.")] = None,
    name: Name = None,
    note: Note = None,
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Name, annotate or tag a screen (labels never change what it measured)."""
    tags = parse_tags(tag)
    if not (tags or untag or name is not None or note is not None):
        raise PackbenchError("nothing to label: give --tag KEY=VALUE, --untag KEY, --name or --note")
    store = open_store(db)
    # An --untag KEY the screen does not carry (a typo, most often) drops nothing: say so.
    absent = []
    if untag:
        held = store.screen_tags([sid := store.screen(screen).id])[sid]
        absent = sorted(set(untag) - set(held))
    screen_id = store.label_screen(screen, name=name, note=note, tags=tags, untag=tuple(untag or ()))
    row, held = store.screen(screen_id), store.screen_tags([screen_id])[screen_id]
    if json_out:
        import json

        typer.echo(json.dumps({"screen_id": screen_id, "name": row.name, "note": row.note, "tags": held},
                              sort_keys=True))
        return
    shown = ", ".join(f"{k}={v}" for k, v in held.items()) or "none"
    # one_line: a right-to-left override in a name or tag would reorder the terminal's line
    typer.echo(one_line(f"screen {screen_id}: name {row.name or '-'}; tags {shown}")
               + (f"; note {row.note!r}" if row.note else "")
               + (one_line(f"; no tag {', '.join(absent)} to drop") if absent else ""))


def label_columns(store, records: list[dict]) -> list[str]:
    """Add each screen's name, tags ({key: value}: JSON's object, CSV's JSON text) and sweep to
    its record; the columns to show (none when no listed screen has a label, so an unlabelled
    listing reads as before). `tags_cell` writes the tags as the table shows them."""
    ids = [r["id"] for r in records]
    if not ids:
        return []
    rows = {s.id: s for s in store.find_screens(ids=ids)}
    tags = store.screen_tags(ids)
    for r in records:
        s = rows[r["id"]]
        # A mapping, not "k=v,k2=v2": a value may hold "," and "=" (k=v,1), so that text could
        # not be split back: {a: "1,b=c", d: "e"} and {a: "1", b: "c,d=e"} read the same.
        r.update(name=s.name, tags=tags[r["id"]] or None, sweep=s.sweep_id)
    shown = [c for c in ("name", "tags", "sweep") if any(r[c] is not None for r in records)]
    for r in records:
        for c in {"name", "tags", "sweep"} - set(shown):
            del r[c]
    return shown


def tags_cell(tags: dict[str, str] | None) -> str | None:
    """A screen's tags in a table cell: `k=v,k2=v2` (JSON and CSV keep the mapping)."""
    return ",".join(f"{k}={v}" for k, v in tags.items()) if tags else None
