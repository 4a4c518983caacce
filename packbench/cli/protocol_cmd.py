"""`packbench protocol validate|show|plan FILE`: a protocol before anything runs.

validate: freeze it (every field checked) and print its identity; show: the frozen body and
its SHA-256; plan: the ordered episodes and, per condition, the bytes and transfer time the
screen will need, estimated from the model's shape and sparsity (core/estimate.py). Each says
what every condition runs with, defaults spelled out (`packet, gather host`), since a frozen
body leaves packet's gather out where it means host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.cli.choices import Shape
from packbench.cli.common import DbUrl, finite
from packbench.cli.plan_rates import CPU, comparable, device_here, earlier_episodes, measured_estimate, model_key, this_host
from packbench.cli.summary import table
from packbench.core.errors import PackbenchError
from packbench.core.files import read_json_object
from packbench.core.text import one_line
from packbench.core.protocol import Condition, FrozenProtocol, load

ProtocolFile = Annotated[Path, typer.Argument(help="Protocol YAML file.", show_default=False)]


def register(app: typer.Typer) -> None:
    protocol_app = typer.Typer(no_args_is_help=True, help="Protocols: validate, show or plan one before submitting it.")
    protocol_app.command("validate")(validate)
    protocol_app.command("show")(show)
    protocol_app.command("plan")(plan_cmd)
    app.add_typer(protocol_app, name="protocol")


def _load(path: Path) -> FrozenProtocol:
    return load(path)  # a missing path, a directory, a FIFO or a device: one line that says which


def _policy(c: Condition) -> str:
    """`packet, gather device`: a condition's policy and every parameter it runs with."""
    return ", ".join([c.policy, *(f"{k} {v if v is not None else 'chosen on the worker'}" for k, v in c.resolved_params.items())])


def _schema(frozen: FrozenProtocol) -> str:
    """`schema 2`, or `read as schema 3, frozen as schema 2` (schema 3 is never frozen)."""
    schema = frozen.body["schema"]
    if frozen.read_as in (None, schema):
        return f"schema {schema}"
    return f"read as schema {frozen.read_as}, frozen as schema {schema}"


def validate(
    protocol: ProtocolFile,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print the same as one JSON object.")] = False,
) -> None:
    """Check every field and freeze the protocol; print its name, schema, SHA-256, episode count
    and what each condition runs with."""
    from packbench.core.plan import plan
    from packbench.service.submit import archive_warning_of, check_family, check_positions, unjudged_warning

    frozen = _load(protocol)
    p = frozen.protocol
    check_positions(frozen)  # model.path: a checkpoint directory whose positions hold an episode, as submit checks
    check_family(frozen)  # an MoE checkpoint: expert policies only, an allowance for one layer's routed experts
    warning = archive_warning_of(frozen)  # valid still: a trusted archive is audited with --max-mib
    unjudged = unjudged_warning(frozen)  # valid still: the figures are recorded, only no verdict reads them
    if json_out:
        typer.echo(json.dumps({"valid": True, "name": p.name, "schema": frozen.body["schema"], "warning": warning,
                               "unjudged": unjudged,
                               "read_as": frozen.read_as or frozen.body["schema"], "sha256": frozen.sha256,
                               "planned_episodes": len(plan(p)),
                               "conditions": [{"name": c.name, "policy": c.policy, "params": c.resolved_params}
                                              for c in p.conditions]}, sort_keys=True, default=str))
        return
    typer.echo(f"valid: {one_line(p.name)} ({_schema(frozen)}), sha256 {frozen.sha256}, "
               f"{len(p.conditions)} conditions, {len(plan(p))} planned episodes")
    for c in p.conditions:
        typer.echo(f"  {c.name}: {_policy(c)}")
    for line in (warning, unjudged):
        if line is not None:
            typer.echo(f"warning: {line}", err=True)


