#!/usr/bin/env bash
# One device call (issue 10's GPU check): a signed screen of synthetic opt-1.3b float16 with every
# policy, its re-execution audit, then the same archive with one episode's byte ledger forged
# consistently and re-sealed without the key: the signature check and the re-execution each
# refuse it, the static audit of the file alone cannot.
# Run from the project root with .whl carried: bash bench/reexecute_device.sh
# CPU dry run: SKIP_WHEELS=1 SHAPE=tiny DTYPE=float32 PREFIX=8 CONT=4 bash bench/reexecute_device.sh
set -uo pipefail
[ -n "${SKIP_WHEELS:-}" ] || [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
root=$PWD
source "$root/bench/every_policy.sh"
source "$root/bench/device_common.sh"; work_dir; cd "$work"
export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives"
every_policy_screen reexecute-opt-1.3b
pb db upgrade >/dev/null
pb keys init --key lab.pem --name device-lab | tail -1
export PACKBENCH_SIGNING_KEY=$work/lab.pem
echo "== screen (signed)"
pb submit p.yaml --wait > s.log 2>&1; echo "submit rc $?"; grep -E "faithfulness|done" s.log | tail -10
archive=$(python3 -c "import json,sys; print(json.load(sys.stdin)['archive_path'])" < <(pb results --screen latest --json))
echo "== static audit"; pb audit latest | tail -1
echo "== re-execution audit (K=4, seed 0)"
pb audit latest --reexecute 4 --seed 0 > rx.log 2> rx.err; echo "rc $?"; cat rx.log
python3 - "$archive" <<'PY' > target
import json, sys
from packbench.core.archive import ArchiveReader
from packbench.core.reexecute import draw, read_archived
a = read_archived(sys.argv[1])
d = draw(a.protocol, a.entries, {i: r["status"] for i, r in a.records.items()}, 4, 0)
print(next(i for i in d.episodes if a.records[i]["condition"] == "packet"))
PY
n=$(cat target)
echo "== forge episode $n's ledger, re-seal without the key"
PYTHONPATH=/tmp/site:$root python3 -m bench.forge "$archive" forged.zip --episode "$n"
cp "$archive.sig" forged.zip.sig 2>/dev/null  # the forger keeps the old signature: it no longer verifies
echo "-- static audit of the file alone"; pb audit --archive forged.zip | tail -1
echo "-- with the lab's key trusted"; pb audit --archive forged.zip --trust lab.pem.pub 2>&1 | grep -E "signature|AGREE|DISAGREE" | tail -2; echo "rc ${PIPESTATUS[0]}"
echo "-- re-execution (K=4, seed 0)"; pb audit --archive forged.zip --reexecute 4 --seed 0 2>/dev/null; echo "rc $?"
