# Sourced by the device scripts (after setting $out, where full logs go).

device_header() {  # what machine and software a run's numbers come from
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
  date -u
}

engine_cuda_tests() {  # every engine CUDA test, the log in $out/pytest.log
  echo "== CUDA tests (engine)"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine > "$out/pytest.log" 2>&1; echo "pytest rc $?"
  grep -E "passed|failed|Error" "$out/pytest.log" | tail -6
}
