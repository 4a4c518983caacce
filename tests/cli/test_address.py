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


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


@pytest.fixture
def http2_404_service():
    """A TCP service that speaks HTTP/2 and answers every request with status 404 (a gRPC port
    that is not Ray's GCS, an HTTP/2 proxy): Ray's C++ client, told to join it, writes a
    `gcs_client.cc: Failed to get cluster ID` warning a second straight to file descriptor 2.
    It listens on 127.0.0.2: given 127.0.0.1, Ray 2.60's client never opened a connection to it
    (12 s watched), so nothing would be tested there."""
    server = socket.socket()
    server.bind(("127.0.0.2", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def speak(conn):
        buf = b""
        try:
            conn.settimeout(0.5)
            while not stop.is_set():
                try:
                    data = conn.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    return
                buf += data
                if buf.startswith(b"PRI * HTTP/2.0"):
                    if len(buf) < 24:
                        continue
                    buf = buf[24:]
                    conn.sendall(_frame(4, 0, 0))  # the server's SETTINGS
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                    stream, payload, buf = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + n], buf[9 + n:]
                    if kind == 4 and not flags & 1:
                        conn.sendall(_frame(4, 1, 0))  # SETTINGS acknowledged
                    elif kind == 6 and not flags & 1:
                        conn.sendall(_frame(6, 1, 0, payload))  # PING answered
                    elif kind == 1:  # a request's HEADERS: ":status: 404" (HPACK static index 13), stream ended
                        conn.sendall(_frame(1, 0x5, stream, b"\x8d"))
        except OSError:
            pass
        finally:
            conn.close()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=speak, args=(conn,), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"127.0.0.2:{server.getsockname()[1]}"
    stop.set()
    t.join()
    server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["nothing-listening", "unknown-host", "ray-client", "not-ray", "http2-not-ray"])
def test_a_wrong_address_fails_fast_in_one_line_and_queues_nothing(workdir, case, request):
    """Bug caught (http2-not-ray): a service that answers HTTP/2 but is not Ray's GCS made Ray's C++
    client print a warning a second to stderr before the one-line refusal."""
    d, env = workdir
    address = {"nothing-listening": f"127.0.0.1:{free_port()}", "unknown-host": "no-such-host.invalid:6379",
               "ray-client": f"ray://127.0.0.1:{free_port()}"}.get(case)
    if case == "not-ray":
        address = request.getfixturevalue("silent_service")
    if case == "http2-not-ray":
        address = request.getfixturevalue("http2_404_service")
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


def test_verbose_shows_what_rays_client_said_while_it_tried(workdir, http2_404_service):
    """--verbose keeps Ray's held warnings: they are written out once the join gives up, before
    the refusal (a lost fd 2, or one never restored, would drop them or the refusal)."""
    d, env = workdir
    r = subprocess.run([sys.executable, "-m", "packbench", "--verbose", "--connect-timeout", "3", "dispatch", "--follow",
                        "--address", http2_404_service], cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Failed to get cluster ID from GCS server" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: --address {http2_404_service}: no Ray cluster answered")
