"""The published routing figures of core/routing.py PUBLISHED, recomputed from the allenai/OLMoE
repository's routing counts (scripts/routing_output/{olmoe,mistral}/expert_counts*/<domain>.pkl:
per layer 0, 7, 15 a Counter of routed slots per expert, and of first-choice pairs between
layers 0 -> 7 and 7 -> 15, over 2048-token sequences of five domains).

Usage:  python -m bench.olmoe_routing PATH/TO/OLMoE/scripts/routing_output
The pickles hold numpy scalars and collections.Counter only; read them from a checkout you trust.
"""

import pickle
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia")
MODELS = {"olmoe": (64, 8), "mistral": (8, 2)}


def figures(root: Path, model: str) -> dict:
    experts, k = MODELS[model]
    skews, carry, cross, unions = [], [], [], defaultdict(list)
    for domain in DOMAINS:
        for counter in pickle.loads((root / model / "expert_counts" / f"{domain}.pkl").read_bytes()):
            v = np.array([counter.get(np.int64(e), 0) for e in range(experts)], float)
            skews.append(v.max() / v.mean())
            carry.append(int(np.searchsorted(np.cumsum(np.sort(v)[::-1]) / v.sum(), 0.8) + 1))
            p = np.minimum(1.0, k * v / v.sum())  # chance a token routes to e, tokens independent
            for n in (32, 128, 512):
                unions[n].append(float(np.sum(1 - (1 - p) ** n)))
        for pairs in pickle.loads((root / model / "expert_counts_crosslayer_top1" / f"{domain}.pkl").read_bytes()):
            cond, marg, total = defaultdict(lambda: defaultdict(int)), defaultdict(int), sum(pairs.values())
            for (a, b), n in pairs.items():
                cond[a][b] += n
                marg[b] += n
            acc = sum(max(v.values()) for v in cond.values()) / total
            cross.append(acc / (max(marg.values()) / total))
    return {"skew": (float(min(skews)), float(max(skews))), "carry80": (min(carry), max(carry)), "cross_layer_lift": (min(cross), max(cross)),
            "union_independent": {n: (min(u), max(u)) for n, u in unions.items()}}


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for model in MODELS:
        f = figures(root, model)
        print(model, {k: (tuple(round(x, 2) for x in v) if isinstance(v, tuple) else
                          {n: tuple(round(x, 1) for x in r) for n, r in v.items()}) for k, v in f.items()})
