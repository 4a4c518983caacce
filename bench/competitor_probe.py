"""Each competitor's steps timed alone, without the queue (issue 24): build (host read +
quantization), one episode per mode, the move to the host and back (QuantizedModel.shelve /
unshelve) and an episode after it. Prints as it goes; a step stuck for STUCK_S seconds dumps
every thread's stack (faulthandler), so a slow or hung step names itself.

  python -m bench.competitor_probe --shape opt-2.7b --methods int8-weight-only,nf4,llm-int8 --modes eager,graph
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

import torch

from packbench.engine.episode import run_episode
from packbench.engine.quantized import QuantizedModel
from packbench.engine.synth import synth_checkpoint


def step(name: str, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # the probe reports and goes on to the next step
        print(f"{name:42} FAILED after {time.perf_counter() - t0:7.2f} s: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    mem = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else 0
    print(f"{name:42} {time.perf_counter() - t0:7.2f} s  allocated {mem:7.0f} MiB", flush=True)
    return out


def left_on_device(top: int = 8) -> None:
    """The largest CUDA tensors still alive (after a shelve, nothing of the model should be)."""
    import gc

    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    seen, found = set(), []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().data_ptr() not in seen:
                seen.add(o.untyped_storage().data_ptr())
                found.append((o.untyped_storage().nbytes(), tuple(o.shape), str(o.dtype), type(o).__name__))
        except Exception:  # noqa: BLE001 - a tensor subclass without storage: skipped
            continue
    found.sort(reverse=True)
    print(f"    live CUDA tensors: {len(found)}, {sum(f[0] for f in found) / 2**20:.0f} MiB; allocated "
          f"{torch.cuda.memory_allocated() / 2**20:.0f} MiB, reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB",
          flush=True)
    for nbytes, shape, dtype, kind in found[:top]:
        print(f"      {nbytes / 2**20:9.1f} MiB {kind} {shape} {dtype}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="opt-2.7b")
    ap.add_argument("--methods", default="int8-weight-only,nf4,llm-int8")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--stuck-s", type=float, default=90)
    ap.add_argument("--dir", default="/tmp/probe-models")
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.stuck_s, repeat=True, file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = step("synthesise", lambda: synth_checkpoint(Path(a.dir) / a.shape, shape=a.shape, dtype="float16",
                                                        seed=0, profile="opt"))
    prompt = [(7 * i) % 1000 + 4 for i in range(a.prefix)]
    for method in a.methods.split(","):
        q = step(f"{method}: build", lambda: QuantizedModel(path, method=method, dtype=torch.float16, device=device))
        if q is None:
            continue
        for mode in a.modes.split(","):
            for k in range(2):
                r = step(f"{method}: episode {k} {mode}", lambda: run_episode(q, prompt, continuation=a.continuation, mode=mode))
                if r is not None:
                    decode = sorted(c.wall_s for c in r.calls[1:])
                    print(f"    decode median {decode[len(decode) // 2] * 1e3:.2f} ms/call; {r.decode_graph}", flush=True)
        if q.can_shelve:
            step(f"{method}: shelve", q.shelve)
            left_on_device()
            step(f"{method}: unshelve", q.unshelve)
            mode = a.modes.split(",")[-1]
            r = step(f"{method}: episode after unshelve {mode}", lambda: run_episode(q, prompt, continuation=a.continuation, mode=mode))
            if r is not None:
                print(f"    {r.decode_graph}", flush=True)
        del q
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
