"""Fidelity: how far an approximate condition's logits are from its reference's.

Pure functions over numpy arrays (no torch). An approximate condition (a low-bit resident
model, core.registry.POLICY_TIERS) is run twice per episode: free-running (its own greedy
tokens) and teacher-forced on the reference's tokens, so that position i of both runs sees the
same prefix. Per episode:

- `mean_kl`, `p99_kl`: KL(reference || condition) of each position's next-token distribution
  (softmax of the logits, natural log), averaged, and its 99th percentile (nearest rank:
  the ceil(0.99 n)-th smallest, no interpolation, so every machine gets the same figure);
- `top1`: the fraction of positions where both argmaxes agree (numpy's argmax: the first of
  tied maxima);
- `max_abs_logit`: the largest |reference logit - condition logit| over every position and token;
- `divergence_step`: the first call (0: the prefill's token) whose free-running token differs
  from the reference's, None when every token agrees.

Computed in float64 from float32 logits (what archives hold); row blocks keep a
(32, 50272) pair's temporaries small.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

FIGURES = ("mean_kl", "p99_kl", "top1", "max_abs_logit", "divergence_step")
P99 = 0.99


@dataclass(frozen=True)
class Fidelity:
    """One episode's fidelity figures (module docstring). `positions` = rows compared."""

    positions: int
    mean_kl: float
    p99_kl: float
    top1: float
    top1_agree: int  # positions whose argmaxes agree: top1 = top1_agree / positions, exactly
    max_abs_logit: float
    divergence_step: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (max-shifted: exact for any finite logits)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_per_position(reference: np.ndarray, condition: np.ndarray) -> np.ndarray:
    """KL(softmax(reference_i) || softmax(condition_i)) for each row i, in nats, float64 (n,).

    Tokens the reference gives probability 0 (underflow) contribute 0, as 0 log 0 = 0. Rounding
    can make a KL a hair below zero; it is clipped at 0.
    """
    ref, cond = _pair(reference, condition)
    out = np.empty(ref.shape[0], dtype=np.float64)
    step = max(1, (1 << 20) // max(ref.shape[1], 1))
    for lo in range(0, ref.shape[0], step):
        lp, lq = log_softmax(ref[lo:lo + step]), log_softmax(cond[lo:lo + step])
        p = np.exp(lp)
        terms = np.where(p > 0, p * (lp - lq), 0.0)
        out[lo:lo + step] = np.maximum(terms.sum(axis=1), 0.0)
    return out


def nearest_rank(values: np.ndarray, q: float) -> float:
    """The ceil(q n)-th smallest of `values` (n >= 1): a percentile with no interpolation."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    rank = max(1, math.ceil(q * len(ordered)))
    return float(ordered[rank - 1])


def divergence_step(reference_tokens: Sequence[int], tokens: Sequence[int]) -> int | None:
    """The first index where the two greedy trajectories differ, None if they never do.

    Trajectories of different lengths diverge where the shorter one ends."""
    for i, (a, b) in enumerate(zip(reference_tokens, tokens)):
        if int(a) != int(b):
            return i
    return None if len(reference_tokens) == len(tokens) else min(len(reference_tokens), len(tokens))


def batch_divergence_step(reference_tokens: Sequence, tokens: Sequence) -> int | None:
    """`divergence_step` of one episode; of a batch (one token list per sequence), the first step
    at which any sequence leaves its reference's. Batches that do not pair up diverge at 0."""
    nested = [bool(t) and all(isinstance(x, list) for x in t) for t in (reference_tokens, tokens)]
    if not any(nested):
        return divergence_step(reference_tokens, tokens)
    if not all(nested) or len(reference_tokens) != len(tokens):
        return 0
    steps = [divergence_step(a, b) for a, b in zip(reference_tokens, tokens)]
    found = [s for s in steps if s is not None]
    return min(found) if found else None


def fidelity(reference_logits: np.ndarray, forced_logits: np.ndarray, *, reference_tokens: Sequence,
             tokens: Sequence) -> Fidelity:
    """Every figure of one episode: `forced_logits` are the condition's, teacher-forced on
    `reference_tokens` (the reference's greedy tokens); `tokens` its own free-running ones. A
    batch's (sequences, calls, vocab) logits count every sequence's positions, and its tokens
    are one list per sequence (`batch_divergence_step`).

    Raises ValueError for arrays that cannot be compared (shapes differ, not 2-D float, empty,
    non-finite values): the gate turns that into a failed verdict.
    """
    ref, cond = _pair(reference_logits, forced_logits)
    kl = kl_per_position(ref, cond)
    agree = int((ref.argmax(axis=1) == cond.argmax(axis=1)).sum())
    worst = 0.0
    step = max(1, (1 << 20) // max(ref.shape[1], 1))
    for lo in range(0, ref.shape[0], step):
        diff = np.abs(ref[lo:lo + step].astype(np.float64) - cond[lo:lo + step].astype(np.float64))
        worst = max(worst, float(diff.max(initial=0.0)))
    n = ref.shape[0]
    return Fidelity(positions=n, mean_kl=float(kl.mean()), p99_kl=nearest_rank(kl, P99), top1=agree / n,
                    top1_agree=agree, max_abs_logit=worst,
                    divergence_step=batch_divergence_step(reference_tokens, tokens))


def _pair(reference: Any, condition: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(reference), np.asarray(condition)
    if a.ndim not in (2, 3) or a.shape != b.shape or a.dtype.kind != "f" or b.dtype.kind != "f":
        raise ValueError(f"logits {b.dtype}{b.shape} cannot be compared with the reference's {a.dtype}{a.shape}")
    if a.ndim == 3:  # a batch: every sequence's positions, one after another
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"logits {a.shape} hold no position")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("non-finite logits")
    return a, b


def forced_reference(episode: dict, by_index: dict[int, dict], *, reference: str) -> dict:
    """The reference episode whose tokens `episode` was teacher-forced on (`forced_from`, a plan
    index): it must be a finished episode of `reference` on the same prompt. ValueError otherwise."""
    i = episode.get("forced_from")
    if not isinstance(i, int) or isinstance(i, bool):
        raise ValueError("was not teacher-forced (no forced_from)")
    ref = by_index.get(i)
    if not isinstance(ref, dict) or ref.get("condition") != reference or ref.get("prompt") != episode.get("prompt"):
        raise ValueError(f"forced_from {i} is not a {reference} episode of prompt {episode.get('prompt')}")
    if ref.get("status") != "ok" or ref.get("logits") is None or not isinstance(ref.get("tokens"), list):
        raise ValueError(f"reference episode {i} did not finish or has no logits")
    return ref


def _token_ids(tokens: list) -> bool:
    """One list of integer token ids, or one such list per sequence (a batch)."""
    def ids(t: Any) -> bool:
        return isinstance(t, list) and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in t)
    return ids(tokens) or all(ids(t) for t in tokens)


def of_episode(episode: dict, by_index: dict[int, dict], *, reference: str) -> Fidelity:
    """Fidelity of one finished approximate episode (with `forced_logits`, `forced_from`,
    `tokens`) against the reference episode it was forced on. ValueError naming what is missing."""
    if episode.get("status") != "ok":
        raise ValueError("did not finish")
    ref = forced_reference(episode, by_index, reference=reference)
    if episode.get("forced_logits") is None or not isinstance(episode.get("tokens"), list):
        raise ValueError("has no teacher-forced logits or tokens")
    # A gate never raises on a record: tokens that are not ids (a hostile archive's [[1, 2], 3])
    # are refused here, as a ValueError the gate turns into a failed verdict.
    for whose, tokens in (("its", episode["tokens"]), (f"reference episode {episode['forced_from']}'s", ref["tokens"])):
        if not _token_ids(tokens):
            raise ValueError(f"{whose} tokens are not token ids (one list, or one list per sequence)")
    return fidelity(ref["logits"], episode["forced_logits"], reference_tokens=ref["tokens"], tokens=episode["tokens"])
