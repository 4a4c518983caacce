"""torch + transformers side of packbench: CPU-first OPT, loader policies, ledger, episodes."""

import os

# DeepSpeed, where it is installed (the [offload] extra), is imported by accelerate from inside
# transformers' save_pretrained and from_pretrained. On a machine without an NVIDIA GPU its
# accelerator detection then logs a warning to stdout, in the middle of a `--json` answer. Naming
# the CPU accelerator there (what it would choose anyway) keeps it quiet; a GPU machine's detection
# is left alone, and a worker that runs zero-inference sets it for its device first
# (engine/zero_inference.py).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
