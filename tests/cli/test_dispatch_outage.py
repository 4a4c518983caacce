"""What `packbench dispatch` says as it leaves a database outage (in-process, a stand-in
dispatcher: the outage itself runs for real in tests/cluster/test_dispatch.py)."""

import pytest
from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.db.store import Store


@pytest.mark.parametrize("follow, code, words", [
    (False, 1, "error: cannot connect"),  # a one-shot dispatch gives up: one line, exit 1 (as before)
    (True, 143, "stopped by SIGTERM while the database was unavailable: held screens go back to the queue "
                "when their leases expire; once it is back, `packbench db reconcile` inserts the rows"),
])
def test_what_dispatch_says_when_the_database_is_down(tmp_path, monkeypatch, follow, code, words):
    """The command's last line for each way a dispatcher leaves a database outage."""
    import packbench.service.dispatcher

    db_url = f"sqlite:///{tmp_path / 'packbench.db'}"
    with Store(db_url) as store:
        store.upgrade()

    class Stub:
        def __init__(self, *args, **options) -> None:
            self.follow, self.outage, self.fatal, self.stopping = options.get("follow"), None, None, None
            self.refusals, self.slots, self.held = [], [], []

        def run(self):
            if self.follow:
                self.stopping, self.outage = "SIGTERM", object()
            else:
                self.stopping, self.fatal = "database", "cannot connect to postgresql at h:5432 (connection refused); ..."
            return []

    monkeypatch.setattr(packbench.service.dispatcher, "Dispatcher", Stub)
    out = CliRunner().invoke(app, ["dispatch", "--db", db_url, *(["--follow"] if follow else [])])
    assert out.exit_code == code
    assert out.output.strip().splitlines()[-1].startswith(words)
