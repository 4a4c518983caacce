"""`make mutate`: mutation testing (mutmut 3) of the modules that decide verdicts and evidence,
each against its own test files, one module at a time and one worker (a 2-core host).

    python tests/mutate.py                      # every module, smallest first
    python tests/mutate.py core/dispersion.py   # some of them
    python tests/mutate.py --list               # the modules and their test files
    python tests/mutate.py --retry core/gates.py  # only the mutants left alive, against today's tests
    PACKBENCH_TEST_PG_URL=postgresql+psycopg://... python tests/mutate.py db/queue.py
                                                # its survivors tried again against the PostgreSQL cases

mutmut reads its settings from the working directory's pyproject.toml, so each module runs in
its own directory .mutate/<module>/ holding a pyproject.toml written here, links to packbench/
and tests/, and mutmut's mutants/ (which keeps results: a rerun tries only what changed). The
score of every module run so far is printed at the end and written to .mutate/score.json.
Not a test file (pytest collects test_*.py only); docs/mutation.md records the latest scores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutate"

# module (under packbench/) -> the test files that speak for it
MODULES: dict[str, list[str]] = {  # in the order `make mutate` runs them: quick ones first
    "engine/ledger.py": ["tests/engine/test_ledger.py"],
    "core/dispersion.py": ["tests/core/test_dispersion.py"],
    "core/fidelity.py": ["tests/core/test_fidelity.py", "tests/core/test_fidelity_edges.py",
                         "tests/core/test_exact_bounds.py"],
    "core/gates.py": ["tests/core/test_gates.py", "tests/core/test_exact_bounds.py"],
    # the counts of a cache, a forecast and a weightless replay: its own tests, the hand-made traces of
    # test_trace.py (simulate's expert-cache policies) and the auditor's replay of an experts section
    # (not test_moe_cache_worker.py or test_audit_paths.py: they synthesise models or screens)
    "core/expert_cache.py": ["tests/core/test_expert_cache.py", "tests/core/test_expert_figures.py",
                             "tests/core/test_trace.py", "tests/core/test_audit_replay.py"],
    "core/trace.py": ["tests/core/test_trace.py", "tests/core/test_trace_refusals.py"],
    # every policy's weightless replay, its totals and its time forecast: the hand-made traces of
    # test_trace.py, the auditor's replay and the overhead forecast (not test_simulate_engine.py,
    # test_trace_screen.py, test_simulate_cli.py or test_bench_moe_overhead.py: they run models or screens)
    "core/simulate.py": ["tests/core/test_trace.py", "tests/core/test_audit_replay.py",
                         "tests/core/test_simulate_overhead.py", "tests/core/test_simulate_mutants.py"],
    "core/audit.py": ["tests/core/test_audit.py", "tests/core/test_audit_fields.py", "tests/core/test_audit_paths.py",
                      "tests/core/test_audit_replay.py",
                      "tests/core/test_evidence.py"],
    "db/queue.py": ["tests/db/test_db_queue.py", "tests/db/test_db_store.py", "tests/db/test_db_faults.py",
                    "tests/db/test_db_reconcile.py", "tests/db/test_db_queries.py"],
    # test_archive_members.py runs a real screen (9 s a fixture): too slow to repeat per mutant
    "core/archive/": ["tests/core/test_archive.py", "tests/core/test_archive_hostile.py"],
    "core/protocol/": ["tests/core/test_protocol.py", "tests/core/test_protocol_batch.py",
                       "tests/core/test_protocol_passes.py", "tests/core/test_protocol_schema3.py",
                       "tests/core/test_protocol_schema4.py", "tests/core/test_protocol_schema5.py",
                       "tests/core/test_protocol_schema6.py", "tests/core/test_protocol_weights.py",
                       "tests/core/test_protocol_bounds.py", "tests/core/test_protocol_scored.py",
                       # the only tests of the MoE synth shapes (schema._moe_conditions, the MoE branches)
                       "tests/core/test_protocol_moe_synth.py"],
}

# What the tests read besides packbench/ and tests/ (protocols/quickstart.yaml, bench/audit.py's
# synthetic screens): linked into each module's directory and copied into mutmut's mutants/.
ALSO = ("bench", "protocols", "docs", "README.md")

# mutmut's statuses, as `mutmut results --all true` prints them
KILLED = ("killed", "timeout")
NOT_RUN = ("not checked", "check was interrupted by user")  # a stopped run: a rerun resumes there


# Modules whose survivors of the SQLite run are tried again against the PostgreSQL cases alone
# (`-m postgresql`) where PACKBENCH_TEST_PG_URL is set: the claim and the reapers have code that runs
# on PostgreSQL only (claim_postgresql, FOR UPDATE SKIP LOCKED), and every PostgreSQL case migrates a
# fresh schema (about 2 s), too slow to run for every mutant. Without the variable: SQLite alone.
PG_ENV = "PACKBENCH_TEST_PG_URL"
POSTGRESQL_STAGE = ("db/queue.py",)

# Modules whose runs keep real fsyncs: the rest load tests/mutate_nofsync.py (disk flushes of
# the archives the tests write are most of their time, and no mutant of theirs touches one).
KEEP_FSYNC = ("core/archive/",)


def _settings(module: str, tests: list[str], *, postgresql: bool = False) -> str:
    pattern = f"packbench/{module}*" if module.endswith("/") else f"packbench/{module}"
    fast = [] if module in KEEP_FSYNC else ["-p", "tests.mutate_nofsync"]
    marks = "postgresql and not gpu and not ray" if postgresql else "not gpu and not ray"
    lines = [
        "[tool.mutmut]",
        'source_paths = ["packbench"]',
        f"only_mutate = [{json.dumps(pattern)}]",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        # -x: one failing test kills the mutant; no cache writes from forked runs
        f"pytest_add_cli_args = {json.dumps(['-x', '-q', '-p', 'no:cacheprovider', *fast, '-m', marks])}",
        "use_git_change_detection = false",
        f"also_copy = {json.dumps(list(ALSO))}",
    ]
    return "\n".join(lines) + "\n"


def _prepare(module: str, *, postgresql: bool = False) -> Path:
    d = WORK / (module.strip("/").replace("/", "-") + ("-postgresql" if postgresql else ""))
    d.mkdir(parents=True, exist_ok=True)
    (WORK / ".gitignore").write_text("*\n")  # scratch: never committed
    for name in ("packbench", "tests", *ALSO):
        link = d / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    settings = _settings(module, MODULES[module], postgresql=postgresql)
    path = d / "pyproject.toml"
    if not path.exists() or path.read_text() != settings:
        path.write_text(settings)
    return d


def _mutmut() -> list[str]:
    return [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())"]


def _results(d: Path) -> dict[str, str]:
    out = subprocess.run(_mutmut() + ["results", "--all", "true"], cwd=d, capture_output=True, text=True,
                         check=True).stdout
    statuses = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            statuses[name] = status
    return statuses


def run(module: str, *, retry_only: bool = False) -> dict:
    d = _prepare(module)
    # One OpenMP thread: mutmut forks each mutant's run from a process that has imported torch, and
    # a forked child's first parallel region can wait forever on the parent's OpenMP pool (a
    # test of 4 s ran into mutmut's 70 s wall limit, counted a timeout, i.e. a kill).
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    pg_url = env.pop(PG_ENV, None)  # the SQLite run never runs the PostgreSQL cases (stage below)
    postgresql = module in POSTGRESQL_STAGE and bool(pg_url)
    if module in POSTGRESQL_STAGE and not postgresql:
        print(f"{module}: {PG_ENV} is not set, so its PostgreSQL cases do not run and the mutants only they reach "
              f"(the PostgreSQL claim, the row locks) count as not killed; set it to a PostgreSQL URL "
              f"(e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test) for the whole score", file=sys.stderr)
    d_pg = _prepare(module, postgresql=True) if postgresql else None
    # killed by the PostgreSQL cases in an earlier run: not tried again (tests only grow)
    killed_pg = ({n for n, s in _results(d_pg).items() if s in KILLED}
                 if d_pg is not None and (d_pg / "mutants").is_dir() else set())
    if not retry_only:
        ran = subprocess.run(_mutmut() + ["run", "--max-children", "1"], cwd=d, env=env)
        if ran.returncode != 0:  # e.g. the clean run of its tests failed: named, the next module still runs
            return {"module": module, "mutants": 0, "killed": 0, "score": None,
                    "not_killed": {f"mutmut run exited {ran.returncode}": "error"}}
    # mutmut keeps a result once it has one, even when tests were added since: every mutant not
    # killed is tried again against today's tests (a killed one stays killed while tests only grow)
    again = [n for n, s in _results(d).items() if s not in KILLED and s not in NOT_RUN and n not in killed_pg]
    if again:
        subprocess.run(_mutmut() + ["run", "--max-children", "1", *again], cwd=d, env=env,
                       stdout=subprocess.DEVNULL)
    everything = _results(d)
    # "not checked": the run was stopped before it came to them (a rerun resumes there)
    statuses = {n: s for n, s in everything.items() if s not in NOT_RUN}
    by_postgresql: set[str] = set()
    if d_pg is not None:
        alive = [n for n, s in statuses.items() if s not in KILLED and n not in killed_pg]
        if alive:
            subprocess.run(_mutmut() + ["run", "--max-children", "1", *alive], cwd=d_pg,
                           env={**env, PG_ENV: pg_url}, stdout=subprocess.DEVNULL)
        pg_statuses = _results(d_pg)
        by_postgresql = {n for n, s in statuses.items() if s not in KILLED and pg_statuses.get(n) in KILLED}
        statuses.update({n: pg_statuses[n] for n in by_postgresql})
    killed = sum(s in KILLED for s in statuses.values())
    survivors = sorted(n for n, s in statuses.items() if s not in KILLED)
    # each survivor's diff, to judge it equivalent or write the test that kills it (about a
    # second each: MUTATE_DIFFS=0 leaves them out)
    if os.environ.get("MUTATE_DIFFS", "1") != "0":
        with open(d / "survivors.diff", "w") as f:
            for name in survivors:
                f.write(subprocess.run(_mutmut() + ["show", name], cwd=d, capture_output=True, text=True).stdout)
    return {"module": module, "mutants": len(statuses), "killed": killed, "not_run": len(everything) - len(statuses),
            "killed_by_postgresql_cases": len(by_postgresql),
            "score": round(100 * killed / len(statuses), 1) if statuses else None,
            "not_killed": {n: statuses[n] for n in survivors}}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        for m, tests in MODULES.items():
            print(f"packbench/{m}: {' '.join(tests)}")
        return 0
    # --retry: only try again the mutants a run left alive (after tests were added); no new ones
    retry_only = argv[:1] == ["--retry"]
    argv = argv[1:] if retry_only else argv
    unknown = [m for m in argv if m not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; choose from {list(MODULES)}", file=sys.stderr)
        return 2
    scores_path = WORK / "score.json"
    scores = json.loads(scores_path.read_text()) if scores_path.exists() else {}
    for module in argv or list(MODULES):
        scores[module] = run(module, retry_only=retry_only)
        WORK.mkdir(exist_ok=True)
        scores_path.write_text(json.dumps(scores, indent=1, sort_keys=True))
    total = sum(s["mutants"] for s in scores.values())
    killed = sum(s["killed"] for s in scores.values())
    for s in scores.values():
        rest = f"; {s['not_run']} not run yet" if s.get("not_run") else ""
        if s.get("killed_by_postgresql_cases"):
            rest += f"; {s['killed_by_postgresql_cases']} of the kills by the PostgreSQL cases"
        print(f"{s['module']:24} {s['killed']:5} / {s['mutants']:5} killed ({s['score']} %){rest}")
        for name, status in s["not_killed"].items():
            print(f"    {status:10} {name}")
    if total:
        print(f"{'all run so far':24} {killed:5} / {total:5} killed ({100 * killed / total:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
