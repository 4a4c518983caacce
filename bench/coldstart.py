"""Cold start of a CPU-first model, stock read against the placed read, alternated.

Usage (GPU machine):  python -m bench.coldstart --shape opt-2.7b --dtype float16 --repeats 2

Each start is a fresh Python process (the worker's view: entry, imports, load, first logit),
reading a checkpoint already in the page cache (one untimed read first). `stock`: safetensors
through safe_open (mmap), the outgoing weights pinned by a copy, the rest moved by
`model.to(device)` from pageable memory, transformers imported at load (mode eager).
`placed`: engine/checkpoint.py read_placed (parallel preads straight into pinned outgoing
weights and, through a pinned ring, into device tensors), mode eager. `placed-graph`: the
same in mode graph, which never imports transformers. The first logit is a dense-stream
prefill in the variant's mode. `+register`: PyTorch's pinned allocator maps pages with
cudaHostRegister on 8 threads (PYTORCH_CUDA_ALLOC_CONF) instead of one cudaHostAlloc.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


VARIANTS = ("stock", "placed", "placed-graph", "placed-graph+register")


def child(model_dir: str, dtype: str, variant: str, prefix: int) -> None:
    t_entry = time.perf_counter()
    import torch

    import engine.model as m
    from engine.checkpoint import build_weights
    from engine.episode import run_episode
    from engine.shapes import dtype_of

    t_import = time.perf_counter()
    mode = "eager"
    if variant == "stock":  # safe_open (mmap), pin by copy, .to(device); transformers at load
        m.build_weights = lambda d, *, dtype, device, host_keys: build_weights(d, dtype=dtype)
    elif variant.startswith("placed-graph"):
        mode = "graph"
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.zeros(1, device=device)  # the CUDA context, as the worker makes it before loading
    t_context = time.perf_counter()
    model = m.CpuFirstModel(Path(model_dir), dtype=dtype_of(dtype), device=device, mode=mode)
    t_loaded = time.perf_counter()
    model.use("dense-stream")
    out = run_episode(model, [2] + list(range(10, 9 + prefix)), continuation=1)
    import sys

    transformers_loaded = "transformers" in sys.modules
    s = model.start
    print(json.dumps({"variant": variant, "import_s": t_import - t_entry, "context_s": t_context - t_import,
                      "read_s": s.read_s, "pin_s": model.host.pin_s, "place_s": s.place_s,
                      "load_s": t_loaded - t_context, "entry_to_logit_s": out.first_logit_at - t_entry,
                      "to_logit_s": out.first_logit_at - t_loaded, "token": out.tokens[0],
                      "transformers_imported": transformers_loaded}))


def profile(model_dir: Path, dtype: str) -> None:
    """Stage times of one load in this process (the page cache already warm)."""
    import os

    import torch
    from transformers import OPTConfig, OPTForCausalLM

    import engine.checkpoint as ck
    from engine.model import is_outgoing
    from engine.shapes import dtype_of

    dt, device = dtype_of(dtype), torch.device("cuda:0")
    torch.zeros(1, device=device)

    def timed(label, fn):
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # no pinned block reused across stages
        torch.cuda.empty_cache()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        print(f"{label:48}{time.perf_counter() - t:8.3f} s", flush=True)
        return out

    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"{len(files)} file(s), {size / 1e9:.2f} GB")
    config = OPTConfig(**{k: v for k, v in ck.read_config(model_dir).items() if k != "packbench_synth"})
    config._attn_implementation = "eager"

    def meta():
        with torch.device("meta"):
            return OPTForCausalLM(config)

    timed("OPTForCausalLM(config) on meta", meta)
    timed("stock read_state_dict (safe_open, lazy)", lambda: ck.read_state_dict(model_dir, dtype=dt))
    buf = bytearray(64 << 20)

    def sequential():
        with open(files[0], "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    timed("one sequential read of the file (64 MiB chunks)", sequential)
    n_out = sum(e[3] for e in ck._entries(model_dir) if is_outgoing(e[0]))
    timed(f"pinned empty x32 ({n_out / 1e9:.2f} GB)",
          lambda: [torch.empty(n_out // 32, dtype=torch.uint8, pin_memory=True) for _ in range(32)])
    timed("pageable empty + touch (same bytes)", lambda: torch.ones(n_out, dtype=torch.uint8))
    for threads in (16, 4):
        timed(f"read_placed threads={threads}",
              lambda: ck.read_placed(model_dir, dtype=dt, device=device, host_keys=is_outgoing, threads=threads))
    timed("read_placed, all on the device (no pinned tensors)",
          lambda: ck.read_placed(model_dir, dtype=dt, device=device, host_keys=lambda n: False))
    timed("read_placed, all on the host in pinned memory",
          lambda: ck.read_placed(model_dir, dtype=dt, device=device, host_keys=lambda n: True))
    timed("stock build_model (host, transformers)", lambda: ck.build_model(model_dir, dtype=dt))
    timed("placed build_weights", lambda: ck.build_weights(model_dir, dtype=dt, device=device, host_keys=is_outgoing))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-125m")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "VARIANT"))
    ap.add_argument("--profile", action="store_true", help="stage times of one load in this process")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.dtype, args.child[1], args.prefix)
        return
    from engine.synth import synth_checkpoint

    # bench.engine's default checkpoint (same folder, same spec): one synthesis serves both
    model_dir = Path(tempfile.gettempdir()) / f"packbench-{args.shape}-{args.dtype}-0.94-hot0.05-0.0"
    if not (model_dir / "config.json").exists():
        synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, sparsity=0.94, seed=0,
                         hot_fraction=0.05, hot_bias=0.0)
    for f in model_dir.glob("*.safetensors"):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    if args.profile:
        profile(model_dir, args.dtype)
        return
    rows = []
    for r in range(args.repeats):
        k = r % len(VARIANTS)
        for variant in VARIANTS[k:] + VARIANTS[:k]:
            t = time.perf_counter()
            env = dict(os.environ)
            if variant.endswith("+register"):  # pinned memory by malloc + cudaHostRegister, 8 threads
                env["PYTORCH_CUDA_ALLOC_CONF"] = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
            res = subprocess.run([sys.executable, "-m", "bench.coldstart", "--dtype", args.dtype, "--prefix",
                                  str(args.prefix), "--child", str(model_dir), variant],
                                 capture_output=True, text=True, env=env)
            if res.returncode:
                raise SystemExit(res.stderr[-3000:])
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["process_s"] = time.perf_counter() - t
            rows.append(row)
            print(json.dumps(row))
    for row in rows:  # the worker's clock starts after its imports (engine/worker.py t_entry)
        row["after_import_s"] = row["entry_to_logit_s"] - row["import_s"]
    keys = ("import_s", "context_s", "read_s", "pin_s", "place_s", "load_s", "to_logit_s",
            "entry_to_logit_s", "after_import_s", "process_s")
    print(f"\n{args.shape} {args.dtype}, prefill {args.prefix} tokens, dense-stream, {args.repeats} alternated repeats "
          f"(median of each)")
    print(f"{'variant':24}" + "".join(f"{k.replace('_s', ''):>15}" for k in keys))
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        med = {k: sorted(r[k] for r in mine)[len(mine) // 2] for k in keys}
        print(f"{variant:24}" + "".join(f"{med[k]:15.2f}" for k in keys))
    print("same first token:", len({r["token"] for r in rows}) == 1,
          "| transformers imported:", {v: any(r["transformers_imported"] for r in rows if r["variant"] == v) for v in VARIANTS})


if __name__ == "__main__":
    main()
