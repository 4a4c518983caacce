"""Does FlexGen 0.1.8's OPT runtime (FMInference/FlexLLMGen) run on this stack? One probe, no fix-ups.

It converts a packbench checkpoint (safetensors) into FlexGen's own layout (one `.npy` per tensor,
names without the `model.` prefix: what flexgen.opt_config.download_opt_weights writes from the Hub
`.bin` files, which cannot be fetched on the GPU machine), builds `OptLM` under a placement policy
that keeps the weights inside the allowance (weights GPU/CPU percentages from FlexGen's model-size
arithmetic, cache and activations on the GPU, compression off), and generates greedily at batch 1.
It prints the versions, then either the decode ms/token or the exact exception and where it was
raised. FlexGen's cost model / policy search (experimental/cost_model.py) is not in the 0.1.8
wheel, so the policy printed here is the probe's, not FlexGen's search's.

    python -m bench.flexgen_probe CHECKPOINT_DIR --allowance-mib 4800 [--gen 16] [--prompt 512]
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


def convert(checkpoint: Path, out: Path) -> None:
    """FlexGen's numpy layout from packbench's safetensors (names as FlexGen's loader reads them)."""
    import numpy as np
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(checkpoint.glob("*.safetensors")):
        for name, t in load_file(f).items():
            name = name.removeprefix("model.")
            with open(out / name, "wb") as fh:  # no `.npy` suffix: FlexGen's loader opens the bare name
                np.save(fh, t.float().numpy().astype(np.float16) if t.is_floating_point() else t.numpy())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--allowance-mib", type=int, default=4800)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--shape", default="opt-2.7b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/flexgen-probe"))
    a = ap.parse_args()
    import torch
    import transformers

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "python": sys.version.split()[0]}
    try:
        import importlib.metadata as md

        facts["flexgen"] = md.version("flexgen")
        from flexgen.compression import CompressionConfig
        from flexgen.flex_opt import OptLM, Policy, get_opt_config
        from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice
        from flexgen.utils import ExecutionEnv

        config = get_opt_config(f"facebook/{a.shape}")
        budget = a.allowance_mib * 2**20 - config.cache_bytes(1, a.prompt + a.gen) - (512 << 20)
        w_gpu = max(0, min(100, int(100 * budget / config.model_bytes())))
        policy = Policy(1, 1, w_gpu, 100 - w_gpu, 100, 0, 100, 0, overlap=True, sep_layer=True, pin_weight=True,
                        cpu_cache_compute=False, attn_sparsity=1.0, compress_weight=False,
                        comp_weight_config=CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False),
                        compress_cache=False,
                        comp_cache_config=CompressionConfig(num_bits=4, group_size=64, group_dim=2, symmetric=False))
        facts["policy"] = {"w_gpu_percent": w_gpu, "w_cpu_percent": 100 - w_gpu, "cache_gpu_percent": 100,
                           "act_gpu_percent": 100, "compress": False}
        weights = a.work / "weights" / f"{a.shape}-np"
        convert(a.checkpoint, weights)
        gpu, cpu, disk = TorchDevice("cuda:0"), TorchDevice("cpu"), TorchDisk(str(a.work / "offload"))
        env = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))
        model = OptLM(config, env, str(a.work / "weights"), policy)
        prompt = [[2] + list(range(100, 100 + a.prompt - 1))]
        model.generate(prompt, max_new_tokens=2)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=a.gen)
        torch.cuda.synchronize()
        facts["generate_s"] = time.perf_counter() - t0
        facts["ms_per_token_incl_prefill"] = 1e3 * facts["generate_s"] / a.gen
        facts["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        facts["verdict"] = "runs"
    except BaseException as e:  # the verdict is the exception itself, verbatim
        where = traceback.extract_tb(e.__traceback__)[-1]
        facts["verdict"] = "fails"
        facts["error"] = f"{type(e).__name__}: {e}"
        facts["at"] = f"{where.filename.split('site-packages/')[-1]}:{where.lineno}: {where.line}"
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
