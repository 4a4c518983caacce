# Sourced by the device scripts: what machine and software a run's numbers come from.
device_header() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
  date -u
}
