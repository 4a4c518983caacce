"""Shared fixtures: synthetic checkpoints (made once per session), a CPU device, the command
line run in this process, and one local Ray cluster that `packbench` subprocesses join."""

import sys
from pathlib import Path

import pytest

from in_process import run_packbench  # tests/in_process.py
from local_ray import clean_environment, ray_head  # tests/local_ray.py


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny OPT checkpoints, one per dtype, sparsity 0.94, seed 0."""
    from packbench.engine.synth import synth_checkpoint  # torch: only the tests that use a checkpoint pay for it

    root = tmp_path_factory.mktemp("checkpoints")
    return {dt: synth_checkpoint(root / f"tiny-{dt}", shape="tiny", dtype=dt, sparsity=0.94, seed=0)
            for dt in ("float32", "float16", "bfloat16")}


@pytest.fixture(scope="session")
def tiny(checkpoints) -> Path:
    return checkpoints["float32"]


@pytest.fixture(scope="session")
def checkpoint_125m(tmp_path_factory) -> Path:
    """An OPT-125m-shaped checkpoint (the real widths), float32, sparsity 0.94, seed 0: 478 MB
    and 1.7 s to write, once for every module that reads it."""
    from packbench.engine.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "opt-125m", shape="opt-125m", dtype="float32",
                            sparsity=0.94, seed=0)


@pytest.fixture(autouse=True)
def _own_host_marks(tmp_path_factory, monkeypatch):
    """Workers made in the test process mark a lock directory of their test's own
    (engine/gpu_lock.py HostPresence): a Worker left alive by one test must not appear as another
    packbench worker on the host in the next test's records. Worker actors, separate processes,
    still mark the host's directory, as in use."""
    import packbench.engine.gpu_lock

    monkeypatch.setattr(packbench.engine.gpu_lock, "DEFAULT_LOCK_DIR", tmp_path_factory.mktemp("host-marks"))


@pytest.fixture(autouse=True, scope="module")
def _torch_threads_per_module():
    """Each test module starts with the host's torch thread count: a module that sets one thread
    (a module fixture or a test calling `torch.set_num_threads(1)`) keeps it for its own tests
    only, not for every module collected after it."""
    torch = sys.modules.get("torch")  # collection imported it where any test module does
    before = torch.get_num_threads() if torch is not None else None
    yield
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture
def packbench_cli(capsys):
    """`packbench_cli(*args, env={...}, cwd=...)` runs `packbench ARGS` in this process
    (tests/in_process.py `run_packbench`); what the test printed before is not the command's."""
    capsys.readouterr()
    return run_packbench


@pytest.fixture(scope="session")
def ray_address():
    """The GCS address of a local Ray cluster that lives as long as the session: `packbench`
    subprocesses that run screens join it (`PACKBENCH_RAY_ADDRESS`, the README's setting) instead
    of each starting and stopping an embedded Ray of its own, 3.2 s more per command on the 2-core
    CI machine (a quickstart `submit --wait`: 11.6-12.0 s embedded, 8.4-8.6 s joined). What they
    print and record does not depend on it; the embedded start itself is tested where it is the
    point (tests/test_tutorial.py's `make demo`, tests/api/test_api_run.py).
    Its workers run this checkout (PYTHONPATH) with packbench's settings unset: a test hands
    what a worker needs through the command's own options and environment, as a user would."""
    with ray_head(clean_environment()) as address:
        yield address


def pytest_collection_modifyitems(config, items):
    """PostgreSQL cases (a `pg_url` test, or a database fixture's postgresql case) are marked `postgresql`,
    so `-m postgresql` selects them alone (tests/mutate.py's PostgreSQL stage).
    `gpu` tests skip with a reason where CUDA is absent, so a bare `pytest` on a CPU machine
    reports them as skipped instead of failing them ("Torch not compiled with CUDA enabled").
    `make test` still deselects them with `-m "not gpu"`; each has a CPU twin."""
    for item in items:
        params = getattr(item, "callspec", None)
        cases = params.params.values() if params is not None else ()
        if "pg_url" in getattr(item, "fixturenames", ()) or any(isinstance(v, str) and v == "postgresql" for v in cases):
            item.add_marker("postgresql")
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
