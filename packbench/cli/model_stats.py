"""`packbench model stats DIR`: the activation statistics of any local OPT checkpoint, real or
synthetic, beside what real OPT measured (engine/stats.py, core/workloads.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.core.errors import PackbenchError
from packbench.core.registry import DTYPE_NAMES
from packbench.core.text import counted

MAX_PREFIX = 2048  # OPT's positions
DEFAULT_PREFIX = 512
DEFAULT_SAMPLED = 128  # tokens --robustness samples after each generated prompt
MAX_COUNT = 1000  # prompts measured one after another: 1000 x 512 tokens is hours on a CPU already
MAX_SEED = 2**63 - 1


def register(model_app: typer.Typer) -> None:
    model_app.command("stats")(stats)


def stats(
    model_dir: Annotated[Path, typer.Argument(help="A local OPT or MoE (Mixtral, Qwen3-MoE, OLMoE) checkpoint "
                                                   "directory (Hugging Face layout).",
                                              show_default=False)],
    prompts: Annotated[Optional[Path], typer.Option(
        help="A text file of prompts (separated by lines of `---`), encoded by the checkpoint's tokenizer; "
             "default: generated prompts (BOS + uniform token ids, as a protocol's generator makes).")] = None,
    count: Annotated[int, typer.Option(min=1, max=MAX_COUNT, help="Generated prompts.")] = 2,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the generated prompts.")] = 0,
    prefix: Annotated[Optional[int], typer.Option(
        show_default=False, help=f"Tokens of each prompt: the prefill call (the union curve's k runs to it); default "
                                 f"{DEFAULT_PREFIX}, or what the model's positions leave beside --continuation.")] = None,
    continuation: Annotated[int, typer.Option(help="Calls per episode: the prefill, then continuation - 1 greedy decode calls.")] = 16,
    dtype: Annotated[str, typer.Option(help=f"One of {', '.join(DTYPE_NAMES)}.",
                                       autocompletion=lambda: list(DTYPE_NAMES))] = "float32",
    device: Annotated[str, typer.Option(help="cpu, or cuda[:N].")] = "cpu",
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print every figure (the whole union curve too) as JSON.")] = False,
    figure: Annotated[Optional[Path], typer.Option(
        help="MoE checkpoints: also write the routing figure (load, reuse, LRU against Belady) to this .svg file.")] = None,
    robustness: Annotated[bool, typer.Option(
        "--robustness", help="Instead: fake-quantization sensitivity (int8 per-channel, int4 and int3 per-channel "
                             "and group-128 RTN, nf4 block-64; every decoder Linear weight), teacher-forced on the "
                             "model's own sampled text (or the --prompts text), beside real OPT's figures.")] = False,
    sampled: Annotated[Optional[int], typer.Option(
        show_default=False, help=f"With --robustness and generated prompts: tokens sampled (temperature 1) after each "
                                 f"prompt and scored; default {DEFAULT_SAMPLED}.")] = None,
    trace: Annotated[Optional[Path], typer.Option(
        help="Also write a trace file here (docs/traces.md): per call and layer the active neurons (OPT) or routed "
             "experts (MoE) of each prompt's episode (prefill + continuation - 1 decode calls), run by the "
             "CPU-first engine; `packbench simulate` replays every policy on it.")] = None,
) -> None:
    """Per-layer density, union growth, consecutive overlap, hot neurons and next-token entropy of an OPT checkpoint;
    for an MoE checkpoint, per layer its load, k-apart reuse, union growth, cross-layer predictability and LRU
    against Belady, beside the published figures. With --robustness: how far an OPT checkpoint's outputs move
    under weight quantization, beside real OPT's figures."""
    if prefix is not None and not 1 <= prefix <= MAX_PREFIX:
        raise PackbenchError(f"--prefix {prefix} must be in 1..{MAX_PREFIX} (OPT's positions)")
    if not 1 <= continuation <= MAX_PREFIX:
        raise PackbenchError(f"--continuation {continuation} must be in 1..{MAX_PREFIX} (OPT's positions)")
    if sampled is not None and not robustness:  # it would be ignored: say so rather than measure something else
        raise PackbenchError(f"--sampled {sampled} is the text --robustness scores; without --robustness nothing is "
                             f"sampled: add --robustness, or drop --sampled")
    if sampled is not None and not 1 <= sampled <= MAX_PREFIX:
        raise PackbenchError(f"--sampled {sampled} must be in 1..{MAX_PREFIX} (OPT's positions)")
    sampled = DEFAULT_SAMPLED if sampled is None else sampled
    if dtype not in DTYPE_NAMES:
        raise PackbenchError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise PackbenchError(f"--device {device!r}: use cpu, cuda or cuda:N")
    from packbench.cli.model_moe import is_moe_dir

    if trace is not None:
        if robustness:
            raise PackbenchError("--trace records the active sets of episodes; drop --robustness or --trace")
        if os.path.lexists(trace):  # a trace is never overwritten (nor a FIFO or device opened)
            raise PackbenchError(f"--trace {trace} exists; give a new file path")
        if not trace.parent.is_dir():
            raise PackbenchError(f"--trace {trace}: its directory does not exist; give a path in an existing directory")
    if figure is not None and figure.suffix.lower() != ".svg":  # `--figure packbench.db` replaced the database
        raise PackbenchError(f"--figure {figure}: write the figure to a .svg file")
    if figure is not None and not figure.parent.is_dir():  # said before any prompt is routed
        raise PackbenchError(f"--figure {figure}: the directory {figure.parent} does not exist; create it or choose "
                             f"another --figure")
    if is_moe_dir(model_dir):  # routing statistics: the prefill's per-token routes are the trace
        if robustness:
            raise PackbenchError("--robustness measures OPT checkpoints (real OPT's figures are its targets); "
                                 f"{model_dir} is an MoE checkpoint: drop --robustness")
        from packbench.engine.config import read_config

        config = read_config(model_dir)  # every key the MoE engine reads checked, one line if not
        from packbench.cli.model_moe import stats as moe_stats

        # The statistics route the prompt alone (one prefill call); a trace decodes --continuation after it.
        positions = config.get("max_position_embeddings")
        if trace is None and isinstance(positions, int) and prefix is not None and prefix > positions:
            raise PackbenchError(f"--prefix {prefix} is more positions than the model's {positions}; "
                                 f"lower --prefix to at most {positions}")
        prefix = _prefix(prefix, continuation=continuation if trace is not None else 1, positions=positions)
        ids = _prompts(model_dir, prompts, count=count, seed=seed, prefix=prefix, vocab=config["vocab_size"])
        moe_stats(model_dir, ids, dtype=dtype, json_out=json_out, device=device, figure=figure)
        if trace is not None:
            _write_trace(trace, model_dir, ids, continuation=continuation, dtype=dtype, device=device,
                         prompts="file" if prompts else f"generator seed {seed}")
        return
    if figure is not None:
        raise PackbenchError("--figure draws an MoE checkpoint's routing; drop it for an OPT checkpoint")
    from packbench.engine.config import read_config

    config = read_config(model_dir)
    # --robustness scores the prompt plus --sampled tokens; the statistics the prompt plus --continuation
    prefix = _prefix(prefix, continuation=sampled if robustness else continuation,
                     positions=config.get("max_position_embeddings", MAX_PREFIX),
                     flag="--sampled" if robustness else "--continuation")
    ids = _prompts(model_dir, prompts, count=count, seed=seed, prefix=prefix, vocab=int(config["vocab_size"]))

    import torch

    from packbench.engine.dtypes import dtype_of
    from packbench.engine.stats import measure, summarise

    if device != "cpu" and not torch.cuda.is_available():
        raise PackbenchError(f"--device {device}: CUDA is not available here; use --device cpu")
    if robustness:
        _robustness(model_dir, config, ids, prompts=prompts, sampled=sampled, seed=seed, dtype=dtype, device=device,
                    json_out=json_out)
        return

    def progress(done: int, total: int) -> None:  # on stderr: stdout is the table or the JSON alone
        typer.echo(f"measured prompt {done}/{total}", err=True)

    summary = summarise(measure(model_dir, ids, continuation=continuation, dtype=dtype_of(dtype), device=device,
                                progress=progress))
    shape = _shape_of(config)
    summary["model"] = {"dir": str(model_dir), "shape": shape, "dtype": dtype,
                        "recipe": config.get("packbench_synth"), "prompts": "file" if prompts else f"generator seed {seed}"}
    from packbench.core.workloads import compare

    summary["real_opt"] = compare(summary, shape=shape) if shape else []
    if json_out:
        typer.echo(json.dumps(_finite(summary), sort_keys=True))
    else:
        typer.echo(render(summary))
    if trace is not None:
        _write_trace(trace, model_dir, ids, continuation=continuation, dtype=dtype, device=device,
                     prompts="file" if prompts else f"generator seed {seed}")


