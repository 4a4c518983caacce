"""The device scripts' time rules and what they print, on the CPU in seconds: bench/peers_device.sh
and bench/simulate_check_device.sh driven with a stub python3 that logs each call (no Ray, no model),
so what they would start within DEADLINE and RESERVE is seen without a device call (their TINY twins,
`TINY=1 bash bench/X.sh`, run the real path)."""

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A python3 that logs its arguments; the predraw (`python3 - FILE`) sleeps DRAW_S seconds.
STUB = """#!/bin/bash
echo "$*" >> "$CALLS"
case "$1 $2 $3" in
  "-c "*) echo "deepspeed 0 transformers 0" ;;
  "- "*) cat > /dev/null; if [ -n "$2" ]; then sleep "${DRAW_S:-0}"; echo "   predraw: stub"; else echo table; fi ;;
  "-m packbench results") echo "{}" ;;
  "-m packbench submit") echo "${SUBMIT_OUT-[    0.0 s] screen 7 attempt 1: 10 episodes on cpu}"; exit "${SUBMIT_RC:-0}" ;;
esac
exit 0
"""


def run_script(tmp_path, env, *, tiny=True):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", STUB), ("nvidia-smi", "#!/bin/sh\necho stub GPU\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.log"
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
            "CALLS": str(calls), "SKIP_FLEXGEN": "1", "BATCHES": "", **env}
    if tiny:
        full.update(TINY="1", PYTHON=str(bin_dir / "python3"))
    else:
        full["SKIP_WHEELS"] = "1"  # the stub on PATH stands in for the device's python3
    r = subprocess.run(["bash", "bench/peers_device.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=60)
    return r, calls.read_text().splitlines() if calls.exists() else []


def test_a_predraw_that_leaves_30_s_or_less_skips_its_screen(tmp_path):
    """The limit was checked against DEADLINE before the predraw only: a draw that used the rest
    left `timeout 0` (no limit at all: the screen ran past the call's 10 minutes) or a negative
    one (no screen, then `audit latest` and `results` of the previous screen under this one's name)."""
    r, calls = run_script(tmp_path, {"PREDRAW": "1", "DEADLINE": "34", "RESERVE": "0", "DRAW_S": "5"})
    assert r.returncode == 0, r.stderr
    assert "== peers-b1: skipped after its predraw, " in r.stdout, r.stdout
    assert "s left of DEADLINE less RESERVE" in r.stdout
    assert any(c.startswith("-m packbench protocol plan") for c in calls), calls
    assert [c for c in calls if c.startswith("- ")] != []  # the predraw ran
    for step in ("-m packbench submit", "-m packbench audit", "-m packbench results"):
        assert not any(c.startswith(step) for c in calls), (step, calls)


def test_a_screen_with_enough_left_after_its_predraw_runs_and_is_audited(tmp_path):
    r, calls = run_script(tmp_path, {"PREDRAW": "1", "DEADLINE": "100", "RESERVE": "0", "DRAW_S": "1"})
    assert r.returncode == 0, r.stderr
    assert "skipped" not in r.stdout.split("== flexgen probe")[0], r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("== peers-b1 (batch 1, 2 x 16 + 6, 64 MiB)"))
    limit = int(line.split("(limit ")[1].split(" s)")[0])
    assert 60 <= limit <= 99, line  # what DEADLINE left after the draw, under SCREEN_TIMEOUT's 300
    assert [c.split()[:3] for c in calls if c.startswith("-m packbench") and "upgrade" not in c] == [
        ["-m", "packbench", "protocol"], ["-m", "packbench", "submit"], ["-m", "packbench", "audit"],
        ["-m", "packbench", "results"]]
    # the screen the submit's progress line named, not `latest`
    assert "-m packbench audit screen 7" in calls and "-m packbench results --screen 7 --json" in calls, calls


def test_a_refused_submit_audits_nothing_rather_than_the_previous_screen(tmp_path):
    """`audit latest` and `results --screen latest` followed every submit: after a refused one
    (a THEN_CONDITIONS screen with flexgen in float32, exit 2, nothing queued) they printed the
    batch screen's AGREE and gates again under the second screen's heading and wrote its JSON as
    peers-b4-then.json."""
    line = "error: protocol field `dtype`: condition flexgen (flexgen) runs in float16 only"
    r, calls = run_script(tmp_path, {"DEADLINE": "100", "SUBMIT_OUT": line, "SUBMIT_RC": "2"})
    assert r.returncode == 0, r.stderr
    assert "== peers-b1 (batch 1, 2 x 16 + 6, 64 MiB): submit rc 2 in " in r.stdout, r.stdout
    assert "   0 " + line + "\n   no screen started: nothing to audit\n" in r.stdout, r.stdout
    assert any(c.startswith("-m packbench submit") for c in calls), calls
    assert not any(c.startswith(("-m packbench audit", "-m packbench results")) for c in calls), calls
    assert not (tmp_path / "out" / "peers-b1.json").exists()


def test_the_zero_inference_cuda_test_keeps_within_the_deadline(tmp_path):
    """It ran for up to 150 s whatever the screens had used: after screens that took their
    DEADLINE less RESERVE the call ran past its 10 minutes."""
    r, calls = run_script(tmp_path, {"SKIP_B1": "1", "DEADLINE": "40", "RESERVE": "10"}, tiny=False)
    assert r.returncode == 0, r.stderr
    assert "== zero-inference CUDA test: skipped, " in r.stdout and "s left of DEADLINE less RESERVE" in r.stdout
    assert not any("pytest" in c for c in calls), calls
    r, calls = run_script(tmp_path, {"SKIP_B1": "1", "DEADLINE": "560", "RESERVE": "10"}, tiny=False)
    assert r.returncode == 0, r.stderr
    assert "== zero-inference CUDA test: rc 0" in r.stdout, r.stdout
    assert any(c.startswith("-m pytest -q -m deepspeed and gpu") for c in calls), calls


# bench/simulate_check_device.sh with a stub python3 (TINY's `PYTHON`): the files its steps write
# made empty, the rates screen's submit leaving an (empty) archive, the screen's submit sleeping
# SUBMIT_S, the audit saying AUDIT.
SIM_STUB = """#!/bin/bash
echo "$*" >> "$CALLS"
want=""; for a in "$@"; do
  case "$want" in out) mkdir -p "$a" ;; file) touch "$a" ;; esac
  case "$a" in --out) [ "$2 $3" = "packbench model" ] && want=out || want=file ;;
    --machine-out|--trace-out) want=file ;; *) want="" ;; esac
done
case "$2 $3" in
  "packbench submit") case "$4" in
    *-rates.yaml) mkdir -p "$PACKBENCH_ARCHIVE_DIR"; [ -n "${NO_RATES:-}" ] || touch "$PACKBENCH_ARCHIVE_DIR/r.zip" ;;
    *) sleep "${SUBMIT_S:-0}" ;; esac ;;
  "packbench audit") echo "$AUDIT" ;;
esac
exit 0
"""


def run_simulate_check(tmp_path, env):
    stub = tmp_path / "python3"
    stub.write_text(SIM_STUB)
    stub.chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.log"
    full = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OUT": str(tmp_path / "out"), "CALLS": str(calls),
            "TINY": "1", "PYTHON": str(stub), **env}
    r = subprocess.run(["bash", "bench/simulate_check_device.sh"], cwd=ROOT, env=full, capture_output=True,
                       text=True, timeout=60)
    return r, calls.read_text().splitlines() if calls.exists() else []


