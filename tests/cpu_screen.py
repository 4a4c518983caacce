"""A screen run on the CPU in this process and archived as the driver archives one (no database,
no Ray): what the tests that audit a whole screen's archive share; and `CpuPool`, real workers
in this process behind the dispatcher's pool interface, for a screen run end to end without Ray."""

from __future__ import annotations

import json
from pathlib import Path

from packbench.core.archive import PLAN_NAME, PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveWriter
from packbench.core.fidelity import of_episode
from packbench.core.gates import compute_verdicts
from packbench.core.pool import NodeInfo, Reply
from packbench.core.plan import plan, prompts
from packbench.engine.worker import Worker


def archive_screen(frozen, model_dir: Path, path: Path) -> tuple[dict, list[dict], list[dict]]:
    """(body, episodes with their logits, verdicts) of the frozen protocol run on the CPU, every
    episode in plan order, an approximate one with its teacher-forced logits and fidelity; the
    sealed archive at `path`. A batch entry runs its prompts together, as the driver runs it."""
    from packbench.core.plan import episode_input as plan_input

    body = json.loads(frozen.canonical)
    worker = Worker(device="cpu")
    start = worker.load(body, str(model_dir))
    ids = prompts(body, vocab=start.pop("vocab"))
    entries = plan(body)
    writer = ArchiveWriter(path)
    writer.add_json(PROTOCOL_NAME, body)
    writer.add_json(PLAN_NAME, {"entries": entries, "prompts": ids})
    env = worker.describe()
    writer.add_json(WORKER_NAME, {"environment": env, "start": start})
    episodes = []
    for entry in entries:
        record = worker.run(entry, plan_input(ids, entry))  # a batch entry: its prompts together
        logits, trace = record.pop("logits"), record.pop("trace", None)
        forced = record.pop("forced_logits", None)
        if record.get("tier") == "approximate":  # as the driver does (service/screen.py ScreenRun.record)
            try:
                record["fidelity"] = of_episode({**record, "forced_logits": forced},
                                                {e["plan_index"]: e for e in episodes},
                                                reference=body["reference"]).as_dict()
            except ValueError:
                record["fidelity"] = None
        writer.add_episode(record, logits, trace, forced, active=record.pop("active_sets", None))
        episodes.append({**record, "logits": logits, "forced_logits": forced})
    verdicts = compute_verdicts(body, episodes, start=start)
    writer.add_json(VERDICTS_NAME, verdicts)
    writer.seal({"protocol_sha256": frozen.sha256, "screen_id": 0, "attempt": 1, "environment": env})
    return body, episodes, verdicts


class CpuPool:
    """The dispatcher's WorkerPool (service/dispatcher/pool.py) with real engine Workers on this
    CPU, in this process: each call runs when it is sent and its reply waits for `wait`. The
    dispatcher, ScreenRun, the archive and the database are the product's; only Ray is left out."""

    def __init__(self) -> None:
        self.replies: list[tuple[Worker, Reply]] = []
        self.workers: list[Worker] = []

    def connect(self) -> None:
        pass  # nothing to start: the workers live in this process

    def gpus(self) -> int:
        return 1

    def start_worker(self, tag, *, pool_size: int) -> Worker:
        worker = Worker(device="cpu")
        self.workers.append(worker)
        self._call(worker, tag, lambda: {**worker.describe(), "node_id": "cpu-node"})
        return worker

    def load(self, worker: Worker, tag, protocol, model_dir, *, model_cache, reuse: bool) -> None:
        self._call(worker, tag, lambda: worker.load(protocol, model_dir, model_cache=model_cache, reuse=reuse))

    def run(self, worker: Worker, tag, entry: dict, prompt) -> None:
        self._call(worker, tag, lambda: worker.run(entry, prompt))

    def in_flight(self) -> int:
        return len(self.replies)

    def wait(self, timeout: float, *, every: bool = False):
        while self.replies:
            yield self.replies.pop(0)[1]

    def kill(self, worker: Worker) -> None:
        self.replies = [(w, r) for w, r in self.replies if w is not worker]

    def nodes(self) -> dict[str, NodeInfo]:
        return {"cpu-node": NodeInfo(None, {})}

    def _call(self, worker: Worker, tag, call) -> None:
        try:
            self.replies.append((worker, Reply(tag, value=call())))
        except Exception as e:  # the worker raised: the call failed, the worker lives (as on Ray)
            self.replies.append((worker, Reply(tag, error=e)))


def resealed(path: Path, out: Path, edit) -> Path:
    """The sealed archive at `path` rewritten to `out` with `edit(members)` applied to its member
    bytes (name -> bytes, the manifest left out) and sealed again: every digest valid, so what the
    auditor finds is the edit itself. Returns `out`."""
    from packbench.core.archive import MANIFEST_NAME, ArchiveReader

    with ArchiveReader(path) as reader:
        names = [n for n in reader.names if n != MANIFEST_NAME]
        manifest = reader.manifest
        members = {n: reader.read_bytes(n) for n in names}
    edit(members)
    w = ArchiveWriter(out)
    for n in names:
        if n.endswith(".json"):
            w.add_json(n, json.loads(members[n]))
        else:
            w.add_bytes(n, members[n])
    w.seal({k: v for k, v in manifest.items() if k != "members"})
    return out
