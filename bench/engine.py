"""Every loader policy head to head on one synthetic checkpoint, plus accelerate's offload.

Usage (GPU machine):  python -m bench.engine --shape opt-2.7b --dtype float16 --allowance-mib 4800
CPU timings are CPU timings: say so when quoting them.

Method (shared/device METHOD.md): one process, one CPU-first model, the allowance imposed on
PyTorch's allocator (minus the CUDA context); conditions alternate, rotated per prompt and
round, so drift hits them alike; the reference (dense-stream) must first reproduce itself;
decode is the median ms per decode call over every scored token. accelerate (--accelerate) is
one more alternated condition, served by a child process that holds its own model (both
models would not fit one allowance), on the same prompts.
"""

import argparse
import atexit
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from packbench.core.plan import BOS
from packbench.core.serving import condition_serving, outlier_text
from packbench.engine import gather
from packbench.engine.episode import run_episode
from packbench.engine.graph import check_mode
from packbench.engine.model import CpuFirstModel
from packbench.engine.ledger import Recorder
from packbench.engine.conditions import POLICIES
from packbench.engine.policies.base import HostWeights, stream_dense, zeroed_workspace
from packbench.engine.allowance import impose
from packbench.engine.sampler import MemorySampler, device_uuid, nvml_handle
from packbench.engine.dtypes import dtype_of
from packbench.engine.synth import synth_checkpoint

MIB = 1 << 20
PARAMS = {"sparse-extents": {"block_rows": 128}, "row-retention": {"rows_per_layer": 1024}}


class SingleStreamDense:
    """dense-stream as it was before its copy stream (issue 11), for `dense-stream+copies=single`
    only: one workspace, each layer's copy issued at fetch on the compute stream. Same bytes,
    same logits; kept here so one alternated run can compare both schedules."""

    name = "dense-stream"  # captured in mode graph like dense-stream (engine/conditions/dense_stream.py graph_safe)
    starts_early = False

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder
        self.workspace = zeroed_workspace(host, device)

    def deactivate(self) -> None:
        self.workspace = None

    def before_layer(self, layer: int) -> None:
        pass  # the copy is issued at fetch

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return stream_dense(self.host, layer, self.workspace, self.recorder)

    def device_bytes(self) -> int:
        return 0 if self.workspace is None else self.workspace.numel() * self.workspace.element_size()

    def pinned_bytes(self) -> int:
        return 0


# `+copies=...`: bench-only variants of dense-stream's copy schedule (not protocol parameters).
COPIES = {"single": SingleStreamDense}


def use(model: CpuFirstModel, policy: str, params: dict) -> None:
    """model.use, or a bench-only variant named by `copies` or `tile` (parse_condition checked it):
    `tile` runs the device gather's Triton kernel with that tile instead of engine.gather's choice,
    `split` with that column split (engine.gather.SPLIT_TOKENS)."""
    params = dict(params)
    tile, split = params.pop("tile", None), params.pop("split", None)
    if tile != gather.TILE_OVERRIDE or split != gather.SPLIT_OVERRIDE:  # another kernel: warm up before a capture
        gather.TILE_OVERRIDE, gather.SPLIT_OVERRIDE = tile, split
        model.graph.forget_warm_ups()
    copies = params.pop("copies", None)
    if copies is None:
        model.use(policy, **params)
    else:
        model.use_policy(COPIES[copies]())


# The graph decoder's measured variants (bench only): +attention=static captures the whole step
# over the static span; +kv=serial runs a captured layer's k and v after q; +attend=matmul runs the
# attention between replayed pieces through torch.matmul as in eager calls, with a copy into the
# static buffer (before 3D views). The first value of each is what mode graph does.
GRAPH_VARIANTS = {"attention": ("live", "static"), "kv": ("parallel", "serial"), "attend": ("views", "matmul")}


