"""Running one screen on a GPU worker actor of its own: `submit --wait` and the simple path.

The per-episode logic (archive, database, verdicts) is service.screen.ScreenRun; this module
only places the actor, feeds it the plan one episode ahead and hands each record over.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cluster.runtime import ensure_ray
from core.errors import PackbenchError
from core.protocol import expand
from core.settings import Settings
from core.source import source_freeze
from service.screen import ScreenOutcome, ScreenRun, archive_name, attempt_key, cause_of
from service.submit import screen_prompts

log = logging.getLogger(__name__)


def place(ray, actor, settings: Settings) -> dict:
    """The actor's environment once it is placed; an actor nobody can place stays pending
    without an error (shared/ray.md), so the wait is bounded."""
    try:
        return ray.get(actor.describe.remote(), timeout=settings.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise PackbenchError(f"no GPU worker could be placed within {settings.placement_timeout_s:.0f} s; check that "
                             "the cluster has a free GPU (`ray status`) or raise --placement-timeout") from None


def run_screen(store, screen_id: int, *, settings: Settings, progress=lambda msg: None) -> ScreenOutcome:
    """Run one queued screen to its end (done or failed) on a new actor, and return what happened."""
    screen = store.screen(screen_id)
    protocol = expand(json.loads(store.protocol(screen.protocol_id).canonical_json))
    ray = ensure_ray(settings)
    from cluster.worker import start_worker

    actor = start_worker(settings)
    try:
        env = place(ray, actor, settings)
        key = attempt_key()
        freeze = source_freeze()
        archive_path = (settings.archive_dir / archive_name(protocol, key)).resolve()
        attempt = store.start_attempt(
            screen_id=screen_id, worker=f"GpuWorker pid {env['pid']}", node=env["host"], gpu_name=env["gpu"] or "cpu",
            gpu_index=int((env["gpu_index"] or "-1").split(",")[0]), machine_id=store.put_machine(
                host=env["host"], gpu_name=env["gpu"], driver=env["driver"], torch=env["torch"], cuda=env["cuda"]),
            source_freeze=freeze, archive_path=str(archive_path))
        run = ScreenRun(store, screen=screen, attempt=attempt, protocol=protocol, archive_path=archive_path,
                        freeze=freeze, progress=progress)
        try:
            run.begin(env)
            start = ray.get(actor.load.remote(protocol, screen.model_dir, model_cache=_cache(settings)))
            vocab = start.pop("vocab")
            token_ids = screen_prompts(protocol, vocab=vocab, model_dir=Path(start["model_dir"]),
                                       prompt_file=Path(screen.prompt_file) if screen.prompt_file else None)
            entries = run.loaded(start, token_ids)
            # One episode ahead: the worker never idles while the driver persists a record.
            pending = [actor.run.remote(e, token_ids[e["prompt"]]) for e in entries[:2]]
            for i in range(len(entries)):
                record = ray.get(pending.pop(0))
                if i + 2 < len(entries):
                    e = entries[i + 2]
                    pending.append(actor.run.remote(e, token_ids[e["prompt"]]))
                run.record(record)
            return run.finish()
        except KeyboardInterrupt:
            run.fail("interrupted", "interrupted by the user")
            raise
        except PackbenchError as e:
            run.fail("failed", str(e))
            raise
        except Exception as e:
            return run.fail("failed", cause_of(e))
    finally:
        ray.kill(actor)


def _cache(settings: Settings) -> str | None:
    return None if settings.model_cache is None else str(settings.model_cache)
