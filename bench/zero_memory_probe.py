"""Where zero-inference's device memory goes on CUDA, module by module, under an allowance
(docs/experiments/competitors.md, "The offloading peers"). One process, the worker's own cap
(engine/allowance.py `impose`), on a synthetic OPT checkpoint:

  1. `accelerate` built under the allowance, one 512-token prefill, then released as the worker
     releases a competitor (reference dropped, gc, empty_cache): what stays allocated;
  2. `ZeroInferenceModel` built under the allowance (its ZeroBudget printed), memory after
     partitioning and after `deepspeed.initialize`; then one prefill of PREFIX tokens and one decode
     call with a hook at every module boundary recording allocated bytes and the gathered
     (available or in-flight, not persistent) parameter elements; the highest readings printed,
     or, on an out-of-memory, the last readings before it.

    python -m bench.zero_memory_probe CHECKPOINT [ALLOWANCE_MIB] [PREFIX] [--no-accelerate] [--scales=0.8,1]

--scales: instead of the worker's live-parameter limit, one run per S with the limit
S x gather budget less twice the largest module (each variant built afresh; DECODES decode calls timed).

Needs CUDA and deepspeed (the [offload] extra)."""

import gc
import json
import sys
from pathlib import Path

import torch

MIB = 1 << 20
DECODES = 8


def _mib(n: int) -> str:
    return f"{n / MIB:9.1f}"


def accelerate_leak(path: Path, allowance: int, context: int, prefix: int) -> dict:
    from packbench.engine.accelerate import AcceleratedModel

    dev = torch.device("cuda:0")
    before = torch.cuda.memory_allocated(dev)
    m = AcceleratedModel(path, dtype=torch.float16, device=dev, allowance_bytes=allowance, context_bytes=context,
                         capacity=prefix + 16)
    built = torch.cuda.memory_allocated(dev)
    cache = m.new_cache(prefix + 16)
    m.forward(torch.arange(4, 4 + prefix, device=dev)[None], cache)
    torch.cuda.synchronize()
    ran = torch.cuda.memory_allocated(dev)
    del m, cache
    gc.collect()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated(dev)
    return {"before_mib": before / MIB, "built_mib": built / MIB, "after_prefill_mib": ran / MIB,
            "after_release_mib": after / MIB}


def zero_probe(path: Path, allowance: int, context: int, prefix: int) -> dict:
    import packbench.engine.zero_inference as zi

    dev = torch.device("cuda:0")
    gc.collect()
    torch.cuda.empty_cache()
    marks: list[tuple[str, int, int]] = []
    real_init = None
    ds = zi.library(dev)
    real_init, real_initialize = ds.zero.Init, ds.initialize

    def init(*a, **k):
        r = real_init(*a, **k)
        torch.cuda.synchronize()
        marks.append(("after zero.Init", torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)))
        return r

    def initialize(*a, **k):
        r = real_initialize(*a, **k)
        torch.cuda.synchronize()
        marks.append(("after deepspeed.initialize", torch.cuda.memory_allocated(dev),
                      torch.cuda.max_memory_allocated(dev)))
        return r

    ds.zero.Init, ds.initialize = init, initialize
    torch.cuda.reset_peak_memory_stats(dev)
    out: dict = {"held_before_mib": torch.cuda.memory_allocated(dev) / MIB}
    try:
        m = zi.ZeroInferenceModel(path, dtype=torch.float16, device=dev, allowance_bytes=allowance,
                                  context_bytes=context, capacity=prefix + 16, batch=1)
    except Exception as e:  # noqa: BLE001 - a probe: the error is its finding
        out["build_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["marks"] = [(n, a / MIB, p / MIB) for n, a, p in marks]
        return out
    finally:
        ds.zero.Init, ds.initialize = real_init, real_initialize
    out["marks"] = [(n, a / MIB, p / MIB) for n, a, p in marks]
    out["budget"] = m.stats.budget
    out["ds_config"] = m.ds_config["zero_optimization"]
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list({id(p): p for p in m._model.parameters()}.values())
    trail: list[tuple[str, int, int]] = []
    names = {mod: n for n, mod in m._model.named_modules()}

    def hook(where):
        def f(mod, *_):
            g = sum(p.ds_numel for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)
            trail.append((f"{where} {names.get(mod, '?')}", torch.cuda.memory_allocated(dev), g,
                          torch.cuda.memory_reserved(dev)))
        return f

    for mod in m._model.modules():
        mod.register_forward_pre_hook(hook("pre"))
        mod.register_forward_hook(hook("post"))
    for phase, ids in (("prefill", torch.arange(4, 4 + prefix, device=dev)[None]),
                       ("decode", torch.tensor([[5]], device=dev))):
        trail.clear()
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            if phase == "prefill":
                cache = m.new_cache()
            m.forward(ids, cache)
            torch.cuda.synchronize()
            top = sorted(trail, key=lambda t: -t[1])[:3]
            out[phase] = {"peak_mib": torch.cuda.max_memory_allocated(dev) / MIB,
                          "peak_reserved_mib": torch.cuda.max_memory_reserved(dev) / MIB,
                          "highest": [(n, a / MIB, g, r / MIB) for n, a, g, r in top],
                          "max_gathered_elements": max((g for _, _, g, _ in trail), default=0)}
        except Exception as e:  # noqa: BLE001
            out[phase] = {"error": f"{type(e).__name__}: {str(e)[:420]}",
                          "last": [(n, a / MIB, g, r / MIB) for n, a, g, r in trail[-3:]],
                          "max_gathered_elements": max((g for _, _, g, _ in trail), default=0)}
            return out
    import time
    times = []
    for i in range(DECODES):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.forward(torch.tensor([[6 + i]], device=dev), cache)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    out["decode_ms"] = sorted(times)[len(times) // 2]
    out["peak_allocated_mib"] = torch.cuda.max_memory_allocated(dev) / MIB
    out["peak_reserved_mib"] = torch.cuda.max_memory_reserved(dev) / MIB
    del m, cache
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = Path(args[0])
    allowance = int(args[1] if len(args) > 1 else 4800) * MIB
    prefix = int(args[2]) if len(args) > 2 else 512
    from packbench.engine.allowance import impose
    from packbench.engine.sampler import device_uuid, nvml_handle

    dev = torch.device("cuda:0")
    handle = nvml_handle(device_uuid(0))
    context = impose(dev, allowance, handle)
    report = {"allowance_mib": allowance / MIB, "context_mib": context / MIB, "prefix": prefix}
    if "--no-accelerate" not in sys.argv:
        try:
            report["accelerate"] = accelerate_leak(path, allowance, context, prefix)
        except Exception as e:  # noqa: BLE001
            report["accelerate"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        context = impose(dev, allowance, handle)
    scales = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--scales=")), None)
    if scales is None:
        report["zero_inference"] = zero_probe(path, allowance, context, prefix)
    else:
        import packbench.engine.zero_inference as zi

        real = zi.ZeroBudget.max_live
        for s in scales.split(","):
            zi.ZeroBudget.max_live = property(
                lambda b, s=float(s): int(s * b.gather_bytes) // b.element_bytes - 2 * b.largest_module)
            context = impose(dev, allowance, handle)
            report[f"zero_inference scale {s}"] = r = zero_probe(path, allowance, context, prefix)
            print(s, {k: r.get(k) for k in ("decode_ms", "peak_allocated_mib", "peak_reserved_mib")},
                  (r.get("decode") or {}).get("error", "")[:300], file=sys.stderr, flush=True)
        zi.ZeroBudget.max_live = real
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