def parse_condition(spec: str) -> tuple[str, dict, bool, str]:
    """`policy[+key=value...]` -> (policy, params, sampler on, mode). `+sampler=off` runs the
    episode without the NVML sampler (memory and energy readings), `+recording=off` without the
    per-call ledger, so their overheads show up as paired differences;
    `+mode=graph` runs it in engine mode graph (engine/graph.py; default eager); a key of
    GRAPH_VARIANTS implies mode graph and makes the mode `graph/key=value,...`;
    `dense-stream+copies=single` runs dense-stream's schedule before issue 11 (bench only)."""
    policy, *pairs = spec.split("+")
    params, sampler, mode, variant = dict(PARAMS.get(policy, {})), True, "eager", {}
    for pair in pairs:
        key, value = pair.split("=")
        if key == "sampler":
            sampler = value != "off"
        elif key == "mode":
            mode = check_mode(value)
        elif key in GRAPH_VARIANTS:
            if value not in GRAPH_VARIANTS[key]:
                raise SystemExit(f"{spec}: +{key}= is one of {', '.join(GRAPH_VARIANTS[key])}")
            variant[key] = value
        elif key == "tile":
            if policy not in ("packet", "phase-switched") or len(value.split(":")) != 3:
                raise SystemExit(f"{spec}: +tile=ROWS:COLUMNS:WARPS is the device gather's (packet, phase-switched)")
            params["tile"] = tuple(int(v) for v in value.split(":"))
        elif key == "split":
            if policy not in ("packet", "phase-switched") or not value.isdigit():
                raise SystemExit(f"{spec}: +split=TOKENS is the device gather's (packet, phase-switched): calls "
                                 f"of at most TOKENS tokens split a neuron block's columns over programs (0: never)")
            params["split"] = int(value)
        elif key == "copies" and (policy != "dense-stream" or value not in COPIES):
            raise SystemExit(f"{spec}: +copies= is dense-stream's only, one of {', '.join(COPIES)}")
        else:
            params[key] = int(value) if value.isdigit() else value
    if variant:
        mode = "graph/" + ",".join(f"{k}={v}" for k, v in sorted(variant.items()))
    return policy, params, sampler, mode


def set_mode(model: CpuFirstModel, mode: str) -> str:
    """`eager`, `graph` or `graph/key=value,...` (parse_condition's) -> the engine mode, with the
    graph decoder's variants set for the next episode (the first of each GRAPH_VARIANTS by default)."""
    mode, _, variant = mode.partition("/")
    chosen = dict(pair.split("=") for pair in variant.split(",") if pair)
    pick = {key: chosen.get(key, values[0]) for key, values in GRAPH_VARIANTS.items()}
    model.graph.attention = pick["attention"]
    model.graph.parallel_kv = pick["kv"] == "parallel"
    model.graph.attend_views = pick["attend"] == "views"
    return mode


