"""Write a historical raw archive for tests/data: the real engine on a tiny synthetic checkpoint.

    python tests/data/make_archives.py PROTOCOL.yaml OUT.zip

It runs a screen exactly as cluster/screen.py does, minus Ray and the database: the plain
`engine.worker.Worker` on the CPU, `core.archive.ArchiveWriter` members in the driver's order
(protocol.json, plan.json, worker.json, each episode's members as it finishes, verdicts.json,
manifest.json last; member names come from core.archive, the layout's owner). The checkpoint
is synthesised into a temporary folder: by the worker from model.synth when the protocol has
one, else here as the tiny float32 OPT (sparsity 0.94, seed 0) that model.path only names.
Written archives are never edited; see tests/data/README.md.

The script uses `ArchiveWriter.add_episode` and the layout constants where the tree has them
and otherwise only APIs that every packbench version since 0.1 has, so the same command also
regenerates an archive at an older commit (`git archive <commit>`, then run it there).
"""

import argparse
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("protocol", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--root", type=Path, default=ROOT, help="packbench tree whose code writes the archive")
    args = ap.parse_args()
    sys.path.insert(0, str(args.root.resolve()))

    import packbench.core.archive as layout_module
    from packbench.core.archive import ArchiveWriter
    from packbench.core.gates import compute_verdicts
    from packbench.core.plan import plan, prompts
    from packbench.core.protocol import load
    from packbench.core.source import source_freeze
    from packbench.engine.synth import synth_checkpoint
    from packbench.engine.worker import Worker

    # The fixed member names from their owner; trees before issue 9 had only these literals.
    layout = vars(layout_module)
    frozen = load(args.protocol)
    body = json.loads(frozen.canonical)
    with tempfile.TemporaryDirectory() as tmp:
        if "synth" in body["model"]:
            # The worker generates model.synth itself, into its model cache: keep that here.
            os.environ["PACKBENCH_MODEL_CACHE"] = tmp
            model_dir = None
        else:
            model_dir = str(synth_checkpoint(Path(tmp) / "model", shape="tiny", dtype="float32", sparsity=0.94,
                                             seed=0))
        worker = Worker("cpu")
        env = worker.describe()
        freeze = source_freeze()
        writer = ArchiveWriter(args.out)
        writer.add_json(layout.get("PROTOCOL_NAME", "protocol.json"), body)
        start = worker.load(body, model_dir)
        vocab = start.pop("vocab")
        entries = plan(body)
        # Older core.plan.prompts read no prompt files.
        kw = {"prompt_file": frozen.prompt_file()} if "prompt_file" in inspect.signature(prompts).parameters else {}
        token_ids = prompts(body, vocab=vocab, **kw)
        writer.add_json(layout.get("PLAN_NAME", "plan.json"), {"entries": entries, "prompts": token_ids})
        start.pop("model_dir", None)  # a temporary folder: say what it held instead
        writer.add_json(layout.get("WORKER_NAME", "worker.json"),
                        {"environment": env, "start": start, "model_dir": "tiny (synthesised)"})
        episodes = []
        for entry in entries:
            record = worker.run(entry, token_ids[entry["prompt"]])
            logits, trace = record.pop("logits"), record.pop("trace", None)  # older workers kept no trace
            if hasattr(writer, "add_episode"):
                writer.add_episode(record, logits, trace)
            else:  # packbench before issue 9: no layout owner; these are the names it wrote
                writer.add_json(f"episodes/{entry['index']:05d}.json", record)
                if logits is not None:
                    writer.add_array(f"logits/{entry['index']:05d}.npy", logits)
            episodes.append({**record, "logits": logits})
            print(f"episode {entry['index']:3d} {entry['condition']:>14} {entry['role']:6} {record['status']}")
        # Older core.gates.compute_verdicts took no start record.
        kw = {"start": start} if "start" in inspect.signature(compute_verdicts).parameters else {}
        verdicts = compute_verdicts(body, episodes, **kw)
        writer.add_json(layout.get("VERDICTS_NAME", "verdicts.json"), verdicts)
        sha = writer.seal({"protocol_sha256": frozen.sha256, "screen_id": 0, "attempt": 1,
                           "environment": env, "source_freeze": freeze})
    for v in verdicts:
        print(f"{v['gate']:>15} {v['condition']:>14} {v['phase']:>7} {'PASS' if v['passed'] else 'FAIL'}")
    print(f"{args.out}: {args.out.stat().st_size} B, sha256 {sha}")


if __name__ == "__main__":
    main()
