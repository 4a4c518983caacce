"""Cold start of a CPU-first model, stock read against the placed read, alternated.

Usage (GPU machine):  python -m bench.coldstart --shape opt-2.7b --dtype float16 --repeats 2

Each start is a fresh Python process (the worker's view: entry, imports, load, first logit),
reading a checkpoint already in the page cache (one untimed read first). `stock`: safetensors
through safe_open (mmap), the outgoing weights pinned by a copy, the rest moved by
`model.to(device)` from pageable memory. `placed`: engine/checkpoint.py read_placed (parallel
preads straight into pinned outgoing weights and, through a pinned ring, into device tensors).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(model_dir: str, dtype: str, variant: str, prefix: int) -> None:
    t_entry = time.perf_counter()
    import torch

    import engine.model as m
    from engine.checkpoint import build_model
    from engine.episode import run_episode
    from engine.shapes import dtype_of

    t_import = time.perf_counter()
    if variant == "stock":
        m.build_model = lambda d, *, dtype, device, host_keys: build_model(d, dtype=dtype)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.zeros(1, device=device)  # the CUDA context, as the worker makes it before loading
    t_context = time.perf_counter()
    model = m.CpuFirstModel(Path(model_dir), dtype=dtype_of(dtype), device=device)
    t_loaded = time.perf_counter()
    model.use("dense-stream")
    out = run_episode(model, [2] + list(range(10, 9 + prefix)), continuation=1)
    s = model.start
    print(json.dumps({"variant": variant, "import_s": t_import - t_entry, "context_s": t_context - t_import,
                      "read_s": s.read_s, "pin_s": model.host.pin_s, "place_s": s.place_s,
                      "load_s": t_loaded - t_context, "entry_to_logit_s": out.first_logit_at - t_entry,
                      "to_logit_s": out.first_logit_at - t_loaded, "token": out.tokens[0]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-125m")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "VARIANT"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.dtype, args.child[1], args.prefix)
        return
    from engine.synth import synth_checkpoint

    model_dir = Path(tempfile.gettempdir()) / f"packbench-cold-{args.shape}-{args.dtype}"
    if not (model_dir / "config.json").exists():
        synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, sparsity=0.94, seed=0)
    for f in model_dir.glob("*.safetensors"):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    rows = []
    for r in range(args.repeats):
        for variant in (("stock", "placed") if r % 2 == 0 else ("placed", "stock")):
            t = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "bench.coldstart", "--dtype", args.dtype, "--prefix",
                                  str(args.prefix), "--child", str(model_dir), variant],
                                 capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(res.stderr[-3000:])
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["process_s"] = time.perf_counter() - t
            rows.append(row)
            print(json.dumps(row))
    keys = ("import_s", "context_s", "read_s", "pin_s", "place_s", "load_s", "to_logit_s",
            "entry_to_logit_s", "process_s")
    print(f"\n{args.shape} {args.dtype}, prefill {args.prefix} tokens, dense-stream, {args.repeats} alternated repeats "
          f"(median of each)")
    print(f"{'variant':8}" + "".join(f"{k.replace('_s', ''):>12}" for k in keys))
    for variant in ("stock", "placed"):
        mine = [r for r in rows if r["variant"] == variant]
        med = {k: sorted(r[k] for r in mine)[len(mine) // 2] for k in keys}
        print(f"{variant:8}" + "".join(f"{med[k]:12.2f}" for k in keys))
    print("same first token:", len({r["token"] for r in rows}) == 1)


if __name__ == "__main__":
    main()
