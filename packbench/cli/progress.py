"""Progress of screens and audits (and of steps such as the layers `model synth` draws): rich bars
on a terminal, plain lines otherwise, nothing with --json.

A view is a callable `(message, **event)`: events with `screen`, `done` and `total` move that
screen's bar (screens and episodes done/total, the current condition, elapsed and remaining
time); other messages are printed above the bars. `--json` output never mixes with progress:
the JSON goes to stdout, and with --json no view is made at all.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import typer


class PlainLines:
    """One line per message: for logs, pipes and CI (not a terminal). A screen's lines (its
    episodes) start with the seconds since this view first heard of that screen."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started: dict[int, float] = {}

    def __call__(self, message: str, **event: Any) -> None:
        screen = event.get("screen")
        if screen is None:
            typer.echo(message)
            return
        now = self.clock()
        elapsed = now - self.started.setdefault(screen, now)
        typer.echo(f"[{elapsed:7.1f} s] {message.lstrip()}")

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
        self.logs = _LogsAbove(self.console)

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
        self.logs.close()
        self.bars.stop()


class _LogsAbove:
    """While bars are live, log records print through their console, above the bars: a stream
    handler writing to the terminal directly would land inside the bar's line."""

    def __init__(self, console: Any) -> None:
        import logging

        root = logging.getLogger()
        self.swapped = [h for h in root.handlers if type(h) is logging.StreamHandler]
        self.handler = logging.Handler()
        self.handler.setFormatter(self.swapped[0].formatter if self.swapped else None)
        self.handler.emit = lambda record: console.print(self.handler.format(record), markup=False,  # type: ignore
                                                         highlight=False, soft_wrap=True)
        for h in self.swapped:
            root.removeHandler(h)
        root.addHandler(self.handler)

    def close(self) -> None:
        import logging

        root = logging.getLogger()
        root.removeHandler(self.handler)
        for h in self.swapped:
            root.addHandler(h)


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


class StepBar:
    """One rich bar of `done/total` steps (e.g. the layers `model synth` draws); `after` names
    what follows the last step, shown once it is reached."""

    def __init__(self, label: str, unit: str, *, after: str | None = None, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.label, self.after = label, after
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                             TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                             console=console or Console(stderr=False), transient=False)
        self.task = self.bars.add_task(label, total=None)
        self.bars.start()

    def __call__(self, done: int, total: int) -> None:
        description = f"{self.label}: {self.after}" if done >= total and self.after else self.label
        self.bars.update(self.task, completed=done, total=total, description=description)

    def close(self) -> None:
        self.bars.stop()


class StepLines:
    """Plain lines for `done/total` steps when stdout is not a terminal: about ten, not one per
    step (a 96-layer checkpoint would print 96), and always the last."""

    def __init__(self, label: str, unit: str, *, after: str | None = None) -> None:
        self.label, self.unit, self.after = label, unit, after
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth == self.shown and done < total:
            return
        self.shown = tenth
        tail = f"; {self.after}" if done >= total and self.after else ""
        typer.echo(f"{self.label}: {done}/{total} {self.unit}{tail}")

    def close(self) -> None:
        pass


class QuietSteps:
    """No progress at all: next to --json, stdout holds the one JSON document."""

    def __call__(self, done: int, total: int) -> None:
        pass

    def close(self) -> None:
        pass


def steps(label: str, unit: str, *, after: str | None = None, quiet: bool = False) -> StepBar | StepLines | QuietSteps:
    """A `(done, total)` progress callback: a bar on a terminal, plain lines otherwise, nothing when `quiet`."""
    if quiet:
        return QuietSteps()
    return StepBar(label, unit, after=after) if sys.stdout.isatty() else StepLines(label, unit, after=after)
