# Sourced by the device scripts (after setting $out, where full logs go).

device_header() {  # what machine and software a run's numbers come from
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
  date -u
}

engine_cuda_tests() {  # every engine CUDA test, the log in $out/pytest.log
  echo "== CUDA tests (engine)"
  timeout 200 python3 -m pytest -q -m "gpu and not deepspeed" -p no:cacheprovider tests/engine > "$out/pytest.log" 2>&1; echo "pytest rc $?"
  grep -E "passed|failed|Error" "$out/pytest.log" | tail -6
}

install_wheels() {  # the carried .whl into /tmp/site (once per machine), on the path; SKIP_WHEELS: none
  [ -n "${SKIP_WHEELS:-}" ] || [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
}

product_env() {  # the wheels on the path, and a fresh database, archive and model cache in $work; pb runs the CLI
  install_wheels
  export RAY_AUTH_MODE=disabled
  work=$(mktemp -d)
  export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives" PACKBENCH_MODEL_CACHE="$work/models"
  python3 -m packbench db upgrade > /dev/null
}
pb() { python3 -m packbench "$@"; }
