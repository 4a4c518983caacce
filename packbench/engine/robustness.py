"""Robustness of any local OPT checkpoint (`packbench model stats --robustness`): how far its
outputs move when every decoder Linear weight is fake-quantized.

The protocol of GPTQ's and AWQ's weight-only tables: every q/k/v/out_proj/fc1/fc2 weight of
the decoder is quantized and dequantized (round to nearest), the embeddings and the (tied)
lm_head are kept; the quantized model is teacher-forced on text and compared with the
full-precision model token by token. The text is the full-precision model's own continuation
of generated prompts, sampled at temperature 1 (`measure`), or a text file's tokens.

Figures per variant (`summarise`), pure functions over per-token values so tests check them by hand:
- dCE: cross-entropy of the text under the quantized model minus under the full-precision one,
  nats per token (its exp is the perplexity ratio, what real OPT's tables report), with a 95 %
  interval that treats sequences as the independent units (tokens of one sequence are not);
- mean and p99 of KL(full || quantized) per token; top-1 agreement of the two argmaxes.

REAL_OPT holds real OPT's published figures for the same variants, with their sources.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# ----------------------------------------------------------------------------- fake quantization

# bitsandbytes' NF4 code (Dettmers et al. 2023, QLoRA): quantiles of N(0, 1) scaled to [-1, 1].
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)


def absmax_symmetric(w: torch.Tensor, *, bits: int) -> torch.Tensor:
    """Per output row (channel): scale max|w| / (2^(bits-1) - 1), round to nearest, dequantize."""
    levels = 2 ** (bits - 1) - 1
    x = w.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / levels).clamp_min(1e-12)
    return ((x / scale).round().clamp(-levels, levels) * scale).to(w.dtype)


def minmax_asymmetric(w: torch.Tensor, *, bits: int, group: int | None = None) -> torch.Tensor:
    """GPTQ's RTN: per output row, or per `group` consecutive input columns of a row, scale
    (max - min) / (2^bits - 1) and an integer zero point (both range ends include 0), round to nearest."""
    levels = 2 ** bits - 1
    rows, cols = w.shape
    g = cols if group is None else min(group, cols)  # a row shorter than a group is one group
    if cols % g:
        raise ValueError(f"a group of {g} columns does not divide a row of {cols}")
    x = w.float().reshape(rows, cols // g, g)
    low = x.amin(dim=2, keepdim=True).clamp(max=0.0)
    high = x.amax(dim=2, keepdim=True).clamp(min=0.0)
    scale = ((high - low) / levels).clamp_min(1e-12)
    zero = (-low / scale).round()
    q = ((x / scale).round() + zero).clamp(0, levels)
    return ((q - zero) * scale).reshape(rows, cols).to(w.dtype)


def nf4_blocks(w: torch.Tensor, *, block: int = 64) -> torch.Tensor:
    """bitsandbytes' NF4: the flattened weight in blocks of `block`, each scaled by its absmax,
    every entry mapped to the nearest NF4_CODE value."""
    x = w.float().reshape(-1)
    if x.numel() % block:
        raise ValueError(f"a block of {block} does not divide {x.numel()} weights")
    x = x.reshape(-1, block)
    code = torch.tensor(NF4_CODE, device=w.device)
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], 1 << 12):  # a chunk of 4096 blocks: its temporaries stay in cache
        chunk = x[i:i + (1 << 12)]
        scale = chunk.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        out[i:i + (1 << 12)] = nearest_code(chunk / scale, code) * scale
    return out.reshape(w.shape).to(w.dtype)


def nearest_code(y: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The value of ascending `code` (within [-1, 1], entries at least 1e-6 apart) nearest each entry
    of `y` in [-1, 1], the lower one on a tie, code[0] for NaN: what
    `(y.unsqueeze(-1) - code).abs().argmin(-1)` picks, bit for bit (|y - c| only falls towards y and
    rises past it, so the nearest is one of the two codes around y), without its (..., len(code))
    distances."""
    flat = y.reshape(-1)
    above = torch.searchsorted(code, flat, out_int32=True).clamp_(max=len(code) - 1)  # first code >= y
    up = code.index_select(0, above)
    down = code.index_select(0, above.sub_(1).clamp_(min=0))
    nearest = torch.where((flat - up).abs() < (flat - down).abs(), up, down)
    return nearest.masked_fill_(flat.isnan(), code[0]).view(y.shape)


