"""A wrong `--address`: one line within the connect timeout, exit 2, and no screen left queued;
an empty queue needs no cluster at all."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from packbench.db.store import Store

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("address")
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    (d / "protocol.yaml").write_text(yaml.safe_dump(body))
    env = dict(os.environ, PACKBENCH_DB_URL=f"sqlite:///{d / 'pb.db'}", PYTHONPATH=str(ROOT))
    env.pop("RAY_AUTH_MODE", None)  # a joined cluster's auth mode is the user's: packbench leaves it alone
    with Store(env["PACKBENCH_DB_URL"]) as store:  # in this process: a subprocess costs 1.2 s for nothing tested
        store.upgrade()
    return d, env


@pytest.fixture
def silent_service():
    """A TCP service that accepts connections and never speaks (not a Ray GCS)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()
    held = []

    def serve():
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["nothing-listening", "unknown-host", "ray-client", "not-ray"])
def test_a_wrong_address_fails_fast_in_one_line_and_queues_nothing(workdir, case, request):
    d, env = workdir
    address = {"nothing-listening": f"127.0.0.1:{free_port()}", "unknown-host": "no-such-host.invalid:6379",
               "ray-client": f"ray://127.0.0.1:{free_port()}"}.get(case)
    if case == "not-ray":
        address = request.getfixturevalue("silent_service")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "packbench", "--connect-timeout", "4", "submit", "protocol.yaml", "--wait",
                        "--address", address], cwd=d, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and address in lines[0], r.stderr
    assert took < 4 + 15  # the connect timeout, plus Python and Ray imports on a loaded 2-core box
    listed = subprocess.run([sys.executable, "-m", "packbench", "screens", "list"], cwd=d, env=env, capture_output=True,
                            text=True)
    assert "no screens" in listed.stdout  # nothing queued by a submit that could not reach the cluster


def test_dispatch_with_nothing_queued_starts_no_ray(workdir):
    """An empty queue is answered from the database alone: given an address where nothing
    listens, a dispatcher that tried to join would fail; this one says there is nothing to do."""
    d, env = workdir
    r = subprocess.run([sys.executable, "-m", "packbench", "--connect-timeout", "2", "dispatch", "--address",
                        f"127.0.0.1:{free_port()}"], cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "no queued screens", (r.returncode, r.stdout, r.stderr)
    # --follow serves the queue: it joins the cluster first, and fails on that address in one line.
    r = subprocess.run([sys.executable, "-m", "packbench", "--connect-timeout", "2", "dispatch", "--follow", "--address",
                        f"127.0.0.1:{free_port()}"], cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nothing answers there" in r.stderr, r.stderr