def _write_trace(out: Path, model_dir: Path, ids: list[list[int]], *, continuation: int, dtype: str, device: str,
                 prompts: str) -> None:
    """`model stats --trace OUT`: the prompts' episodes through the CPU-first engine, traced."""
    from packbench.core.trace import TraceError, write_trace
    from packbench.engine.dtypes import dtype_of
    from packbench.engine.tracing import record_trace

    t = record_trace(model_dir, ids, continuation=continuation, dtype=dtype_of(dtype), device=device,
                     source={"tool": "packbench model stats --trace", "prompts": prompts, "episode": None,
                             "protocol": None},
                     progress=lambda done, total: typer.echo(f"traced prompt {done}/{total}", err=True))
    try:
        write_trace(t, out)
    except TraceError as e:
        raise PackbenchError(f"--trace: {e}") from None
    typer.echo(f"wrote the trace of {counted(len(ids), 'episode')} ({counted(len(t.calls), 'call')}) to {out}", err=True)


def _prefix(prefix: int | None, *, continuation: int, positions, flag: str = "--continuation") -> int:
    """--prefix, or the default cut to what the model's positions leave beside --continuation
    (the tiny shape has 256); an explicit one that does not fit is refused here, not by an
    IndexError inside the model."""
    from packbench.core.protocol.schema import positions_refusal

    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        positions = MAX_PREFIX
    if prefix is None:
        prefix = min(DEFAULT_PREFIX, positions - continuation + 1)
        if prefix < 1:
            raise PackbenchError(f"{flag} {continuation} leaves no position for a prompt in the model's "
                                 f"{positions}; lower {flag}")
        return prefix
    refusal = positions_refusal(prefix, continuation, positions=positions, model="the model")
    if refusal:
        raise PackbenchError(refusal.replace("prefix_tokens", "--prefix").replace("continuation_tokens", flag))
    return prefix