@dataclass(frozen=True)
class Variant:
    """One fake-quantization scheme: its name, what it means, and the function of a weight."""

    name: str
    label: str
    quantize: Callable[[torch.Tensor], torch.Tensor]


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("int8-channel", "int8 per-channel, symmetric absmax", lambda w: absmax_symmetric(w, bits=8)),
    Variant("int4-channel", "int4 per-channel RTN, asymmetric min-max", lambda w: minmax_asymmetric(w, bits=4)),
    Variant("int4-g128", "int4 group-128 RTN, asymmetric min-max", lambda w: minmax_asymmetric(w, bits=4, group=128)),
    Variant("nf4-b64", "nf4 block-64 (bitsandbytes' code)", lambda w: nf4_blocks(w, block=64)),
    # Beyond the calibrated targets (docs/workloads.md, "Beyond the targets: other bit widths"):
    # the same RTN at 3 bits, which real OPT's tables also report; no profile is fitted to them.
    Variant("int3-channel", "int3 per-channel RTN, asymmetric min-max", lambda w: minmax_asymmetric(w, bits=3)),
    Variant("int3-g128", "int3 group-128 RTN, asymmetric min-max", lambda w: minmax_asymmetric(w, bits=3, group=128)),
)}

# Real OPT: WikiText-2 perplexity, ln(quantized / fp16): what a synthetic checkpoint of the shape
# is calibrated against (docs/workloads.md). (variant, shape) -> (ln ratio, how it reads, source).
GPTQ = "GPTQ (Frantar et al. 2022, arXiv 2210.17323v2) Table 3, RTN 4-bit per-channel"
AWQ = ("AWQ (Lin et al. 2023) RTN w4 g128, as reproduced in AffineQuant's README figure "
       "(bytedance/AffineQuant, fig/weight-only-opt.png)")
GPTQ3 = "GPTQ (Frantar et al. 2022, arXiv 2210.17323v2) Table 3, RTN 3-bit per-channel"
AWQ3 = "AWQ (Lin et al. 2023, arXiv 2306.00978v6) Table 3, RTN INT3 group-128"
QUANTO = ("optimum-quanto's OPT perplexity chart (huggingface/optimum-quanto @76946f35, "
          "bench/generation/charts/facebook-opt-1.3b_Perplexity.png, removed from the tree later), int8 weights, "
          "float16 activations")
