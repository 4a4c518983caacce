"""Where a profiled episode's host-to-device copies go, per MoE policy, from the CUDA profiler's
own timeline: how many expert copies it issues, their bytes, the copy engine's rate over them
(bytes / summed copy durations), how much of them a kernel ran beside, and the kernels' and the
calls' time. Written to explain conditions whose measured decode time is below compute + bytes at
the copy rate (docs/experiments/simulate.md): a higher rate on some copies, or host work hidden
under them.

  python -m bench.copy_profile --model DIR [--device cuda] [--dtype float16] [--policy SPEC ...]

SPEC is `packet:gather=device`, `expert-cache:capacity=4,rule=lru` and so on, read by `packbench
simulate`'s own --policy parser (core/simulate.py parse_policy). One warm episode each, then one
profiled episode of the protocol's generator prompt (seed 0, PREFIX + CONT), prefill and decode.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from packbench.core.simulate import parse_policy


def main() -> None:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from packbench.core.plan import BOS
    from packbench.engine.episode import run_episode
    from packbench.engine.moe.model import CpuFirstMoE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--policy", action="append", default=None)
    a = ap.parse_args()
    policies = a.policy or ["packet:gather=device", "expert-cache:capacity=4,rule=lru",
                            "expert-cache:capacity=4,rule=lfu", "expert-cache:capacity=6,rule=lru"]
    model = CpuFirstMoE(a.model, dtype=getattr(torch, a.dtype), device=torch.device(a.device))
    rng = np.random.Generator(np.random.PCG64(0))
    prompt = [BOS] + rng.integers(4, model.vocab, size=a.prefix - 1).tolist()
    print("per profiled episode (prefill and decode): expert copies (>= 1 MiB host to device), MB, the copy "
          "engine's rate over them, their ms, ms of them a kernel ran beside, kernel ms, the calls' wall ms, streams")
    for text in policies:
        name, params = parse_policy(text, "expert")
        model.use(name, **params)
        run_episode(model, prompt, continuation=a.continuation)  # warm
        model.use(name, **params)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = run_episode(model, prompt, continuation=a.continuation)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel")]
        big = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", "")
               and e.get("args", {}).get("bytes", 0) >= 1 << 20]  # expert copies, not indices or tokens
        kernels = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel"]
        nbytes = sum(e["args"]["bytes"] for e in big)
        copy_us = sum(e["dur"] for e in big)
        # how much of the copies' time a kernel ran beside them (another stream, or the copy engine
        # working under the compute engine): 0 where everything is one stream
        beside = sum(max(0.0, min(e["ts"] + e["dur"], b) - max(e["ts"], a)) for e in big for a, b in kernels)
        streams = sorted({e.get("args", {}).get("stream") for e in big} - {None})
        wall = sum(c.wall_s for c in out.calls) * 1e3
        rows = [text, len(big), nbytes / 1e6, nbytes / copy_us / 1e3 if copy_us else 0.0, copy_us / 1e3,
                beside / 1e3, sum(b - a for a, b in kernels) / 1e3, wall, ",".join(map(str, streams))]
        print(" ".join(f"{v:>10.2f}" if isinstance(v, float) else f"{v!s:>10}" for v in rows), flush=True)

if __name__ == "__main__":
    main()
