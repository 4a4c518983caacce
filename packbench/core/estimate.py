"""What a screen will move, estimated before anything runs: a pure function of the frozen
protocol, the model's shape and its activation sparsity (`packbench protocol plan`).

The model: every outgoing row is `hidden` values of the protocol's dtype; a token activates
an ordinary neuron with probability 1 - sparsity, and a hot neuron (engine/synth.py: fc1 bias
`hot_bias` x std x sqrt(hidden) over a unit-variance pre-activation) with probability
Phi(hot_bias); in a calibrated profile's checkpoint, neuron j of layer l with probability
Phi(mu_l + spread Z_j) (engine/synth.py profile_tensors). A call of T tokens needs the union of its tokens' active sets; the estimate
takes tokens as independent, 1 - (1 - a)^T, which is an UPPER estimate: real tokens share
active neurons (the report's union-sparsity plot shows how much), so measured prefill unions
come out smaller. Each condition kind declares its own byte rule (`h2d_bytes` of its module in
core/conditions/, over the call's `CallInputs`) and how it bounds the truth (`bound`); docs/engine.md
lists them. This module never asks which kind it estimates.

Time is the transfer floor at a stated host-to-device rate (default: the pinned rate measured
on the H200, shared/device/NOTES.md); compute, synchronisation and Python are not in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from packbench.core.conditions import CONDITIONS
from packbench.core.conditions.base import CallInputs
from packbench.core.plan import plan
from packbench.core.protocol import Protocol, expand
from packbench.core.registry import INT8_SCALE_BYTES, SHAPES, weights_of

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Pinned host-to-device copies of 64 MiB and more on the H200 (shared/device/NOTES.md).
DEFAULT_H2D_GBPS = 55.0


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    layers: int
    vocab: int = 50272
    max_positions: int = 2048

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"model shape {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, shape: str) -> ModelShape:
        d = SHAPES[shape]
        return cls(hidden=d["hidden"], ffn=d["ffn"], layers=d["layers"], vocab=d["vocab"],
                   max_positions=d["max_positions"])

    def param_count(self) -> int:
        """OPT's parameters (pre-LN, tied output embedding): embeddings, and per layer q/k/v/out
        projections, fc1, fc2 and two LayerNorms; the final LayerNorm."""
        h, f = self.hidden, self.ffn
        per_layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
        return self.vocab * h + (self.max_positions + 2) * h + self.layers * per_layer + 2 * h


# Gauss-Hermite-like grid for E over a standard normal offset (a profile's neuron rates).
_GRID = [(-6.0 + 12.0 * i / 120, math.exp(-0.5 * (-6.0 + 12.0 * i / 120) ** 2)) for i in range(121)]
_GRID_SUM = sum(w for _, w in _GRID)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class Activity:
    sparsity: float  # fraction of ordinary neurons exactly zero per token
    hot_fraction: float = 0.0
    hot_bias: float = 0.0
    # A calibrated profile instead (engine/synth.py profile_tensors): per layer, the mean of the
    # neurons' bias offsets (pre-activation stds), and their spread. Set by `of_profile`.
    layer_offsets: tuple[float, ...] = ()
    rate_spread: float = 0.0

    @classmethod
    def of_profile(cls, profile: str, shape: str) -> Activity:
        """The activity of a profile's checkpoint: neuron j of layer l fires with probability
        Phi(mu_l + spread Z_j) per token (engine/synth.py profile_tensors draws exactly that)."""
        from packbench.core.registry import PROFILES

        p = PROFILES[profile]
        densities = p.layer_densities(shape)
        offsets = tuple(NormalDist().inv_cdf(d) * math.sqrt(1.0 + p.rate_spread ** 2) for d in densities)
        return cls(sparsity=1.0 - sum(densities) / len(densities), layer_offsets=offsets, rate_spread=p.rate_spread)

    def union_fraction(self, tokens: int) -> float:
        """Expected fraction of a layer's neurons active in any of `tokens` independent tokens."""
        if self.layer_offsets:  # mean over layers and over the neurons' rates
            total = 0.0
            for mu in self.layer_offsets:
                total += sum(w * (1 - (1 - _phi(mu + self.rate_spread * z)) ** tokens) for z, w in _GRID) / _GRID_SUM
            return total / len(self.layer_offsets)
        a = 1.0 - self.sparsity
        p_hot = 0.5 * (1.0 + math.erf(self.hot_bias / math.sqrt(2.0)))  # Phi(hot_bias)
        h = self.hot_fraction
        return (1 - h) * (1 - (1 - a) ** tokens) + h * (1 - (1 - p_hot) ** tokens)

    def block_fraction(self, tokens: int, block_rows: int) -> float:
        """Expected fraction of `block_rows`-row blocks holding an active row (neurons independent)."""
        return 1 - (1 - self.union_fraction(tokens)) ** block_rows


