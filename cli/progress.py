"""Progress of screens and audits: rich bars on a terminal, plain lines otherwise, nothing with --json.

A view is a callable `(message, **event)`: events with `screen`, `done` and `total` move that
screen's bar (screens and episodes done/total, the current condition, elapsed and remaining
time); other messages are printed above the bars. `--json` output never mixes with progress:
the JSON goes to stdout, and with --json no view is made at all.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import typer


class PlainLines:
    """One line per message: for logs, pipes and CI (not a terminal)."""

    def __call__(self, message: str, **event: Any) -> None:
        typer.echo(message)

    def close(self) -> None:
        pass

    def echo(self, text: str, err: bool = False) -> None:
        typer.echo(text, err=err)


class Bars:
    """rich progress bars, one per screen in flight (rich ships with typer)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console = Console(stderr=False)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("episodes"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                             console=self.console, transient=False)
        self.tasks: dict[int, Any] = {}
        self.bars.start()

    def __call__(self, message: str, **event: Any) -> None:
        screen, done, total = event.get("screen"), event.get("done"), event.get("total")
        if screen is None or total is None:
            self.bars.console.print(message, markup=False, highlight=False)
            return
        label = f"screen {screen}" + (f" [{event['condition']}]" if event.get("condition") else "")
        if screen not in self.tasks:
            self.tasks[screen] = self.bars.add_task(label, total=total)
        self.bars.update(self.tasks[screen], completed=done, total=total, description=label)
        if done >= total:
            self.bars.update(self.tasks[screen], description=f"screen {screen} done")

    def echo(self, text: str, err: bool = False) -> None:
        if err:
            typer.echo(text, err=True)
        else:
            self.bars.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self.bars.stop()


class Silent:
    def __call__(self, message: str, **event: Any) -> None:
        pass

    def echo(self, text: str, err: bool = False) -> None:
        typer.echo(text, err=err)

    def close(self) -> None:
        pass


def view(*, json_out: bool) -> PlainLines | Bars | Silent:
    """Bars on a terminal, plain lines when stdout is not one, nothing next to --json."""
    if json_out:
        return Silent()
    return Bars() if sys.stdout.isatty() else PlainLines()


ProgressView = Callable[..., None]
