"""The episode record: its one home. Every field a worker reports for an episode, its type,
where it sits in the record, whether the database stores it (and in which column), whether it
is a total that the per-call ledger recomputes, and whether the auditor compares it.

The worker builds the record (`engine/worker.Worker.run`: the fields below plus `logits`),
the gates read it (`core/gates.py`), the archive keeps it whole (`episodes/NNNNN.json`), the
database keeps the `STORED_FIELDS` (`db/models.SqlEpisode`'s columns and
`db/records.EpisodeRow` are generated from them), the auditor compares the
`AUDITED` ones between archive and database, and `core.metrics.episode_totals` recomputes
the `ledger` ones from the call ledger (a test holds the two lists equal).

Pure Python (no numpy, no SQLAlchemy): `db/`, `core/` and `cli/` all import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packbench.core.canonical import canonical_json


@dataclass(frozen=True)
class Field:
    """One field of an episode record.

    name: the field's name (`EpisodeRow` attribute for a stored field).
    type: int, float, str or list (token ids).
    path: where the worker's record holds it, e.g. ("phases", "prefill", "h2d_bytes").
    column: the `episodes` column; None when only the archive keeps it.
    stored_as: "value" (as is), "json" (canonical JSON text) or "length" (the ids in the list at path:
        its length, or for a batch's list of lists the sum of theirs, `token_count`).
    required: every record has it, a failed episode's included (`record[key]`, else KeyError).
    nullable: None is stored as None; otherwise a missing or None value is stored as the
        type's zero (0, 0.0, []): a failed episode reports no measurements.
    ledger: a total recomputable from the per-call ledger (`core.metrics.episode_totals`).
    audited: compared by the auditor between the database row and the archive record.
    """

    name: str
    type: type
    path: tuple[str, ...]
    column: str | None = None
    stored_as: str = "value"
    required: bool = False
    nullable: bool = False
    ledger: bool = False
    audited: bool = False

    @property
    def default(self) -> Any:
        """What is stored when the record lacks the value (or holds None)."""
        return None if self.nullable else self.type()


def _stored(name: str, type_: type, *path: str, **options: Any) -> Field:
    """A field the database stores in a column of its own name; audited unless told."""
    return Field(name, type_, path or (name,), column=options.pop("column", name),
                 audited=options.pop("audited", True), **options)


def _kept(name: str, type_: type, *path: str, **options: Any) -> Field:
    """A field only the archive keeps (the database has no column for it)."""
    return Field(name, type_, path or (name,), **options)


# In `EpisodeRow` order. Stored fields first.
EPISODE_FIELDS: tuple[Field, ...] = (
    _stored("plan_index", int, required=True, audited=False),  # the key the auditor matches on
    _stored("condition", str, required=True),
    _stored("role", str, required=True),  # warmup | scored
    _stored("prompt", int, required=True),
    _stored("status", str, required=True),  # ok | failed
    _stored("error", str, nullable=True, audited=False),  # free text; the archive adds a traceback
    # Batch 1: the generated ids, one per call; a batch: one such list per sequence.
    _stored("tokens", list, column="tokens_json", stored_as="json"),
    _stored("n_tokens", int, "tokens", stored_as="length"),  # tokens generated, every sequence's
    _stored("wall_s", float),
    _stored("call_s", float, ledger=True),
    _stored("h2d_weight_bytes", int, ledger=True),
    _stored("h2d_index_bytes", int, ledger=True),
    _stored("d2h_bytes", int, ledger=True),  # activity readbacks
    # A phase's h2d_bytes already counts weights + indices (the worker adds them).
    _stored("prefill_h2d_bytes", int, "phases", "prefill", "h2d_bytes", ledger=True),
    _stored("decode_h2d_bytes", int, "phases", "decode", "h2d_bytes", ledger=True),
    _stored("prefill_call_s", float, "phases", "prefill", "call_s", ledger=True),
    _stored("decode_call_s", float, "phases", "decode", "call_s", ledger=True),
    _stored("peak_allocated_bytes", int, "memory", "peak_allocated_bytes", nullable=True),
    _stored("peak_sampled_bytes", int, "memory", "peak_sampled_bytes", nullable=True),
    # Audited where the row holds a value: rows stored before revision 0006 hold NULL whatever
    # their archived record says (core/audit.py NULL_BEFORE_COLUMN).
    _stored("energy_j", float, nullable=True),
    # An approximate condition's fidelity against its reference (core/fidelity.py): computed by
    # the driver from the logits, recomputed by the auditor. None on exact episodes; a
    # divergence_step of None on an approximate one means its tokens never diverged.
    _stored("fidelity_mean_kl", float, "fidelity", "mean_kl", nullable=True),
    _stored("fidelity_p99_kl", float, "fidelity", "p99_kl", nullable=True),
    _stored("fidelity_top1", float, "fidelity", "top1", nullable=True),
    _stored("fidelity_max_abs_logit", float, "fidelity", "max_abs_logit", nullable=True),
    _stored("fidelity_divergence_step", int, "fidelity", "divergence_step", nullable=True),
    # Archive only.
    _kept("prompts", list),  # a batch's prompts, in batch order (core/plan.py batch_prompts); batch 1 has none
    _kept("policy", str),
    _kept("params", dict),
    _kept("tier", str),  # exact | approximate (core.registry.tier_of)
    _kept("fidelity", dict),  # core.fidelity.Fidelity.as_dict(), approximate episodes only
    _kept("forced_from", int),  # the reference episode an approximate one was teacher-forced on
    _kept("forced_s", float),  # the teacher-forced pass's seconds (not part of wall_s)
    _kept("quantization", dict),  # engine/quantized.py QuantizationStats: what building the model cost
    _kept("offload", dict),  # engine/accelerate.py OffloadStats, zero_inference.py ZeroStats, flexgen.py FlexGenStats: placement and its cost
    _kept("first_logit_since_entry_s", float),
    # An expert cache or forecast (MoE; engine/moe/cache.py): capacity, rule, forecast, the
    # per-call, per-layer routing and what the policy counted, and the totals a replay of that
    # routing gives (core/expert_cache.py episode_figures): hits, misses, prefetched, used,
    # wasted, hit_rate beside belady_rate for the same capacity; the auditor replays them.
    _kept("experts", dict),
    # Separate passes (protocol `passes`, schema 7): {timing_wall_s (= wall_s), recording_wall_s,
    # recording_call_s: one per call}; every time above is the timing pass's, every count and
    # memory figure the recording pass's (engine/passes.py runs them, core/passes.py checks them).
    # Absent when the passes run together.
    _kept("passes", dict),
    _kept("logits_d2h_bytes", int, ledger=True),  # recording readbacks
    _kept("rows_copied", int, ledger=True),
    _kept("rows_wasted", int, ledger=True),  # from newer engines, when the ledger carries it
    _kept("copy_wait_s", float, ledger=True),  # likewise
    _kept("prefill_calls", int, "phases", "prefill", "calls", ledger=True),
    _kept("decode_calls", int, "phases", "decode", "calls", ledger=True),
    _kept("peak_reserved_bytes", int, "memory", "peak_reserved_bytes"),
    _kept("kv_bytes", int, "memory", "kv_bytes"),
    _kept("policy_device_bytes", int, "memory", "policy_device_bytes"),
    _kept("host_outgoing_bytes", int, "memory", "host_outgoing_bytes"),
    _kept("pinned_bytes", int, "memory", "pinned_bytes"),
    _kept("device_param_bytes", int, "memory", "device_param_bytes"),
    _kept("host_rss_peak_bytes", int, "memory", "host_rss_peak_bytes"),
    _kept("context_bytes", int, "memory", "context_bytes"),
    _kept("sampler", dict),  # samples, period_s, sampler_overhead_s, scope, other_processes ([pid, bytes] or None)
    _kept("host_workers", list),  # [pid, device] of other packbench workers alive on the host (engine/gpu_lock.py)
    _kept("host_load", dict),  # other processes' CPU seconds, cores, load average during it (engine/host_load.py)
    _kept("calls", list),  # the per-call ledger (core.metrics)
    _kept("traceback", str),  # failed episodes
    # The worker's time for the plan entry: the policy's activation, the episode and its
    # measurements (a failed one: until the failure); wall_s is the episode alone.
    _kept("episode_s", float),
    # What the worker ran just before this episode ({condition, plan_index, load: the worker's
    # load count, so another screen's shows}; None for its first): interference shows by it
    # (core/serving.py by_previous). Absent from older archives.
    _kept("previous", dict),
)
STORED_FIELDS: tuple[Field, ...] = tuple(f for f in EPISODE_FIELDS if f.column is not None)
LEDGER_FIELDS: tuple[Field, ...] = tuple(f for f in EPISODE_FIELDS if f.ledger)
# Database column -> path in the archive's record, for the auditor's comparison.
AUDITED: dict[str, tuple[str, ...]] = {f.name: f.path for f in STORED_FIELDS if f.audited}
FIELDS_BY_NAME: dict[str, Field] = {f.name: f for f in EPISODE_FIELDS}
# `packbench results --sort` columns, the per-episode measurements a user ranks by: stored
# fields, h2d_bytes (weights + indices) and started_at (the attempt's). `db/queries.py` orders
# by them, `cli/query.py` lists them in `--help` without importing SQLAlchemy.
SORT_NAMES = ("energy_j", "wall_s", "call_s", "h2d_bytes", "d2h_bytes", "peak_allocated_bytes", "peak_sampled_bytes",
              "n_tokens", "started_at")


def token_count(tokens: Any) -> int:
    """Token ids a record's `tokens` holds: one list (batch 1) or one list per sequence (a batch)."""
    return sum(len(t) if isinstance(t, list) else 1 for t in tokens or ())


def value_at(record: Any, path: tuple[str, ...]) -> Any:
    """The value at `path`, or None where a level is missing or not a mapping."""
    for key in path:
        if not isinstance(record, Mapping):
            return None
        record = record.get(key)
    return record


def stored_values(record: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's record as `episodes` column values (without attempt_id).

    Required fields must be present (KeyError otherwise); any other may be missing (a
    failed episode): counters become 0, nullable values None, tokens [].
    """
    out: dict[str, Any] = {}
    for f in STORED_FIELDS:
        value = record[f.path[0]] if f.required else value_at(record, f.path)
        if f.stored_as == "length":
            value = token_count(value)
        elif value is None:
            value = f.default
        if f.stored_as == "json":
            value = canonical_json(list(value)).decode("utf-8")
        out[f.column] = value  # type: ignore[index]
    return out