def call_h2d_bytes(policy: str, params: dict, *, phase: str, tokens: int, shape: ModelShape, row_bytes: int,
                   activity: Activity, allowance_bytes: int = 0) -> float:
    """Expected H2D bytes of one call (all layers) under `policy`: its kind's `h2d_bytes`."""
    call = CallInputs(phase=phase, tokens=tokens, shape=shape, row_bytes=row_bytes, activity=activity,
                      allowance_bytes=allowance_bytes)
    return CONDITIONS[policy].h2d_bytes(params, call)


def estimate(protocol: Protocol | dict, *, shape: ModelShape, activity: Activity,
             h2d_gbps: float = DEFAULT_H2D_GBPS) -> dict:
    """Per condition, over the whole plan (warmups included): episodes, H2D bytes per prefill
    call, per decode call, per episode and in all, and the transfer floor in seconds at
    `h2d_gbps`; with the model's parameter and outgoing bytes against the allowance."""
    p = expand(protocol)
    if h2d_gbps <= 0:
        raise ValueError(f"the host-to-device rate must be > 0 GB/s, got {h2d_gbps}")
    row_bytes = shape.hidden * DTYPE_BYTES[p.dtype]
    entries = plan(p)
    decode_calls = p.continuation_tokens - 1
    rows = []
    for c in p.conditions:
        int8 = weights_of(c.policy, c.params) == "int8"  # hidden int8 values and a float32 scale a row
        kw = dict(shape=shape, row_bytes=shape.hidden + INT8_SCALE_BYTES if int8 else row_bytes, activity=activity,
                  allowance_bytes=p.allowance_bytes)
        # A batch's call needs the union of every sequence's tokens (docs/protocol.md, "Batched decode").
        prefill = call_h2d_bytes(c.policy, dict(c.params), phase="prefill", tokens=p.batch * p.prefix_tokens, **kw)
        decode = call_h2d_bytes(c.policy, dict(c.params), phase="decode", tokens=p.batch, **kw)
        episode = prefill + decode_calls * decode
        n = sum(e["condition"] == c.name for e in entries)
        total = n * episode
        rows.append({"condition": c.name, "policy": c.policy, "params": dict(c.params), "episodes": n,
                     "bound": CONDITIONS[c.policy].bound, "prefill_call_bytes": prefill,
                     "decode_call_bytes": decode, "episode_bytes": episode, "total_bytes": total,
                     "episode_transfer_s": episode / (h2d_gbps * 1e9), "total_transfer_s": total / (h2d_gbps * 1e9)})
    params_bytes = shape.param_count() * DTYPE_BYTES[p.dtype]
    outgoing = shape.layers * shape.ffn * row_bytes
    return {"conditions": rows, "episodes": len(entries), "calls_per_episode": 1 + decode_calls,
            "loader_device": loader_device(p, shape=shape),
            "h2d_gbps": h2d_gbps, "row_bytes": row_bytes,
            "prefill_active_fraction": activity.union_fraction(p.batch * p.prefix_tokens),
            "decode_active_fraction": activity.union_fraction(p.batch),
            "param_bytes": params_bytes, "outgoing_bytes": outgoing, "allowance_bytes": p.allowance_bytes,
            "total_bytes": sum(r["total_bytes"] for r in rows),
            "total_transfer_s": sum(r["total_transfer_s"] for r in rows)}


