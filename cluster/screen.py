"""Running a screen: place it on a GPU worker actor, persist each episode as it returns,
write the raw archive as it goes, then seal it, compute the verdicts and store them.

The database and the archive are written by this driver process only; the worker returns
records. Failures are kept: an interrupted or failed attempt stays in the database with its
cause, and its partial archive stays on disk.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.runtime import ensure_ray
from core.archive import ArchiveWriter
from core.errors import PackbenchError
from core.gates import compute_verdicts
from core.plan import plan, prompts
from core.source import source_freeze


PLACEMENT_TIMEOUT_S = float(os.environ.get("PACKBENCH_PLACEMENT_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class ScreenOutcome:
    screen_id: int
    attempt_id: int
    archive_path: Path
    archive_sha256: str | None
    status: str
    error: str | None


def screen_prompts(body: dict, *, vocab: int, model_dir: Path | None, prompt_file: Path | None) -> list[list[int]]:
    """The screen's prompt token ids; text prompts go through the checkpoint's own tokenizer."""
    tokenize = None
    if "text_file" in body["prompts"]:
        from engine.prompts import tokenizer_for

        tokenize = tokenizer_for(Path(model_dir))
    return prompts(body, vocab=vocab, prompt_file=prompt_file, tokenize=tokenize)


def run_screen(store, screen_id: int, *, archive_dir: Path, address: str | None = None,
               progress=lambda msg: None) -> ScreenOutcome:
    """Run one queued screen to its end (done or failed) and return what happened."""
    screen = store.screen(screen_id)
    proto = store.protocol(screen.protocol_id)
    body = json.loads(proto.canonical_json)
    model_dir = screen.model_dir
    archive_dir.mkdir(parents=True, exist_ok=True)
    # Racing dispatchers cannot clobber each other: ArchiveWriter refuses an existing file.
    number = len(store.attempts(screen_id)) + 1
    archive_path = (archive_dir / f"screen-{screen_id:05d}-attempt-{number}.zip").resolve()

    ray = ensure_ray(address)
    from cluster.worker import start_worker

    actor = start_worker()
    try:
        # An actor nobody can place stays pending without an error (shared/ray.md): bound it.
        env = ray.get(actor.describe.remote(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise PackbenchError(f"no GPU worker could be placed within {PLACEMENT_TIMEOUT_S:.0f} s; check that the "
                             "cluster has a free GPU (`ray status`) or set PACKBENCH_PLACEMENT_TIMEOUT_S") from None
    freeze = source_freeze()
    attempt = store.start_attempt(
        screen_id=screen_id, worker=f"GpuWorker pid {env['pid']}", node=env["host"], gpu_name=env["gpu"] or "cpu",
        gpu_index=int((env["gpu_index"] or "-1").split(",")[0]), machine_id=store.put_machine(
            host=env["host"], gpu_name=env["gpu"], driver=env["driver"], torch=env["torch"], cuda=env["cuda"]),
        source_freeze=freeze, archive_path=str(archive_path))
    writer = ArchiveWriter(archive_path)
    episodes: list[dict] = []
    try:
        writer.add_json("protocol.json", body)
        start = ray.get(actor.load.remote(body, model_dir))
        vocab = start.pop("vocab")
        entries = plan(body)
        token_ids = screen_prompts(body, vocab=vocab, model_dir=Path(start["model_dir"]),
                                   prompt_file=Path(screen.prompt_file) if screen.prompt_file else None)
        writer.add_json("plan.json", {"entries": entries, "prompts": token_ids})
        writer.add_json("worker.json", {"environment": env, "start": start, "model_dir": model_dir})
        progress(f"screen {screen_id} attempt {attempt.number}: {len(entries)} episodes on {env['device']}")
        refs = [actor.run.remote(e, token_ids[e["prompt"]]) for e in entries]
        for entry, ref in zip(entries, refs):
            record = ray.get(ref)
            logits, trace = record.pop("logits"), record.pop("trace")
            writer.add_episode(record, logits, trace)
            store.put_episode(attempt.id, record)
            episodes.append({**record, "logits": logits})
            progress(f"  episode {entry['index']:3d} {entry['condition']:>14} {entry['role']:6} "
                     f"prompt {entry['prompt']} {record['status']}")
        verdicts = compute_verdicts(body, episodes, start=start)
        writer.add_json("verdicts.json", verdicts)
        sha = writer.seal({"protocol_sha256": proto.sha256, "screen_id": screen_id, "attempt": attempt.number,
                           "environment": env, "source_freeze": freeze})
        store.put_verdicts(attempt.id, verdicts)
        store.finish_attempt(attempt.id, status="done", archive_sha256=sha)
        return ScreenOutcome(screen_id, attempt.id, archive_path, sha, "done", None)
    except KeyboardInterrupt:
        store.finish_attempt(attempt.id, status="interrupted", error="interrupted by the user")
        raise
    except Exception as e:
        # A RayTaskError wraps the worker's exception (and subclasses it): report the cause.
        cause = getattr(e, "cause", None) or e
        if isinstance(cause, PackbenchError):
            store.finish_attempt(attempt.id, status="failed", error=str(cause))
            raise cause from None
        error = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        store.finish_attempt(attempt.id, status="failed", error=error)
        return ScreenOutcome(screen_id, attempt.id, archive_path, None, "failed", error)
    finally:
        ray.kill(actor)

