"""Robustness of the synthetic profiles at real OPT shapes (issue 42; docs/workloads.md): every
decoder Linear weight fake-quantized (engine/robustness.py), teacher-forced on the full-precision
model's own text (prompts of generated tokens, then tokens it samples at temperature 1), beside
real OPT's published figures. One shape and profile per process; bench/robustness_device.sh runs
the four shapes side by side and prints the table.

    python -m bench.robustness --shape opt-2.7b --profile opt3 --dtype float16 --device cuda --json out.json

`--profile opt3+rank=48+salient=0.01:5` measures a candidate: the named profile with fields replaced
(`rank`, `salient` as share:scale, `salient_count`, `outlier_salience`; `outliers=none` as a diagnostic), labelled as written; a published profile never changes (core/registry.py).
`--layers N` draws a proxy on a CPU: the shape's widths with N decoder layers (each layer's density
from the N-layer trend); docs/workloads.md's opt-2.7b proxy is `--shape opt-2.7b --layers 4`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> None:
    from packbench.core.plan import BOS
    from packbench.core.registry import PROFILES, SHAPES
    from packbench.engine.robustness import VARIANTS, measure, real_opt, sample_continuations
    from packbench.engine.dtypes import dtype_of
    from packbench.engine.synth import profile_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=tuple(SHAPES))
    ap.add_argument("--profile", required=True, help=f"one of {', '.join(PROFILES)}, or NAME+field=value+...")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--sampled", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="a proxy: the shape's widths with this many layers")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        PROFILES[args.profile] = candidate(args.profile, PROFILES)  # this process's table only
    except ValueError as e:
        ap.error(f"--profile {args.profile!r}: {e}")
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants {args.variants!r}: give some of {', '.join(VARIANTS)}")
    if args.layers is not None:  # a proxy: this process's shape table only (profile_tensors reads it)
        SHAPES[args.shape] = {**SHAPES[args.shape], "layers": args.layers}
    from transformers import OPTForCausalLM  # noqa: F401  (imported before the clock starts: drawn_s is the draw)

    t0 = time.time()
    model = profile_model(args.shape, seed=args.seed, profile=args.profile, dtype=dtype_of(args.dtype))
    drawn = time.time() - t0
    model = model.to(args.device).eval()
    rng = np.random.Generator(np.random.PCG64(args.seed))
    vocab = SHAPES[args.shape]["vocab"]
    prompts = [[BOS] + rng.integers(4, vocab, size=args.prefix - 1).tolist() for _ in range(args.prompts)]
    seqs = sample_continuations(model, prompts, tokens=args.sampled, seed=args.seed, device=args.device)
    figures = measure(None, seqs, score_from=[args.prefix] * args.prompts, variants=variants,
                      dtype=dtype_of(args.dtype), device=args.device, model=model)
    out = {"shape": args.shape, "layers": SHAPES[args.shape]["layers"], "profile": args.profile, "dtype": args.dtype, "prompts": args.prompts,
           "prefix": args.prefix, "sampled": args.sampled, "drawn_s": round(drawn, 1),
           "total_s": round(time.time() - t0, 1), "variants": figures, "real_opt": real_opt(args.shape)}
    for name, f in figures.items():
        real = out["real_opt"].get(name)
        print(f"{args.shape:9} {args.profile:5} {name:13} dCE {f['dce']:.4f} ({f['dce_low']:.4f}..{f['dce_high']:.4f}) "
              f"KL {f['mean_kl']:.4f} p99 {f['p99_kl']:.3f} top1 {f['top1']:.3f}"
              + (f"  real {real['ln_ratio']:.3f}" if real else ""), flush=True)
    print(f"drawn in {drawn:.1f} s, {out['total_s']:.1f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=float)


def candidate(spec: str, profiles: dict):
    """The profile `NAME+field=value+...` names: profiles[NAME] with `rank` (an integer) or `salient`
    (share:scale) replaced. A ValueError names what is wrong."""
    import dataclasses

    name, *changes = spec.split("+")
    if name not in profiles:
        raise ValueError(f"no profile {name!r}; use one of {', '.join(profiles)}")
    fields = {}
    for change in changes:
        key, _, value = change.partition("=")
        if key == "rank" and value.isdigit():
            fields["rank"] = int(value)
        elif key == "salient" and value.count(":") == 1:
            share, scale = (float(x) for x in value.split(":"))
            fields["salient"] = (share, scale)
        elif key == "salient_count" and value.isdigit():
            fields["salient_count"] = int(value)
        elif key == "outlier_salience" and value in ("inputs", "layer"):
            fields["outlier_salience"] = value
        elif key == "outliers" and value == "none":  # a diagnostic: no outlier dims at any shape
            fields["outliers"] = {}
        else:
            raise ValueError(f"{change!r} is not rank=N, salient=SHARE:SCALE, salient_count=N, "
                             "outlier_salience=inputs|layer or outliers=none")
    return dataclasses.replace(profiles[name], **fields)


def table(paths: list[str]) -> str:
    """The markdown table of several --json files: per shape and variant, each profile's dCE
    (interval) and mean KL / top-1, real OPT's ln ratio, and the first profile's ratios to it (dCE,
    and mean KL: on the model's own samples the expected dCE, with far less noise)."""
    runs = [json.load(open(p)) for p in paths]
    profiles = list(dict.fromkeys(r["profile"] for r in runs))
    by = {(r["shape"], r["profile"]): r for r in runs}
    shapes = list(dict.fromkeys(r["shape"] for r in runs))
    head = ["variant", "shape"] + [f"{p} dCE (95 %)" for p in profiles] + [f"{p} KL / top-1" for p in profiles] + \
        ["real OPT", f"{profiles[0]} dCE / real", f"{profiles[0]} KL / real"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    variants = list(next(iter(runs))["variants"])
    for v in variants:
        for s in shapes:
            row = [v, s]
            cells = [by.get((s, p)) for p in profiles]
            row += [f"{c['variants'][v]['dce']:.4f} ({c['variants'][v]['dce_low']:.4f}..{c['variants'][v]['dce_high']:.4f})"
                    if c else "" for c in cells]
            row += [f"{c['variants'][v]['mean_kl']:.4f} / {c['variants'][v]['top1']:.3f}" if c else "" for c in cells]
            real = (cells[0] or {}).get("real_opt", {}).get(v) if cells[0] else None
            row += [f"{real['ln_ratio']:.3f}" if real else "-",
                    f"{cells[0]['variants'][v]['dce'] / real['ln_ratio']:.2f}" if real and cells[0] else "-",
                    f"{cells[0]['variants'][v]['mean_kl'] / real['ln_ratio']:.2f}" if real and cells[0] else "-"]
            lines.append("| " + " | ".join(row) + " |")
    times = ", ".join(f"{r['shape']} {r['profile']} drawn {r['drawn_s']} s ({r['total_s']} s)" for r in runs)
    return "\n".join(lines) + f"\n\n{runs[0]['prompts']} prompts x {runs[0]['prefix']} tokens + {runs[0]['sampled']} " \
                              f"sampled, {runs[0]['dtype']}; {times}"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["table"]:
        print(table(sys.argv[2:]))
    else:
        main()