# The CUDA context and lazily loaded kernels beside a worker's allowance, as workers measured it:
# 748-760 MiB on H100s and the H200 (docs/experiments/competitors.md, the peers' configurations).
TYPICAL_CONTEXT_BYTES = 750 << 20
WORKING_FIXED_BYTES = 192 << 20  # a prefill's working set beside rows and activations (working_bytes)


def loader_device(protocol: Protocol | dict, *, shape: ModelShape) -> dict | None:
    """What packbench's own OPT loaders of `protocol` hold on the device beside activations (each
    kind's `holds`: every weight but the outgoing rows, or every weight), and the KV cache of batch
    x (prefix + continuation) tokens in the protocol's dtype; `left_bytes` is what the allowance
    leaves for the CUDA context and activations (negative: over it). The tightest condition counts;
    None where the protocol has no such condition (competitors size their own placement; a kind
    run without the cap holds none)."""
    p = expand(protocol)
    size = DTYPE_BYTES[p.dtype]
    params = shape.param_count() * size
    outgoing = shape.layers * shape.ffn * shape.hidden * size
    holding = {c.name: CONDITIONS[c.policy].holds(dict(c.params)) for c in p.conditions
               if CONDITIONS[c.policy].competitor is None and "opt" in CONDITIONS[c.policy].families}
    held = {name: params if what == "all" else params - outgoing for name, what in holding.items() if what}
    if not held:
        return None
    device = max(held.values())
    kv = 2 * shape.layers * shape.hidden * (p.prefix_tokens + p.continuation_tokens) * p.batch * size
    return {"conditions": [n for n, b in held.items() if b == device], "device_bytes": device, "kv_bytes": kv,
            "activation_bytes": working_bytes(shape, tokens=p.batch * p.prefix_tokens, size=size),
            "allowance_bytes": p.allowance_bytes, "left_bytes": p.allowance_bytes - device - kv}


def working_bytes(shape: ModelShape, *, tokens: int, size: int) -> int:
    """About what an OPT loader's prefill of `tokens` (batch x prefix) needs on the device beside
    the weights it holds there and the KV cache: two layers' outgoing rows (the rows in flight and the
    ones being consumed), three (hidden + ffn) activations a prefill token, and WORKING_FIXED_BYTES
    (cuBLAS's workspace, the allocator's rounding). Fitted to the working sets the GPU runs left
    (peak sampled less a 748 MiB context, the weights held and the KV cache;
    docs/experiments/competitors.md) and rounded up: OPT-13B's streaming loader at batch 8 and 32 used
    632 and 849 MiB (this gives 667 and 892), OPT-2.7B at batch 32 used 420 (this gives 442); at
    batch 64 OPT-2.7B's loaders ran out of memory with about 115 MiB left beside the context (this
    gives 592), and at batch 16 under 4800 MiB with 194 (this gives 367). A guide for the warning
    below, not a bound."""
    return (2 * shape.ffn * shape.hidden * size + 3 * tokens * (shape.hidden + shape.ffn) * size
            + WORKING_FIXED_BYTES)


def loader_device_warning(room: dict | None, *, batch: int) -> str | None:
    """One line when what packbench's loaders hold (loader_device) leaves less of the allowance than a
    CUDA context and the prefill's working set (working_bytes) take: the screen's episodes of those
    conditions will run out of memory (OPT-13B at batch 64 under 20480 MiB did, and OPT-2.7B at batch
    64 under 5700 MiB with 862 MiB left). Not a refusal: the context is measured on the worker, not
    here, and the working set is an estimate. None for an allowance no larger than a context: a CPU
    screen's (the quickstart's 64 MiB), where the allowance is recorded, not imposed, and which a GPU
    could not run whatever its loaders held."""
    if (room is None or room["allowance_bytes"] <= TYPICAL_CONTEXT_BYTES
            or room["left_bytes"] >= TYPICAL_CONTEXT_BYTES + room["activation_bytes"]):
        return None
    mib = 1 << 20
    names = ", ".join(room["conditions"])
    return (f"{names} hold{'s' if len(room['conditions']) == 1 else ''} {room['device_bytes'] / mib:,.0f} MiB on the "
            f"device (every weight but the outgoing rows) and the KV cache of batch {batch}, "
            f"{room['kv_bytes'] / mib:,.0f} MiB: {room['left_bytes'] / mib:,.0f} MiB of the "
            f"{room['allowance_bytes'] / mib:,.0f} MiB allowance is left for the CUDA context (about "
            f"{TYPICAL_CONTEXT_BYTES / mib:,.0f} MiB on an H100 or H200) and the prefill's activations (about "
            f"{room['activation_bytes'] / mib:,.0f} MiB), so expect them to run out of memory; raise allowance_mib "
            f"or lower the batch")


