"""Batched decode against batch size (issue 26, target 3): ms per token per sequence and bytes per
decode call of dense-stream, `packet {gather: device}` and an int8 low-bit resident competitor,
at each batch, on one calibrated synthetic checkpoint under the allowance.

  python -m bench.batch --shape opt-2.7b --batches 1,2,4,8,16,32 --mode graph --allowance-mib 4800

Method: one process. The CPU-first model's two loaders alternate per round at each batch (the
same B prompts, drawn as a protocol's generator draws them), a warm-up episode first; packet's
logits must equal dense-stream's bit for bit at the same batch. Then the CPU-first model's device
part moves to the host and the competitor (torchao int8 weight-only) is built and timed on the
same prompts in each of its modes (`--competitor-modes`, default eager and compile, its fastest at
batch 1; compile's first episode at each batch compiles and captures, and is the warm-up). Decode is the median ms per decode call
over every scored call, divided by B for ms per token per sequence; bytes per call are the
decode calls' mean host-to-device bytes (weights and indices). An episode that fails (an
out-of-memory under the allowance: the KV cache grows with B) is printed as its error, and the
run goes on.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

import numpy as np
import torch

from packbench.core.plan import BOS
from packbench.core.registry import COMPETITOR_MODES
from packbench.engine.allowance import impose
from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.sampler import device_uuid, nvml_handle
from packbench.core.registry import SHAPES
from packbench.engine.dtypes import DTYPES, dtype_of
from packbench.engine.synth import synth_checkpoint

MIB = 1 << 20
LOADERS = {"dense-stream": ("dense-stream", {}), "packet": ("packet", {"gather": "device"})}
COMPETITOR = "int8-weight-only"
MAX_BATCH = 1 << 16  # far past where packets and dense-stream meet at opt-2.7b (docs/experiments/batched.md)


def batch_prompts(batch: int, *, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """B prompts as a protocol's generator draws them (core/plan.py prompts)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return [[BOS] + rng.integers(4, vocab, size=length - 1).tolist() for _ in range(batch)]


def measure(model, prompts: list[list[int]], continuation: int) -> dict:
    """One episode's decode figures (or its error)."""
    try:
        out = run_episode(model, prompts if len(prompts) > 1 else prompts[0], continuation=continuation)
    except Exception as e:  # an OOM under the allowance, say: reported, the run goes on
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if isinstance(e, torch.OutOfMemoryError):  # the KV cache grows with B: say so plainly
            return {"error": f"out of memory under the allowance ({str(e).splitlines()[0][:60]})"}
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"}
    decode = [c for c in out.calls if c.phase == "decode"]
    return {"ms": [c.wall_s * 1e3 for c in decode], "logits": out.logits,
            "bytes": statistics.fmean(sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in decode)}


def rounds(run, rounds_n: int) -> dict:
    """A warm-up episode, then `rounds_n` scored ones: their decode calls pooled."""
    first = run()
    if "error" in first:
        return first
    scored = [run() for _ in range(rounds_n)]
    failed = next((r for r in scored if "error" in r), None)
    if failed is not None:
        return failed
    return {"ms": [m for r in scored for m in r["ms"]], "bytes": scored[-1]["bytes"], "logits": scored[-1]["logits"]}


def loaders(model: CpuFirstModel, batches: list[int], args, vocab: int) -> dict:
    """(condition, B) -> figures for the CPU-first model's loaders, alternated per round."""
    out: dict = {}
    for b in batches:
        prompts = batch_prompts(b, length=args.prefix, vocab=vocab)
        got: dict[str, list[dict]] = {name: [] for name in LOADERS}
        for r in range(args.rounds + 1):  # round 0: the warm-ups
            names = list(LOADERS) if r % 2 == 0 else list(reversed(LOADERS))
            for name in names:
                policy, params = LOADERS[name]
                model.use(policy, **params)
                got[name].append(measure(model, prompts, args.continuation))
        for name, runs in got.items():
            failed = next((x for x in runs if "error" in x), None)
            out[name, b] = failed or {"ms": [m for x in runs[1:] for m in x["ms"]], "bytes": runs[-1]["bytes"],
                                      "logits": runs[-1]["logits"]}
        print(f"batch {b:3d}: {cell(out['dense-stream', b], b)} dense-stream, {cell(out['packet', b], b)} packet"
              f"{transfer(out['dense-stream', b], out['packet', b])}", flush=True)
    return out


