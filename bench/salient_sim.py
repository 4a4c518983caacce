"""Which law of input-column scales makes per-channel RTN more fragile than group-128, weight by
weight (docs/workloads.md, "opt3"): a (rows, columns) Gaussian weight W, column scales c, the
reparameterised weight W diag(c) quantized (engine/robustness.py VARIANTS) and read by inputs x / c
(x iid unit): the output error's power over that of W quantized without scales,
sum((Q(W c) - W c)^2 / c^2) / sum((Q(W) - W)^2), per variant and row width. The ratio of the
int4 per-channel factor to the group-128 factor is what the profile needs (opt2's ratio is 1-2,
real OPT's 4-7); the int8 factor must stay small.

    python -m bench.salient_sim                     # every law below, 384 rows, seed 0
"""

from __future__ import annotations

import torch


def factors(cols: int, c: torch.Tensor, *, rows: int, gen: torch.Generator) -> dict[str, float]:
    from packbench.engine.robustness import VARIANTS

    w = torch.randn(rows, cols, generator=gen)
    out = {}
    for name, v in VARIANTS.items():
        plain = (v.quantize(w) - w).pow(2).sum()
        scaled = ((v.quantize(w * c) - w * c) / c).pow(2).sum()
        out[name] = float(scaled / plain)
    return out


def laws(gen: torch.Generator) -> dict[str, callable]:
    def sparse(share: float, scale: float):
        def draw(n: int) -> torch.Tensor:
            c = torch.ones(n)
            c[torch.randperm(n, generator=gen)[:max(1, round(share * n))]] = scale
            return c
        return draw

    return {
        **{f"lognormal sigma {s}": (lambda n, s=s: torch.exp(s * torch.randn(n, generator=gen))) for s in (0.3, 0.5, 1.0)},
        **{f"pareto alpha {a}": (lambda n, a=a: torch.rand(n, generator=gen).pow(-1 / a)) for a in (3, 4)},
        **{f"{share:.1%} x{scale:g}": sparse(share, scale) for share, scale in ((0.005, 8), (0.01, 4), (0.01, 8))},
    }


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    widths = (768, 2560, 5120, 10240, 20480)
    print(f"{'law':20} " + " ".join(f"{w:>28}" for w in widths))
    print(f"{'':20} " + " ".join(f"{'int8 / pc / g128 / ratio':>28}" for _ in widths))
    for name, draw in laws(gen).items():
        cells = []
        for cols in widths:
            f = factors(cols, draw(cols), rows=384, gen=gen)
            cells.append(f"{f['int8-channel']:7.1f} {f['int4-channel']:6.1f} {f['int4-g128']:5.1f} "
                         f"{f['int4-channel'] / f['int4-g128']:5.1f}")
        print(f"{name:20} " + " ".join(f"{c:>28}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