# What the writer archives besides the logits (measured on CPU screens of the tiny model,
# tests/core/test_archive_estimate.py): an episode's record is ~1.4 KB plus ~280 B per call and
# a few bytes per generated token; the manifest lists every member in ~100 B; protocol, plan,
# worker and verdicts take a few KB; a memory trace is an .npy of (samples, 2) float64.
NPY_HEADER_BYTES = 128
RECORD_BYTES, RECORD_CALL_BYTES, RECORD_TOKEN_BYTES = 1400, 280, 8
MANIFEST_MEMBER_BYTES = 100
FIXED_BYTES = 8 << 10
LOGIT_BYTES = 4  # float32: every call's last-position logits, upcast exactly (engine/episode.py)


def archive_bytes(protocol: Protocol | dict, *, vocab: int) -> dict:
    """The archive a screen of `protocol` will write, estimated from its plan: every planned
    episode (warmups included) stores its logits, (batch, calls, vocab) float32; an episode of an
    approximate condition also its teacher-forced logits of the same shape (an upper estimate:
    only those whose prompt the reference already ran have them); plus records, memory traces
    (their headers), the manifest and the fixed members. Uncompressed member bytes, what the
    reader's total bound (MAX_TOTAL_BYTES) counts and, logits being stored, about the file's size.
    Trace files of active sets (`trace: true`) are not counted. Returns {bytes, logits_bytes,
    episodes, forced_episodes, episode_logits_bytes}."""
    from packbench.core.registry import tier_of

    p = expand(protocol)
    entries = plan(p)
    calls, batch = p.continuation_tokens, p.batch
    tiers = {c.name: tier_of(c.policy) for c in p.conditions}
    forced = sum(tiers.get(e["condition"]) == "approximate" for e in entries)
    one = batch * calls * vocab * LOGIT_BYTES + NPY_HEADER_BYTES
    logits = (len(entries) + forced) * one
    records = len(entries) * (RECORD_BYTES + calls * RECORD_CALL_BYTES + batch * calls * RECORD_TOKEN_BYTES
                              + NPY_HEADER_BYTES)  # the memory trace's header
    members = 3 * len(entries) + forced + 5
    total = logits + records + members * MANIFEST_MEMBER_BYTES + FIXED_BYTES
    return {"bytes": total, "logits_bytes": logits, "episodes": len(entries), "forced_episodes": forced,
            "episode_logits_bytes": one}


def archive_warning(estimated: dict) -> str | None:
    """One line when the estimated archive is over the audit's bound (the smaller of the reader's
    file and total-member bounds, core/archive/reader.py): the estimate, the bound and the fixes;
    None within it. Not a refusal: a trusted archive is audited with `--max-mib`."""
    from packbench.core.archive import reader
    from packbench.core.archive.bounds import mib_to_admit

    bound = min(reader.MAX_ARCHIVE_BYTES, reader.MAX_TOTAL_BYTES)
    size = int(estimated["bytes"])
    if size <= bound:
        return None
    forced = estimated["forced_episodes"]
    episodes = f"{estimated['episodes']} episodes" + (f" + {forced} teacher-forced" if forced else "")
    return (f"this screen's archive will be about {size / (1 << 20):,.0f} MiB ({episodes} x "
            f"{estimated['episode_logits_bytes'] / (1 << 20):,.1f} MiB of float32 logits), over the audit bound of "
            f"{bound >> 20} MiB, so `packbench audit` will refuse it: plan fewer prompts, episodes or tokens, or "
            f"audit it with `packbench audit SCREEN --max-mib {mib_to_admit(size)}` (only an archive you trust)")
