"""Do a checkpoint's CPU logits depend on the thread count? One synthetic checkpoint per shape,
one forward pass over a 96-token prompt (eager attention) at each thread count, each count's
logits compared bit for bit with one thread's (and one thread's with itself, run again).

    python -m bench.cpu_threads                    # the tiny shapes, float32 and bfloat16
    python -m bench.cpu_threads --shapes olmoe-1b-7b:1 --dtypes float32

A count whose logits differ means a CPU archive re-executed on another count would not match
bit for bit: re-execution runs on the archive's recorded count (service/audit.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

SHAPES = ("tiny", "mixtral-tiny:3", "qwen3-moe-tiny:3", "olmoe-tiny:3")


def draw(shape: str, layers: int | None, out: Path) -> Path:
    """A synthetic checkpoint of `shape` (OPT with profile opt4, or an MoE shape) in `out`."""
    from packbench.core.moe import MOE_SHAPES

    if shape in MOE_SHAPES:
        from packbench.engine.moe.synth import synth_moe

        return synth_moe(out, shape=shape, layers=layers, dtype="float32")
    from packbench.engine.synth import synth_checkpoint

    return synth_checkpoint(out, shape=shape, dtype="float32", seed=0, profile="opt4")


def logits_by_threads(model_dir: Path, dtype: str, counts: list[int]) -> dict[int, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    before, out = torch.get_num_threads(), {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            with torch.no_grad():
                out[n] = model(ids).logits.float()
    finally:
        torch.set_num_threads(before)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="SHAPE or SHAPE:LAYERS (MoE), comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="2,3,4", help="counts compared with one thread's")
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    print(f"{'shape':20} {'dtype':9} {'1 again':>8} " + " ".join(f"{n:>6}" for n in counts))
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.shapes.split(","):
            shape, _, layers = spec.partition(":")
            model_dir = draw(shape, int(layers) if layers else None, Path(tmp) / shape)
            for dtype in args.dtypes.split(","):
                got = logits_by_threads(model_dir, dtype, [1, *counts, 1])
                again = logits_by_threads(model_dir, dtype, [1])[1]
                same = {n: "same" if torch.equal(got[1], got[n]) else "DIFFER" for n in counts}
                print(f"{spec:20} {dtype:9} {'same' if torch.equal(got[1], again) else 'DIFFER':>8} "
                      + " ".join(f"{same[n]:>6}" for n in counts), flush=True)


if __name__ == "__main__":
    main()
