"""Building blocks of the dispatcher's tests: a protocol file of fake screens (the fake pool
runs them in milliseconds), a dispatcher on the fake pool that keeps what it said, and the
plan indexes an attempt has rows for."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import yaml

from packbench.core.settings import DEFAULT_EPISODE_TIMEOUT_S, DEFAULT_LOAD_TIMEOUT_S, Settings
from packbench.service.dispatcher import Dispatcher


def protocol_file(folder: Path, *, prompts: int = 1, continuation: int = 2, name: str = "fake-screen") -> Path:
    body = {"schema": 2, "name": name,
            "model": {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}},
            "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": prompts}}, "prefix_tokens": 8,
            "continuation_tokens": continuation,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}], "reference": "dense-stream",
            "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    path = folder / f"{name}-{prompts}x{continuation}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def interrupt_on_call(monkeypatch, module, name: str, n: int) -> tuple[list, object]:
    """Patch `module.name` to raise KeyboardInterrupt on its n-th call, the calls before it going
    through: an interrupt part-way through a transaction. Returns (the first argument of each
    call, the real function, to patch back)."""
    real, calls = getattr(module, name), []

    def patched(session, ref, **options):
        calls.append(ref)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(session, ref, **options)

    monkeypatch.setattr(module, name, patched)
    return calls, real


def dispatcher(store, tmp_path, pool, *, episode_timeout_s: float = DEFAULT_EPISODE_TIMEOUT_S,
               load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, **options) -> Dispatcher:
    said: list[str] = []
    options.setdefault("lease_s", 30)
    s = Dispatcher(store, Settings(archive_dir=tmp_path / "archives", episode_timeout_s=episode_timeout_s,
                                   load_timeout_s=load_timeout_s), pool,
                  progress=lambda message, **event: said.append(message), **options)
    s.said = said  # type: ignore[attr-defined]
    return s


def rows(store, attempt_id: int) -> list[int]:
    return [e.plan_index for e in store.episodes(attempt_id)]


def gone_pid() -> int:
    """The pid of a process that has ended (a killed driver's, say)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def process_gone(db: Path, dispatcher_id: int) -> int:
    """A dispatcher that ran in this test's process has ended: its row now names a pid that is
    no process (in-process dispatchers share the test's pid, which lives on). Returns that pid."""
    pid = gone_pid()
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE dispatchers SET pid = ? WHERE id = ?", (pid, dispatcher_id))
    return pid