def show(
    protocol: ProtocolFile,
    full: Annotated[bool, typer.Option("--full", metavar="", help="The full schema-2 form (every default spelled out) instead "
                                                      "of the frozen body.")] = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object: name, SHA-256, schema, body.")] = False,
) -> None:
    """Print the frozen body (what is hashed and archived) and its SHA-256, after `#` lines
    saying what each condition runs with."""
    frozen = _load(protocol)
    if json_out:
        typer.echo(json.dumps({"name": frozen.name, "sha256": frozen.sha256, "schema": frozen.body["schema"],
                               "body": frozen.protocol.full_dict() if full else frozen.body}, sort_keys=True,
                              default=str))
        return
    typer.echo(f"# {one_line(frozen.name)}: sha256 {frozen.sha256} ({_schema(frozen)})")
    for c in frozen.protocol.conditions:
        typer.echo(f"#   {c.name}: {_policy(c)}")
    typer.echo(json.dumps(frozen.protocol.full_dict() if full else frozen.body, indent=2, sort_keys=True))


def _written_recipe(model_dir) -> dict:
    """How a `packbench model synth` checkpoint was made (its config.json's packbench_synth), or {}."""
    try:
        # bounded: a config.json that is a FIFO hung `protocol plan` in read_bytes (NotReadable is a ValueError)
        recipe = read_json_object(model_dir / "config.json", limit=1 << 20).get("packbench_synth")
    except (OSError, ValueError):
        return {}
    return recipe if isinstance(recipe, dict) else {}


def _written_activity(model_dir):
    """The Activity a `packbench model synth` checkpoint was written with, or None."""
    from packbench.core.estimate import Activity
    from packbench.core.registry import PROFILES, SHAPES

    recipe = _written_recipe(model_dir)
    if recipe.get("profile") in PROFILES and recipe.get("shape") in SHAPES:
        return Activity.of_profile(recipe["profile"], recipe["shape"])
    value = recipe.get("sparsity")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
        return Activity(sparsity=float(value))
    return None


def rate(ctx: typer.Context, param: typer.CallbackParam, value: float) -> float:
    """--h2d-gbps: a rate in GB/s within the bounds of a machine file's pinned_h2d_gbps. Below them
    the transfer time overflows: 5e-324 GB/s printed `Infinity` in --json, which is no JSON."""
    from packbench.core.simulate import MAX_VALUE, MIN_VALUE

    value = finite(ctx, param, value)
    if not MIN_VALUE <= value <= MAX_VALUE:
        raise typer.BadParameter(f"{value:g} is not a rate in GB/s from {MIN_VALUE:g} to {MAX_VALUE:g}")
    return value


