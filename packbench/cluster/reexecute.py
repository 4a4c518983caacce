"""Re-execution on the cluster: one GPU worker actor of the archive's accelerator type re-runs
drawn episodes (core/reexecute.py says what is drawn and compared).

The worker is the dispatcher's kind (cluster/worker.py: one per GPU, its GPU held by the
host-wide lock); it loads the archived protocol's model cold and runs plan entries as a screen
would, then is killed. Nothing here writes an archive or a database row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from packbench.cluster.runtime import ensure_ray
from packbench.cluster.worker import start_worker
from packbench.core.errors import PackbenchError
from packbench.core.plan import episode_input
from packbench.core.settings import Settings


@dataclass
class Rerun:
    env: dict  # the worker's describe(): host, gpu, node_id, ...
    start: dict  # its load() record
    records: dict[int, dict]  # plan index -> record (logits included)
    reference_again: dict | None  # the reference episode's second run
    seconds: float


def _accelerator_type(ray, gpu_name: str) -> str | None:
    """Ray's accelerator_type (e.g. "H200") that names the archived GPU ("NVIDIA H200"), when a
    node of the cluster declares one: the worker is then placed on such a node."""
    if not gpu_name:
        return None
    types = {key.split(":", 1)[1] for node in ray.nodes() if node.get("Alive")
             for key in node.get("Resources", {}) if key.startswith("accelerator_type:")}
    matches = [t for t in types if t.lower() in gpu_name.lower()]
    return max(matches, key=len) if matches else None


def _one_line(e: BaseException) -> PackbenchError:
    """A worker's failure as one line: the worker's own bad-input message when it refused (a
    checkpoint that is not there, a digest that differs), else what died and why."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, PackbenchError):
        return PackbenchError(str(cause).splitlines()[0] if str(cause) else type(cause).__name__)
    text = str(cause).splitlines()[0] if str(cause) else ""
    return PackbenchError(f"the re-execution worker failed: {type(cause).__name__}: {text[:300]}; nothing was "
                          f"recorded (retry, or run with -v for the worker's log)")


def run_drawn(protocol_body: dict, model_dir: str | None, *, entries: list[dict], prompts: list[list[int]],
              runs: list[int], warmups: list[int], reference_twice: int | None, accelerator: str,
              settings: Settings, progress=lambda msg: None, model_sha256: str | None = None,
              placements: dict[int, dict] | None = None) -> Rerun:
    """Load the protocol's model cold on a fresh worker of `accelerator` ("" for a CPU-run
    archive) and run `warmups` (discarded), then `runs` in order (the reference one twice).
    `model_sha256`: the checkpoint digest the archive measured; a checkpoint loaded with another
    is refused before any episode runs. `placements`: plan index -> the archived `offload` section
    each such episode is handed (engine/worker.py `run`'s `placement`)."""
    ray = ensure_ray(settings)
    options = {}
    accel_type = _accelerator_type(ray, accelerator)
    if accel_type is not None:
        options["accelerator_type"] = accel_type
    t0 = time.perf_counter()
    actor = start_worker(settings, **options)
    try:
        return _run(ray, actor, protocol_body, model_dir, entries=entries, prompts=prompts, runs=runs, warmups=warmups,
                    reference_twice=reference_twice, accelerator=accelerator, accel_type=accel_type,
                    settings=settings, progress=progress, t0=t0, model_sha256=model_sha256, placements=placements)
    except (ray.exceptions.RayError, PackbenchError) as e:
        raise _one_line(e) from None
    finally:
        ray.kill(actor, no_restart=True)


def _run(ray, actor, protocol_body, model_dir, *, entries, prompts, runs, warmups, reference_twice, accelerator,
         accel_type, settings, progress, t0, model_sha256=None, placements=None) -> Rerun:
    """run_drawn's body, on a started actor (placement, accelerator check, load, episodes)."""
    ready, _ = ray.wait([ref := actor.describe.remote()], timeout=settings.placement_timeout_s)
    if not ready:
        raise PackbenchError(f"no GPU worker of type {accel_type or accelerator or 'any'} could be placed within "
                             f"{settings.placement_timeout_s:g} s (are all GPUs held by a dispatcher?); retry "
                             f"when one is free, or raise --placement-timeout")
    env = ray.get(ref)
    if env.get("gpu_busy"):
        raise PackbenchError(f"the re-execution worker cannot use its GPU: {env['gpu_busy']}")
    if (env.get("gpu") or "") != (accelerator or ""):
        raise PackbenchError(f"the archive was measured on {accelerator or 'the CPU'}, the worker placed is on "
                             f"{env.get('gpu') or 'the CPU'}: re-execution needs the same accelerator type; run "
                             f"it on a cluster that has one (--address)")
    progress(f"re-executing on {env.get('host')} ({env.get('gpu') or 'cpu'}, node {env.get('node_id', '')[:8]})")
    cache = None if settings.model_cache is None else str(settings.model_cache)
    start = ray.get(actor.load.remote(protocol_body, model_dir, model_cache=cache, reuse=False))
    if model_sha256 is not None and start.get("model_sha256") != model_sha256:
        # Other weights cannot check the archive: a re-run on them would call an honest archive
        # DISAGREE (and record it against its screen).
        synth = (protocol_body.get("model") or {}).get("synth") is not None
        fix = ("remove that folder, and the worker generates the protocol's synthetic checkpoint again" if synth
               else "restore it, or give --archive FILE --model-dir DIR with a copy that has the archived digest")
        raise PackbenchError(f"the checkpoint at {start.get('model_dir')} has content digest "
                             f"{start.get('model_sha256')}, the archive measured {model_sha256}: not the weights the screen "
                             f"measured (another checkpoint, or this one changed since), so nothing was re-executed "
                             f"or recorded; {fix}")
    by_index = {e["index"]: e for e in entries}
    placements = placements or {}

    def run(i: int):
        return actor.run.remote(by_index[i], episode_input(prompts, by_index[i]), placement=placements.get(i))

    for i in warmups:
        ray.get(run(i))
    records, again = {}, None
    for n, i in enumerate(runs, 1):
        entry = by_index[i]
        records[i] = ray.get(run(i))
        progress(f"  re-executed episode {i:3d} {entry['condition']:>14} {records[i]['status']} ({n}/{len(runs)})")
        if i == reference_twice:
            again = ray.get(run(i))
    return Rerun(env, start, records, again, time.perf_counter() - t0)
