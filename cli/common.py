"""Options and helpers shared by the command modules."""

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from core.errors import PackbenchError

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


def output_dir(path: Path, option: str) -> Path:
    """`path` as a directory to write into, created if missing; one line naming `option` if it
    cannot be (a file there, no permission, a read-only or virtual file system)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if path.exists() or isinstance(e, (FileExistsError, NotADirectoryError)) \
            else e.strerror or type(e).__name__
        raise PackbenchError(f"{option} {path}: cannot create that directory ({why}); "
                             f"give {option} a writable directory") from None
    return path


def write_output(path: Path, text: str, option: str) -> None:
    """Write `text` to `path` (UTF-8) whole or not at all: through a temporary file beside it, so
    a failure (no such directory, a full disk) leaves no partial file and any old one as it was;
    one line naming `option` if it cannot be written."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        hint = "create that directory or" if not path.parent.is_dir() else "free space, check permissions, or"
        raise PackbenchError(f"{option} {path}: cannot write it ({e.strerror or type(e).__name__}); "
                             f"{hint} choose another {option}") from None