def plan_cmd(
    protocol: ProtocolFile,
    sparsity: Annotated[Optional[float], typer.Option(
        callback=finite, help="Fraction of post-ReLU activations exactly zero per token (default: model.synth's; required for "
             "model.path, e.g. 0.94: pretrained OPT shows 0.90-0.97).")] = None,
    h2d_gbps: Annotated[float, typer.Option(
        "--h2d-gbps", callback=rate, help="Host-to-device rate for the transfer floor, GB/s (default: pinned copies on the H200).")]
    = 55.0,
    shape: Annotated[Optional[Shape], typer.Option(
        help="The model's shape when model.path's config.json is not on this machine.")] = None,
    device: Annotated[Optional[str], typer.Option(
        help="The accelerator kind to estimate the time for, as attempts record it (e.g. 'NVIDIA H200', or cpu; "
             "default: this machine's).")] = None,
    db: DbUrl = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print the plan and the estimate as JSON.")] = False,
    sweep: Annotated[Optional[list[str]], typer.Option(
        "--sweep", help="FIELD=V1,V2,... (repeatable): list the points `submit --sweep` would queue, each with its "
                        "protocol hash and estimated bytes and transfer time.")] = None,
) -> None:
    """Print the ordered episodes and, per condition, the bytes the screen will move and its time:
    measured rates of earlier episodes on the same device (the database), else the GPU transfer floor."""
    from packbench.core.estimate import archive_bytes, archive_warning, estimate, loader_device_warning
    from packbench.core.plan import plan

    frozen = _load(protocol)
    p = frozen.protocol
    from packbench.cli.model_moe import is_moe_dir

    synth = p.model.synth
    if (synth is not None and synth.is_moe) or (frozen.model_dir() is not None and is_moe_dir(frozen.model_dir())):
        _moe_plan(frozen, h2d_gbps=h2d_gbps, json_out=json_out)
        return
    from packbench.core.moe import family_refusal

    refusal = family_refusal([(c.name, c.policy, dict(c.resolved_params)) for c in p.conditions], family="opt",
                             model=f"the OPT shape this plan is for ({frozen.model_dir() or 'model.synth'})")
    if refusal:  # an MoE checkpoint's plan reads its config.json, which is not here
        raise PackbenchError(f"protocol field `{refusal[0]}`: {refusal[1]} (protocol plan reads an MoE "
                             f"checkpoint's shape from its config.json: plan where the checkpoint is)")
    if sparsity is not None and not 0 < sparsity < 1:
        raise PackbenchError(f"--sparsity {sparsity} is not in (0, 1)")
    if sweep:
        from packbench.cli.sweep import plan_sweep

        named = None if shape is None else shape.value
        plan_sweep(protocol, sweep, json_out=json_out, estimate_of=lambda f: estimate(
            f.protocol, shape=_shape(f, named), activity=_activity(f, sparsity), h2d_gbps=h2d_gbps))
        return
    activity = _activity(frozen, sparsity)
    shape = _shape(frozen, None if shape is None else shape.value)
    _check_positions(frozen, shape)
    if frozen.model_dir() is None or frozen.model_dir().exists():
        from packbench.service.submit import check_family

        check_family(frozen)  # the offloading peers' refusals (an allowance, a dtype, a placement), as submit's
    entries = plan(p)
    est = estimate(p, shape=shape, activity=activity, h2d_gbps=h2d_gbps)
    timing = _timing(p, est, device=device or device_here(), db=db, model=model_key(p, model_dir=frozen.model_dir()))
    archive = archive_bytes(p, vocab=shape.vocab)  # the audit bound: docs/archive.md, "Bounds"
    warning = archive_warning(archive)
    device_warning = loader_device_warning(est["loader_device"], batch=p.batch)
    if json_out:
        typer.echo(json.dumps({"protocol": p.name, "sha256": p.sha256, "entries": entries, "estimate": est,
                               "time": timing, "archive": {**archive, "warning": warning},
                               "device_warning": device_warning}, indent=2, sort_keys=True))
        return
    typer.echo(f"{one_line(p.name)}: sha256 {p.sha256}")
    typer.echo(f"{len(entries)} episodes in this order, each 1 prefill call of {p.prefix_tokens} tokens + "
               f"{p.continuation_tokens - 1} decode calls")
    typer.echo(table(entries, ["index", "condition", "role", "prompt", "repetition"]))
    typer.echo("")
    _print_estimate(p, est, timing, shape=shape, h2d_gbps=h2d_gbps)
    _print_archive(archive, warning)
    if device_warning is not None:
        typer.echo(f"warning: {device_warning}", err=True)


def _mib(n: int) -> str:
    """Bytes in MiB to three significant figures: a tiny shape's 12 KiB expert read `0.0 MiB`."""
    return f"{n / 2**20:.3g}"


def _print_archive(archive: dict, warning: str | None) -> None:
    """`archive: about X MiB (...)` and, over the audit bound, the `warning:` line on stderr."""
    typer.echo(f"archive: about {archive['bytes'] / (1 << 20):,.1f} MiB ({archive['episodes']} episodes' float32 logits of "
               f"{archive['episode_logits_bytes']:,} bytes each"
               + (f", {archive['forced_episodes']} teacher-forced" if archive["forced_episodes"] else "") + ")")
    if warning is not None:
        typer.echo(f"warning: {warning}", err=True)