def pinned_h2d_gbps(device: torch.device, mib: int = 256, reps: int = 10, trials: int = 5) -> float:
    """The pinned copy's peak: the best of `trials` timings of `reps` copies (one timing alone
    read 43.7 GB/s on a lease where dense-stream then moved 50.4: the floor must not be low)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, reps * src.numel() / (time.perf_counter() - t0) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return best


def accelerate_server(conn, model_dir: str, dtype: str, continuation: int, allowance_mib: int,
                      uuid: str | None) -> None:
    """A child process holding accelerate's device_map="auto" offload at the same max_memory.

    It lives beside the CPU-first model for the whole run, so its episodes alternate with the
    packbench conditions (drift hits both alike) without either model counting against the
    other's allowance; it runs only while the parent waits for its answer. Per prompt sent,
    it answers with that episode's timings, logits, tokens and sampled peak.
    """
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.cuda.set_per_process_memory_fraction(1.0)  # accelerate gets max_memory, as its users do
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype_of(dtype), device_map="auto",
                                                 max_memory={0: f"{allowance_mib}MiB", "cpu": "200GiB"},
                                                 attn_implementation="eager")
    model.eval()
    sampler = MemorySampler(uuid)
    conn.send("ready")
    while (prompt := conn.recv()) is not None:
        sampler.start()
        cache, ids, rows, toks, walls = DynamicCache(), torch.tensor([prompt], device="cuda"), [], [], []
        with torch.inference_mode():
            for _ in range(continuation):
                t0 = time.perf_counter()
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
                row = logits.float().cpu().numpy()
                walls.append(time.perf_counter() - t0)
                toks.append(int(row.argmax()))
                rows.append(row)
                ids = torch.tensor([[toks[-1]]], device="cuda")
        conn.send({"walls": walls, "logits": np.stack(rows), "tokens": toks,
                   "peak_sampled": sampler.stop()["peak_sampled_bytes"] or 0,
                   "peak_alloc": torch.cuda.max_memory_allocated()})
    sampler.close()


def start_accelerate(model_dir: Path, args, uuid: str | None):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # Not a daemon: it starts its own NVML sampler process, which a daemon may not.
    proc = ctx.Process(target=accelerate_server,
                       args=(child, str(model_dir), args.dtype, args.continuation, args.allowance_mib, uuid))
    proc.start()
    if receive((parent, proc)) != "ready":
        raise SystemExit("accelerate's process did not start")
    return parent, proc


def stop_accelerate(accelerate) -> None:
    conn, proc = accelerate
    if proc.is_alive():
        conn.send(None)
        proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()


def receive(accelerate, timeout_s: float = 300.0):
    """The child's next answer; exits if the child died or stays silent (never hang the run)."""
    conn, proc = accelerate
    deadline = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"accelerate's process died (exit code {proc.exitcode}); see its traceback above")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"accelerate's process gave no answer in {timeout_s:.0f} s")
    return conn.recv()


def workload(rows: dict, policies: list[str]) -> None:
    """Byte ratios against dense-stream (docs/workloads.md's rows): per decode call, per prefill,
    per episode; early-forecast's extra bytes over packet's and its decode-to-decode forecasts."""
    dense = next((n for n in policies if n.split("+")[0] == "dense-stream" and rows[n]["episode_h2d"]), None)
    if dense is None:
        return
    ref = rows[dense]
    mean = statistics.mean
    print(f"\nworkload against {dense} (H2D bytes, index bytes included):")
    for name in policies:
        row = rows[name]
        if not row["episode_h2d"] or name == dense:
            continue
        line = (f"  {name}: decode {mean(row['decode_h2d']) / mean(ref['decode_h2d']):.4%}, prefill "
                f"{mean(row['prefill_h2d']) / mean(ref['prefill_h2d']):.4%}, episode "
                f"{sum(row['episode_h2d']) / sum(ref['episode_h2d']):.4%}")
        packet = next((n for n in policies if n.split("+")[0] == "packet" and rows[n]["episode_h2d"]), None)
        if row["fc_used"] and packet:
            line += (f"; over {packet}: {sum(row['episode_h2d']) / sum(rows[packet]['episode_h2d']) - 1:+.2%} "
                     f"(decode-to-decode forecasts alone: {sum(row['fc_wasted']) / sum(rows[packet]['episode_rows']):+.2%}); "
                     f"those wasted {sum(row['fc_wasted']):,} / used {sum(row['fc_used']):,} rows "
                     f"(x{sum(row['fc_wasted']) / max(sum(row['fc_used']), 1):.3f})")
        print(line)


def oom(row: dict) -> str:
    return f" ({len(row['failed'])} failed)" if row["failed"] else ""


def serving_record(walls: list[float], wall_s: float, decode_graph: str | None, *,
                   tokens: list[int] | None = None) -> dict:
    """An episode as core/serving.py reads an archived record: its calls' walls (the first the
    prefill), its wall and its decode graph; what the report and `packbench results` read."""
    tokens = tokens or [1] * len(walls)
    calls = [{"phase": "prefill" if n == 0 else "decode", "wall_s": w, "tokens": t}
             for n, (w, t) in enumerate(zip(walls, tokens))]
    return {"status": "ok", "wall_s": wall_s, "calls": calls, "engine": {"decode_graph": decode_graph}}