REAL_OPT: dict[tuple[str, str], tuple[float, str, str]] = {
    ("int8-channel", "opt-1.3b"): (0.002, "<= 0.002 (15.27 -> 15.24)", QUANTO),
    ("int4-channel", "opt-125m"): (math.log(37.28 / 27.65), "27.65 -> 37.28", GPTQ),
    ("int4-channel", "opt-1.3b"): (math.log(48.17 / 14.63), "14.63 -> 48.17", GPTQ),
    ("int4-channel", "opt-2.7b"): (math.log(16.92 / 12.47), "12.47 -> 16.92", GPTQ),
    ("int4-channel", "opt-6.7b"): (math.log(12.10 / 10.86), "10.86 -> 12.10", GPTQ),
    ("int4-channel", "opt-13b"): (math.log(11.32 / 10.13), "10.13 -> 11.32", GPTQ),
    # opt-125m: the same figure's 27.65 -> 30.47, held out (no profile's target: docs/workloads.md)
    ("int4-g128", "opt-125m"): (math.log(30.47 / 27.65), "27.65 -> 30.47 (held out)", AWQ),
    ("int4-g128", "opt-1.3b"): (0.044, "0.044", AWQ),
    ("int4-g128", "opt-2.7b"): (0.043, "0.043", AWQ),
    ("int4-g128", "opt-6.7b"): (0.026, "0.026", AWQ),
    ("int4-g128", "opt-13b"): (0.018, "0.018", AWQ),
    # Beyond the calibrated targets: 3-bit RTN, which no profile is fitted to (docs/workloads.md,
    # "Beyond the targets: other bit widths"). Real OPT collapses there, and not monotonically in size.
    ("int3-channel", "opt-125m"): (math.log(1.3e3 / 27.65), "27.65 -> 1.3e3", GPTQ3),
    ("int3-channel", "opt-1.3b"): (math.log(1.3e4 / 14.63), "14.63 -> 1.3e4", GPTQ3),
    ("int3-channel", "opt-2.7b"): (math.log(1.6e4 / 12.47), "12.47 -> 1.6e4", GPTQ3),
    ("int3-channel", "opt-6.7b"): (math.log(5.8e3 / 10.86), "10.86 -> 5.8e3", GPTQ3),
    ("int3-channel", "opt-13b"): (math.log(3.4e3 / 10.13), "10.13 -> 3.4e3", GPTQ3),
    ("int3-g128", "opt-1.3b"): (math.log(119.47 / 14.62), "14.62 -> 119.47", AWQ3),
    ("int3-g128", "opt-2.7b"): (math.log(298.00 / 12.47), "12.47 -> 298.00", AWQ3),
    ("int3-g128", "opt-6.7b"): (math.log(23.54 / 10.86), "10.86 -> 23.54", AWQ3),
    ("int3-g128", "opt-13b"): (math.log(46.04 / 10.13), "10.13 -> 46.04", AWQ3),
}


def real_opt(shape: str | None) -> dict[str, dict]:
    """Real OPT's figures for `shape` by variant: {variant: {ln_ratio, reads, source, held_out}}; held_out: a
    figure no profile was tuned to (its `reads` says so), printed beside a measurement as a check, not a target."""
    return {v: {"ln_ratio": r, "reads": reads, "source": src, "held_out": "(held out)" in reads}
            for (v, s), (r, reads, src) in REAL_OPT.items() if s == shape}


# ----------------------------------------------------------------------------- statistics


