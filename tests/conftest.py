"""Shared fixtures: synthetic checkpoints (made once per session), a CPU device, and the command
line run in this process."""

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny OPT checkpoints, one per dtype, sparsity 0.94, seed 0."""
    from engine.synth import synth_checkpoint  # torch: only the tests that use a checkpoint pay for it

    root = tmp_path_factory.mktemp("checkpoints")
    return {dt: synth_checkpoint(root / f"tiny-{dt}", shape="tiny", dtype=dt, sparsity=0.94, seed=0)
            for dt in ("float32", "float16", "bfloat16")}


@pytest.fixture(scope="session")
def tiny(checkpoints) -> Path:
    return checkpoints["float32"]


@pytest.fixture(autouse=True)
def _own_host_marks(tmp_path_factory, monkeypatch):
    """Workers made in the test process mark a lock directory of their test's own
    (engine/gpu_lock.py HostPresence): a Worker left alive by one test must not appear as another
    packbench worker on the host in the next test's records. Worker actors, separate processes,
    still mark the host's directory, as in use."""
    import engine.gpu_lock

    monkeypatch.setattr(engine.gpu_lock, "DEFAULT_LOCK_DIR", tmp_path_factory.mktemp("host-marks"))


@dataclass(frozen=True)
class Ran:
    """What one `packbench` command returned and printed (the names of subprocess's result)."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def packbench_cli(capsys, monkeypatch):
    """`packbench_cli(*args, env={...}, cwd=...)` runs `packbench ARGS` in this process through the
    console entry point (`cli.main.main`: its exit codes and one-line errors), with `env` set and
    in `cwd` for that call only: milliseconds, where a `python -m cli` subprocess costs 0.4-0.7 s
    of interpreter start and imports on the 2-core CI machine. Commands that start Ray belong in a
    subprocess (an embedded Ray would outlive the call in this process)."""
    from cli.main import main

    def run(*args: str, env: Mapping[str, str] = {}, cwd: Path | None = None) -> Ran:
        capsys.readouterr()  # what the test printed before is not this command's
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            if cwd is not None:
                patch.chdir(cwd)
            patch.setattr(sys, "argv", ["packbench", *args])
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip with a reason where CUDA is absent, so a bare `pytest` on a CPU machine
    reports them as skipped instead of failing them ("Torch not compiled with CUDA enabled").
    `make test` still deselects them with `-m "not gpu"`; each has a CPU twin."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine "
                                   "(run on a GPU host, or deselect with -m 'not gpu')")
    for item in gpu_items:
        item.add_marker(skip)
