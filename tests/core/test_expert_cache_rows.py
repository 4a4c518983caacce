"""core/report.py's `expert_cache_rows` (the "expert caches" table of `packbench results` and the
report) against hand counts on plain records, no archive.

Bug caught: "decode MB/token" divided the decode calls' host-to-device bytes by the number of
decode calls, so at batch B > 1 it showed MB per decode call, B times the per-token figure
(`packbench simulate` and the report's decode ms/token divide by the calls' tokens)."""

from types import SimpleNamespace

from packbench.core.report import Episode, expert_cache_rows

EXPERT_BYTES = 73_728  # mixtral-tiny, float32


def _record(*, batch: int, moved: list[int]) -> dict:
    """One scored expert-cache episode: a prefill call, then one decode call per entry of `moved`
    (experts moved host-to-device in it), each call feeding `batch` sequences."""
    calls = [{"phase": "prefill", "tokens": 9 * batch, "h2d_weight_bytes": [8 * EXPERT_BYTES], "h2d_index_bytes": [0]}]
    calls += [{"phase": "decode", "tokens": batch, "h2d_weight_bytes": [m * EXPERT_BYTES], "h2d_index_bytes": [0]}
              for m in moved]
    decode_h2d = sum(moved) * EXPERT_BYTES
    experts = {"capacity": 2, "rule": "lru", "forecast": "off", "routed": 20, "hits": 5, "belady_hits": 8,
               "prefetched": 0, "used": 0, "wasted": 0,
               "decode": {"routed": 12, "hits": 5, "belady_hits": 8, "used": 0}}
    return {"plan_index": 0, "condition": "lru2", "role": "scored", "status": "ok", "calls": calls,
            "phases": {"prefill": {"calls": 1, "h2d_bytes": 8 * EXPERT_BYTES},
                       "decode": {"calls": len(moved), "h2d_bytes": decode_h2d}},
            "experts": experts}


def _screen(records: list[dict]) -> SimpleNamespace:
    protocol = SimpleNamespace(conditions=[SimpleNamespace(name="lru2", tier="exact")])
    return SimpleNamespace(protocol=protocol, episodes=[Episode(r, 0, None) for r in records])


def test_decode_bytes_per_token_divides_by_tokens_not_calls():
    # Batch 3: 4 decode calls of 3 tokens each moved 2, 3, 1, 0 experts: 6 experts over 12 tokens.
    row, = expert_cache_rows(_screen([_record(batch=3, moved=[2, 3, 1, 0])]))
    assert row["decode_bytes_per_token"] == 6 * EXPERT_BYTES / 12


def test_decode_bytes_per_token_at_batch_1_is_per_call():
    row, = expert_cache_rows(_screen([_record(batch=1, moved=[2, 3, 1, 0]), _record(batch=1, moved=[1, 1, 1, 1])]))
    assert row["decode_bytes_per_token"] == 10 * EXPERT_BYTES / 8