def _moe_plan(frozen: FrozenProtocol, *, h2d_gbps: float, json_out: bool) -> None:
    """The plan of a screen on an MoE checkpoint: its episodes, and per condition the bytes of the
    prefill call and of a decode call (core/moe.py call_bytes) with their transfer floor."""
    from packbench.core.estimate import archive_bytes, archive_warning
    from packbench.core.moe import MoeShape, call_bytes, call_bytes_bound, shape_of_config
    from packbench.core.plan import plan
    from packbench.engine.config import read_config
    from packbench.service.submit import check_family, check_positions

    p = frozen.protocol
    if p.model.synth is not None:  # a synthetic MoE shape: the schema checked positions and conditions
        s: MoeShape = MoeShape.of(p.model.synth.shape, layers=p.model.synth.layers)
    else:
        check_positions(frozen)
        check_family(frozen)
        s = shape_of_config(read_config(frozen.model_dir()))
    batch = p.batch
    rows = []
    for c in p.conditions:
        gather = c.resolved_params.get("gather", "device")
        hot = c.resolved_params.get("hot", 0)
        params = dict(c.resolved_params)
        pre = call_bytes(s, p.dtype, c.policy, tokens=batch * p.prefix_tokens, phase="prefill", gather=gather, hot=hot,
                         params=params)
        dec = call_bytes(s, p.dtype, c.policy, tokens=batch, phase="decode", gather=gather, hot=hot, params=params)
        bound = call_bytes_bound(c.policy, dict(c.resolved_params), tokens=batch * p.prefix_tokens)  # the longest call
        rows.append({"condition": c.name, "policy": c.policy, "prefill_bytes": pre, "decode_bytes": dec, "bound": bound,
                     "decode_floor_ms": dec / (h2d_gbps * 1e9) * 1e3})
    entries = plan(p)
    # the shape's vocabulary: a synthetic MoE shape's own, a checkpoint's from its config.json
    archive = archive_bytes(p, vocab=s.vocab if isinstance(s.vocab, int) and s.vocab > 0 else 50272)
    warning = archive_warning(archive)
    if json_out:
        typer.echo(json.dumps({"protocol": p.name, "sha256": p.sha256, "entries": entries, "moe": rows,
                               "archive": {**archive, "warning": warning}}, indent=2, sort_keys=True))
        return
    typer.echo(f"{one_line(p.name)}: sha256 {p.sha256}")
    typer.echo(f"{len(entries)} episodes in this order, each 1 prefill call of {p.prefix_tokens} tokens + "
               f"{p.continuation_tokens - 1} decode calls")
    typer.echo(table(entries, ["index", "condition", "role", "prompt", "repetition"]))
    typer.echo(f"\nMoE: {s.layers} layers{f' ({s.moe_layers} with experts)' if s.dense_layers else ''} x {s.experts} experts (top {s.k}) of {_mib(s.expert_bytes(p.dtype))} MiB; "
               f"bytes host-to-device per call, floor at {h2d_gbps} GB/s")
    typer.echo(table([{**r, "prefill_MB": f"{r['prefill_bytes'] / 1e6:.1f}", "decode_MB": f"{r['decode_bytes'] / 1e6:.1f}",
                       "decode_floor_ms": f"{r['decode_floor_ms']:.2f}"} for r in rows],
                     ["condition", "policy", "prefill_MB", "decode_MB", "bound", "decode_floor_ms"]))
    _print_archive(archive, warning)


def _check_positions(frozen: FrozenProtocol, shape) -> None:
    """An episode must fit the model's positions: the checkpoint's own when it is here (what
    submit checks), else the --shape the plan is made for."""
    from packbench.core.protocol.schema import positions_refusal
    from packbench.service.submit import check_positions

    model_dir = frozen.model_dir()
    if model_dir is not None and model_dir.exists():
        check_positions(frozen)
        return
    p = frozen.protocol
    refusal = positions_refusal(p.prefix_tokens, p.continuation_tokens, positions=shape.max_positions,
                                model=f"the {shape.layers}-layer shape the plan is made for")
    if refusal:
        raise PackbenchError(f"protocol field `prefix_tokens`: {refusal}")


def _activity(frozen: FrozenProtocol, sparsity: float | None):
    """The activation statistics the bytes are estimated from: --sparsity, the synthetic recipe, or
    what `packbench model synth` wrote into the checkpoint."""
    from packbench.core.estimate import Activity

    synth = frozen.protocol.model.synth
    legacy = synth is not None and synth.profile is None
    if sparsity is not None:  # a uniform synth's hot neurons stay
        activity = Activity(sparsity=sparsity, hot_fraction=synth.hot_fraction if legacy else 0.0,
                            hot_bias=synth.hot_bias if legacy else 0.0)
    elif synth is not None and synth.profile is not None:
        activity = Activity.of_profile(synth.profile, synth.shape)
    elif legacy:
        activity = Activity(sparsity=synth.sparsity, hot_fraction=synth.hot_fraction, hot_bias=synth.hot_bias)
    else:
        activity = _written_activity(frozen.model_dir())
    if activity is None:
        raise PackbenchError("model.path protocols need --sparsity (fraction of activations exactly zero, e.g. 0.94); "
                             "a checkpoint written by `packbench model synth` says its own")
    return activity


