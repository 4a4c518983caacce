"""Plant known bugs, one at a time, in a scratch copy of the checkout and check that the tests
named for each fail (docs/mutation.md). The checkout itself is never edited.

    python tests/plant.py            # every planted bug
    python tests/plant.py dispersion # those whose name holds a word

Each bug is (name, file, the text replaced, its replacement, the tests that must fail). A bug
whose text is no longer in its file is reported as stale: the table must follow the code. The
named tests run twice in the copy, first without the bug (they must pass: a test that fails
anyway, say for a file the copy lacks, would call every bug caught), then with it.
Not a test file (pytest collects test_*.py only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUGS: list[tuple[str, str, str, str, list[str]]] = [
    ("acquisition: float product", "packbench/core/gates.py",
     "passed = _exact_le(Fraction(num, den), max_ratio)", "passed = num <= max_ratio * den",
     ["tests/core/test_exact_bounds.py::test_acquisition_57_of_100_passes_a_057_gate"]),
    ("acquisition: float quotient", "packbench/core/gates.py",
     "passed = _exact_le(Fraction(num, den), max_ratio)", "passed = num / den <= max_ratio",
     ["tests/core/test_exact_bounds.py::test_acquisition_a_hair_over_the_ratio_fails_though_floats_round_it_onto_the_ratio"]),
    ("useful latency: float comparison", "packbench/core/gates.py",
     "first_ok = _exact_le(first_s, max_first_episode_s)", "first_ok = first_s <= max_first_episode_s",
     ["tests/core/test_exact_bounds.py::test_useful_latency_compares_seconds_with_the_written_decimal_exactly"]),
    ("runtime: float comparison", "packbench/core/gates.py",
     "passed = _exact_le(hi, max_ratio)", "passed = hi <= max_ratio",
     ["tests/core/test_exact_bounds.py::test_runtime_upper_bound_against_the_written_decimal_exactly"]),
    ("fidelity: float top-1", "packbench/core/gates.py",
     "return Fraction(fid.top1_agree, fid.positions) >= Fraction(str(threshold))",
     "return fid.top1 >= threshold",
     ["tests/core/test_exact_bounds.py::test_fidelity_top1_57_of_100_meets_057_and_5_of_6_misses_its_float"]),
    ("fidelity: float KL and logit bounds", "packbench/core/gates.py",
     "return _exact_le(getattr(fid, FIDELITY_FIGURES[bound][0]), threshold)",
     "return getattr(fid, FIDELITY_FIGURES[bound][0]) <= threshold",
     ["tests/core/test_exact_bounds.py::test_fidelity_logit_bound_is_the_written_decimal",
      "tests/core/test_exact_bounds.py::test_fidelity_kl_bounds_are_the_written_decimal"]),
    ("archive: worker.json's hash not checked", "packbench/core/archive/verify.py",
     'if digest.hexdigest() != entry["sha256"]:',
     'if digest.hexdigest() != entry["sha256"] and name != "worker.json":',
     ["tests/core/test_archive_members.py::test_a_same_size_crc_valid_rewrite_of_each_member_kind_is_altered"]),
    ("archive: an unreadable member (bad CRC) passes verify", "packbench/core/archive/verify.py",
     'return Problem(name, "unreadable", f"unreadable member {shown}: {e.cause}")',
     'return None',
     ["tests/core/test_archive_hostile.py::test_random_damage_never_crashes_the_reader",
      "tests/core/test_archive_members.py::test_random_damage_to_the_real_archive_is_always_a_problem"]),
    ("audit: compares passed only", "packbench/core/audit.py",
     'keys = VERDICT_KEYS + tuple(f for f in ("episodes", "detail") if f in b[k] and f in a[k])',
     'keys = ("passed",)',
     ["tests/core/test_audit_fields.py::test_every_verdict_field_changed_in_the_database_disagrees"]),
    ("dispersion: floor(q n) rank", "packbench/core/dispersion.py",
     "math.ceil(q * len(xs)) - 1", "math.floor(q * len(xs))",
     ["tests/core/test_dispersion.py::test_spread_at_ten_is_the_first_and_ninth_order_statistics"]),
    ("protocol: prompts x prefix_tokens bound removed", "packbench/core/protocol/schema.py",
     'if prompts_n > MAX_PROMPTS or prompts_n * full["prefix_tokens"] > MAX_PROMPT_TOKENS:',
     'if prompts_n > MAX_PROMPTS:',
     ["tests/core/test_protocol_bounds.py::test_prompts_x_prefix_tokens_is_bounded"]),
    ("protocol: the hash ignores allowance_mib", "packbench/core/protocol/freeze.py",
     "sha256=sha256_hex(canonical_json(body))",
     'sha256=sha256_hex(canonical_json({k: v for k, v in body.items() if k != "allowance_mib"}))',
     ["tests/core/test_protocol_bounds.py::test_every_field_of_meaning_changes_the_hash",
      "tests/core/test_protocol_bounds.py::test_the_hash_is_the_sha256_of_the_whole_frozen_body"]),
    ("dense-stream: fc2 does not wait for its copy", "packbench/engine/policies/dense.py",
     "torch.cuda.current_stream(self.device).wait_event(done)", "pass",
     ["tests/engine/test_dense_stream_order.py::test_fc2_waits_for_its_own_layers_copy_event"]),
    ("dense-stream: a copy overwrites a workspace fc2 may still read", "packbench/engine/policies/dense.py",
     "b.copy.wait_stream(torch.cuda.current_stream(self.device))", "pass",
     ["tests/engine/test_dense_stream_order.py::test_fc2_waits_for_its_own_layers_copy_event"]),
    # Beyond the list: caches, the charges shared by engine and simulator, serving figures,
    # the report's tiers, the frontier, attempt numbering.
    ("expert cache: LRU keeps the higher id of a tie", "packbench/core/expert_cache.py",
     "return (self.last[e], -e)", "return (self.last[e], e)",
     ["tests/core/test_expert_cache.py::test_tie_breaks"]),
    ("expert cache: LFU without recency", "packbench/core/expert_cache.py",
     "return (self.count[e], self.last[e], -e)", "return (self.count[e], -e)",
     ["tests/core/test_expert_cache.py::test_tie_breaks"]),
    ("expert cache: one expert over capacity kept", "packbench/core/expert_cache.py",
     "key=self._key, reverse=True)[:self.capacity])", "key=self._key, reverse=True)[:self.capacity + 1])",
     ["tests/core/test_expert_cache.py::test_cycle_one_longer_than_the_cache"]),
    ("Belady: experts never routed again kept first", "packbench/core/expert_cache.py",
     "    never = len(sets)\n", "    never = 0\n",
     ["tests/core/test_expert_cache.py::test_lfu_keeps_the_popular_expert_and_does_not_admit_a_rarer_one"]),
    ("forecast: prefetches what the cache holds", "packbench/core/expert_cache.py",
     "prefetched = tuple(e for e in _routed_set(forecast) if e not in held)",
     "prefetched = tuple(e for e in _routed_set(forecast))",
     ["tests/core/test_expert_cache.py::test_forecast_accounting_by_hand"]),
    ("charges: indices priced as int32", "packbench/core/charges.py",
     "INDEX_BYTES = 8 ", "INDEX_BYTES = 4 ",
     ["tests/core/test_trace.py::test_the_estimate_prices_an_index_as_the_ledger_does"]),
    ("charges: row-retention's hit sends one index, not a slot and a row", "packbench/core/charges.py",
     "return dict(index_bytes=2 * hits * INDEX_BYTES)", "return dict(index_bytes=hits * INDEX_BYTES)",
     ["tests/core/test_trace.py::test_row_retention_by_hand"]),
    ("charges: a layer's last extent block counted whole", "packbench/core/charges.py",
     "return int(np.minimum(block_rows, units - blocks * block_rows).sum())", "return int(blocks.size * block_rows)",
     ["tests/core/test_trace.py::test_sparse_extents_by_hand"]),
    ("charges: a forecast's waste counts the active set, not its hits", "packbench/core/charges.py",
     "return active[~hit], int(predicted.size - hit.sum())", "return active[~hit], int(predicted.size - hit.size)",
     ["tests/core/test_trace.py::test_early_forecast_host_and_device_by_hand"]),
    ("row cache: fills evict the most recently used slots", "packbench/core/charges.py",
     'fill_slots = np.argsort(last_used, kind="stable")[: fill_rows.size]',
     'fill_slots = np.argsort(-last_used, kind="stable")[: fill_rows.size]',
     ["tests/engine/test_lru.py::test_least_recently_used_is_evicted"]),
    ("row cache: the first misses fill it, not the last", "packbench/core/charges.py",
     "fill_rows = miss_rows[-slots:] if miss_rows.size > slots else miss_rows",
     "fill_rows = miss_rows[:slots] if miss_rows.size > slots else miss_rows",
     ["tests/engine/test_lru.py::test_more_misses_than_slots_keep_the_last_ones"]),
    ("serving: the steady call includes the first decode call", "packbench/core/serving.py",
     "steady = median(decode[1:]) if len(decode) > 1 else None", "steady = median(decode) if len(decode) > 1 else None",
     ["tests/core/test_serving.py::test_serving_figures_of_one_episode_match_their_formulas_by_hand"]),
    ("serving: TPOT over one call too many", "packbench/core/serving.py",
     '"tpot_s": after_first / len(decode) if decode else None',
     '"tpot_s": after_first / (len(decode) + 1) if decode else None',
     ["tests/core/test_serving.py::test_serving_figures_of_one_episode_match_their_formulas_by_hand"]),
    ("serving: ITL percentiles one rank up", "packbench/core/serving.py",
     "return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]",
     "return xs[min(len(xs) - 1, max(0, math.floor(q / 100 * len(xs))))]",
     ["tests/core/test_serving.py::test_serving_figures_of_one_episode_match_their_formulas_by_hand"]),
    ("report: exact and approximate ranked together", "packbench/core/report.py",
     'ranked = sorted((r for r in rows if r["tier"] == tier and r["steady_call_s"]), key=lambda r: r["steady_call_s"])',
     'ranked = sorted((r for r in rows if r["steady_call_s"]), key=lambda r: r["steady_call_s"])',
     ["tests/cli/test_report_serving.py::test_an_approximate_condition_is_ranked_in_its_own_tier"]),
    ("frontier: an approximate condition charged the CPU-first model's parameters", "packbench/core/report.py",
     'keys = ("policy_device_bytes", "kv_bytes") if row["tier"] == "approximate" else (',
     'keys = ("device_param_bytes", "policy_device_bytes", "kv_bytes") if row["tier"] == "approximate" else (',
     ["tests/engine/test_quantized.py::test_a_screen_archives_fidelity_and_the_audit_recomputes_it"]),
    ("queue: every attempt numbered 1", "packbench/db/queue.py",
     "number=(last or 0) + 1", "number=1",
     ["tests/db/test_db_queue.py::test_start_attempt_numbers_per_screen_and_starts_the_screen_once"]),
    # Beyond the first two lists (2026-12-05): simulate's ledger and prediction, fidelity, the
    # re-execution audit, provenance, the MoE policies' bytes, traces, result queries and
    # comparisons, the faithfulness verdict, the archive writer, the ledger totals, host load.
    ("simulate: copy time leaves out index bytes", "packbench/core/simulate.py",
     'copy_ms = (d["h2d_weight_bytes"] + d["h2d_index_bytes"]) / d["tokens"] / (rate * 1e9) * 1e3',
     'copy_ms = d["h2d_weight_bytes"] / d["tokens"] / (rate * 1e9) * 1e3',
     ["tests/cli/test_simulate_cli.py::test_a_machine_file_predicts_compute_plus_copy"]),
    ("simulate: compute scaled by layers upside down", "packbench/core/simulate.py",
     'scaled = float(v["value"]) * model.layers / int(layers)',
     'scaled = float(v["value"]) * int(layers) / model.layers',
     ["tests/core/test_trace.py::test_predicted_time_is_compute_plus_bytes_at_the_copy_rate"]),
    ("simulate: dense-stream's overlapped copies added to compute", "packbench/core/simulate.py",
     'total = max(compute, copy_ms) if out["overlap"] == "overlapped" else compute + copy_ms',
     "total = compute + copy_ms",
     ["tests/cli/test_simulate_cli.py::test_a_machine_file_predicts_compute_plus_copy"]),
    ("simulate: a policy's state carried across episodes", "packbench/core/simulate.py",
     "    for episode in trace.episodes():\n        step = make(m, params)  # fresh per episode, as the engine's policy is\n",
     "    step = make(m, params)\n    for episode in trace.episodes():\n",
     ["tests/core/test_trace.py::test_every_episode_starts_with_a_fresh_policy", "tests/engine/test_simulate_engine.py::test_every_opt_policy_simulated_equals_the_engine"]),
    ("simulate: hit rate over units copied", "packbench/core/simulate.py",
     "out[phase][key] = out[phase][num] / routed if",
     'out[phase][key] = out[phase][num] / (out[phase]["rows_copied"] or 1) if',
     ["tests/core/test_trace.py::test_expert_caches_by_hand"]),
    ("simulate: device early-forecast forecasts prefill", "packbench/core/simulate.py",
     'predicted = prev[layer] if phase == "decode" else np.zeros(0, dtype=np.int64)',
     "predicted = prev[layer]",
     ["tests/core/test_trace.py::test_a_prefill_after_decode_calls_is_never_forecast"]),
    ("fidelity: p99 rank floor", "packbench/core/fidelity.py",
     "rank = max(1, math.ceil(q * len(ordered)))",
     "rank = max(1, math.floor(q * len(ordered)))",
     ["tests/core/test_fidelity_edges.py::test_nearest_rank_at_its_edges", "tests/core/test_fidelity.py::test_episode_figures_by_hand"]),
    ("fidelity: KL direction swapped", "packbench/core/fidelity.py",
     "lp, lq = log_softmax(ref[lo:lo + step]), log_softmax(cond[lo:lo + step])",
     "lp, lq = log_softmax(cond[lo:lo + step]), log_softmax(ref[lo:lo + step])",
     ["tests/core/test_fidelity.py::test_kl_is_not_symmetric_and_zero_probability_terms_vanish"]),
    ("fidelity: a shorter trajectory never diverges", "packbench/core/fidelity.py",
     "return None if len(reference_tokens) == len(tokens) else min(len(reference_tokens), len(tokens))",
     "return None",
     ["tests/core/test_fidelity.py::test_divergence_step"]),
    ("fidelity: a batch diverges at its last sequence's step", "packbench/core/fidelity.py",
     "return min(found) if found else None",
     "return max(found) if found else None",
     ["tests/core/test_fidelity_edges.py::test_batch_divergence_is_the_first_sequence_to_leave_its_reference"]),
    ("provenance: checkpoint digest without file names", "packbench/core/provenance.py",
     'h.update(f"{f.relative_to(root).as_posix()}\\0{size}\\0{fh.hexdigest()}\\n".encode())',
     'h.update(f"{size}\\0{fh.hexdigest()}\\n".encode())',
     ["tests/core/test_evidence.py::test_the_checkpoint_digest_is_its_documented_formula_and_pins_each_files_name"]),
    ("reexecute: only a slower re-run is out of tolerance", "packbench/core/reexecute.py",
     "(a > 0 and 1 / factor <= r / a <= factor)",
     "(a > 0 and r / a <= factor)",
     ["tests/core/test_reexecute.py::test_a_re_run_faster_than_the_factor_is_out_of_tolerance_too"]),
    ("reexecute: K drawn on top of one per condition", "packbench/core/reexecute.py",
     "extra = max(0, k - len(chosen))",
     "extra = k",
     ["tests/core/test_reexecute.py::test_the_draw_is_seeded_and_covers_every_condition"]),
    ("reexecute: KV bytes not compared", "packbench/core/reexecute.py",
     'EXACT_MEMORY = ("kv_bytes", "policy_device_bytes",',
     'EXACT_MEMORY = ("policy_device_bytes",',
     ["tests/core/test_reexecute.py::test_every_exact_field_is_compared"]),
    ("reexecute: per-call ledger keys skipped as times", "packbench/core/reexecute.py",
     'if key.endswith("_s"):  # times',
     'if key.endswith("s"):  # times',
     ["tests/core/test_reexecute.py::test_every_exact_field_is_compared"]),
    ("expert cache engine: slots not charged", "packbench/engine/moe/cache.py",
     "return (sum(w.nbytes for w in self.workspaces)\n                + sum(s.nbytes for s in self.slots if s is not None))",
     "return sum(w.nbytes for w in self.workspaces)",
     ["tests/engine/test_moe_cache.py::test_device_bytes_charge_slots_and_workspaces"]),
    ("expert cache engine: one workspace while forecasting", "packbench/engine/moe/cache.py",
     "for _ in range(2 if self.forecast else 1)]",
     "for _ in range(1)]",
     ["tests/engine/test_moe_cache.py::test_caches_and_forecasts_are_dense_stream_bit_for_bit_with_exact_ledgers"]),
    ("expert cache engine: a used prefetch fetched again", "packbench/engine/moe/cache.py",
     "                at.setdefault(e, (ws.gate_up[e], ws.down[e]))\n                continue\n",
     "                at.setdefault(e, (ws.gate_up[e], ws.down[e]))\n",
     ["tests/engine/test_moe_cache.py::test_caches_and_forecasts_are_dense_stream_bit_for_bit_with_exact_ledgers"]),
    ("moe packet device gather charged an index", "packbench/engine/moe/policies.py",
     "charges.unit_packet(len(ids), host.expert_bytes, index=0)",
     "charges.unit_packet(len(ids), host.expert_bytes)",
     ["tests/engine/test_moe.py::test_every_policy_is_dense_stream_bit_for_bit_with_exact_ledgers"]),
    ("moe mapped one-token call charged one expert's bytes", "packbench/engine/moe/policies.py",
     "self.recorder.add(layer, active=k, rows=k, weight_bytes=k * self.host.expert_bytes)",
     "self.recorder.add(layer, active=k, rows=k, weight_bytes=self.host.expert_bytes)",
     ["tests/engine/test_moe_mapped.py::test_mapped_gathers_are_dense_stream_bit_for_bit_with_their_bytes"]),
    ("moe packet host gather: staging not charged", "packbench/engine/moe/policies.py",
     "return self.workspace.nbytes + (0 if self.packet is None else self.packet.nbytes)",
     "return self.workspace.nbytes",
     ["tests/engine/test_moe.py::test_device_bytes_charge_each_policys_workspace_and_packet"]),
    ("device early-forecast: missed rows not counted as copied", "packbench/engine/policies/device_gather.py",
     "rows=forecast[layer] + missed[layer]",
     "rows=forecast[layer]",
     ["tests/engine/test_simulate_engine.py::test_every_opt_policy_simulated_equals_the_engine"]),
    ("trace: forecast after a dense layer allowed", "packbench/core/trace.py",
     "layer > 0 and layer not in skip and layer - 1 not in skip",
     "layer > 0 and layer not in skip",
     ["tests/core/test_trace.py::test_no_forecast_is_made_for_or_after_a_layer_without_experts"]),
    ("trace: unit id equal to units accepted", "packbench/core/trace.py",
     "if ids.size and ids.max() >= model.units:",
     "if ids.size and ids.max() > model.units:",
     ["tests/core/test_trace.py::test_hostile_files_are_refused_with_one_line"]),
    ("results: --until includes its instant", "packbench/db/queries.py",
     "criteria.append(SqlAttempt.started_at < f.until)",
     "criteria.append(SqlAttempt.started_at <= f.until)",
     ["tests/db/test_db_queries.py::test_results_filters_pick_screens"]),
    ("results: a bare --since date moved a day", "packbench/db/queries.py",
     "if end and _is_bare_date(text.strip()):",
     "if _is_bare_date(text.strip()):",
     ["tests/db/test_db_queries.py::test_parse_when"]),
    ("results: --passed keeps a condition with a failed verdict", "packbench/db/queries.py",
     "criteria += [_same_condition_verdicts(), ~_same_condition_verdicts(~SqlVerdict.passed)]",
     "criteria += [_same_condition_verdicts()]",
     ["tests/db/test_db_queries.py::test_results_passed_or_failed_without_a_gate"]),
    ("results: episodes without a value sorted first", "packbench/db/queries.py",
     "order.insert(0, (key.desc() if f.descending else key.asc()).nulls_last())",
     "order.insert(0, key.desc() if f.descending else key.asc())",
     ["tests/cli/test_query.py::test_results_show_filter_and_sort_by_energy"]),
    ("audit cli: repeated audits with different digests exit 0", "packbench/cli/audit_cmd.py",
     "if differ or not all(o.agrees for o in judged):",
     "if not all(o.agrees for o in judged):",
     ["tests/cli/test_audit_cli.py::test_repeated_audits_that_agree_with_different_digests_exit_1"]),
    ("faithfulness: warmups not judged", "packbench/core/gates.py",
     "        mine = _of(episodes, condition)\n",
     '        mine = [e for e in _of(episodes, condition) if e.get("role") == "scored"]\n',
     ["tests/core/test_gates.py::test_faithfulness_passes_on_identical_logits_and_covers_warmups"]),
    ("faithfulness: the last scored reference episode kept", "packbench/core/gates.py",
     'refs.setdefault(e.get("prompt"), e)',
     'refs[e.get("prompt")] = e',
     ["tests/core/test_gates.py::test_faithfulness_compares_against_the_first_scored_reference_of_the_prompt"]),
    ("archive writer: sha256 leaves out the end record", "packbench/core/archive/writer.py",
     "        digest.update(self._tail)\n",
     "",
     ["tests/core/test_archive.py::test_seal_hash_manifest_and_compression"]),
    ("ledger totals: a phase's H2D bytes leave out the index", "packbench/core/metrics.py",
     'phase["h2d_bytes"] += w + i',
     'phase["h2d_bytes"] += w',
     ["tests/core/test_metrics.py::test_totals_extend_the_v01_totals_without_changing_them"]),
    ("ledger totals: a stored total compared by value, not type", "packbench/core/metrics.py",
     "return type(a) is type(b) and a == b",
     "return a == b",
     ["tests/core/test_metrics.py::test_stored_totals_are_compared_exactly_and_only_when_stored"]),
    ("ledger: a call of 0 tokens well formed", "packbench/core/metrics.py",
     "if not _is_int(call.get(key)) or call[key] < 1:",
     "if not _is_int(call.get(key)) or call[key] < 0:",
     ["tests/core/test_metrics.py::test_ledger_problems_name_the_call_and_field"]),
    ("compare: energy per token over every episode's tokens", "packbench/db/compare.py",
     '"energy_tokens": cast(func.sum(case((_HAS_ENERGY, SqlEpisode.n_tokens))), BigInteger)',
     '"energy_tokens": cast(func.sum(SqlEpisode.n_tokens), BigInteger)',
     ["tests/cli/test_query.py::test_compare_shows_energy_and_takes_every_format"]),
    ("compare: the best top-1 shown, not the worst", "packbench/db/compare.py",
     '"fidelity_top1_min": func.min(',
     '"fidelity_top1_min": func.max(',
     ["tests/cli/test_query.py::test_compare_labels_tiers_and_compares_fidelity"]),
    ("host busy: exactly half a core not flagged", "packbench/core/dispersion.py",
     "        if cores >= threshold:\n",
     "        if cores > threshold:\n",
     ["tests/core/test_dispersion.py::test_other_cores_at_the_judged_bound_and_from_wall_s"]),
    ("results --limit: the note printed when exactly the limit matched", "packbench/cli/query.py",
     "if limit is not None and len(rows) > limit:",
     "if limit is not None and len(rows) >= limit:",
     ["tests/cli/test_query.py::test_results_limit_says_more_matched"]),
    ("reexecute: a failure compared by its whole message", "packbench/core/reexecute.py",
     'return str(error or "").split(":", 1)[0]',
     'return str(error or "")',
     ["tests/core/test_reexecute.py::test_failed_episodes_must_fail_the_same_way"]),
    ("signature: a non-canonical envelope accepted", "packbench/core/provenance.py",
     "          and canonical_json(env) == raw)",
     "          )",
     ["tests/core/test_evidence.py::test_an_envelope_not_in_canonical_json_is_malformed"]),
    ("reexecute: a failed reference episode run twice", "packbench/core/reexecute.py",
     'reference = next((i for i in chosen if by_index[i]["condition"] == protocol.reference\n                      and statuses[i] == "ok"), None)',
     'reference = next((i for i in chosen if by_index[i]["condition"] == protocol.reference), None)',
     ["tests/core/test_reexecute.py::test_a_reference_with_no_finished_episode_is_not_run_twice"]),
    ("host load: iowait counted as busy", "packbench/engine/host_load.py",
     "busy = sum(ticks) - ticks[3] - ticks[4]",
     "busy = sum(ticks) - ticks[3]",
     ["tests/engine/test_host_load.py::test_busy_seconds_are_the_busy_fields_without_idle_or_iowait"]),
    ("host load: the worker's own CPU counted as others'", "packbench/engine/host_load.py",
     "other = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))",
     "other = max(0.0, after[0] - before[0])",
     ["tests/engine/test_host_load.py::test_other_cpu_seconds_leave_out_this_processs_own"]),
    ("host-experts: a tie for the hot set goes to the higher id", "packbench/engine/moe/host_experts.py",
     "key=lambda e: (-int(counts[e]), e))",
     "key=lambda e: (-int(counts[e]), -e))",
     ["tests/engine/test_moe_peers.py::test_a_hot_sets_tie_goes_to_the_lower_id_and_a_split_call_charges_every_tensor_sent"]),
    ("host-experts: the routed ids sent down not charged", "packbench/engine/moe/host_experts.py",
     "d2h_bytes=_nbytes(ids, *sent), index_bytes=_nbytes(out))",
     "d2h_bytes=_nbytes(*sent), index_bytes=_nbytes(out))",
     ["tests/engine/test_moe_peers.py::test_a_hot_sets_tie_goes_to_the_lower_id_and_a_split_call_charges_every_tensor_sent"]),
    ("plan: a prompt id equal to the vocabulary accepted", "packbench/core/plan.py",
     "bad = [t for t in p if t >= vocab]",
     "bad = [t for t in p if t > vocab]",
     ["tests/core/test_plan.py::test_prompt_ids_must_lie_inside_the_vocabulary"]),
    ("compare machines: unknown checkpoint digests match", "packbench/service/compare.py",
     "return len(digests) <= 1 and None not in digests",
     "return len(digests) <= 1",
     ["tests/service/test_compare_agreement.py::test_an_unknown_checkpoint_digest_is_not_the_same_weights"]),
    ("compare machines: a verdict one machine did not judge agrees", "packbench/service/compare.py",
     "agree=len(judged) == 1 and None not in cells)",
     "agree=len(judged) == 1)",
     ["tests/service/test_compare_agreement.py::test_a_verdict_one_machine_did_not_judge_is_a_disagreement"]),
    ("compare machines: the first done attempt, not the latest", "packbench/service/compare.py",
     "        a = done[-1]\n",
     "        a = done[0]\n",
     ["tests/service/test_compare_agreement.py::test_a_screen_speaks_by_its_latest_done_attempt"]),
]


# What the scratch copy holds: every tracked part a test reads (tests read protocols/*.yaml, the
# docs' examples and README's commands; a test that cannot find them fails whatever is planted).
COPIED_DIRS = ("packbench", "tests", "bench", "protocols", "docs")
COPIED_FILES = ("pyproject.toml", "README.md", "Makefile")


def plant(name: str, file: str, old: str, new: str, tests: list[str]) -> str:
    source = (ROOT / file).read_text()
    if source.count(old) != 1:
        return "stale (the replaced text is not in the file exactly once)"
    with tempfile.TemporaryDirectory(prefix="plant-") as tmp:
        for part in COPIED_DIRS:
            shutil.copytree(ROOT / part, Path(tmp) / part, ignore=shutil.ignore_patterns("__pycache__"))
        for part in COPIED_FILES:
            shutil.copy(ROOT / part, tmp)
        env = {**os.environ, "PYTHONPATH": tmp, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}

        def pytest() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
                                  cwd=tmp, env=env, capture_output=True, text=True)

        # Without the bug the named tests must pass: one that fails anyway would call any bug caught.
        clean = pytest()
        if clean.returncode != 0:
            return f"BASELINE FAILS (pytest exit {clean.returncode} without the bug)"
        (Path(tmp) / file).write_text(source.replace(old, new))
        out = pytest()
    if out.returncode != 1:
        return f"NOT CAUGHT (pytest exit {out.returncode})"
    failed = {line.split()[1].split("[")[0] for line in out.stdout.splitlines() if line.startswith("FAILED ")}
    # every test named must fail (a file named whole: any of its tests)
    quiet = [t for t in tests if not any(f == t or f.startswith(t + "::") for f in failed)]
    return f"NOT CAUGHT by {quiet}" if quiet else "caught"


def main(words: list[str]) -> int:
    missed = 0
    for name, file, old, new, tests in BUGS:
        if words and not any(w in name for w in words):
            continue
        result = plant(name, file, old, new, tests)
        missed += result != "caught"
        print(f"{result:10} {name}: {' '.join(t.rpartition('/')[2] for t in tests)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
