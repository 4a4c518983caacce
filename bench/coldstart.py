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
`@<pin>`: read_placed's host layout (engine/checkpoint.py PIN_MODES; without it, the default);
`@legacy`: the read as it was before them (bench/legacy_read.py), the baseline.

`--profile --fresh`: where a fresh process spends its read. Each probe runs in a new process,
probes alternated, `--repeats` rounds, medians; the imports are excluded and the CUDA context
(made first, as a worker does) is reported apart. Probes: `read@<pin>` (read_placed with its
stage times), and raw steps: `pinned-32` (32 pinned tensors of the outgoing weights' size, the
old layout), `pinned-blocks`, `device-alloc` (the device tensors' empties), `touch` (fresh
anonymous memory of the outgoing weights' size populated on the reading threads), `pread`
(the whole file read by the reading threads into reused buffers: the page cache's rate).
Runs on the CPU too (device cpu; the CUDA-only probes are skipped).
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
PINS = ("legacy", "tensors", "blocks", "register", "map")  # legacy: bench/legacy_read.py
PROBES = tuple(f"read@{p}" for p in PINS) + ("pinned-32", "pinned-blocks", "device-alloc", "touch", "pread")


def child(model_dir: str, dtype: str, variant: str, prefix: int) -> None:
    t_entry = time.perf_counter()
    import torch

    import packbench.engine.model as m
    from packbench.engine.checkpoint import build_weights
    from packbench.engine.episode import run_episode
    from packbench.engine.dtypes import dtype_of

    t_import = time.perf_counter()
    mode = "eager"
    name, variant, _, pin = variant, *variant.partition("@")
    if pin:
        import packbench.engine.checkpoint as ck

        if pin == "legacy":
            from bench.legacy_read import read_placed

            ck.read_placed = read_placed
        else:
            ck.PIN = pin
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
    print(json.dumps({"variant": name, "import_s": t_import - t_entry, "context_s": t_context - t_import,
                      "read_s": s.read_s, "pin_s": model.host.pin_s, "place_s": s.place_s,
                      "load_s": t_loaded - t_context, "entry_to_logit_s": out.first_logit_at - t_entry,
                      "to_logit_s": out.first_logit_at - t_loaded, "token": out.tokens[0],
                      "transformers_imported": transformers_loaded}))


def probe(model_dir: str, dtype: str, name: str, threads: int | None) -> None:
    """One probe of `--profile --fresh`, in this (fresh) process: a JSON line of seconds."""
    t_entry = time.perf_counter()
    import torch

    import packbench.engine.checkpoint as ck
    from packbench.engine.model import is_outgoing
    from packbench.engine.dtypes import dtype_of

    t_import = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = {"probe": name, "import_s": t_import - t_entry, "context_s": t0 - t_import}
    entries = ck._entries(Path(model_dir))
    host = [e for e in entries if not cuda or is_outgoing(e[0])]
    host_bytes = sum(e[3] for e in host)
    threads = threads or min(16, os.cpu_count() or 1)
    keep = None
    if name.startswith("read@"):
        stages = {}
        if name == "read@legacy":
            from bench.legacy_read import read_placed

            ck.read_placed = read_placed
        keep = ck.read_placed(Path(model_dir), dtype=dtype_of(dtype), device=device, host_keys=is_outgoing,
                              threads=threads, pin=name.split("@")[1], timings=stages)
        out.update({f"{k}_s": v for k, v in stages.items()})
        if cuda:  # are the host weights pinned, and does a copy from them run at the pinned rate?
            w = keep[host[0][0]]
            out["pinned"] = w.is_pinned()
            dst = torch.empty_like(w, device=device)
            sync()
            t = time.perf_counter()
            for _ in range(4):
                dst.copy_(w, non_blocking=True)
            sync()
            out["h2d_GBps"] = 4 * w.numel() * w.element_size() / (time.perf_counter() - t) / 1e9
            t0 += time.perf_counter() - t  # not part of the read
    elif name == "pinned-32":
        keep = [torch.empty(e[3], dtype=torch.uint8, pin_memory=cuda) for e in host]
    elif name == "pinned-blocks":
        keep = [torch.empty(sum(ck._aligned(host[i][3]) for i in g), dtype=torch.uint8, pin_memory=cuda)
                for g in ck._blocks([e[3] for e in host])]
    elif name == "device-alloc":
        keep = [torch.empty(e[5], dtype=e[4], device=device) for e in entries if cuda and not is_outgoing(e[0])]
    elif name == "touch":
        import mmap
        from concurrent.futures import ThreadPoolExecutor

        keep = mmap.mmap(-1, ck._aligned(host_bytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base, step = ck._Mapping.tensor(keep).data_ptr(), ck.CHUNK
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda a: ck._populate(base + a, min(step, host_bytes - a)), range(0, host_bytes, step)))
        out["populate_supported"] = ck._can_populate[0]
    elif name == "pread":
        from concurrent.futures import ThreadPoolExecutor

        files = sorted(Path(model_dir).glob("*.safetensors"))
        bufs = [torch.empty(ck.CHUNK, dtype=torch.uint8) for _ in range(threads)]
        for b in bufs:
            b.fill_(0)  # touched: only the copy from the page cache is timed
        t0 = time.perf_counter()
        jobs = []
        for f in files:
            fd, size = os.open(f, os.O_RDONLY), f.stat().st_size
            jobs += [(fd, off, min(ck.CHUNK, size - off)) for off in range(0, size, ck.CHUNK)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda j: ck._pread(j[0], bufs[j[1] // ck.CHUNK % threads][:j[2]], j[1]), jobs))
        out["GBps"] = sum(j[2] for j in jobs) / (time.perf_counter() - t0) / 1e9
    else:
        raise SystemExit(f"unknown probe {name}: one of {', '.join(PROBES)}")
    sync()
    out["total_s"] = time.perf_counter() - t0
    print(json.dumps(out))
    del keep


def fresh_profile(model_dir: Path, args) -> None:
    """`--profile --fresh`: every probe in its own new process, alternated, medians."""
    import torch

    probes = [p.strip() for p in args.probes.split(",")] if args.probes else list(PROBES)
    if not torch.cuda.is_available():
        probes = [p for p in probes if p not in ("pinned-32", "pinned-blocks", "device-alloc")]
    rows = []
    for r in range(args.repeats):
        k = r % len(probes)
        for name in probes[k:] + probes[:k]:
            cmd = [sys.executable, "-m", "bench.coldstart", "--dtype", args.dtype, "--probe", str(model_dir), name]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                print(json.dumps({"probe": name, "error": res.stderr.strip().splitlines()[-1:]}), flush=True)
                continue
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    keys = sorted({k for r in rows for k in r if k not in ("probe",)} - {"pinned", "populate_supported"},
                  key=lambda k: (k not in ("import_s", "context_s"), k == "total_s", k))
    print(f"\nfresh-process probes, {args.shape} {args.dtype}, {args.repeats} alternated rounds, medians "
          f"(seconds; GBps in GB/s); stages of one read overlap (host side and device side run together)")
    print(f"{'probe':16}" + "".join(f"{k.replace('_s', ''):>14}" for k in keys))
    for name in probes:
        mine = [r for r in rows if r["probe"] == name]
        if not mine:
            continue
        cells = []
        for k in keys:
            vals = sorted(r[k] for r in mine if k in r)
            cells.append(f"{vals[len(vals) // 2]:14.3f}" if vals else f"{'':>14}")
        extra = [f"pinned={mine[0]['pinned']}" for _ in [0] if "pinned" in mine[0]]
        print(f"{name:16}" + "".join(cells) + ("  " + " ".join(extra) if extra else ""))


def profile(model_dir: Path, dtype: str) -> None:
    """Stage times of one load in this process (the page cache already warm)."""
    import os

    import torch
    from transformers import OPTConfig, OPTForCausalLM

    import packbench.engine.checkpoint as ck
    from packbench.engine.model import is_outgoing
    from packbench.engine.dtypes import dtype_of

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
    ap.add_argument("--fresh", action="store_true", help="with --profile: each probe in a fresh process")
    ap.add_argument("--probes", help=f"with --profile --fresh: comma-separated, of {', '.join(PROBES)}")
    ap.add_argument("--variants", help=f"comma-separated, default {','.join(VARIANTS)}; a variant may end "
                    f"in @<pin> ({', '.join(PINS)})")
    ap.add_argument("--threads", type=int, help="reading threads (default: read_placed's)")
    ap.add_argument("--probe", nargs=2, metavar=("MODEL_DIR", "PROBE"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.dtype, args.child[1], args.prefix)
        return
    if args.probe:
        probe(args.probe[0], args.dtype, args.probe[1], args.threads)
        return
    from packbench.engine.synth import synth_checkpoint

    # bench.engine's default checkpoint (same folder, same spec): one synthesis serves both
    model_dir = Path(tempfile.gettempdir()) / f"packbench-{args.shape}-{args.dtype}-0.94-hot0.05-0.0"
    if not (model_dir / "config.json").exists():
        synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, sparsity=0.94, seed=0,
                         hot_fraction=0.05, hot_bias=0.0)
    for f in model_dir.glob("*.safetensors"):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    if args.profile and args.fresh:
        fresh_profile(model_dir, args)
        return
    if args.profile:
        profile(model_dir, args.dtype)
        return
    variants = tuple(v.strip() for v in args.variants.split(",")) if args.variants else VARIANTS
    rows = []
    for r in range(args.repeats):
        k = r % len(variants)
        for variant in variants[k:] + variants[:k]:
            t = time.perf_counter()
            env = dict(os.environ)
            if variant.split("@")[0].endswith("+register"):  # pinned memory by malloc + cudaHostRegister, 8 threads
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
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        med = {k: sorted(r[k] for r in mine)[len(mine) // 2] for k in keys}
        print(f"{variant:24}" + "".join(f"{med[k]:15.2f}" for k in keys))
    print("same first token:", len({r["token"] for r in rows}) == 1,
          "| transformers imported:", {v: any(r["transformers_imported"] for r in rows if r["variant"] == v) for v in variants})


if __name__ == "__main__":
    main()
