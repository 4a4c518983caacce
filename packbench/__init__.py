"""packbench: frozen protocols of exact CPU-first offloaded inference, run on Ray GPU workers,
stored in a SQL database and audited from raw archives.

One import name holds every layer, `cli -> service -> cluster -> engine / core` with `db` and
`migrations` beside them (docs/architecture.md). At the top sits the Python API, for results in
a notebook and submitting from a script:

    import packbench
    db = packbench.connect("sqlite:///packbench.db")
    db.screens(tags={"team": "infra"}).frame()     # a pandas DataFrame (pip install 'packbench[api]')
    db.episodes(screen=3)                          # records: db.records.EpisodeRow, core/record.py's fields
    packbench.read_archive("archives/screen-00003-attempt-1-....zip").episodes()  # no database

docs/api.md documents it with an example that a test runs as written.

The API's names load on first use (PEP 562), so `import packbench.core.gates` on a worker pulls
in neither the database layer nor anything else of the API: importing packbench starts nothing.
"""

from __future__ import annotations

import importlib

# name -> the module of packbench.api that defines it
_API = {"Archive": "archive", "read_archive": "archive", "Client": "client", "connect": "client",
        "Records": "frames"}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f"packbench.api.{_API[name]}"), name)
    raise AttributeError(f"module 'packbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
