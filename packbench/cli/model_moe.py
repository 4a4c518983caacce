"""`packbench model synth --shape <MoE shape>` and `packbench model stats DIR` on an MoE
checkpoint: routing-calibrated synthesis (engine/moe/synth.py) and routing statistics beside the
published figures (engine/moe/stats.py, core/routing.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import typer

from packbench.core.errors import PackbenchError
from packbench.core.moe import FAMILIES, MOE_SHAPES, ROUTING_OF, ROUTING_PROFILES
from packbench.core.routing import PUBLISHED
from packbench.core.text import counted, one_line


def is_moe_dir(model_dir: Path) -> bool:
    """config.json names an MoE family packbench runs (read without torch). Anything else is False,
    for read_config to refuse in one line: a config.json that is a FIFO (read_text waited for a
    writer), JSON that is no object (`[]`: AttributeError) or nested 100,000 deep
    (RecursionError), a model_type that is a list (unhashable)."""
    from packbench.core.files import read_json_object

    try:
        config = read_json_object(Path(model_dir) / "config.json", limit=1 << 20)
    except (OSError, ValueError):
        return False
    return isinstance(config.get("model_type"), str) and config["model_type"] in FAMILIES


def check_synth(*, shape: str, profile: str | None, layers: int | None, device: str) -> None:
    """`model synth`'s MoE options, refused in one line before anything is written."""
    if profile is not None and profile not in ROUTING_PROFILES:
        raise PackbenchError(f"--routing {profile!r} is not a routing profile; use one of {', '.join(ROUTING_PROFILES)} "
                             f"(or omit it: {shape} takes {ROUTING_OF[shape]})")
    full = MOE_SHAPES[shape]["layers"]
    if layers is not None and not 1 <= layers <= full:
        raise PackbenchError(f"--layers {layers} must be in 1..{full} ({shape}'s depth)")
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise PackbenchError(f"--device {device!r}: use cpu, cuda or cuda:N")
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        raise PackbenchError(f"--device {device}: CUDA is not available here; use --device cpu")


def synth(out: Path, *, shape: str, dtype: str, seed: int, profile: str | None, layers: int | None,
          device: str, json_out: bool) -> None:
    check_synth(shape=shape, profile=profile, layers=layers, device=device)
    from packbench.engine.moe.synth import synth_moe

    full = MOE_SHAPES[shape]["layers"]

    try:
        path = synth_moe(out, shape=shape, seed=seed, dtype=dtype, layers=layers, profile=profile, device=device)
    except OSError as e:
        raise PackbenchError(f"--out {out}: cannot write the checkpoint ({e.strerror or type(e).__name__}); "
                             f"free space or choose another --out") from None
    name = profile or ROUTING_OF[shape]
    depth = layers or full
    if json_out:
        typer.echo(json.dumps({"path": str(path), "shape": shape, "dtype": dtype, "profile": name, "seed": seed,
                               "layers": depth}))
        return
    typer.echo(f"wrote {shape} {dtype} checkpoint (routing profile {name}, {depth} of {full} layers, seed {seed}) "
               f"to {path}")


def stats(model_dir: Path, ids: list[list[int]], *, dtype: str, json_out: bool, device: str = "cpu",
          figure: Path | None = None) -> None:
    """Routing statistics of an MoE checkpoint over prompts `ids` (each one prefill call)."""
    import torch

    from packbench.core.routing import check, summarise
    from packbench.engine.moe.stats import routing_traces

    def progress(done: int, total: int) -> None:
        typer.echo(f"routed prompt {done}/{total}", err=True)

    if device != "cpu" and not torch.cuda.is_available():
        raise PackbenchError(f"--device {device}: CUDA is not available here; use --device cpu")
    recipe = _recipe(Path(model_dir) / "packbench_synth.json")  # refused before any prompt is routed
    traces, meta = routing_traces(model_dir, ids, dtype=getattr(torch, dtype), device=device, progress=progress)
    summary = summarise(traces, experts=meta["experts"], k=meta["k"], layer_ids=meta["layer_ids"])
    profile = (recipe or {}).get("profile")
    published = profile if isinstance(profile, str) and profile in PUBLISHED else \
        ("mixtral" if meta["family"] == "mixtral" else "olmoe")
    summary["model"] = {"dir": str(model_dir), "family": meta["family"], "dtype": dtype, "recipe": recipe,
                        "prompts": len(ids), "tokens": len(ids[0])}
    summary["published"] = {"name": published, **{k: v for k, v in PUBLISHED[published].items()}}
    summary["checks"] = check(summary, published)
    if figure is not None:
        from packbench.cli.common import write_output
        from packbench.cli.report_figures import routing_figure

        write_output(figure, routing_figure(summary), "--figure")  # whole or not at all
    if json_out:
        typer.echo(json.dumps(_finite(summary), sort_keys=True, default=list))
        return
    typer.echo(render(summary))


