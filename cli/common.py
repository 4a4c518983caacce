"""Options and helpers shared by the command modules."""

from pathlib import Path
from typing import Annotated, Optional

import typer

DbUrl = Annotated[Optional[str], typer.Option("--db", help="Database URL (default: $PACKBENCH_DB_URL or sqlite:///packbench.db).")]
Json = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")]
Address = Annotated[Optional[str], typer.Option(
    envvar="PACKBENCH_RAY_ADDRESS", help="Join this Ray cluster (host:port of the head) instead of an embedded local one.")]
ArchiveDir = Annotated[Path, typer.Option("--archive-dir", envvar="PACKBENCH_ARCHIVE_DIR", help="Where raw archives are written.")]


def open_store(url: str | None, *, at_head: bool = True):
    """The results store; refuses a database that is not at the migration head unless told not to."""
    from db.store import Store

    store = Store(url)
    if at_head:
        store.check_head()
    return store
