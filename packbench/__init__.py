"""packbench's Python API: results in a notebook, submitting from a script.

    import packbench
    db = packbench.connect("sqlite:///packbench.db")
    db.screens(tags={"team": "infra"}).frame()     # a pandas DataFrame (pip install 'packbench[api]')
    db.episodes(screen=3)                          # records: db.records.EpisodeRow, core/record.py's fields
    packbench.read_archive("archives/screen-00003-attempt-1-....zip").episodes()  # no database

docs/api.md documents it with an example that a test runs as written.

Layer rule: this package is the public facade beside `cli/` at the top of
`cli -> service -> cluster -> engine / core`. It imports `service`, `db` and `core` as the CLI
does, `cluster` only inside `Client.run` (which needs Ray), and never sqlalchemy, ray or torch
itself; importing it starts nothing.
"""

from packbench.archive import Archive, read_archive
from packbench.client import Client, connect
from packbench.frames import Records

__all__ = ["Archive", "Client", "Records", "connect", "read_archive"]
