"""What real OPT measured: the figures a synthetic profile is calibrated to (docs/workloads.md).

Pure data, each figure with where it comes from. The seed's release notes (shared/seed/)
measured CPU-first OPT screens byte for byte; `row_ratio` removes the 8 index bytes a packet
row carries there, so a figure compares with `engine/stats.py`'s row counts. Keys name
`engine.stats.summarise` fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Anchor:
    """One real-OPT figure: the statistic (a `summarise` key path), its value, the shape and
    workload it was measured on (prefix tokens, calls per episode), and its source."""

    key: str
    label: str
    value: float
    shape: str
    prefix_tokens: int
    calls: int
    source: str


def row_ratio(byte_ratio: float, *, hidden: int, dtype_bytes: int, index_bytes: int = 8) -> float:
    """A packet/dense-stream byte ratio as a row ratio (packets carry an index per row)."""
    row = hidden * dtype_bytes
    return byte_ratio * row / (row + index_bytes)


ANCHORS: tuple[Anchor, ...] = (
    Anchor("workload.decode_packet_over_dense", "decode packet / dense-stream rows per call",
           row_ratio(0.033287, hidden=2560, dtype_bytes=2), "opt-2.7b", 512, 16,
           "seed v0.41: decode used 3.3287 % of dense-stream's outgoing bytes (OPT-2.7B fp16, 512-token prefixes)"),
    Anchor("workload.prefill_packet_over_dense", "512-token prefill packet / dense-stream rows",
           row_ratio(0.689268, hidden=2560, dtype_bytes=2), "opt-2.7b", 512, 16,
           "seed v0.41: prefill packets used 68.9268 % of dense-stream's outgoing bytes"),
    Anchor("workload.episode_packet_over_dense", "episode packets / dense-stream rows (32 + 16 tokens)",
           row_ratio(3_825_246_984 / 80_530_636_800, hidden=2560, dtype_bytes=2), "opt-2.7b", 32, 16,
           "seed v0.40: packets 3,825,246,984 B against dense 80,530,636,800 B (3 x 32-token prefixes, 16 calls)"),
    Anchor("workload.episode_packet_over_dense", "episode packets / dense-stream rows (16 + 8 tokens, held out)",
           row_ratio(1_635_580_200 / 25_769_803_776, hidden=2048, dtype_bytes=4), "opt-1.3b", 16, 8,
           "seed v0.33 and v0.35: packets 1,635,580,200 B against dense 25,769,803,776 B (OPT-1.3B fp32, 2 x "
           "16-token prefixes, 8 calls each); held out: no profile was tuned to it"),
    Anchor("workload.forecast_extra_over_demand_decode_only", "early-forecast extra rows over demand (decode to decode)",
           193_193 / (4_266_763_400 / 8_200), "opt-1.3b", 32, 16,
           "seed v0.38: 193,193 wasted rows over demand-only 4,266,763,400 B at 8,200 B a row (+37.13 %); "
           "its forecasts came from the previous decode call (the counts allow no prefill forecast)"),
    Anchor("workload.forecast_wasted_over_used_decode_only", "forecast rows wasted / used (decode to decode)",
           193_193 / 188_336, "opt-1.3b", 32, 16,
           "seed v0.38: forecasts wasted 193,193 rows and used 188,336"),
    Anchor("next_token.entropy_nats", "next-token entropy, nats", math.log(12.47), "opt-2.7b", 512, 16,
           "ln of OPT-2.7B's WikiText-2 perplexity, 12.47 (GPTQ, Frantar et al. 2022, Table 3): a calibrated "
           "model's mean entropy is close to its cross-entropy"),
    Anchor("next_token.entropy_nats", "next-token entropy, nats", math.log(14.62), "opt-1.3b", 32, 16,
           "ln of OPT-1.3B's WikiText-2 perplexity, 14.62 (GPTQ, Table 3)"),
    Anchor("hot.0.8", "share of neurons carrying 80 % of activations", 0.26, "opt-30b", 0, 0,
           "PowerInfer (Song et al. 2023): 26 % of an OPT-30B block's neurons give 80 % of its activations"),
)

TOLERANCE = 0.20  # a profile matches a figure when within 20 % of it (every row of the table)


def lookup(summary: dict, key: str) -> float:
    """summary["a"]["b"] for key "a.b" (split at the first dot: hot's keys are shares, "hot.0.8")."""
    head, _, rest = key.partition(".")
    return float(summary[head][rest])


HOT_MIN_TOKENS = 256  # the hot-neuron share needs many tokens per neuron (fewer concentrate it)


def compare(summary: dict, *, shape: str) -> list[dict]:
    """Each anchor of the summary's own workload against it: measured on `shape` with the same
    prefix and the same calls per episode (or shape-free: hot, given HOT_MIN_TOKENS prefix tokens);
    rows of label, real, measured, measured/real and whether it is within TOLERANCE. An episode's
    length moves its figures (an episode's packets over dense-stream, the forecast counts), so a
    summary of other episodes is compared with none of them."""
    rows = []
    calls = summary["decode_calls"] + 1  # the prefill, then the decode calls
    for a in ANCHORS:
        if a.key == "hot.0.8":
            if summary["prefix_tokens"] < HOT_MIN_TOKENS:
                continue
        elif a.shape != shape or a.prefix_tokens != summary["prefix_tokens"] or a.calls != calls:
            continue
        measured = lookup(summary, a.key)
        ratio = measured / a.value if a.value else math.nan
        rows.append({"key": a.key, "label": a.label, "real": a.value, "measured": measured, "ratio": ratio,
                     "within": abs(ratio - 1) <= TOLERANCE, "real_shape": a.shape, "source": a.source,
                     "workload": f"{a.prefix_tokens} + {a.calls}" if a.calls else "-"})
    return rows
