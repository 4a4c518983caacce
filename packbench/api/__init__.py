"""packbench's Python API (`import packbench` re-exports these names): the public facade beside
`cli/` at the top of `cli -> service -> cluster -> engine / core`. It imports `service`, `db` and
`core` as the CLI does, `cluster` only inside `Client.run` (which needs Ray), and never
sqlalchemy, ray or torch itself; importing it starts nothing."""

from packbench.api.archive import Archive, read_archive
from packbench.api.client import Client, connect
from packbench.api.frames import Records

__all__ = ["Archive", "Client", "Records", "connect", "read_archive"]
