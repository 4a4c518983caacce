"""bench/peers_device.sh's time rules, on the CPU in seconds: the script driven with a stub python3
that logs each call (no Ray, no model), so what it would start within DEADLINE and RESERVE is seen
without a device call (the TINY twin, `TINY=1 bash bench/peers_device.sh`, runs the real path)."""

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


def test_the_zero_inference_cuda_test_keeps_within_the_deadline(tmp_path):
    """It ran for up to 150 s whatever the screens had used: after screens that took their
    DEADLINE less RESERVE the call ran past its 10 minutes."""
    r, calls = run_script(tmp_path, {"SKIP_B1": "1", "DEADLINE": "45", "RESERVE": "10"}, tiny=False)
    assert r.returncode == 0, r.stderr
    assert "== zero-inference CUDA test: skipped, " in r.stdout and "s left of DEADLINE less RESERVE" in r.stdout
    assert not any("pytest" in c for c in calls), calls
    r, calls = run_script(tmp_path, {"SKIP_B1": "1", "DEADLINE": "560", "RESERVE": "10"}, tiny=False)
    assert r.returncode == 0, r.stderr
    assert "== zero-inference CUDA test: rc 0" in r.stdout, r.stdout
    assert any(c.startswith("-m pytest -q -m deepspeed and gpu") for c in calls), calls
