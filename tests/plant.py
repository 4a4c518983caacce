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
