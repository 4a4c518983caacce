"""A pytest plugin `tests/mutate.py` loads for mutation runs (`-p tests.mutate_nofsync`), never
CI: `os.fsync` does nothing, so the archives the tests write cost no disk flushes (half the time
of the audit's tests on the 2-core host). Durability is not what those runs test; the module
that owns the fsyncs (core/archive/) is run without this plugin. Not a test file."""

import os

os.fsync = lambda fd: None
