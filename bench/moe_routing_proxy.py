"""Routing statistics of a real MoE shape on the CPU, through a proxy: the shape's hidden size,
attention, router, expert count, top-k and vocabulary, with each expert's intermediate width
divided by --shrink and its down_proj scaled by sqrt(shrink), so an expert's output keeps the
real shape's variance (what the next routers see) at a fraction of the bytes. Routing depends on
the experts only through their outputs; the proxy is named `<shape>-proxy` in the output.

Usage:  python -m bench.moe_routing_proxy --shape mixtral-8x7b --layers 10 --shrink 32 [--count 2 --prefix 256] [--keep DIR]
Prints core/routing.py check() beside the published figures, and per layer the skew, the
cross-layer lift (chance-corrected and raw) and the temporal lift. --shrink 1 is the real shape.
--keep DIR leaves the proxy checkpoint there (a new folder), for `packbench model stats DIR --trace`.
"""

import argparse
import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import torch


# An expert's down projection as save_pretrained writes it: per expert (`experts.N.down_proj.weight`,
# Mixtral's `experts.N.w2.weight`) or fused (`experts.down_proj`).
DOWN = re.compile(r"experts\.(\d+\.(down_proj|w2)\.weight|down_proj)$")


def proxy_checkpoint(out: Path, *, shape: str, layers: int, shrink: int, seed: int, profile: str | None) -> Path:
    from safetensors.torch import load_file, save_file

    import packbench.core.moe as core_moe
    from packbench.engine.moe.synth import synth_moe

    name = shape
    if shrink > 1:
        s = dict(core_moe.MOE_SHAPES[shape])
        s["intermediate"] = max(8, s["intermediate"] // shrink)
        name = f"{shape}-proxy"
        core_moe.MOE_SHAPES[name] = s  # this process only: synth_moe reads the table
        core_moe.ROUTING_OF[name] = core_moe.ROUTING_OF[shape]
    synth_moe(out, shape=name, layers=layers, seed=seed, profile=profile)
    if shrink > 1:
        scale = math.sqrt(core_moe.MOE_SHAPES[shape]["intermediate"] / core_moe.MOE_SHAPES[name]["intermediate"])
        scaled = 0
        for f in out.glob("*.safetensors"):
            sd = load_file(f)
            down = {k for k in sd if DOWN.search(k)}
            scaled += len(down)
            save_file({k: v * scale if k in down else v for k, v in sd.items()}, f, metadata={"format": "pt"})
        if not scaled:  # a layout this does not know: the proxy would not be one
            raise SystemExit(f"no expert down projection found in {out}; update DOWN")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--shrink", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="Also write the summary here.")
    ap.add_argument("--keep", type=Path, default=None, help="Write the proxy checkpoint here (a new folder) and keep it.")
    a = ap.parse_args()
    from packbench.core.routing import check, summarise
    from packbench.engine.moe.stats import routing_traces

    torch.set_num_threads(min(4, torch.get_num_threads()))
    if a.keep is not None and a.keep.exists():
        ap.error(f"--keep {a.keep} exists; name a new folder")
    with tempfile.TemporaryDirectory() as tmp:
        d = proxy_checkpoint(a.keep or Path(tmp) / "m", shape=a.shape, layers=a.layers, shrink=a.shrink, seed=a.seed,
                             profile=a.profile)
        config = json.loads((d / "config.json").read_text())
        rng = np.random.Generator(np.random.PCG64(a.seed))
        ids = [[1] + rng.integers(2, config["vocab_size"], a.prefix - 1).tolist() for _ in range(a.count)]
        traces, meta = routing_traces(d, ids)
    summary = summarise(traces, experts=meta["experts"], k=meta["k"])
    published = "mixtral" if meta["family"] == "mixtral" else "olmoe"
    label = a.shape if a.shrink == 1 else f"{a.shape}-proxy (intermediate / {a.shrink})"
    print(f"{label}, {a.layers} layers, seed {a.seed}, {a.count} x {a.prefix} tokens; published: {published}")
    for r in check(summary, published):
        lo, hi = r["measured"]
        print(f"  {'-  ' if r['ok'] is None else 'ok ' if r['ok'] else 'OUT'} {r['target']:<55} published {r['published']}  measured {lo:.2f}-{hi:.2f}")
    rows = summary["layers"]
    print("  skew per layer     ", " ".join(f"{r['skew']:.2f}" for r in rows))
    print("  cross-layer lift   ", " ".join(f"{r['next_layer']['lift']:.2f}" for r in rows if "next_layer" in r))
    print("  (raw, uncorrected) ", " ".join(f"{r['next_layer']['raw_lift']:.2f}" for r in rows if "next_layer" in r))
    print("  temporal lift      ", " ".join(f"{r['temporal_lift']:.2f}" for r in rows))
    if a.json:
        a.json.write_text(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
