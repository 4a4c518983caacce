"""User-facing errors. Each message is one line that names the cause and the fix.

The CLI prints `str(error)` and exits with code 2; no traceback is shown for these.
"""


class PackbenchError(Exception):
    """Base for every error caused by input the user can correct."""


class ProtocolError(PackbenchError):
    """The protocol file is malformed, has unknown fields or bad values."""


class CheckpointError(PackbenchError):
    """A model directory is missing, incomplete or of an unsupported architecture."""


class ArchiveError(PackbenchError):
    """A raw archive is missing, unreadable or hostile."""


class ArchiveStorageError(ArchiveError):
    """The archive's storage refused a write (a full disk, a quota, a read-only mount, an I/O
    error): the storage's fault, not the screen's; `packbench dispatch` exits 74 for it."""


class ClusterUnreachable(PackbenchError):
    """No Ray cluster answered at the address given (nothing there, another service, a timeout).

    The CLI exits at once after printing it: Ray may still be retrying in a background thread.
    """


class PlacementDoesNotFit(PackbenchError):
    """A re-execution handed a competitor its archived placement (core/reexecute.py), and the
    re-executing worker's device cannot hold it beside the CUDA context and what it holds there
    now: the episode is not judged (a partial re-execution), since a placement chosen again
    would move other bytes than the archive's."""