def _timing(p, est: dict, *, device: str, db: str | None, model: str) -> dict:
    """The screen's time: `measured` (rates of earlier episodes on `device`), else `gpu-bound` (the
    transfer floor, a lower bound on a GPU) or `unknown` (a CPU screen with no earlier episodes)."""
    rows, unread = earlier_episodes(db, model=model, dtype=p.dtype)
    rows = comparable(rows, model=model, dtype=p.dtype, device=device, host=this_host())
    planned = {r["condition"]: r["episodes"] for r in est["conditions"]}
    measured = measured_estimate(rows, planned=planned, tokens=p.continuation_tokens)
    kind = "measured" if measured["measured_episodes"] else "gpu-bound" if device != CPU else "unknown"
    return {"kind": kind, "device": device, "model": model, "database": unread, **measured,
            "gpu_bound_s": est["total_transfer_s"] if device != CPU else None}


def _print_estimate(p, est: dict, timing: dict, *, shape, h2d_gbps: float) -> None:
    gpu = timing["device"] != CPU
    typer.echo(f"estimate: {shape.layers} layers x {shape.ffn} neurons, outgoing row {est['row_bytes']} B ({p.dtype}); "
               f"active per call {est['decode_active_fraction']:.2%} (decode), up to "
               f"{est['prefill_active_fraction']:.2%} (prefill, independent tokens)"
               + (f"; transfer floor at {h2d_gbps:g} GB/s host-to-device on a GPU (--h2d-gbps)" if gpu else ""))
    if not gpu:
        typer.echo("no GPU on this machine: a screen dispatched here runs on the CPU, where these bytes are "
                   "host-memory copies and its time is the CPU's compute, not a GPU transfer floor")
    rates = {c["condition"]: c for c in timing["conditions"]}
    rows = []
    for r in est["conditions"]:
        row = {"condition": r["condition"], "policy": _policy(p.condition(r["condition"])), "episodes": r["episodes"],
               "bound": r["bound"], "prefill/call": _bytes(r["prefill_call_bytes"]),
               "decode/call": _bytes(r["decode_call_bytes"]), "per episode": _bytes(r["episode_bytes"]),
               "all episodes": _bytes(r["total_bytes"])}
        if gpu:
            row.update({"GPU transfer/episode": _seconds(r["episode_transfer_s"]),
                        "GPU transfer": _seconds(r["total_transfer_s"])})
        if timing["kind"] == "measured":
            m = rates[r["condition"]]
            row["measured time"] = "no rate" if m["total_s"] is None else \
                f"{_seconds(m['total_s'])} ({m['measured_episodes']} ep.)"
        rows.append(row)
    typer.echo(table(rows, list(rows[0])))
    typer.echo(f"screen: {_bytes(est['total_bytes'])} host-to-device")
    for line in _time_lines(timing, h2d_gbps=h2d_gbps) + _passes_lines(p) + _competitor_modes(p, cpu=not gpu):
        typer.echo(line)
    allowance = est["allowance_bytes"]
    typer.echo(f"parameters {_bytes(est['param_bytes'])} ({'exceed' if est['param_bytes'] > allowance else 'fit'} "
               f"the {p.allowance_mib} MiB allowance); outgoing weights {_bytes(est['outgoing_bytes'])} stay on the "
               f"host")
    room = est["loader_device"]
    if room is not None:
        typer.echo(f"device: packbench's loaders hold {_bytes(room['device_bytes'])} + a KV cache of "
                   f"{_bytes(room['kv_bytes'])} at batch {p.batch}; "
                   f"{_bytes(room['left_bytes']) if room['left_bytes'] >= 0 else '-' + _bytes(-room['left_bytes'])} of the allowance left "
                   f"for the CUDA context and activations (about {_bytes(room['activation_bytes'])} at this prefill)")