def test_simulate_check_prints_the_audits_verdict_not_only_its_exit_code(tmp_path):
    """`audit rc 0` is also a PARTIAL audit of a screen its timeout cut short (an unfinished attempt
    decides no exit code): the line that says which was in the log only."""
    line = "audit of screen 1: PARTIAL (attempt 1 interrupted: 9 of 24 episodes)"
    r, calls = run_simulate_check(tmp_path, {"DEADLINE": "200", "AUDIT": line})
    assert r.returncode == 0, r.stderr
    assert "   audit rc 0\n   " + line + "\n" in r.stdout, r.stdout
    assert any(c.startswith("-m packbench submit") for c in calls), calls


def test_simulate_check_skips_the_screen_under_a_minute_and_still_compares(tmp_path):
    r, calls = run_simulate_check(tmp_path, {"DEADLINE": "100", "AUDIT": "audit of screen 1: AGREE"})
    assert r.returncode == 0, r.stderr
    assert "-- submit skipped: " in r.stdout and "s left of DEADLINE 100" in r.stdout, r.stdout
    submits = [c for c in calls if c.startswith("-m packbench submit")]
    assert len(submits) == 1 and submits[0].split()[3].endswith("-rates.yaml"), calls  # the rates screen only
    assert not any(c.startswith("-m packbench audit") for c in calls), calls
    assert any(c.startswith("-m bench.simulate_check compare") for c in calls), calls
    assert r.stdout.rstrip().splitlines()[-1].startswith("done in ")


def test_simulate_check_predicts_from_the_rates_screen_and_compares_only_the_screen(tmp_path):
    """The compute rates come from a rates screen the worker ran (`measure --rates-from` its archive),
    and that archive is moved out of the screens' folder before the screen: compare reads the newest
    archive there, which would be the rates screen's whenever the screen left none."""
    r, calls = run_simulate_check(tmp_path, {"DEADLINE": "200", "AUDIT": "audit of screen 2: AGREE"})
    assert r.returncode == 0, r.stderr
    steps = [" ".join(c.split()[1:3]) for c in calls if c.startswith("-m ") and "upgrade" not in c]
    assert steps == ["bench.moe_overhead --device", "packbench model", "packbench submit", "bench.simulate_check measure",
                     "bench.simulate_check predict", "packbench protocol", "packbench submit", "packbench audit",
                     "bench.simulate_check compare"], steps
    measure = next(c for c in calls if c.startswith("-m bench.simulate_check measure")).split()
    rates = Path(measure[measure.index("--rates-from") + 1])
    assert rates.name == "r.zip" and rates.parent.name == "rates", measure
    compare = next(c for c in calls if c.startswith("-m bench.simulate_check compare")).split()
    assert Path(compare[compare.index("--archives") + 1]).name == "archives" and rates.parent.name != "archives"


def test_simulate_check_without_a_rates_archive_predicts_nothing(tmp_path):
    """A rates screen that left no archive (refused, timed out) stops the call before predictions:
    predicted from nothing, the check would compare nothing with the screen's runs."""
    r, calls = run_simulate_check(tmp_path, {"DEADLINE": "200", "NO_RATES": "1", "AUDIT": ""})
    assert r.returncode == 1
    assert "-- no rates screen archive: nothing predicted" in r.stdout, r.stdout
    assert not any(c.startswith(("-m bench.simulate_check", "-m packbench protocol")) for c in calls), calls
    assert sum(c.startswith("-m packbench submit") for c in calls) == 1, calls
