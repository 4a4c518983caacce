"""The episode record has one home (core/record.py); the schema, the rows, the ledger and the
auditor agree with it."""

from __future__ import annotations

import dataclasses

from packbench.core.audit import EPISODE_FIELDS
from packbench.core.metrics import episode_totals
from packbench.core.record import AUDITED, EPISODE_FIELDS as RECORD_FIELDS, LEDGER_FIELDS, STORED_FIELDS, stored_values
from packbench.db.models import SqlEpisode
from packbench.db.records import EpisodeRow


def test_the_episodes_table_is_made_of_the_stored_fields():
    """db/models.py generates the columns from STORED_FIELDS: each one of its field's type."""
    columns = [c for c in SqlEpisode.__table__.columns if c.name not in ("id", "attempt_id")]
    assert [c.name for c in columns] == [f.column for f in STORED_FIELDS]
    for column, field in zip(columns, STORED_FIELDS):
        assert column.nullable == field.nullable, column.name
        python_type = str if field.stored_as == "json" else field.type
        assert column.type.python_type is python_type, column.name


def test_episode_rows_are_the_stored_fields():
    assert [f.name for f in dataclasses.fields(EpisodeRow)] == ["id", "attempt_id", *(f.name for f in STORED_FIELDS)]


def test_ledger_fields_are_what_the_ledger_recomputes():
    call = {"index": 0, "phase": "prefill", "tokens": 4, "layers": 2, "active_rows": [1, 2], "rows_copied": [1, 2],
            "h2d_weight_bytes": [10, 20], "h2d_index_bytes": [1, 2], "d2h_bytes": [3, 4], "rows_wasted": [0, 1],
            "copy_wait_s": [0.0, 0.5], "logits_d2h_bytes": 8, "wall_s": 0.25}
    totals = episode_totals([call, {**call, "index": 1, "phase": "decode", "tokens": 1}])

    def paths(tree: dict, prefix: tuple = ()) -> set:
        out = set()
        for key, value in tree.items():
            out |= paths(value, prefix + (key,)) if isinstance(value, dict) else {prefix + (key,)}
        return out

    assert {f.path for f in LEDGER_FIELDS} == paths(totals)


def test_the_auditor_compares_what_it_always_compared():
    """Pinned: what the auditor compares is part of what its digest covers."""
    assert EPISODE_FIELDS == AUDITED == {
        "condition": ("condition",), "role": ("role",), "prompt": ("prompt",), "status": ("status",),
        "tokens": ("tokens",), "n_tokens": ("tokens",), "wall_s": ("wall_s",), "call_s": ("call_s",),
        "h2d_weight_bytes": ("h2d_weight_bytes",), "h2d_index_bytes": ("h2d_index_bytes",),
        "d2h_bytes": ("d2h_bytes",),
        "prefill_h2d_bytes": ("phases", "prefill", "h2d_bytes"), "decode_h2d_bytes": ("phases", "decode", "h2d_bytes"),
        "prefill_call_s": ("phases", "prefill", "call_s"), "decode_call_s": ("phases", "decode", "call_s"),
        "peak_allocated_bytes": ("memory", "peak_allocated_bytes"),
        "peak_sampled_bytes": ("memory", "peak_sampled_bytes"),
        # n_tokens (the tokens' count) and energy_j (where the row holds one) compare equal for
        # every row stored from its record, so an agreeing audit's digest holds.
        "energy_j": ("energy_j",),
        # Issue 24: approximate episodes' fidelity (None on every exact one, so archives made
        # before compare as they always did and their audit digests hold).
        "fidelity_mean_kl": ("fidelity", "mean_kl"), "fidelity_p99_kl": ("fidelity", "p99_kl"),
        "fidelity_top1": ("fidelity", "top1"), "fidelity_max_abs_logit": ("fidelity", "max_abs_logit"),
        "fidelity_divergence_step": ("fidelity", "divergence_step"),
    }
    assert list(EPISODE_FIELDS) == [f.name for f in STORED_FIELDS if f.audited]  # same order: same problems


def test_names_are_unique_and_stored_values_fill_every_column():
    assert len({f.name for f in RECORD_FIELDS}) == len(RECORD_FIELDS)
    failed = {"plan_index": 0, "condition": "c", "role": "scored", "prompt": 0, "status": "failed",
              "phases": {"prefill": None}, "memory": None, "tokens": None}
    values = stored_values(failed)
    assert list(values) == [f.column for f in STORED_FIELDS]
    assert (values["tokens_json"], values["n_tokens"], values["prefill_h2d_bytes"], values["wall_s"]) == ("[]", 0, 0, 0.0)
    assert values["peak_allocated_bytes"] is None and values["error"] is None
