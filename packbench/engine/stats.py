"""Activation statistics of any local OPT checkpoint (`packbench model stats`): what decides
what every loader policy's bytes, caches and forecasts can do on it.

`measure` runs stock transformers (eager, on the CPU or a GPU) over prompts: a prefill call of
the prompt, then greedy decode calls, as an episode does, and keeps which FFN neurons are
active (post-ReLU exactly non-zero) per token and layer. `summarise` turns those masks into
the figures below; it is pure numpy, so tests check it against counts made by hand:

- density: each layer's active fraction per token, in prefill and in decode tokens;
- union: the active fraction of the union of a prompt's first k tokens, k = 1..prefix (what a
  prefill packet moves, over dense-stream's bytes);
- overlap: of a decode token's active neurons, the share active again in the next token (what
  a forecast from the previous call can use), and the Jaccard index of the two sets;
- hot: the smallest share of a layer's neurons that carries 50 / 80 / 95 % of its activations
  (counts), averaged over layers;
- entropy and top-1 probability of every next-token distribution;
- workload: the byte ratios of the seed's screens, in active rows (packbench's ledger adds
  INDEX_BYTES per row): decode packet / dense-stream per call, prefill packet / dense-stream, a
  whole episode's packets / dense-stream, and early-forecast's extra rows over demand-only
  packets, both as packbench forecasts (from every previous call, the prefill included) and as
  the seed's v0.38 counted them (decode calls from the previous decode call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HOT_SHARES = (0.5, 0.8, 0.95)


@dataclass
class PromptActivity:
    """One prompt's activity: `prefill` (layers, prefix, ffn) and `decode` (layers, calls - 1, ffn)
    bool masks of exactly non-zero post-ReLU activations; `entropy` and `top1` (nats,
    probability) of every next-token distribution the calls produced (prefill positions, then
    each decode call's)."""

    prefill: np.ndarray
    decode: np.ndarray
    entropy: np.ndarray
    top1: np.ndarray


def measure(model_dir: Path, prompts: list[list[int]], *, continuation: int, dtype: torch.dtype = torch.float32,
            device: str = "cpu", progress: Callable[[int, int], None] | None = None) -> list[PromptActivity]:
    """One PromptActivity per prompt: the prompt as one prefill call, then `continuation - 1` greedy decode
    calls (an episode of `continuation` calls), on stock transformers' OPT."""
    from transformers import DynamicCache

    from packbench.engine.checkpoint import build_model

    model = build_model(Path(model_dir), dtype=dtype).to(device)
    masks: list[torch.Tensor] = []
    hooks = [layer.fc2.register_forward_hook(lambda mod, args, out: masks.append(_active(args[0])))
             for layer in model.model.decoder.layers]
    traces = []
    try:
        with torch.inference_mode():
            for n, prompt in enumerate(prompts):
                calls, entropy, top1 = [], [], []
                ids, cache = torch.tensor([prompt], device=device), DynamicCache(config=model.config)
                for _ in range(continuation):
                    masks.clear()
                    out = model(ids, None, cache, use_cache=True)  # positional: 5.17 calls it past_key_values
                    logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # (T, vocab)
                    entropy.append(-(logp.exp() * logp).sum(-1).cpu())
                    top1.append(logp.max(-1).values.exp().cpu())
                    calls.append(torch.stack(masks).cpu().numpy())  # (layers, T, ffn)
                    ids = out.logits[0, -1].argmax().view(1, 1)
                traces.append(PromptActivity(prefill=calls[0], decode=np.concatenate(calls[1:], axis=1) if calls[1:]
                                    else np.zeros(calls[0].shape[:1] + (0,) + calls[0].shape[2:], dtype=bool),
                                    entropy=torch.cat(entropy).numpy(), top1=torch.cat(top1).numpy()))
                if progress is not None:
                    progress(n + 1, len(prompts))
    finally:
        for hook in hooks:
            hook.remove()
    return traces


def _active(h: torch.Tensor) -> torch.Tensor:
    """fc2's input (B, T, ffn), or (B*T, ffn) as transformers' OPT layer reshapes it -> (T, ffn) bool."""
    return (h.reshape(-1, h.shape[-1]) != 0).cpu()


def union_curve(prefill: np.ndarray) -> np.ndarray:
    """(prefix,) active fraction of the union of tokens 0..k-1, k = 1..prefix, over layers and neurons."""
    layers, tokens, ffn = prefill.shape
    first = np.where(prefill.any(axis=1), prefill.argmax(axis=1), tokens)  # (layers, ffn) first active token
    counts = np.bincount(first.ravel(), minlength=tokens + 1)[:tokens]
    return np.cumsum(counts) / (layers * ffn)


def hot_shares(counts: np.ndarray, shares: tuple[float, ...] = HOT_SHARES) -> dict[str, float]:
    """The smallest fraction of neurons whose activation counts sum to each share of the total."""
    c = np.sort(counts.ravel())[::-1].astype(np.float64)
    total = c.sum()
    if total == 0:
        return {f"{s:g}": float("nan") for s in shares}
    cum = np.cumsum(c) / total
    return {f"{s:g}": float((np.searchsorted(cum, s - 1e-12) + 1) / c.size) for s in shares}


def summarise(traces: list[PromptActivity]) -> dict:
    """The figures of the module docstring, from one PromptActivity per prompt (all prompts of one length)."""
    if not traces:
        raise ValueError("no traces: give at least one prompt")
    prefill = np.stack([t.prefill for t in traces])  # (P, layers, T, ffn)
    decode = np.stack([t.decode for t in traces])  # (P, layers, D, ffn)
    prompts, layers, tokens, ffn = prefill.shape
    calls = decode.shape[2]
    union = np.mean([union_curve(t.prefill) for t in traces], axis=0)  # (T,)
    prefill_union = prefill.any(axis=2)  # (P, layers, ffn): the prefill call's packet
    counts = prefill.sum(axis=(0, 2)) + decode.sum(axis=(0, 2))  # (layers, ffn) activations per neuron
    hot = [hot_shares(layer) for layer in counts]  # per layer, as PowerInfer counts a block

    def overlap(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
        """(share of a's active set active in b, Jaccard) pooled; a, b: (..., ffn) bool."""
        both, was, either = (a & b).sum(), a.sum(), (a | b).sum()
        return (float(both / was) if was else float("nan"), float(both / either) if either else float("nan"))

    decode_used, decode_jaccard = overlap(decode[:, :, :-1], decode[:, :, 1:]) if calls > 1 else (math.nan, math.nan)
    prefill_used, prefill_jaccard = overlap(prefill[:, :, :-1], prefill[:, :, 1:]) if tokens > 1 else (math.nan, math.nan)
    demand_decode = decode.sum()  # rows: every decode call moves its active rows
    demand = prefill_union.sum() + demand_decode
    # early-forecast: a decode call's forecast is its layer's active rows in the previous call;
    # rows forecast but not active are wasted. packbench forecasts the first decode call from the
    # prefill's packet; the seed's v0.38 counted decode-to-decode forecasts only.
    waste_later = (decode[:, :, :-1] & ~decode[:, :, 1:]).sum() if calls > 1 else 0
    used_later = (decode[:, :, :-1] & decode[:, :, 1:]).sum() if calls > 1 else 0
    waste_first = (prefill_union & ~decode[:, :, 0]).sum() if calls else 0
    entropy = np.concatenate([t.entropy for t in traces])
    top1 = np.concatenate([t.top1 for t in traces])
    return {
        "prompts": prompts, "prefix_tokens": tokens, "decode_calls": calls, "layers": layers, "ffn": ffn,
        "density": {
            "prefill": float(prefill.mean()), "decode": float(decode.mean()) if calls else math.nan,
            "by_layer_prefill": prefill.mean(axis=(0, 2, 3)).tolist(),
            "by_layer_decode": decode.mean(axis=(0, 2, 3)).tolist() if calls else [math.nan] * layers,
        },
        "union": {"curve": union.tolist(), **{f"{k}": float(union[k - 1]) for k in _ks(tokens)}},
        "overlap": {"decode_next": decode_used, "decode_jaccard": decode_jaccard,
                    "prefill_next": prefill_used, "prefill_jaccard": prefill_jaccard},
        "hot": {share: float(np.mean([h[share] for h in hot])) for share in hot[0]},
        "next_token": {"entropy_nats": float(entropy.mean()), "top1_prob": float(top1.mean()),
                       "entropy_p10": float(np.percentile(entropy, 10)), "entropy_p90": float(np.percentile(entropy, 90))},
        "workload": {
            "decode_packet_over_dense": float(decode.mean()) if calls else math.nan,
            "prefill_packet_over_dense": float(prefill_union.mean()),
            "episode_packet_over_dense": float(demand / (prompts * layers * ffn * (1 + calls))),
            "forecast_extra_over_demand": float((waste_first + waste_later) / demand),
            "forecast_extra_over_demand_decode_only": float(waste_later / demand),
            "forecast_wasted_over_used_decode_only": float(waste_later / used_later) if used_later else math.nan,
        },
    }


def _ks(tokens: int) -> list[int]:
    """The union curve's points a table shows: 1, 2, 4, ..., and the prefix itself."""
    ks = [1 << i for i in range(tokens.bit_length()) if 1 << i <= tokens]
    return ks if ks[-1] == tokens else ks + [tokens]