def exactly(d: dict, p: dict) -> str:
    """Whether packet's last logits are dense-stream's bit for bit ('-' where either failed)."""
    if "error" in d or "error" in p:
        return "-"
    return "yes" if p["logits"].tobytes() == d["logits"].tobytes() else "NO"


def transfer(d: dict, p: dict) -> str:
    """The batch line's bytes and bit check, so a run cut short keeps them (the table comes last)."""
    if "error" in d or "error" in p:
        return ""
    return f" ({p['bytes']:,.0f} of {d['bytes']:,.0f} bytes a call, bit-identical: {exactly(d, p)})"


def competitor(model: CpuFirstModel, batches: list[int], args, vocab: int, device: torch.device) -> dict:
    """("int8 <mode>", B) -> figures for the low-bit model in each mode, built once the CPU-first
    model's device part has moved to the host (both would not fit one allowance)."""
    from packbench.engine.quantized import QuantizedModel

    if model.slot.policy is not None:
        model.slot.policy.deactivate()
        model.slot.policy = None
    model.weights.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        q = QuantizedModel(model.model_dir, method=COMPETITOR, dtype=model.dtype, device=device)
    except Exception as e:  # a missing library: every cell fails, and the table's last lines say why
        why = f"{type(e).__name__}: {str(e)[:80]}"
        print(f"int8 model not built: {why}", flush=True)
        return {(f"int8 {m}", b): {"error": why} for m in args.competitor_modes for b in batches}
    out = {}  # a batch outside --competitor-batches has no cell
    for b in [b for b in batches if b in args.competitor_batches]:
        prompts = batch_prompts(b, length=args.prefix, vocab=vocab)
        for m in args.competitor_modes:
            q.mode = m
            out[f"int8 {m}", b] = rounds(lambda: measure(q, prompts, args.continuation), args.rounds)
            print(f"batch {b:3d}: {cell(out[f'int8 {m}', b], b)} int8 {m}", flush=True)
    return out


def cell(r: dict, b: int) -> str:
    if "error" in r:
        return r["error"][:40]
    return f"{statistics.median(r['ms']) / b:8.3f} ms/token/seq"