def _recipe(path: Path) -> dict | None:
    """The synthetic checkpoint's recipe (engine/moe/synth.py writes it), None without one; a file
    that is not a JSON object (or a FIFO, which read_text waited on) is one line naming it."""
    from packbench.core.files import NOT_AN_OBJECT, read_json_object

    if not os.path.lexists(path):
        return None
    try:
        return read_json_object(path, limit=1 << 20)
    except (OSError, ValueError) as e:  # NotReadable (a FIFO, a device, too large) is a ValueError
        why = NOT_AN_OBJECT if str(e) == NOT_AN_OBJECT else f"cannot read it as JSON ({one_line(str(e))[:120]})"
        raise PackbenchError(f"{path} {why}; regenerate the checkpoint with `packbench model synth` "
                             f"or remove that file") from None


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render(s: dict) -> str:
    m, p = s["model"], s["published"]
    lines = [f"{m['dir']}: {m['family']}, {s['experts']} experts, top {s['k']}, {m['dtype']}; "
             f"{counted(m['prompts'], 'prompt')} x {m['tokens']} tokens",
             f"(repeat of any expert between consecutive tokens by chance: {100 * s['repeat_any_chance']:.1f} %)", ""]
    caches = list(s["layers"][0]["cache"])
    head = (f"{'layer':>5} {'skew':>6} {'c80':>4} {'reuse1':>7} {'lift':>5} {'any':>6} "
            + " ".join(f"{'u' + str(n):>6}" for n in s["layers"][0]["union"])
            + f" {'next':>5} " + " ".join(f"{'lru/lfu/opt c=' + str(c):>21}" for c in caches))
    lines.append(head)
    for r in s["layers"]:
        nxt = r.get("next_layer", {}).get("lift")
        lines.append(f"{r['layer']:>5} {r['skew']:6.2f} {r['carry80']:4d} {r['reuse'][1]:7.3f} {r['temporal_lift']:5.2f} "
                     f"{100 * r['repeat_any']:5.1f}% "
                     + " ".join(f"{v:6.1f}" for v in r["union"].values())
                     + f" {'-' if nxt is None else f'{nxt:.2f}':>5} "
                     + " ".join(f"{r['cache'][c]['lru']:9.3f}/{r['cache'][c]['lfu']:.3f}/{r['cache'][c]['belady']:.3f}"
                              for c in caches))
    lines += ["", "skew: busiest expert / mean; c80: experts carrying 80 %; reuse1: shared experts of consecutive tokens / k;",
              "lift: reuse1 over the same routing shuffled; any: consecutive tokens sharing an expert; uN: distinct experts",
              "among the first N tokens; next: cross-layer lift of the first choice to the next layer listed; lru/lfu/opt:",
              "hit rates of a c-expert cache per layer, each token's experts one request: LRU, LFU and Belady's optimum",
              "(core/expert_cache.py).",
              "", f"published ({p['name']}: {p['source']}):"]
    for row in s["checks"]:
        lo, hi = row["published"]
        want = f">= {lo}" if hi is None else f"{lo}-{hi}"
        got = f"{row['measured'][0]:.2f}-{row['measured'][1]:.2f}"
        lines.append(f"  {row['target']:<52} published {want:<14} this {got:<14} {_verdict(row['ok'])}")
    return "\n".join(lines)


def _verdict(ok: bool | None) -> str:
    """A check row's word: within its target, outside it, or not judged (a bound no measurement can pass)."""
    return "not judged" if ok is None else "ok" if ok else "OUTSIDE"
