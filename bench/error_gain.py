"""How a rounding error travels through the depth of a synthetic checkpoint (docs/workloads.md,
"Beyond the targets: other bit widths"): the decoder Linears of one layer (or of every layer)
fake-quantized with a variant (engine/robustness.py VARIANTS), then, after each layer, the residual
stream's relative error ||h_q - h|| / ||h|| over every position of generated prompts, and the mean
KL(full || quantized) of the next-token distributions at the end.

A response that stays a small perturbation carries int3's error at a fixed multiple of int4's
(about 15 / 7, the ratio of their steps) from layer to layer; a threshold that switches on between
the two step sizes (what real OPT's 3-bit collapse needs) would show int3's error growing through
the depth where int4's does not.

    python -m bench.error_gain --shape opt-125m --profile opt4                  # layer 0 quantized
    python -m bench.error_gain --shape opt-125m --profile opt4 --quantize all   # every layer
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def relative_errors(model: torch.nn.Module, ids: torch.Tensor, linears: list[torch.nn.Linear],
                    quantize) -> tuple[list[float], float]:
    """Per hidden state after the embeddings (each layer's output; the last after the final
    LayerNorm), ||h_q - h|| / ||h|| with `linears` quantized, and the logits' mean KL."""
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True)
    originals = [m.weight.data.clone() for m in linears]
    try:
        with torch.no_grad():
            for m in linears:
                m.weight.data = quantize(m.weight.data)
        with torch.inference_mode():
            out = model(ids, output_hidden_states=True)
    finally:
        for m, w in zip(linears, originals):
            m.weight.data = w
    errors = [float((q - h).norm() / h.norm()) for h, q in zip(ref.hidden_states[1:], out.hidden_states[1:])]
    p, q = torch.log_softmax(ref.logits.float(), -1), torch.log_softmax(out.logits.float(), -1)
    return errors, float((p.exp() * (p - q)).sum(-1).mean())


def main(argv: list[str] | None = None) -> None:
    from packbench.core.plan import BOS
    from packbench.core.registry import PROFILES, SHAPES
    from packbench.engine.robustness import VARIANTS
    from packbench.engine.synth import profile_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=tuple(SHAPES))
    ap.add_argument("--profile", required=True, choices=tuple(PROFILES))
    ap.add_argument("--layers", type=int, default=None, help="a proxy: the shape's widths with this many layers")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", default="0", help="the layer whose Linears are quantized, or `all`")
    ap.add_argument("--variants", default="int4-channel,int3-channel,int4-g128,int3-g128")
    args = ap.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants {args.variants!r}: give some of {', '.join(VARIANTS)}")
    if args.layers is not None:  # a proxy: this process's shape table only (profile_tensors reads it)
        SHAPES[args.shape] = {**SHAPES[args.shape], "layers": args.layers}
    layers = SHAPES[args.shape]["layers"]
    if args.quantize != "all" and not (args.quantize.isdigit() and int(args.quantize) < layers):
        ap.error(f"--quantize {args.quantize!r}: a layer in 0..{layers - 1}, or all")
    model = profile_model(args.shape, seed=args.seed, profile=args.profile, dtype=torch.float32).eval()
    rng = np.random.Generator(np.random.PCG64(args.seed))
    vocab = SHAPES[args.shape]["vocab"]
    ids = torch.tensor([[BOS] + rng.integers(4, vocab, size=args.prefix - 1).tolist() for _ in range(args.prompts)])
    chosen = model.model.decoder.layers if args.quantize == "all" else [model.model.decoder.layers[int(args.quantize)]]
    linears = [m for layer in chosen for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    print(f"{args.shape} {args.profile}, layers {layers}, layer(s) {args.quantize} quantized; "
          f"relative residual-stream error after each layer (the last after the final LayerNorm), then mean KL")
    rows = {}
    for name in variants:
        rows[name], kl = relative_errors(model, ids, linears, VARIANTS[name].quantize)
        print(f"{name:13} " + " ".join(f"{e:.4f}" for e in rows[name]) + f"  KL {kl:.4f}", flush=True)
    for low, high in (("int4-channel", "int3-channel"), ("int4-g128", "int3-g128")):
        if low in rows and high in rows:
            print(f"{high} / {low}: " + " ".join(f"{b / a:.2f}" for a, b in zip(rows[low], rows[high])))


if __name__ == "__main__":
    main()