def table(rows: dict, batches: list[int], modes: list[str]) -> None:
    """The exact loaders, then the competitor (approximate tier) in each mode: its own columns."""
    lowbit = [f"int8 {m}" for m in modes]
    print("\n| batch | dense-stream ms/tok/seq | packet ms/tok/seq | dense MB/call | packet MB/call "
          "| packet / dense bytes | packet / dense time | packet exact | "
          + " | ".join(f"{q} (approximate) ms/tok/seq | packet / {q} time" for q in lowbit) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |" + " ---: | ---: |" * len(lowbit))
    fmt = lambda v: "fail" if v is None else f"{v:.3f}"  # noqa: E731
    ratio = lambda a, c: "-" if a is None or c is None else f"{a / c:.3f}"  # noqa: E731
    mb = lambda r: "fail" if "error" in r else f"{r['bytes'] / 1e6:.1f}"  # noqa: E731
    per_seq = lambda r, b: statistics.median(r["ms"]) / b if "error" not in r else None  # noqa: E731
    for b in batches:
        d, p = rows["dense-stream", b], rows["packet", b]
        exact = exactly(d, p)
        byte_ratio = "-" if "error" in d or "error" in p else f"{p['bytes'] / d['bytes']:.4f}"
        line = (f"| {b} | {fmt(per_seq(d, b))} | {fmt(per_seq(p, b))} | {mb(d)} | {mb(p)} | {byte_ratio} "
                f"| {ratio(per_seq(p, b), per_seq(d, b))} | {exact} |")
        for q in lowbit:
            if (q, b) not in rows:  # not timed (--competitor-batches)
                line += " - | - |"
                continue
            line += f" {fmt(per_seq(rows[q, b], b))} | {ratio(per_seq(p, b), per_seq(rows[q, b], b))} |"
        print(line)
    for other in ("dense-stream", *lowbit):
        timed = [b for b in batches if (other, b) in rows
                 and "error" not in rows["packet", b] and "error" not in rows[other, b]]
        if not timed:  # a verdict needs both timed at one batch at least
            errors = [r["error"] for b in batches for r in (rows["packet", b], rows.get((other, b), {})) if "error" in r]
            print(f"packets against {other}: not measured" + (f" ({errors[0]})" if errors else ""))
            continue
        lost = [b for b in timed
                if statistics.median(rows["packet", b]["ms"]) >= statistics.median(rows[other, b]["ms"])]
        print(f"packets stop paying against {other}: "
              + (f"from batch {lost[0]}" if lost else f"not within batches {','.join(map(str, timed))}"))


def batch_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (argparse's type: a bad list is one line, not a traceback)."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes, e.g. 1,8,32") from None
    if any(not 1 <= b <= MAX_BATCH for b in batches):
        raise argparse.ArgumentTypeError(f"batch sizes are 1 to {MAX_BATCH}, got {text!r}")
    return batches


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="opt-2.7b", choices=list(SHAPES))
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES))
    ap.add_argument("--batches", default="1,2,4,8,16,32", type=batch_list)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="graph", choices=("eager", "graph"))
    ap.add_argument("--competitor-modes", default="eager,compile", help="the int8 competitor's modes, comma-separated")
    ap.add_argument("--competitor-batches", type=batch_list, help="the batches the competitor is timed at (default: every one); "
                    "each compiles its step again, 2-4 minutes at opt-13b")
    ap.add_argument("--allowance-mib", type=int, default=4800)
    ap.add_argument("--dir", default="/tmp/batch-models")
    a = ap.parse_args(argv)
    a.competitor_modes = a.competitor_modes.split(",")
    batches = a.batches
    a.competitor_batches = a.competitor_batches or batches
    positions = SHAPES[a.shape]["max_positions"]
    if a.prefix < 1 or a.continuation < 1 or a.prefix + a.continuation > positions:
        ap.error(f"--prefix and --continuation are at least 1 and together at most {a.shape}'s {positions} positions")
    if a.rounds < 1 or a.allowance_mib < 1:
        ap.error("--rounds and --allowance-mib are at least 1")
    if unknown := [m for m in a.competitor_modes if m not in COMPETITOR_MODES]:
        ap.error(f"--competitor-modes: {', '.join(map(repr, unknown))}: each is one of {', '.join(COMPETITOR_MODES)}")
    if extra := [b for b in a.competitor_batches if b not in batches]:
        ap.error(f"--competitor-batches {','.join(map(str, extra))}: not among --batches {','.join(map(str, batches))}")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    path = Path(a.dir) / f"{a.shape}-{a.dtype}-opt"
    if not (path / "config.json").exists():
        synth_checkpoint(path, shape=a.shape, dtype=a.dtype, seed=0, profile="opt")
    handle = nvml_handle(device_uuid(device.index or 0)) if device.type == "cuda" else None
    context = impose(device, a.allowance_mib * MIB, handle) if device.type == "cuda" else 0
    model = CpuFirstModel(path, dtype=dtype_of(a.dtype), device=device, mode=a.mode)
    print(f"{a.shape} {a.dtype}, prefix {a.prefix} + {a.continuation}, mode {a.mode} (int8: {', '.join(a.competitor_modes)}), "
          f"allowance {a.allowance_mib} MiB (CUDA context {context / MIB:.0f} MiB charged), {a.rounds} rounds",
          flush=True)
    rows = loaders(model, batches, a, model.vocab)
    rows.update(competitor(model, batches, a, model.vocab, device))
    table(rows, batches, a.competitor_modes)


if __name__ == "__main__":
    main()
