"""A re-execution audit (service/audit.py reexecute_archive) with its worker in this process: Ray's
part (`cluster/reexecute.py run_drawn`: placement, kill) stood in for, the re-run itself
(`cluster/reexecute.py _run`: load, warmups, episodes and what they are handed) the product's."""

from __future__ import annotations

import time


class _Call:
    def __init__(self, method) -> None:
        self.remote = method


class LocalActor:
    """A worker behind the actor handle's `.method.remote(...)` form; each call runs when sent."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self.worker, name))


class LocalRay:
    """`ray.wait` / `ray.get` over values already computed."""

    @staticmethod
    def wait(refs, timeout=None):
        return list(refs), []

    @staticmethod
    def get(value):
        return value


def rerun_here(monkeypatch, make_worker) -> list:
    """Make re-executions run `_run` over a worker from `make_worker()` in this process; returns
    the list the workers made are appended to."""
    import packbench.cluster.reexecute as rx

    made = []

    def run_drawn(protocol_body, model_dir, *, entries, prompts, runs, warmups, reference_twice, accelerator,
                  settings, progress=lambda msg: None, model_sha256=None, **more):
        made.append(make_worker())
        return rx._run(LocalRay, LocalActor(made[-1]), protocol_body, model_dir, entries=entries, prompts=prompts,
                       runs=runs, warmups=warmups, reference_twice=reference_twice, accelerator=accelerator,
                       accel_type=None, settings=settings, progress=progress, t0=time.perf_counter(),
                       model_sha256=model_sha256, **more)

    monkeypatch.setattr(rx, "run_drawn", run_drawn)
    return made
