"""The steps of bench/simulate_check_device.sh around the screen: rates and routing measured on the
machine, `packbench simulate`'s predictions written down before the runs, and the runs compared
with them (docs/experiments/simulate.md, "The check in one call").

  measure:  the copy rate (1 GiB from pinned memory on CUDA, as bench/moe.py measures it; a host
            memcpy on the CPU) and resident compute (the checkpoint's experts all on the device,
            the protocol's prompt, 1 warm-up and REPEATS episodes, the steady decode call: the
            screen's rule) into a machine file, with the overhead fragment of bench/moe_overhead.py,
            and expert-cache's own zero-copy compute (a cache holding every expert, warmed by one
            episode of a held-out prompt, then timed on it: 0 B moved; `families` of the entry);
            then the routing those runs will see: one traced episode of the same prompt, resident
            (every policy computes the same bits, so the same routing: engine/tracing.py).
            With --rates-from ARCHIVE both compute figures come instead from a rates screen the
            product's worker ran before (`resident` and `cache-all`, a cold cache of every expert,
            on a held-out prompt: bench/simulate_check_device.sh step (i)), timed by the rule and
            in the process that time the screen they predict; no episode here is timed.
  predict:  `packbench simulate TRACE --machine FILE --json` for each condition; writes
            predictions.md (the table, the rates and their sources, the trace's and machine's
            sha256) and predictions.json, and prints their sha256.
  compare:  the newest screen archive's measurements beside predictions.json: per condition
            decode ms/token (the steady decode call, docs/metrics.md: per scored episode the median
            decode call but its first, the median over episodes, as `packbench report` gives it), MB per decode token,
            decode hit rate; measured / predicted and whether within 15 %. The prediction judged is
            simulate's `steady_call_ms`, the same statistic over the traced episode's calls (each
            priced alone); its mean per token stands beside it in predictions.md.

Usage:
  python -m bench.simulate_check measure --model DIR --prefix P --continuation C --machine-out M.json \
      --trace-out R.trace --overhead FRAGMENT.json [--rates-from RATES.zip] [--device cuda] [--dtype float16]
  python -m bench.simulate_check predict --trace R.trace --machine M.json --out predictions.md \
      --condition NAME=SPEC ...
  python -m bench.simulate_check compare --predictions predictions.json --archives DIR [--out compare.md]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

TOLERANCE = 0.15


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


# ----------------------------------------------------------------------------- measure


def overhead_of(path: Path) -> dict:
    """{"overhead_us": ...} from bench.moe_overhead's fragment, or from a machine file holding one
    (bench/machines/*.json): only that term. Spread whole, a machine file's rates replaced the ones
    this call measured (its copy rate, and a compute table without this shape's key)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"--overhead {path}: not a readable JSON file ({type(e).__name__}: {e}); give bench.moe_overhead's "
                 f"--out file, or leave --overhead out")
    if not isinstance(doc, dict) or not isinstance(doc.get("overhead_us"), dict):
        sys.exit(f"--overhead {path}: no overhead_us object in it; give bench.moe_overhead's --out file (or a machine "
                 f"file that holds one), or leave --overhead out")
    return {"overhead_us": doc["overhead_us"]}


def steady_ms(runs) -> tuple[float, int]:
    """(median ms of the steady decode calls, how many): every decode call but each episode's first,
    the screen's rule (docs/metrics.md)."""
    decode = [c.wall_s for r in runs for c in r.calls[2:] if c.phase == "decode"]
    return statistics.median(decode) * 1e3, len(decode)


def moved_bytes(runs) -> int:
    """Host-to-device bytes (weights and indices) the episodes' ledgers charged."""
    return sum(sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for r in runs for c in r.calls)


def cache_compute(model, prompt: list[int], *, continuation: int, repeats: int) -> tuple[float, int, int]:
    """expert-cache's own zero-copy decode: a cache whose capacity is every expert of a layer (its
    slots hold the whole checkpoint's experts on the device), warmed by one episode of `prompt`, then
    `repeats` episodes of the same prompt, whose routing the warm episode admitted, so every routed
    expert hits and nothing is copied: the cache path's compute and host work (readback, the
    cache's step, the reads through its view) with zero bytes. (median steady decode ms, decode calls
    timed, bytes the timed episodes' ledgers moved: 0 unless the routing changed between episodes)."""
    from packbench.engine.episode import run_episode

    model.use("expert-cache", capacity=model.host.experts, rule="lru")
    run_episode(model, prompt, continuation=continuation)  # the warm episode: every routed expert admitted
    runs = [run_episode(model, prompt, continuation=continuation) for _ in range(repeats)]
    ms, n = steady_ms(runs)
    return ms, n, moved_bytes(runs)


RATES = ("resident", "cache-all")  # the rates screen's conditions (bench/simulate_check_device.sh step (i))


def screen_rates(archive: Path, *, copy_bps: float, cmd: str, where: str) -> tuple[dict, dict]:
    """The machine file's compute entry (value, source) and its `families` from a rates screen's
    archive: `resident` as measured, `cache-all`'s steady decode call less the copy time of what its
    decode calls moved (a cold cache of every expert, fresh each episode: the experts its prefill did
    not route are fetched on first use, a few MB at most) at the copy rate. The worker timed both by
    the rule and in the process that time the screen predicted (docs/metrics.md)."""
    from packbench.core.report import read_screen

    try:
        screen = read_screen(archive)
    except Exception as e:  # noqa: BLE001 - any unreadable archive: one line, nothing written
        sys.exit(f"--rates-from {archive}: not a readable screen archive ({type(e).__name__}: {e}); give the rates "
                 f"screen's archive (bench/simulate_check_device.sh step (i))")
    got = measured_of(screen)
    missing = [n for n in RATES if n not in got]
    if missing:
        sys.exit(f"--rates-from {archive}: no finished scored episode of {', '.join(missing)} in screen "
                 f"{screen.protocol.name!r}; run the rates screen again (conditions {', '.join(RATES)})")
    p = screen.protocol
    what = (f"screen {p.name} ({archive.name}, sha256 {sha256(archive)[:16]}), {p.dtype}, "
            f"{got['resident']['episodes']} scored episodes of a held-out prompt x {p.prefix_tokens} + "
            f"{p.continuation_tokens}, timed by its worker: {cmd}, {where}")
    resident = {"value": round(got["resident"]["ms"], 3),
                "source": f"resident decode ms/token (steady decode call, as `packbench report` gives it; episodes "
                          f"{_range(got['resident'])} ms) of {what}"}
    c = got["cache-all"]
    copy_ms = c["mb"] * 1e6 / copy_bps * 1e3
    family = {"value": round(c["ms"] - copy_ms, 3),
              "source": f"expert-cache of every expert (cache-all, cold each episode, decode hit rate "
                        f"{_pct(c['hit_rate'])} %), decode ms/token {c['ms']:.2f} (episodes {_range(c)} ms) less its "
                        f"{c['mb']:.1f} MB per decode token at the copy rate ({copy_ms:.2f} ms), of {what}"}
    return resident, {"expert-cache": family}


def _range(m: dict) -> str:
    return f"{m['lo']:.2f}-{m['hi']:.2f}"


def measure(a: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from bench.moe_overhead import copy_rate, machine_name
    from packbench.core.plan import BOS
    from packbench.core.trace import write_trace
    from packbench.engine.episode import run_episode
    from packbench.engine.moe.model import CpuFirstMoE
    from packbench.engine.tracing import Tracer

    overhead = overhead_of(a.overhead) if a.overhead else {}  # before minutes are spent measuring
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    if device.type == "cuda":  # the screen's worker's threads (engine/worker.py): its compute is what is predicted
        import os

        from packbench.engine.gpu_lock import host_gpus

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, host_gpus())))
    cmd = "`bash bench/simulate_check_device.sh` (bench.simulate_check measure)"
    where = f"{machine_name(device)}, {_today()}"
    rate = copy_rate(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 28))
    print(f"copy rate {rate / 1e9:.2f} GB/s", flush=True)
    rates = screen_rates(a.rates_from, copy_bps=rate, cmd=cmd, where=where) if a.rates_from else None
    model = CpuFirstMoE(a.model, dtype=dtype, device=device)
    rng = np.random.Generator(np.random.PCG64(a.seed))  # the protocol's generator prompt (core/plan.py prompts)
    prompt = [BOS] + rng.integers(4, model.vocab, size=a.prefix - 1).tolist()
    model.use("resident")
    run_episode(model, prompt, continuation=min(a.continuation, 4))  # warm-up: kernels, allocator
    timed = rates is None  # else the rates screen's worker timed them
    runs = [run_episode(model, prompt, continuation=a.continuation) for _ in range(a.repeats if timed else 0)]
    tracer = Tracer(model, source={"checkpoint": str(a.model), "tool": "bench.simulate_check measure",
                                   "prompts": f"generator seed {a.seed}", "device": str(device)})
    try:
        traced = run_episode(model, prompt, continuation=a.continuation)
    finally:
        tracer.close()
    trace = tracer.trace()
    if runs and traced.tokens != runs[0].tokens:  # said, not fatal: the screen's hit columns will show it
        print("WARNING: the traced episode's tokens differ from the timed ones; its routing may not be the runs'",
              flush=True)
    write_trace(trace, a.trace_out)
    key = f"{trace.model.shape}:{trace.model.layers}"
    print(f"trace of {len(trace.calls)} calls to {a.trace_out}", flush=True)
    if rates is not None:
        entry, families = rates
        print(f"resident decode {entry['value']:.2f} ms/token ({key}), expert-cache's own "
              f"{families['expert-cache']['value']:.2f} ms/token: the rates screen {a.rates_from.name}", flush=True)
        write_machine(a, device, rate, key, entry, families, overhead, cmd, where)
        return
    compute, n_decode = steady_ms(runs)  # the screen's steady decode call (docs/metrics.md)
    print(f"resident decode {compute:.2f} ms/token ({key}, median of {n_decode} decode calls)", flush=True)
    # expert-cache's own compute on a held-out prompt: the protocol's generator at seed + 1, the same
    # lengths. At one token a decode call routes k experts a layer whatever the prompt, so the work is
    # the screen's; the prompt is not the screen's, so the figure is a rate of the shape, not a replay
    # of the episodes it predicts.
    held_out = np.random.Generator(np.random.PCG64(a.seed + 1))
    other = [BOS] + held_out.integers(4, model.vocab, size=a.prefix - 1).tolist()
    families = {}
    own, n_own, moved = cache_compute(model, other, continuation=a.continuation, repeats=a.repeats)
    if moved:  # not zero-copy: the prediction keeps resident compute + overhead for the caches
        print(f"WARNING: the full expert cache moved {moved} B in its timed episodes (routing changed between "
              f"episodes); its compute is not written", flush=True)
    else:
        print(f"expert-cache zero-copy decode {own:.2f} ms/token ({key}, capacity {model.host.experts} of every "
              f"layer, median of {n_own} decode calls, 0 B moved)", flush=True)
        families["expert-cache"] = {
            "value": round(own, 3),
            "source": f"expert-cache:capacity={model.host.experts},rule=lru (every expert of a layer), warmed by one "
                      f"episode, decode ms/token (steady decode call, 0 B moved by its ledger), {a.dtype}, "
                      f"{a.repeats} episodes of a held-out prompt (generator seed {a.seed + 1}) x {a.prefix} + "
                      f"{a.continuation}: {cmd}, {where}"}
    entry = {"value": round(compute, 3),
             "source": f"resident decode ms/token (steady decode call), {a.dtype}, 1 warm-up + {a.repeats} episodes of "
                       f"the protocol's prompt (generator seed {a.seed}) x {a.prefix} + {a.continuation}: {cmd}, {where}"}
    write_machine(a, device, rate, key, entry, families, overhead, cmd, where)


def write_machine(a: argparse.Namespace, device, rate: float, key: str, entry: dict, families: dict, overhead: dict,
                  cmd: str, where: str) -> None:
    from bench.moe_overhead import machine_name

    kind = "pinned host-to-device copy" if device.type == "cuda" else "host memcpy (the CPU twin: no device)"
    machine = {
        "name": machine_name(device),
        "description": f"Rates measured in one call by bench/simulate_check_device.sh before the runs they predict, {where}.",
        "pinned_h2d_gbps": {"value": round(rate / 1e9, 3),
                            "source": f"{kind} rate, median of 5 copies of {(1 << 30) if device.type == 'cuda' else (1 << 28)} B: {cmd}, {where}"},
        "decode_compute_ms": {key: {**entry, **({"families": families} if families else {})}},
        **overhead,
    }
    Path(a.machine_out).write_text(json.dumps(machine, indent=1) + "\n")
    print(f"wrote {a.machine_out}", flush=True)


# ----------------------------------------------------------------------------- predict


def simulate(trace: Path, machine: Path, specs: list[str]) -> dict:
    args = [sys.executable, "-m", "packbench", "simulate", str(trace), "--machine", str(machine), "--json"]
    for s in specs:
        args += ["--policy", s]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"packbench simulate failed ({r.returncode}): {r.stderr.strip()[-600:]}")
    return json.loads(r.stdout)


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def predict(a: argparse.Namespace) -> None:
    conditions = [c.split("=", 1) for c in a.condition]
    out = simulate(a.trace, a.machine, [spec for _, spec in conditions])
    machine = json.loads(Path(a.machine).read_text())
    rows = []
    for (name, spec), p in zip(conditions, out["policies"]):
        d, pred = p["totals"]["decode"], p["prediction"]
        # judged: the steady decode call, the screen's statistic (the mean per token beside it)
        rows.append({"condition": name, "policy": spec, "ms": pred.get("steady_call_ms"),
                     "mean_ms": pred.get("decode_ms_per_token"),
                     "compute_ms": pred.get("compute_ms_per_token"), "copy_ms": pred.get("copy_ms_per_token"),
                     "overhead_ms": pred.get("overhead_ms_per_token"), "overhead": pred.get("overhead"),
                     "hidden_ms": pred.get("prefetch_hidden_ms_per_token"),
                     "compute_family": pred.get("compute_family"),
                     "mb": (d["h2d_weight_bytes"] + d["h2d_index_bytes"]) / d["tokens"] / 1e6 if d["tokens"] else None,
                     "hit_rate": d.get("hit_rate"), "belady_rate": d.get("belady_rate")})
    m = out["model"]
    lines = [f"# Predicted before the runs: {m['shape']} ({m['layers']} layers) on {machine['name']}", "",
             f"`packbench simulate {Path(a.trace).name} --machine {Path(a.machine).name}`, {_today()}; trace sha256 "
             f"{sha256(Path(a.trace))} ({out['calls']} calls, {out['episodes']} episode, recorded on the device "
             f"before the screen), machine file sha256 {sha256(Path(a.machine))}. A prediction, not a measurement.",
             "", "| condition | policy | predicted steady decode call, ms | mean ms per decode token | compute | copy "
                 "| prefetch hidden | overhead | MB per decode token | hit % | Belady % |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['condition']} | `{r['policy']}` | {_f(r['ms'])} | {_f(r['mean_ms'])} | {_f(r['compute_ms'])} | "
                     f"{_f(r['copy_ms'])} | {_f(r['hidden_ms'])} | {_f(r['overhead_ms'])} | {_f(r['mb'], ',.1f')} | "
                     f"{_pct(r['hit_rate'])} | {_pct(r['belady_rate'])} |")
    lines += ["", "Rates (the machine file, measured in this call before the predictions):", "",
              f"- copy: {machine['pinned_h2d_gbps']['value']} GB/s ({machine['pinned_h2d_gbps']['source']})"]
    for key, v in machine.get("decode_compute_ms", {}).items():
        lines.append(f"- compute {key}: {v['value']} ms ({v['source']})")
        for family, f in v.get("families", {}).items():
            lines.append(f"- compute {key}, {family}'s own: {f['value']} ms ({f['source']})")
    for family, terms in machine.get("overhead_us", {}).items():
        lines.append(f"- overhead {family}: " + ", ".join(f"{t} {v['value']} us" for t, v in terms.items())
                     + f" ({next(iter(terms.values()))['source']})")
    whose = {r["condition"]: f"{r['compute_family']}'s own zero-copy decode" if r["compute_family"] else "resident"
             for r in rows}
    lines += ["", "Compute per condition:", ""] + [f"- {r['condition']}: {whose[r['condition']]}" for r in rows]
    lines += ["", "Overhead per condition:", ""] + [f"- {r['condition']}: {r['overhead']}" for r in rows]
    lines += ["", "Judged: the steady decode call (each decode call priced alone, per episode the median but the "
                  "first call, as the screen measures it); compute, copy, prefetch hidden and overhead are the "
                  "mean per token's parts.", "", "Model: " + out["assumptions"] + "."]
    Path(a.out).write_text("\n".join(lines) + "\n")
    js = Path(a.out).with_suffix(".json")
    js.write_text(json.dumps({"model": m, "machine": machine["name"], "rows": rows}, indent=1) + "\n")
    print("\n".join(lines[:len(rows) + 6]))
    print(f"sha256 {sha256(Path(a.out))}  {a.out}\nsha256 {sha256(js)}  {js}")


# ----------------------------------------------------------------------------- compare


def measured(archive: Path) -> dict:
    """Per condition of the screen: decode ms/token (the steady decode call of the scored finished
    episodes), MB per decode token, the decode hit rate and the scored episodes counted."""
    from packbench.core.report import read_screen

    return measured_of(read_screen(archive))


def measured_of(screen) -> dict:
    """measured() of a read screen (core/report.py ScreenData). The time is the condition's steady
    decode call as `packbench report` gives it (core/serving.py condition_serving, docs/metrics.md):
    per scored episode the median decode call but its first, per condition the median over episodes."""
    from packbench.core.report import expert_cache_rows
    from packbench.core.serving import condition_serving, episode_serving, scored_ok

    cache = {r["condition"]: r for r in expert_cache_rows(screen)}
    records = [e.record for e in screen.episodes]
    out = {}
    for c in screen.protocol.conditions:
        eps = scored_ok(records, c.name)
        calls = [call for r in eps for call in r["calls"] if call["phase"] == "decode"]
        steady = condition_serving(eps)["steady_call_s"]
        if steady is None:
            continue
        each = [f["steady_call_s"] * 1e3 for r in eps if (f := episode_serving(r)) and f["steady_call_s"] is not None]
        out[c.name] = {"episodes": len(eps), "ms": steady * 1e3, "lo": min(each), "hi": max(each),
                       "mb": statistics.mean(sum(call["h2d_weight_bytes"]) + sum(call["h2d_index_bytes"])
                                             for call in calls) / 1e6,
                       "hit_rate": cache[c.name]["decode_hit_rate"] if c.name in cache else None}
    return out


def judged(rows: list[dict], got: dict) -> list[dict]:
    """Per predicted condition: the measurement beside it, measured / predicted and whether that is
    within 15 % (None where the condition was not measured or has no predicted time)."""
    out = []
    for r in rows:
        m = got.get(r["condition"])
        ratio = m["ms"] / r["ms"] if m is not None and r["ms"] else None
        out.append({**r, "measured": m, "ratio": ratio,
                    "within": None if ratio is None else abs(ratio - 1) <= TOLERANCE + 1e-12})
    return out


def compare(a: argparse.Namespace) -> None:
    pred = json.loads(Path(a.predictions).read_text())
    archives = sorted(Path(a.archives).rglob("*.zip"), key=lambda p: p.stat().st_mtime)
    if not archives:
        sys.exit(f"no archive under {a.archives}: the screen did not finish; nothing measured to compare")
    rows = judged(pred["rows"], measured(archives[-1]))
    print(f"{archives[-1].name}: predicted ({Path(a.predictions).name}, written before the screen) against measured")
    print(f"{'condition':<20} {'eps':>3} {'pred ms':>9} {'meas ms':>9} {'episodes ms':>15} {'meas/pred':>9} "
          f"{'within 15%':>10} {'pred MB':>10} {'meas MB':>10} {'pred hit%':>9} {'meas hit%':>9}")
    for r in rows:
        m = r["measured"] or {}
        verdict = "not run" if not m else "-" if r["within"] is None else "yes" if r["within"] else "NO"
        spread = _range(m) if m else "-"
        print(f"{r['condition']:<20} {m.get('episodes', 0):>3} {_f(r['ms']):>9} {_f(m.get('ms')):>9} {spread:>15} "
              f"{_f(r['ratio'], '.3f'):>9} {verdict:>10} {_f(r['mb'], ',.1f'):>10} {_f(m.get('mb'), ',.1f'):>10} "
              f"{_pct(r['hit_rate']):>9} {_pct(m.get('hit_rate')):>9}")
    done = [r for r in rows if r["within"] is not None]
    summary = f"within 15 %: {sum(r['within'] for r in done)} of {len(done)} conditions measured with a prediction"
    print(summary)
    if a.out is not None:  # the same table in markdown, for docs/experiments/simulate.md
        lines = [f"Screen {archives[-1].name} against {Path(a.predictions).name} (sha256 {sha256(Path(a.predictions))}).",
                 "", "| condition | predicted ms | measured ms | episodes' steady calls, ms | measured / predicted | "
                     "within 15 % | predicted MB / measured MB | predicted hit % / measured | scored episodes |",
                 "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in rows:
            m = r["measured"] or {}
            verdict = "not run" if not m else "-" if r["within"] is None else "yes" if r["within"] else "**no**"
            lines.append(f"| {r['condition']} | {_f(r['ms'])} | {_f(m.get('ms'))} | {_range(m) if m else '-'} | "
                         f"{_f(r['ratio'])} | {verdict} | "
                         f"{_f(r['mb'], ',.1f')} / {_f(m.get('mb'), ',.1f')} | {_pct(r['hit_rate'])} / "
                         f"{_pct(m.get('hit_rate'))} | {m.get('episodes', 0)} |")
        Path(a.out).write_text("\n".join(lines + ["", summary + "."]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--model", type=Path, required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="float16")
    m.add_argument("--prefix", type=int, default=128)
    m.add_argument("--continuation", type=int, default=16)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--overhead", type=Path, default=None, help="bench.moe_overhead's fragment (JSON)")
    m.add_argument("--rates-from", type=Path, default=None,
                   help="the rates screen's archive: resident and cache-all timed by the worker (no episode timed here)")
    m.add_argument("--machine-out", type=Path, required=True)
    m.add_argument("--trace-out", type=Path, required=True)
    p = sub.add_parser("predict")
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--machine", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--condition", action="append", required=True, help="NAME=SPEC (a simulate --policy)")
    c = sub.add_parser("compare")
    c.add_argument("--predictions", type=Path, required=True)
    c.add_argument("--archives", type=Path, required=True)
    c.add_argument("--out", type=Path, default=None, help="also write the table in markdown here")
    a = ap.parse_args()
    {"measure": measure, "predict": predict, "compare": compare}[a.step](a)


if __name__ == "__main__":
    main()