def serving_table(rows: dict, policies: list[str], w: int) -> None:
    """The serving figures of docs/metrics.md over the same episodes, by the same functions as the
    report, `packbench results` and the API (core.serving.condition_serving)."""
    print(f"\nserving figures (docs/metrics.md; medians over episodes, ITL over every decode call)")
    print(f"{'condition':{w}}{'TTFT ms':>9}{'TPOT ms':>9}{'ITL p50':>9}{'p90':>8}{'p99':>8}{'tok/s':>9}"
          f"{'steady ms':>10}{'once ms':>9}{'capture ms':>11}  beyond 3 IQR (walls)")
    for name in policies:
        if not rows[name]["records"]:
            continue
        f = condition_serving(rows[name]["records"])
        ms = lambda v: float("nan") if v is None else v * 1e3  # noqa: E731
        print(f"{name:{w}}{ms(f['ttft_s']):9.3f}{ms(f['tpot_s']):9.3f}{ms(f['itl_p50_s']):9.3f}"
              f"{ms(f['itl_p90_s']):8.3f}{ms(f['itl_p99_s']):8.3f}{f['decode_tokens_per_s'] or float('nan'):9.1f}"
              f"{ms(f['steady_call_s']):10.3f}{ms(f['first_decode_excess_s']):9.3f}{ms(f['capture_s']):11.1f}"
              f"  {outlier_text(len(f['outliers']['wall_s'])) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-125m")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--sparsity", type=float, default=0.94)
    ap.add_argument("--hot-fraction", type=float, default=0.05)
    ap.add_argument("--hot-bias", type=float, default=0.0)
    ap.add_argument("--profile", default=None, help="a calibrated profile (core/registry.py PROFILES, e.g. opt) "
                    "instead of --sparsity/--hot-*")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: synthesise into a temp dir")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--allowance-mib", type=int, default=4800)
    ap.add_argument("--conditions", default=",".join(POLICIES),
                    help="comma list of policy[+param=value...]; +sampler=off drops the NVML sampler, +recording=off the ledger")
    ap.add_argument("--accelerate", action="store_true", help="also run accelerate's device_map offload")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    # As the worker actor does (cluster/worker.py); read when CUDA's allocator starts.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    uuid = device_uuid(device.index or 0) if cuda else None
    handle = nvml_handle(uuid)
    sampler_on, sampler_off = MemorySampler(uuid), MemorySampler(None)
    bw = pinned_h2d_gbps(device)
    context = impose(device, args.allowance_mib * MIB, handle) if cuda else 0
    print(f"CUDA context and other non-allocator memory: {context / MIB:.0f} MiB")
    model_dir = args.model_dir
    recipe = (dict(profile=args.profile) if args.profile else
              dict(sparsity=args.sparsity, hot_fraction=args.hot_fraction, hot_bias=args.hot_bias))
    if model_dir is None:
        model_dir = Path(tempfile.gettempdir()) / (
            f"packbench-{args.shape}-{args.dtype}-" + (f"profile-{args.profile}" if args.profile else
                                                       f"{args.sparsity}-hot{args.hot_fraction}-{args.hot_bias}"))
        if not (model_dir / "config.json").exists():
            t = time.perf_counter()
            synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, seed=0, **recipe)
            print(f"synthesised {args.shape} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    try:
        model = CpuFirstModel(model_dir, dtype=dtype_of(args.dtype), device=device)
    except torch.cuda.OutOfMemoryError as e:
        raise SystemExit(f"the CPU-first model does not fit the allowance: {str(e).splitlines()[0]}")
    print(f"cold start {time.perf_counter() - t:.1f} s: {model.start}; pin {model.host.pin_s:.1f} s")
    # The host's own time per call: forward() returns once a captured step is enqueued, so a
    # decode call whose host time is near its wall kept the GPU waiting on the host.
    host_ms: list[float] = []
    forward = model.forward

    def timed_forward(ids, cache):
        t0 = time.perf_counter()
        logits = forward(ids, cache)
        host_ms.append((time.perf_counter() - t0) * 1e3)
        return logits

    model.forward = timed_forward
    rng = np.random.Generator(np.random.PCG64(0))
    prompts = [[BOS] + rng.integers(4, model.vocab, size=args.prefix - 1).tolist() for _ in range(args.prompts)]
    policies = args.conditions.split(",")
    accelerate = None
    if args.accelerate and cuda:
        accelerate = start_accelerate(model_dir, args, uuid)
        atexit.register(stop_accelerate, accelerate)  # on any exit: a live child would block it
        policies.append("accelerate")

    # The reference runs in the mode of the conditions it judges: one dense-stream per mode, and
    # over int8 rows for the int8 conditions (`+weights=int8`: exact against the int8 dense-stream).
    modes = sorted({parse_condition(name)[3] for name in policies if name != "accelerate"} | {"eager"})
    int8_modes = sorted({parse_condition(name)[3] for name in policies
                         if name != "accelerate" and parse_condition(name)[1].get("weights") == "int8"})
    refs = {}
    for mode, weights in [(m, "dtype") for m in modes] + [(m, "int8") for m in int8_modes]:
        key = mode if weights == "dtype" else (mode, "int8")
        model.use("dense-stream", weights=weights)
        refs[key] = [run_episode(model, p, continuation=args.continuation, mode=set_mode(model, mode))
                     for p in prompts]
        model.use("dense-stream", weights=weights)
        again = run_episode(model, prompts[0], continuation=args.continuation, mode=set_mode(model, mode))
        print(f"dense-stream (mode {mode}, weights {weights}) reproduces itself: "
              f"{np.array_equal(refs[key][0].logits, again.logits)}")
    for mode in modes:
        if mode != "eager":  # mode graph's own decoder against stock transformers (fp16 weights)
            same = [np.array_equal(a.logits, b.logits) for a, b in zip(refs[mode], refs["eager"])]
            toks = [a.tokens == b.tokens for a, b in zip(refs[mode], refs["eager"])]
            diff = max(float(np.abs(a.logits - b.logits).max()) for a, b in zip(refs[mode], refs["eager"]))
            print(f"dense-stream mode {mode} vs eager (stock transformers): tokens equal {all(toks)}, "
                  f"logits bit-identical {all(same)} (max abs diff {diff:.3g})")
            for i, (a, b) in enumerate(zip(refs[mode], refs["eager"])):
                calls = [c for c in range(len(a.tokens)) if not np.array_equal(a.logits[c], b.logits[c])]
                if calls:  # where the bits first part, how close stock's top two logits were there
                    c = calls[0]
                    top = np.sort(b.logits[c])[-2:]
                    split = next((k for k in range(len(a.tokens)) if a.tokens[k] != b.tokens[k]), None)
                    print(f"  prompt {i}: logits first differ at call {c} (max {np.abs(a.logits[c] - b.logits[c]).max():.3g}, "
                          f"stock's top-2 gap there {top[1] - top[0]:.3g}); tokens first differ at call {split}")

    keys = ("decode_ms", "prefill_s", "decode_h2d", "prefill_h2d", "peak_sampled", "peak_alloc", "exact",
            "failed", "wasted", "wait_ms", "device_bytes", "graph", "first_ms", "episode_s", "host_ms",
            "episode_h2d", "episode_rows", "fc_used", "fc_wasted", "records")
    rows: dict[str, dict[str, list]] = {p: {k: [] for k in keys} for p in policies}
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    scopes: set = set()  # "process" unless NVML cannot attribute memory to processes here
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            k = (r * len(prompts) + i) % len(policies)
            for name in policies[k:] + policies[:k]:  # rotate the order every episode
                row = rows[name]
                if name == "accelerate":
                    accelerate[0].send(prompt)
                    out = receive(accelerate)
                    row["records"].append(serving_record(out["walls"], sum(out["walls"]), None))
                    row["prefill_s"].append(out["walls"][0])
                    row["decode_ms"] += [w * 1e3 for w in out["walls"][1:]]
                    row["peak_sampled"].append(out["peak_sampled"])
                    row["peak_alloc"].append(out["peak_alloc"])
                    ref = refs["eager"]
                    row["exact"].append(np.array_equal(out["logits"], ref[i].logits) and out["tokens"] == ref[i].tokens)
                    continue
                policy, params, sampling, mode = parse_condition(name)
                ref = refs[(mode, "int8") if params.get("weights") == "int8" else mode]
                mode = set_mode(model, mode)
                sampler = sampler_on if sampling else sampler_off
                unbounded = params.pop("unbounded", None) == "yes"
                model.recorder.enabled = params.pop("recording", "on") != "off"  # the ledger's own cost
                if cuda:  # "unbounded" conditions run without the allowance (resident, for reference)
                    torch.cuda.set_per_process_memory_fraction(
                        1.0 if unbounded else (args.allowance_mib * MIB - context) / total, device)
                try:
                    use(model, policy, params)
                    sampler.start()
                    host_ms.clear()
                    out = run_episode(model, prompt, continuation=args.continuation, mode=mode)
                except Exception as e:  # an OOM under the allowance, say: recorded, the run goes on
                    sampler.stop()
                    row["failed"].append(f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
                    model.slot.policy = None
                    torch.cuda.empty_cache()
                    continue
                sampled = sampler.stop()
                row["peak_sampled"].append(sampled["peak_sampled_bytes"] or 0)
                scopes.add(sampled["scope"])
                row["records"].append(serving_record([c.wall_s for c in out.calls], out.wall_s, out.decode_graph,
                                                     tokens=[c.tokens for c in out.calls]))
                row["prefill_s"].append(out.calls[0].wall_s)
                row["decode_ms"] += [c.wall_s * 1e3 for c in out.calls[1:]]
                row["first_ms"] += [c.wall_s * 1e3 for c in out.calls[1:2]]  # mode graph: the capture's call
                row["episode_s"].append(out.wall_s)
                row["host_ms"] += host_ms[2:]  # decode calls after the first (the capture's)
                row["prefill_h2d"].append(sum(out.calls[0].h2d_weight_bytes) + sum(out.calls[0].h2d_index_bytes))
                row["decode_h2d"] += [sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in out.calls[1:]]
                row["wasted"] += [sum(c.rows_wasted) for c in out.calls[1:]]
                row["episode_h2d"].append(sum(sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in out.calls))
                row["episode_rows"].append(sum(sum(c.rows_copied) for c in out.calls))
                for before, call in zip(out.calls[1:], out.calls[2:]):  # decode-to-decode forecasts (seed v0.38)
                    if any(call.rows_wasted) and None not in before.active_rows:
                        row["fc_wasted"].append(sum(call.rows_wasted))
                        row["fc_used"].append(sum(before.active_rows) - sum(call.rows_wasted))
                row["wait_ms"] += [sum(c.copy_wait_s) * 1e3 for c in out.calls[1:]]
                row["peak_alloc"].append(out.peak_allocated_bytes)
                row["device_bytes"].append(model.slot.policy.device_bytes())
                row["graph"].append(out.decode_graph)
                row["exact"].append(np.array_equal(out.logits, ref[i].logits) and out.tokens == ref[i].tokens)
                if cuda:
                    context = max(context, impose(device, args.allowance_mib * MIB, handle))

    if accelerate is not None:
        stop_accelerate(accelerate)

    print(f"\npinned H2D bandwidth: {bw:.1f} GB/s; {device}"
          f"{' ' + torch.cuda.get_device_name(device) if cuda else ''}; torch {torch.__version__}; "
          f"allowance {args.allowance_mib} MiB (largest CUDA context seen {context / MIB:.0f} MiB, charged); "
          f"sampled scope {', '.join(sorted(map(str, scopes)))}")
    made = f"profile {args.profile}" if args.profile else f"sparsity {args.sparsity} hot {args.hot_fraction}@{args.hot_bias}"
    print(f"{args.shape} {args.dtype} {made}, "
          f"{args.prompts} prompts x {args.prefix} + {args.continuation} tokens, {args.rounds} rounds, alternated\n")
    w = max(15, *(len(name) + 1 for name in policies))
    print(f"{'condition':{w}}{'decode ms':>10}{'p10-p90':>14}{'prefill s':>10}{'H2D/decode':>14}{'H2D/prefill':>15}"
          f"{'wasted/dec':>11}{'wait ms':>8}{'peak smp MiB':>13}{'alloc MiB':>10} exact")
    res, failures = {}, []
    for name in policies:
        row = rows[name]
        if not row["decode_ms"]:
            print(f"{name:{w}} FAILED x{len(row['failed'])}: {row['failed'][0] if row['failed'] else ''}")
            continue
        if row["failed"]:
            failures.append(f"{name}: {len(row['failed'])} failed, first: {row['failed'][0]}")
        d = np.array(row["decode_ms"])
        res[name] = float(np.median(d))
        if row["decode_h2d"]:
            ledger = (f"{statistics.mean(row['decode_h2d']):14,.0f}{statistics.mean(row['prefill_h2d']):15,.0f}"
                      f"{statistics.mean(row['wasted']):11,.0f}{statistics.mean(row['wait_ms']):8.2f}")
        else:  # accelerate keeps no ledger
            ledger = f"{'-':>14}{'-':>15}{'-':>11}{'-':>8}"
        print(f"{name:{w}}{np.median(d):10.2f}{np.percentile(d, 10):7.2f}-{np.percentile(d, 90):6.2f}"
              f"{statistics.median(row['prefill_s']):10.3f}{ledger}{max(row['peak_sampled']) / MIB:13.0f}"
              f"{max(row['peak_alloc']) / MIB:10.0f} {all(row['exact'])}{oom(row)}")
    for line in failures:
        print(line)
    print(f"\n{'condition':{w}}{'p90/p10':>8}{'PCIe floor ms':>14}{'x floor':>8}{'1st decode ms':>14}{'episode s':>10}"
          f"{'host ms':>8}  decode step")
    for name in policies:
        row = rows[name]
        if not row["decode_ms"]:
            continue
        d = np.array(row["decode_ms"])
        floor = statistics.mean(row["decode_h2d"]) / (bw * 1e9) * 1e3 if row["decode_h2d"] and cuda else float("nan")
        notes = sorted({g.split(" (")[0] for g in row["graph"] if g})
        captured = [g.split("(")[1].split(" ms") for g in row["graph"] if g and g.startswith("captured")]
        if captured:  # "captured (x ms, y of them instantiating...)": inside the first decode call's wall
            total = statistics.median(float(c[0]) for c in captured)
            ending = statistics.median(float(c[1].split(", ")[1].split(" of")[0]) for c in captured)
            notes = [f"captured in {total:.0f} ms ({ending:.0f} instantiating; medians)"]
        first = statistics.median(row["first_ms"]) if row["first_ms"] else float("nan")
        episode = statistics.median(row["episode_s"]) if row["episode_s"] else float("nan")
        host = statistics.median(row["host_ms"]) if row["host_ms"] else float("nan")
        print(f"{name:{w}}{np.percentile(d, 90) / np.percentile(d, 10):8.2f}{floor:14.2f}"
              f"{res[name] / floor if floor else float('nan'):8.2f}{first:14.2f}{episode:10.3f}{host:8.2f}"
              f"  {', '.join(notes) or '-'}")
    for name in [n for n in policies if n.split("+")[0] == "dense-stream" and n in res]:
        if not cuda:
            break
        per_call = statistics.mean(rows[name]["decode_h2d"])
        gbps = per_call / (res[name] / 1e3) / 1e9
        print(f"{name} decode moves {gbps:.1f} GB/s = {gbps / bw:.0%} of the pinned copy bandwidth")
    workload(rows, policies)
    serving_table(rows, policies, w)
    resident = res.get("resident", res.get("resident+unbounded=yes"))
    for name in ("packet", "packet+gather=device"):
        if name in res and resident:
            print(f"{name} / resident decode: {res[name] / resident:.2f}x")
    for name in ("packet", "packet+gather=device"):
        if name in res and "accelerate" in res:
            print(f"accelerate / {name} decode: {res['accelerate'] / res[name]:.2f}x")


if __name__ == "__main__":
    main()