def _robustness(model_dir: Path, config: dict, ids: list[list[int]], *, prompts: Path | None, sampled: int, seed: int,
                dtype: str, device: str, json_out: bool) -> None:
    """`model stats --robustness`: engine/robustness.py's figures beside real OPT's for the shape."""
    from packbench.core.registry import robustness_caveat
    from packbench.engine.robustness import VARIANTS, real_opt, robustness as measure_robustness
    from packbench.engine.dtypes import dtype_of

    figures = measure_robustness(model_dir, ids, sampled=sampled, seed=seed, text=prompts is not None,
                                 dtype=dtype_of(dtype), device=device,
                                 progress=lambda name: typer.echo(f"measured {name}", err=True))
    shape = _shape_of(config)
    real = real_opt(shape)
    synth = config.get("packbench_synth")
    out = {"model": {"dir": str(model_dir), "shape": shape, "dtype": dtype, "recipe": synth,
                     "caveat": robustness_caveat(synth) if synth else None},
           "text": "file" if prompts else f"generator seed {seed}: {counted(len(ids), 'prompt')} x {len(ids[0])} tokens, "
                                          f"then {sampled} sampled tokens each (scored)",
           "variants": {name: {"label": VARIANTS[name].label, **f, "real_opt": real.get(name)}
                        for name, f in figures.items()}}
    if json_out:
        typer.echo(json.dumps(_finite(out), sort_keys=True))
        return
    typer.echo(render_robustness(out))


def render_robustness(s: dict) -> str:
    """The terminal table of `model stats --robustness`: one row per variant, real OPT's figure beside it."""
    m = s["model"]
    lines = [f"{m['dir']}: {m['shape'] or 'unknown shape'}, {m['dtype']}; {s['text']}", "",
             f"{'variant':42} {'dCE nats/token (95 %)':>28} {'mean KL':>8} {'p99 KL':>8} {'top-1':>6} {'real OPT':>9}"]
    sources = []
    for f in s["variants"].values():
        interval = "" if f["dce_low"] is None or not math.isfinite(f["dce_low"]) else \
            f" ({f['dce_low']:.4f}..{f['dce_high']:.4f})"
        real = f["real_opt"]
        if real and real["source"] not in sources:
            sources.append(real["source"])
        mark = f"{'*' if real.get('held_out') else ''}{real['ln_ratio']:.3f} [{sources.index(real['source']) + 1}]" \
            if real else "-"
        lines.append(f"{f['label']:42} {f['dce']:>10.4f}{interval:>18} {f['mean_kl']:8.4f} {f['p99_kl']:8.3f} "
                     f"{f['top1']:6.3f} {mark:>9}")
    tokens = next(iter(s["variants"].values()))
    lines.append(f"({tokens['tokens']} tokens in {tokens['sequences']} sequences; dCE = ln of the perplexity ratio)")
    lines += [f"[{i}] {src}" for i, src in enumerate(sources, 1)]
    if any(f["real_opt"] and f["real_opt"].get("held_out") for f in s["variants"].values()):
        lines.append("* held out: no profile was tuned to this figure (docs/workloads.md)")
    if not sources:
        lines.append(f"real OPT has no published figure of these variants at {m['shape'] or 'this shape'}")
    if m.get("caveat"):
        lines += ["", m["caveat"]]
    return "\n".join(lines)