def token_figures(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Per token, from (T, vocab) logits of the full-precision and the quantized model and the
    (T,) next tokens: dce (CE quantized - CE full, nats), kl (KL(full || quantized)), agree (argmax equal)."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    out = torch.log_softmax(logits.float(), dim=-1)
    t = targets.view(-1, 1)
    dce = ref.gather(1, t) - out.gather(1, t)
    kl = (ref.exp() * (ref - out)).sum(-1).clamp_min(0.0)  # rounding can make a zero KL -1e-9
    agree = ref.argmax(-1) == out.argmax(-1)
    return {"dce": dce.view(-1).double().cpu().numpy(), "kl": kl.double().cpu().numpy(),
            "agree": agree.cpu().numpy()}


# Student's t, 0.975 quantile, by degrees of freedom (a 95 % two-sided interval over few sequences).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_interval(per_sequence: list[np.ndarray]) -> tuple[float, float, float]:
    """(mean per token, low, high): the pooled mean over every token, and a 95 % interval from
    the spread of the sequences' own means (weighted by their tokens; Student's t over
    sequences - 1 degrees of freedom), since tokens of one sequence are not independent.
    One sequence: no interval (nan, nan)."""
    n = np.array([len(x) for x in per_sequence], dtype=np.float64)
    sums = np.array([float(np.sum(x)) for x in per_sequence])
    mean = float(sums.sum() / n.sum())
    k = len(per_sequence)
    if k < 2:
        return mean, math.nan, math.nan
    # cluster-robust standard error of a ratio estimator: sum over sequences of (sum_s - n_s mean)^2
    se = math.sqrt(float(((sums - n * mean) ** 2).sum()) * k / (k - 1)) / float(n.sum())
    t = T975[k - 2] if k - 1 <= len(T975) else 1.96
    return mean, mean - t * se, mean + t * se


def summarise(per_sequence: list[dict[str, np.ndarray]]) -> dict:
    """One variant's figures from token_figures of each sequence."""
    if not per_sequence:
        raise ValueError("no sequences: give at least one prompt")
    mean, low, high = mean_interval([s["dce"] for s in per_sequence])
    kl = np.concatenate([s["kl"] for s in per_sequence])
    agree = np.concatenate([s["agree"] for s in per_sequence])
    return {"dce": mean, "dce_low": low, "dce_high": high, "mean_kl": float(kl.mean()),
            "p99_kl": float(np.percentile(kl, 99)), "top1": float(agree.mean()), "tokens": int(kl.size),
            "sequences": len(per_sequence)}


# ----------------------------------------------------------------------------- measurement


def decoder_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every Linear of the decoder layers (q, k, v, out_proj, fc1, fc2): not the embeddings, not lm_head."""
    return [m for layer in model.model.decoder.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def sample_continuations(model: torch.nn.Module, prompts: list[list[int]], *, tokens: int, seed: int,
                         device: str) -> list[list[int]]:
    """Each prompt followed by `tokens` tokens the model samples at temperature 1 (one seeded CPU
    generator, so a seed gives the same text on every device up to the logits' rounding)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, cache, seq = torch.tensor([prompt], device=device), DynamicCache(config=model.config), list(prompt)
            for _ in range(tokens):
                # The cache positionally: transformers 5.25 names it `cache`, 5.17 `past_key_values`, and a
                # misspelt keyword is swallowed by **kwargs (every token sampled without its context).
                logits = model(ids, None, cache, use_cache=True).logits[0, -1].float().cpu()
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                seq.append(nxt)
                ids = torch.tensor([[nxt]], device=device)
            out.append(seq)
    return out


def measure(model_dir: Path, sequences: list[list[int]], *, score_from: list[int], variants: tuple[str, ...] = tuple(VARIANTS),
            dtype: torch.dtype = torch.float32, device: str = "cpu", model: torch.nn.Module | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Teacher-force every sequence through the full-precision model and through each variant
    (every decoder Linear weight fake-quantized in place, then restored); score the tokens of
    sequence i from position score_from[i] on. {variant: summarise(...)}."""
    from packbench.engine.checkpoint import build_model

    if model is None:
        model = build_model(Path(model_dir), dtype=dtype).to(device)
    model.eval()
    linears = decoder_linears(model)

    def logits_of() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [model(input_ids=torch.tensor([seq], device=device)).logits[0, start - 1:-1]
                    for seq, start in zip(sequences, score_from)]

    targets = [torch.tensor(seq[start:], device=device) for seq, start in zip(sequences, score_from)]
    reference = logits_of()
    out = {}
    for name in variants:
        originals = [m.weight.data.clone() for m in linears]
        try:
            with torch.no_grad():
                for m in linears:
                    m.weight.data = VARIANTS[name].quantize(m.weight.data)
            quantized = logits_of()
        finally:
            for m, w in zip(linears, originals):
                m.weight.data = w
        out[name] = summarise([token_figures(r, q, t) for r, q, t in zip(reference, quantized, targets)])
        if progress is not None:
            progress(name)
    return out


def robustness(model_dir: Path, prompts: list[list[int]], *, sampled: int, seed: int, text: bool,
               variants: tuple[str, ...] = tuple(VARIANTS), dtype: torch.dtype = torch.float32, device: str = "cpu",
               progress: Callable[[str], None] | None = None) -> dict[str, dict]:
    """`measure` on the model's own text: each prompt followed by `sampled` tokens it samples at
    temperature 1 (scored: those tokens), or, `text` True, the prompts themselves (a text file's
    tokens; scored: every token after the first). Each variant's figures are its own, whichever
    others are measured beside it."""
    from packbench.engine.checkpoint import build_model

    model = build_model(Path(model_dir), dtype=dtype).to(device)
    if text:
        return measure(model_dir, prompts, score_from=[1] * len(prompts), variants=variants, dtype=dtype,
                       device=device, model=model, progress=progress)
    sequences = sample_continuations(model, prompts, tokens=sampled, seed=seed, device=device)
    return measure(model_dir, sequences, score_from=[len(p) for p in prompts], variants=variants, dtype=dtype,
                   device=device, model=model, progress=progress)
