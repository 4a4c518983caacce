"""Where does DeepSpeed ZeRO-Inference's device memory go during one call? (issue 48)

On the H200 every zero-inference episode of OPT-2.7B under 4800 MiB ran out of memory with 3.91 GiB
allocated while fetching a 50 MiB (fc) weight, though its configuration keeps at most 2 x hidden^2
parameters live. On the CPU (DS_ACCELERATOR=cpu, opt-125m float32) the gathered parameters peak at
the tied embedding (38.6 M of 125 M elements) and are all released after each call, default
configuration or `stage3_max_reuse_distance: 0` alike. This probe measures the same on any device,
per configuration variant, with a hook before and after every module: the gathered parameter
elements (ds_status not NOT_AVAILABLE, persistent vectors left out) and, on CUDA, the allocated
bytes, printing the module at whose entry each peaks. One JSON line per variant.

    python -m bench.zero_memory_probe CHECKPOINT --device cuda --dtype float16 [--variants default,reuse0,small]

Variants: default (engine/zero_inference.py ds_config), reuse0 (stage3_max_reuse_distance 0),
small (reuse 0 and prefetch bucket 0). Each variant runs in its own process (DeepSpeed binds its
accelerator and process group for the life of a process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def variant_config(base: dict, variant: str) -> dict:
    z = base["zero_optimization"]
    if variant in ("reuse0", "small"):
        z["stage3_max_reuse_distance"] = 0
    if variant == "small":
        z["stage3_prefetch_bucket_size"] = 0
    if variant not in ("default", "reuse0", "small"):
        raise SystemExit(f"unknown variant {variant!r}: use default, reuse0 or small")
    return base


def one(checkpoint: Path, device: str, dtype: str, variant: str, prefix: int, decode: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    import torch

    from packbench.engine import zero_inference as zi
    from packbench.engine.dtypes import dtype_of

    base = zi.ds_config
    zi.ds_config = lambda **kw: variant_config(base(**kw), variant)
    dev = torch.device(device)
    m = zi.ZeroInferenceModel(checkpoint, dtype=dtype_of(dtype), device=dev)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list({id(p): p for p in m._model.parameters()}.values())
    hidden = m.config.hidden_size
    peak = {"gathered": 0, "gathered_at": None, "allocated": 0, "allocated_at": None}

    def sample(name: str):
        g = sum(p.ds_numel for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and p.ds_numel > hidden)
        if g > peak["gathered"]:
            peak.update(gathered=g, gathered_at=name)
        if dev.type == "cuda":
            a = torch.cuda.memory_allocated(dev)
            if a > peak["allocated"]:
                peak.update(allocated=a, allocated_at=name)

    for name, mod in m._model.named_modules():
        mod.register_forward_pre_hook(lambda *_, n=name: sample("enter " + n))
        mod.register_forward_hook(lambda *_, n=name: sample("leave " + n))
    out = {"variant": variant, "device": device, "dtype": dtype, "config": m.ds_config["zero_optimization"],
           "parameters": sum(p.ds_numel for p in params), "device_bytes_after_init": m.stats.device_bytes}
    cache = m.new_cache()
    try:
        m.forward(torch.arange(4, 4 + prefix, device=dev).reshape(1, -1), cache)
        out["prefill"] = dict(peak)
        for k in peak:
            peak[k] = 0 if k in ("gathered", "allocated") else None
        for t in range(decode):
            m.forward(torch.tensor([[5 + t]], device=dev), cache)
        out["decode"] = dict(peak)
    except Exception as e:  # the measurement is the point: an OOM is recorded with the peaks so far
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        out["at_error"] = dict(peak)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variants", default="default,reuse0,small")
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.checkpoint, args.device, args.dtype, args.one, args.prefix, args.decode)))
        return
    for v in args.variants.split(","):
        r = subprocess.run([sys.executable, "-m", "bench.zero_memory_probe", str(args.checkpoint), "--device",
                            args.device, "--dtype", args.dtype, "--prefix", str(args.prefix), "--decode",
                            str(args.decode), "--one", v], capture_output=True, text=True)
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if lines else json.dumps({"variant": v, "rc": r.returncode,
                                                  "stderr": r.stderr.strip().splitlines()[-1:] or ""}))


if __name__ == "__main__":
    main()