def _prompts(model_dir: Path, path: Path | None, *, count: int, seed: int, prefix: int, vocab: int) -> list[list[int]]:
    """Generated prompts, or a text file's encoded by the checkpoint's tokenizer, cut to `prefix`."""
    if path is None:
        import numpy as np

        from packbench.core.plan import BOS

        rng = np.random.Generator(np.random.PCG64(seed))
        return [[BOS] + rng.integers(4, vocab, size=prefix - 1).tolist() for _ in range(count)]
    from packbench.core.protocol.prompt_files import read_prompt_file
    from packbench.engine.prompts import tokenizer_for

    _, texts = read_prompt_file("text_file", path, field="--prompts")
    ids = tokenizer_for(model_dir)(texts)
    short = [i for i, p in enumerate(ids) if len(p) < prefix]
    if short:
        raise PackbenchError(f"--prompts: prompt {short[0]} of {path} has {len(ids[short[0]])} tokens, fewer than "
                             f"--prefix {prefix}; write longer prompts or lower --prefix")
    return [p[:prefix] for p in ids]


def _shape_of(config: dict) -> str | None:
    """The preset shape whose dimensions config.json has (a real OPT's too), or None."""
    from packbench.core.registry import SHAPES

    dims = (config.get("hidden_size"), config.get("ffn_dim"), config.get("num_hidden_layers"))
    return next((name for name, s in SHAPES.items() if (s["hidden"], s["ffn"], s["layers"]) == dims), None)


def _finite(value):
    """NaN as null: JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def render(s: dict) -> str:
    """The terminal table: the summary's figures, then real OPT's beside them."""
    pct = lambda x: "-" if x is None or not math.isfinite(x) else f"{100 * x:.2f} %"  # noqa: E731
    d, u, o, n, w = s["density"], s["union"], s["overlap"], s["next_token"], s["workload"]
    m = s["model"]
    lines = [f"{m['dir']}: {m['shape'] or 'unknown shape'}, {m['dtype']}; {counted(s['prompts'], 'prompt')} ({m['prompts']}) "
             f"x {s['prefix_tokens']} tokens + {counted(s['decode_calls'], 'decode call')}",
             "",
             f"active per token     prefill {pct(d['prefill'])}   decode {pct(d['decode'])}",
             "  by layer (decode)  " + " ".join(f"{100 * x:.1f}" for x in d["by_layer_decode"]) + "  (%)",
             "union of k tokens    " + "   ".join(f"k={k} {pct(v)}" for k, v in u.items() if k != "curve"),
             f"consecutive overlap  decode {pct(o['decode_next'])} of a token's set active in the next "
             f"(Jaccard {pct(o['decode_jaccard'])}); prefill {pct(o['prefill_next'])}",
             "hot neurons          " + "   ".join(f"{pct(float(k))} of activations: {pct(v)} of neurons"
                                                for k, v in s["hot"].items()),
             f"next token           entropy {n['entropy_nats']:.2f} nats (p10 {n['entropy_p10']:.2f}, "
             f"p90 {n['entropy_p90']:.2f}), top-1 probability {n['top1_prob']:.3f}",
             "",
             "rows moved, as packbench's ledger counts them (index bytes aside):",
             f"  decode packet / dense-stream per call        {pct(w['decode_packet_over_dense'])}",
             f"  prefill packet / dense-stream                {pct(w['prefill_packet_over_dense'])}",
             f"  episode packets / dense-stream               {pct(w['episode_packet_over_dense'])}",
             f"  early-forecast extra over demand             {pct(w['forecast_extra_over_demand'])} "
             f"(decode to decode only, as the seed counted: {pct(w['forecast_extra_over_demand_decode_only'])}; "
             f"wasted/used {w['forecast_wasted_over_used_decode_only']:.3f})"]
    if s["real_opt"]:
        width = max(len(r["label"]) + len(r["real_shape"]) + 3 for r in s["real_opt"])
        lines += ["", f"{'real OPT (measured on)':{width}} {'real':>10} {'this':>10} {'this/real':>10}"]
        for r in s["real_opt"]:
            near = "" if r["within"] else "  (outside 20 %)"
            lines.append(f"{r['label'] + ' (' + r['real_shape'] + ')':{width}} {r['real']:10.4f} {r['measured']:10.4f} "
                         f"{r['ratio']:10.2f}{near}")
        lines.append("(real OPT's figures of this shape, prefix and episode length; docs/workloads.md lists every "
                     "workload's)")
    return "\n".join(lines)
