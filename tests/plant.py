"""Plant known bugs, one at a time, in a scratch copy of the checkout and check that the tests
named for each fail (docs/mutation.md). The checkout itself is never edited.

    python tests/plant.py            # every planted bug
    python tests/plant.py dispersion # those whose name holds a word

Each bug is (name, file, the text replaced, its replacement, the tests that must fail). A bug
whose text is no longer in its file is reported as stale: the table must follow the code.
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
]


def plant(name: str, file: str, old: str, new: str, tests: list[str]) -> str:
    source = (ROOT / file).read_text()
    if source.count(old) != 1:
        return "stale (the replaced text is not in the file exactly once)"
    with tempfile.TemporaryDirectory(prefix="plant-") as tmp:
        for part in ("packbench", "tests", "bench"):
            shutil.copytree(ROOT / part, Path(tmp) / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tmp)
        (Path(tmp) / file).write_text(source.replace(old, new))
        env = {**os.environ, "PYTHONPATH": tmp, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
                             cwd=tmp, env=env, capture_output=True, text=True)
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