def _time_lines(timing: dict, *, h2d_gbps: float) -> list[str]:
    """What the screen's time is known to be, and from what."""
    where = timing["device"] if timing["device"] != CPU else f"the CPU of {this_host()}"
    unread = f" ({timing['database']})" if timing["database"] else ""
    if timing["kind"] == "measured":
        missing = [c["condition"] for c in timing["conditions"] if c["s_per_token"] is None]
        total = (f"about {_seconds(timing['total_s'])}" if timing["total_s"] is not None else
                 f"unknown for {', '.join(missing)} (no rate known)")
        return [f"time: {total}, an estimate from {timing['measured_episodes']} earlier episodes of {timing['model']} "
                f"on {where} (the median seconds per generated token of each "
                f"condition)"]
    if timing["kind"] == "gpu-bound":
        return [f"time: >= {_seconds(timing['gpu_bound_s'])}, a GPU-rate bound (the transfer floor at {h2d_gbps:g} "
                f"GB/s); no earlier episodes of {timing['model']} on {where} to estimate from{unread}"]
    return [f"time: no rate is known for a CPU screen: no earlier episodes of {timing['model']} on {where}{unread}; "
            f"a GPU transfer floor does not bound it (a screen's time here is the CPU's compute)"]


def _passes_lines(p) -> list[str]:
    """With separate passes (schema 7), what the time above leaves out: every episode runs twice."""
    if not p.separate_passes:
        return []
    return ["passes: separate: every episode runs twice, timed with the ledger and the sampler off, then recorded "
            "with them on; the times above are one pass's, the screen takes about twice as long"]


def _competitor_modes(p, *, cpu: bool = False) -> list[str]:
    """One line per competitor: the mode it runs in, and why its library cannot be captured; on a
    machine without a GPU (`cpu`), that a CPU worker refuses a CUDA-only one before any episode."""
    from packbench.core.conditions import CONDITIONS
    from packbench.core.registry import competitor_library, fastest_mode, mode_refusal, stack_refusal

    out = []
    for c in p.conditions:
        if CONDITIONS[c.policy].competitor is not None:
            params = c.resolved_params
            why = mode_refusal(c.policy, params, "graph")
            fails = stack_refusal(c.policy, params)
            fastest = fastest_mode(c.policy, params)
            # Above batch 1 an omitted mode is eager (the fastest modes were measured at batch 1); the frozen
            # body cannot tell it from a written `mode: eager`, so the hint holds for both.
            slower = p.batch > 1 and params["mode"] == "eager" and fastest != "eager"
            out.append(f"{c.name} ({competitor_library(c.policy, params)}): mode {params['mode']}"
                       + (f"; {why}" if why else "")
                       + (f"; a CUDA worker refuses mode {params['mode']} here: {fails}" if fails else "")
                       + (f"; at batch 1 its fastest mode is {fastest} (above batch 1 a mode left out is eager): "
                          f"write mode: {fastest} to compare it in its fastest mode" if slower else "")
                       + (f"; CUDA only: a screen run on the CPU fails before any episode "
                          f"({CONDITIONS[c.policy].competitor.cpu_refusal}): dispatch it to a GPU worker"
                          if cpu and CONDITIONS[c.policy].competitor.cpu_refusal else ""))
    return out



def _seconds(s: float) -> str:
    """Seconds a reader takes in at a glance: `1.896 s`, `19.07 ms`, `12.6 µs` (never `1.26e-05`)."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= size:
            return f"{s / size:,.4g} {unit}"
    return f"{s * 1e9:,.3g} ns" if s > 0 else "0 s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.4g} {unit}"
    return f"{n:,.0f} B"


def _shape(frozen: FrozenProtocol, named: str | None):
    """The model's shape: --shape, the synthetic preset, or the checkpoint's config.json."""
    from packbench.core.estimate import ModelShape

    synth = frozen.protocol.model.synth
    if named is not None or synth is not None:
        return ModelShape.of(named or synth.shape)
    config = frozen.model_dir() / "config.json"
    try:
        c = read_json_object(config, limit=1 << 20)  # a FIFO, /dev/zero, no JSON object: a ValueError
        return ModelShape(hidden=c["hidden_size"], ffn=c["ffn_dim"], layers=c["num_hidden_layers"],
                          vocab=c.get("vocab_size", 50272), max_positions=c.get("max_position_embeddings", 2048))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise PackbenchError(f"cannot read the model's shape from {config} ({one_line(str(e)[:200])}); give --shape (one of "
                             f"{', '.join(s.value for s in Shape)}) or put the checkpoint there") from None


