"""`packbench simulate TRACE`: every loader policy's ledger replayed on a trace of active sets,
with no weights, counted as the engine counts it, and a stated time prediction.

A policy here is a table entry (`SIMULATED`): for a unit ("row": OPT, "expert": MoE) and a
policy name, a function of the trace's model and the condition's params that returns a fresh
`step(phase, layer, active, forecast, tokens) -> Charge` for one episode (the engine makes a fresh policy for every
episode: `CpuFirstModel.use`, so caches and forecasts start empty each episode here too). A
step lists the `Recorder.add` charges the engine's policy makes for that layer, from the same
functions (core/charges.py), in the same order; the ledger sums them as `Recorder.add` does.
Adding a policy is one function and one entry. The expert caches (`expert-cache`, LRU or LFU,
forecast off or on) and `expert-forecast` decide through core/expert_cache.py, as the engine
does; a forecast reads the trace's forecast set of the layer (trace version 2 or 3: made in the
layer with experts before it), and a trace without one refuses them.

Time (`predict`): per decode token, the machine's measured compute time of a resident decode
token at the trace's shape (scaled per layer from a measurement at another depth, and said so)
plus the decode call's host-to-device bytes at the machine's pinned copy rate: copies and
compute run one after the other (every packet waits for its layer's activity; an MoE layer's
experts are copied before its expert loop), except OPT's dense-stream, whose copies run on a
stream of their own beside compute (engine/policies/dense.py), so its time is the larger of
the two. An expert cache's hit moves nothing, so costs nothing; a forecast's prefetch runs on a
side stream beside about one layer's compute (the layer with experts before it, then its own
attention), so per decode call and layer the smaller of its copy and one layer's share of the
compute is hidden and the rest is serial copy time (`prefetch_hidden_ms`).
Where the machine file holds `overhead_us` (docs/traces.md, "Time: machines and the model"),
each decode call also pays the engine's fixed costs beyond compute and bytes, measured on that
machine at negligible bytes (bench/moe_overhead.py): per MoE layer (the routing readback that
synchronises the layer, the policy's per-layer bookkeeping), per expert moved (its copies' issue
and latency), per routed expert of a cache (read through the cache's view) and per forecast (the
next router applied, read back, its prefetch issued), added serially (`overhead_ms`). A file
without them still predicts compute + copy, and the prediction says the term is missing.
Where the compute entry holds a policy family's own figure (`families`: that family's decode timed
on the checkpoint with nothing moved, bench/simulate_check.py), it replaces resident compute for
the family's policies, and the family's per-layer and per-routed terms, which that time already
holds, are not added again; its per-moved term and the forecast's terms still are.
It is a prediction from stated rates, never a measurement.

Layer rule: core. numpy only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from packbench.core import charges
from packbench.core.expert_cache import CACHE_RULES, LayerCache, belady_by_phase, forecast_step
from packbench.core.registry import INT8_SCALE_BYTES
from packbench.core.text import show
from packbench.core.trace import Trace, TraceModel, forecast_possible

LEDGER_KEYS = ("active_rows", "rows_copied", "h2d_weight_bytes", "h2d_index_bytes", "d2h_bytes", "rows_wasted")
_ADD_KEYS = {"rows": "rows_copied", "weight_bytes": "h2d_weight_bytes", "index_bytes": "h2d_index_bytes",
             "d2h_bytes": "d2h_bytes", "wasted": "rows_wasted"}


class SimulateError(ValueError):
    """A policy or parameter the simulation cannot replay (the message names the fix)."""


@dataclass
class Charge:
    """One layer of one call: the engine's `Recorder.add` charges in order, and the hits of a
    cache (not in the engine's ledger; reported beside it); an expert cache also reports its
    misses and its forecast's prefetched and used experts (the wasted ones are the ledger's)."""

    charges: list[dict] = field(default_factory=list)
    hits: int | None = None
    misses: int | None = None
    prefetched: int | None = None
    used: int | None = None


# step(phase, layer, active, forecast, tokens): `forecast` is the trace's forecast set for the layer
# (core/trace.py; None where the trace has none or no forecast can be made); `tokens` the call's.
Stepper = Callable[[str, int, np.ndarray, "np.ndarray | None", int], Charge]


def _unit_bytes(model: TraceModel, params: dict) -> int:
    """A unit's bytes as the condition moves it: an int8 row is hidden int8 values and a scale."""
    if params.get("weights", "dtype") == "int8":
        if model.unit != "row" or not model.hidden:
            raise SimulateError("weights int8 moves OPT rows of hidden + 4 bytes; the trace has no OPT hidden size")
        return model.hidden + INT8_SCALE_BYTES
    return model.unit_bytes


# ----------------------------------------------------------------------------- OPT rows


def _resident(model: TraceModel, params: dict) -> Stepper:
    return lambda phase, layer, active, forecast=None, tokens=1: Charge()  # resident: nothing to fetch


def _dense_stream(model: TraceModel, params: dict) -> Stepper:
    rb = _unit_bytes(model, params)
    return lambda phase, layer, active, forecast=None, tokens=1: Charge([charges.dense_copy(model.units, rb)])


def _host_packet(model: TraceModel, active: np.ndarray, rb: int) -> list[dict]:
    """packet {gather: host}: the mask readback, then the active rows indexed by themselves."""
    return [charges.activity_readback(active.size, model.units), charges.unit_packet(active.size, rb)]


def _packet(model: TraceModel, params: dict) -> Stepper:
    rb = _unit_bytes(model, params)
    if params.get("gather", "host") == "device":
        return lambda phase, layer, active, forecast=None, tokens=1: Charge([charges.device_counts(active.size, rb)])
    return lambda phase, layer, active, forecast=None, tokens=1: Charge(_host_packet(model, active, rb))


def _phase_switched(model: TraceModel, params: dict) -> Stepper:
    decode = _packet(model, params)
    rb = _unit_bytes(model, params)

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        if phase == "prefill":
            return Charge([charges.dense_copy(model.units, rb)])
        return decode(phase, layer, active)
    return step


def _sparse_extents(model: TraceModel, params: dict) -> Stepper:
    from packbench.core.registry import check_param, param_default

    block = check_param("sparse-extents", "block_rows", params.get("block_rows",
                                                                   param_default("sparse-extents", "block_rows")))

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        blocks = charges.extent_blocks(active, block)
        rows = charges.extent_rows(blocks, block, model.units)
        return Charge([charges.activity_readback(active.size, model.units),
                     charges.unit_packet(rows, model.unit_bytes, index=blocks.size)])
    return step


# row-retention's replay holds an int64 slot for every row of every layer: 2^27 of them is 1 GiB,
# OPT-175B is 96 x 49,152 = 4.7 M. A trace claiming 2^31 - 1 rows a layer (which the reader
# allows: ids are only checked against it) asked numpy for 32 GiB and exited 70.
MAX_RETENTION_ROWS = 2**27


def _row_retention(model: TraceModel, params: dict) -> Stepper:
    from packbench.core.registry import check_param

    if "rows_per_layer" not in params:
        raise SimulateError("row-retention needs rows_per_layer (e.g. row-retention:rows_per_layer=512)")
    if model.layers * model.units > MAX_RETENTION_ROWS:
        raise SimulateError(f"row-retention keeps a slot for every row of every layer: {model.layers} layers x "
                            f"{model.units} rows is over {MAX_RETENTION_ROWS}; replay it on a trace of fewer layers")
    slots = min(check_param("row-retention", "rows_per_layer", params["rows_per_layer"]), model.units)
    slot_of = np.full((model.layers, model.units), -1, dtype=np.int64)
    last_used = np.full((model.layers, slots), -1, dtype=np.int64)
    clock = {"call": 0, "layer": model.layers}

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        if layer <= clock["layer"]:  # a new call (layers run in order): the recorder's serial moves on
            clock["call"] += 1
        clock["layer"] = layer
        hit_rows, _, miss_rows, fill_rows, _ = charges.lru_plan(slot_of[layer], last_used[layer], active,
                                                                clock["call"])
        out = [charges.activity_readback(active.size, model.units)]
        if hit_rows.size:
            out.append(charges.retention_hits(hit_rows.size))
        out.append(charges.unit_packet(miss_rows.size, model.unit_bytes))
        if fill_rows.size:
            out.append(charges.retention_fills(fill_rows.size))
        return Charge(out, hits=int(hit_rows.size))
    return step


def _early_forecast(model: TraceModel, params: dict) -> Stepper:
    rb = model.unit_bytes
    if params.get("gather", "host") == "device":
        prev = [np.zeros(0, dtype=np.int64) for _ in range(model.layers)]  # the device's `prev`: zeros

        def device_step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None,
                        tokens: int = 1) -> Charge:
            predicted = prev[layer] if phase == "decode" else np.zeros(0, dtype=np.int64)
            missed, wasted = charges.forecast_split(predicted, active)
            prev[layer] = active
            return Charge([charges.device_counts(active.size, rb, counters=4, rows=predicted.size + missed.size,
                                               wasted=wasted)])
        return device_step
    previous: list[np.ndarray | None] = [None] * model.layers

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        out = []
        predicted = previous[layer] if phase == "decode" else None
        if predicted is not None and predicted.size == 0:
            predicted = None  # nothing forecast: the layer sends its whole demand after fc1
        if predicted is not None:  # before_layer: the forecast's packet
            out.append(charges.unit_packet(predicted.size, rb))
        out.append(charges.activity_readback(active.size, model.units))
        previous[layer] = active
        if predicted is None:
            out.append(charges.unit_packet(active.size, rb))
        else:
            remainder, wasted = charges.forecast_split(predicted, active)
            out.append(dict(wasted=wasted))
            out.append(charges.unit_packet(remainder.size, rb))
        return Charge(out)
    return step


# ----------------------------------------------------------------------------- MoE experts


def _expert_dense(model: TraceModel, params: dict) -> Stepper:
    return lambda phase, layer, active, forecast=None, tokens=1: Charge([charges.dense_copy(model.units,
                                                                                          model.unit_bytes)])


def _expert_packet(model: TraceModel, params: dict) -> Stepper:
    gather = params.get("gather", "host")
    device = gather == "device"

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        if gather == "mapped":  # the routing stays on the device: nothing read back, no index
            # A call of more than one token gathers its union, counted on the device and read after
            # the call (ExpertMappedPacket.settle); a one-token call's k experts are known (top-k).
            count = [] if tokens == 1 else [dict(d2h_bytes=charges.COUNT_BYTES)]
            return Charge([dict(active=active.size, **charges.unit_packet(active.size, model.unit_bytes, index=0)),
                           *count])
        return Charge([charges.activity_readback(active.size, model.units),
                     charges.unit_packet(active.size, model.unit_bytes, index=0 if device else None)])
    return step


def _expert_phase_switched(model: TraceModel, params: dict) -> Stepper:
    packet = _expert_packet(model, params)

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        if phase == "prefill":
            return Charge([charges.dense_copy(model.units, model.unit_bytes)])
        return packet(phase, layer, active, tokens=tokens)
    return step


def _expert_cache(model: TraceModel, params: dict) -> Stepper:
    """expert-cache {capacity, rule, forecast} and expert-forecast (capacity 0, forecast on), as
    engine/moe/cache.py decides them: per layer a `LayerCache` (core/expert_cache.py), the layer's
    forecast (made in the layer with experts before it) accounted against the cache before its step."""
    if "capacity" not in params:
        raise SimulateError("expert-cache needs capacity (e.g. expert-cache:capacity=4,rule=lru,forecast=off)")
    from packbench.core.moe import capacity_refusal
    from packbench.core.registry import check_param

    capacity, rule = check_param("expert-cache", "capacity", params["capacity"]), params.get("rule", "lru")
    why = capacity_refusal(capacity, model.units, "the trace's model")
    if why:
        raise SimulateError(f"capacity {why}")
    forecasting = params.get("forecast", "off") == "on"
    caches = [LayerCache(capacity, rule) for _ in range(model.layers)]  # raises ValueError on a bad capacity
    eb, units = model.unit_bytes, model.units

    def step(phase: str, layer: int, active: np.ndarray, forecast: np.ndarray | None = None, tokens: int = 1) -> Charge:
        cache = caches[layer]
        out = [charges.activity_readback(active.size, units)]
        prefetched = used = None
        wasted = 0
        brought: set[int] = set()
        if forecasting and forecast is not None:
            f = forecast_step(forecast.tolist(), cache.cached, active.tolist())
            # Charged to this layer while the MoE layer before it ran (engine: `prefetch(layer, ...)`).
            out.insert(0, charges.expert_prefetch(len(f.prefetched), eb, units))
            prefetched, used, wasted, brought = len(f.prefetched), len(f.used), len(f.wasted), set(f.used)
        s = cache.step(active.tolist())
        fetched = sum(1 for e in s.misses if e not in brought)
        out.append(charges.expert_fetch(fetched, eb, wasted=wasted))
        return Charge(out, hits=len(s.hits), misses=len(s.misses), prefetched=prefetched, used=used)
    return step


def _expert_forecast(model: TraceModel, params: dict) -> Stepper:
    return _expert_cache(model, {"capacity": 0, "forecast": "on"})


# Every policy the simulation replays, by unit and name, with the params it reads.
SIMULATED: dict[tuple[str, str], tuple[Callable[[TraceModel, dict], Stepper], tuple[str, ...]]] = {
    ("row", "resident"): (_resident, ()),
    ("row", "dense-stream"): (_dense_stream, ("weights",)),
    ("row", "packet"): (_packet, ("gather", "weights")),
    ("row", "phase-switched"): (_phase_switched, ("gather",)),
    ("row", "sparse-extents"): (_sparse_extents, ("block_rows",)),
    ("row", "row-retention"): (_row_retention, ("rows_per_layer",)),
    ("row", "early-forecast"): (_early_forecast, ("gather",)),
    ("expert", "resident"): (_resident, ()),
    ("expert", "dense-stream"): (_expert_dense, ()),
    ("expert", "packet"): (_expert_packet, ("gather",)),
    ("expert", "phase-switched"): (_expert_phase_switched, ("gather",)),
    ("expert", "expert-cache"): (_expert_cache, ("capacity", "rule", "forecast")),
    ("expert", "expert-forecast"): (_expert_forecast, ()),
}
# Expert caches: ledger() adds Belady's hits for the same capacity (core/expert_cache.py).
EXPERT_CACHES = {"expert-cache", "expert-forecast"}


def needs_forecast(name: str, params: dict) -> bool:
    """Whether the policy reads the trace's forecast sets (core/trace.py, version 2 or 3)."""
    return name == "expert-forecast" or (name == "expert-cache" and params.get("forecast", "off") == "on")


# Policies whose copies overlap compute in the engine (predict takes the larger of the two).
OVERLAPPED = {("row", "dense-stream")}
# What `simulate` replays when no --policy is given.
DEFAULT_POLICIES = {
    "row": ["resident", "dense-stream", "packet", "packet:gather=device", "phase-switched",
            "phase-switched:gather=device", "sparse-extents", "row-retention:rows_per_layer=ROWS",
            "early-forecast", "early-forecast:gather=device"],
    "expert": ["resident", "dense-stream", "packet", "packet:gather=device", "packet:gather=mapped", "phase-switched",
               "phase-switched:gather=device", "phase-switched:gather=mapped", "expert-cache:capacity=CAP,rule=lru", "expert-cache:capacity=CAP,rule=lfu",
               "expert-forecast", "expert-cache:capacity=CAP,rule=lru,forecast=on"],
}
_PARAM_VALUES = {"gather": ("host", "device"), "weights": ("dtype", "int8"), "rule": CACHE_RULES,
                 "forecast": ("off", "on")}


def parse_policy(text: str, unit: str) -> tuple[str, dict]:
    """`name` or `name:key=value,key=value` (e.g. `packet:gather=device`,
    `row-retention:rows_per_layer=512`) -> (name, params), checked against the table."""
    name, colon, rest = text.partition(":")
    if (unit, name) not in SIMULATED:
        names = sorted(n for u, n in SIMULATED if u == unit)
        raise SimulateError(f"policy {name!r} cannot be simulated on a trace of {unit}s; use one of {', '.join(names)}")
    allowed = SIMULATED[(unit, name)][1]
    # As --sweep FIELD= is refused: a separator with nothing after it is a typo, not "no parameters"
    # (`packet:` ran as packet under a label that said otherwise; so did `packet:gather=device,`).
    if colon and not all(rest.split(",")):
        fix = f"{name!r} alone or {name}:key=value,..." if allowed else f"{name!r} alone (it takes no parameters)"
        raise SimulateError(f"policy {text!r} has an empty parameter (nothing after ':' or between commas); "
                            f"write {fix}")
    params: dict = {}
    for item in rest.split(",") if colon else ():
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise SimulateError(f"policy {name}: parameter {item!r} is not one of {', '.join(allowed)} (write "
                                f"{name}:key=value)" if allowed else f"policy {name} takes no parameters; "
                                f"give it as {name!r} alone, not {text!r}")
        if key in params:  # the row is labelled with the text as written: which of two values ran is not said
            raise SimulateError(f"policy {name}: {key} is given twice; give it once")
        if key in _PARAM_VALUES:
            # `mapped`: an MoE model's sync-free expert gather (core/conditions/base.py), never OPT's
            choices = _PARAM_VALUES[key] + (("mapped",) if key == "gather" and unit == "expert" else ())
            if value not in choices:
                raise SimulateError(f"policy {name}: {key} must be one of {', '.join(choices)}")
            params[key] = value
        else:
            # ASCII digits only: int() also takes '٤', ' 4' and '1_0', which the row's label would show as written
            if not (value.isascii() and value.removeprefix("-").isdigit()):
                raise SimulateError(f"policy {name}: {key} must be an integer, got {value!r}")
            params[key] = int(value)
    return name, params


CACHE_KEYS = ("hits", "misses", "prefetched", "used", "belady_hits")


def check(trace: Trace, name: str, params: dict) -> Callable[[TraceModel, dict], Stepper]:
    """Raise SimulateError where `name {params}` cannot be replayed on `trace` (everything `ledger`
    refuses, before any call is replayed: a command given several policies refuses a bad one before
    replaying the others); else the policy's stepper factory."""
    make = SIMULATED[(trace.model.unit, name)][0]
    if needs_forecast(name, params) and trace.forecasts is None:
        raise SimulateError(f"{name} needs the trace's forecast sets, which this trace does not hold; record it "
                            f"with packbench's tracer (trace version 2 or later) from the MoE checkpoint")
    make(trace.model, params)  # its own parameter checks (capacity, rows_per_layer, int8's hidden size)
    return make


def ledger(trace: Trace, name: str, params: dict) -> list[dict]:
    """Per call, the engine's CallLedger fields (index, phase, tokens and the per-layer lists of
    LEDGER_KEYS) as `name {params}` would record them on this trace, plus per layer the cache's
    `hits` (None where the policy has no cache) and, for an expert cache, `misses`, the forecast's
    `prefetched` and `used` (None where no forecast was made), and `belady_hits`: Belady's optimal
    hits for the same capacity on the episode's same requests, in a call of each phase those of the
    run that makes the most hits in that phase's calls (core/expert_cache.py `belady_by_phase`), so
    a phase's sum bounds every cache's hits in it."""
    m = trace.model
    make = check(trace, name, params)
    skip = set(m.layers_without_units)
    calls = []
    for episode in trace.episodes():
        step = make(m, params)  # fresh per episode, as the engine's policy is
        first = len(calls)
        for c in episode:
            call = trace.calls[c]
            row = {"index": c, "episode": call.episode, "phase": call.phase, "tokens": call.tokens,
                   "active_rows": [None] * m.layers, "rows_copied": [0] * m.layers,
                   "h2d_weight_bytes": [0] * m.layers, "h2d_index_bytes": [0] * m.layers,
                   "d2h_bytes": [0] * m.layers, "rows_wasted": [0] * m.layers,
                   **{key: [None] * m.layers for key in CACHE_KEYS}}
            for layer in range(m.layers):
                if layer in skip:
                    continue  # a dense layer of an MoE model: no experts, nothing charged
                forecast = trace.forecasts[c][layer] if (trace.forecasts is not None
                                                         and forecast_possible(m, layer, trace.version)) else None
                s = step(call.phase, layer, trace.sets[c][layer], forecast, call.tokens)
                for key in ("hits", "misses", "prefetched", "used"):
                    row[key][layer] = getattr(s, key)
                for add in s.charges:
                    if add.get("active") is not None:
                        row["active_rows"][layer] = add["active"]
                    for key, field_name in _ADD_KEYS.items():
                        row[field_name][layer] += add.get(key, 0)
            calls.append(row)
        if name in EXPERT_CACHES:
            capacity = params.get("capacity", 0)
            for layer in range(m.layers):
                if layer in skip:
                    continue
                hits = belady_by_phase([trace.sets[c][layer].tolist() for c in episode],
                                       [trace.calls[c].phase for c in episode], capacity)
                for row, h in zip(calls[first:], hits):
                    row["belady_hits"][layer] = h
    return calls


def totals(calls: list[dict]) -> dict:
    """Per phase: calls, tokens, units moved, H2D weight and index bytes, D2H bytes, wasted
    units, and the cache's hits, misses, prefetched, used, Belady's hits (None when the policy
    has none of them) with `hit_rate` and `belady_rate` over the units observed active."""
    out = {}
    for phase in ("prefill", "decode"):
        mine = [c for c in calls if c["phase"] == phase]
        cache = {key: [v for c in mine for v in c[key] if v is not None] for key in CACHE_KEYS}
        out[phase] = {"calls": len(mine), "tokens": sum(c["tokens"] for c in mine),
                      "rows_copied": sum(sum(c["rows_copied"]) for c in mine),
                      "active_rows": sum(sum(a for a in c["active_rows"] if a is not None) for c in mine),
                      "h2d_weight_bytes": sum(sum(c["h2d_weight_bytes"]) for c in mine),
                      "h2d_index_bytes": sum(sum(c["h2d_index_bytes"]) for c in mine),
                      "d2h_bytes": sum(sum(c["d2h_bytes"]) for c in mine),
                      "rows_wasted": sum(sum(c["rows_wasted"]) for c in mine),
                      **{key: sum(v) if v else None for key, v in cache.items()}}
        routed = out[phase]["active_rows"]
        for key, num in (("hit_rate", "hits"), ("belady_rate", "belady_hits")):
            out[phase][key] = out[phase][num] / routed if out[phase][num] is not None and routed else None
    return out


# ----------------------------------------------------------------------------- machines


def machine_problem(machine: object) -> str | None:
    """Why a machine file's mapping cannot price a trace (docs/traces.md, "Machines"), or None."""
    if not isinstance(machine, dict) or not isinstance(machine.get("name"), str):
        return "a machine file is a JSON object with name, pinned_h2d_gbps and decode_compute_ms"
    rate = machine.get("pinned_h2d_gbps")
    if not _figure(rate, _positive):
        return (f"pinned_h2d_gbps must be {{value: a rate > 0 in GB/s, {MIN_VALUE:g} to {MAX_VALUE:g}, source: the command "
                f"and date that measured it}}")
    compute = machine.get("decode_compute_ms", {})
    if not isinstance(compute, dict):
        return "decode_compute_ms must map shape:layers to {value, source}"
    for key, v in compute.items():
        shape, _, layers = key.rpartition(":")
        # ASCII digits only: "²".isdigit() holds, yet int("²") raises; and a layer count has few digits.
        if not shape or not (layers.isascii() and layers.isdigit()) or len(layers) > 6 or int(layers) < 1:
            return f"decode_compute_ms key {show(key)} must be shape:layers, e.g. qwen3-30b-a3b:12"
        if not _figure(v, _positive):
            return (f"decode_compute_ms[{show(key)}] must be {{value: ms > 0, {MIN_VALUE:g} to {MAX_VALUE:g}, "
                    f"source: command and date}}")
        problem = _families_problem(key, v.get("families", {}))
        if problem:
            return problem
    return _overhead_problem(machine.get("overhead_us", {}))


def _figure(v: object, valid: Callable[[object], bool]) -> bool:
    """A machine file's measured figure: {value, source}, its value `valid`, its source text."""
    return isinstance(v, dict) and valid(v.get("value")) and isinstance(v.get("source"), str)


def _families_problem(key: str, families: object) -> str | None:
    """Why an entry's optional `families` (each policy family's own zero-copy compute) is refused."""
    where = f"decode_compute_ms[{show(key)}]['families']"
    if not isinstance(families, dict):
        return f"{where} must map a policy family ({', '.join(COMPUTE_FAMILIES)}) to {{value, source}}"
    for family, v in families.items():
        if family not in COMPUTE_FAMILIES:
            return f"{where} key {show(family)} must be one of {', '.join(COMPUTE_FAMILIES)}"
        if not _figure(v, _positive):
            return (f"{where}[{family!r}] must be {{value: ms > 0, {MIN_VALUE:g} to {MAX_VALUE:g}, "
                    f"source: command and date}}")
    return None


def _overhead_problem(overhead: object) -> str | None:
    if not isinstance(overhead, dict):
        return f"overhead_us must map a policy family ({', '.join(OVERHEAD_FAMILIES)}) to its terms"
    for family, terms in overhead.items():
        if family not in OVERHEAD_FAMILIES:
            return f"overhead_us key {show(family)} must be one of {', '.join(OVERHEAD_FAMILIES)}"
        if not isinstance(terms, dict) or not terms:
            return f"overhead_us[{family!r}] must map {', '.join(OVERHEAD_TERMS)} to {{value, source}}"
        for term, v in terms.items():
            if term not in OVERHEAD_TERMS:
                return f"overhead_us[{family!r}] key {show(term)} must be one of {', '.join(OVERHEAD_TERMS)}"
            if not _figure(v, _non_negative):
                return (f"overhead_us[{family!r}][{term!r}] must be {{value: microseconds >= 0, at most {MAX_VALUE:g}, "
                        f"source: command and date}}")
    return None


# A machine file's figures as floats bounded far beyond any real rate, ms or us: an integer of 400
# digits (float() overflows) or a rate of 5e-324 GB/s (the predicted time is inf, and --json's
# output is no JSON) is refused where it is read, not by the arithmetic that prices a trace.
MIN_VALUE, MAX_VALUE = 1e-9, 1e12


def _number(v: object) -> float | None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _positive(v: object) -> bool:
    f = _number(v)
    return f is not None and MIN_VALUE <= f <= MAX_VALUE


def _non_negative(v: object) -> bool:
    f = _number(v)
    return f is not None and (f == 0 or MIN_VALUE <= f <= MAX_VALUE)


# The engine's fixed costs a decode call pays beyond resident compute and bytes, by policy family
# (machine files' `overhead_us`, measured by bench/moe_overhead.py). Per family, microseconds:
# `layer_us` per MoE layer of a call (for `forecast`: per layer that receives a forecast),
# `moved_us` per expert moved host-to-device (for `forecast`: per expert prefetched; for the
# others: per expert fetched on demand), `routed_us` per routed expert of the layer.
OVERHEAD_FAMILIES = ("dense-stream", "packet", "packet-host", "expert-cache", "forecast")
OVERHEAD_TERMS = ("layer_us", "moved_us", "routed_us")
# The families whose decode can be timed on the checkpoint itself with no bytes moved, so that time
# replaces resident compute (`decode_compute_ms[...]['families']`): a policy's first overhead family.
# `forecast` rides on a cache and is never a policy's compute.
COMPUTE_FAMILIES = ("dense-stream", "packet", "packet-host", "expert-cache")
# The terms a family's own zero-copy compute already holds: every layer and routed expert it paid
# with nothing moved. What moving adds (moved_us) and the forecast's family stay.
IN_OWN_COMPUTE = ("layer_us", "routed_us")


def overhead_families(unit: str, name: str, params: dict) -> tuple[str, ...] | None:
    """The overhead families a policy's decode calls pay: () for resident (its time is the
    compute), None where the model has none (OPT rows, and the mapped expert gather: not measured)."""
    if unit != "expert" or params.get("gather") == "mapped":
        return None
    if name == "resident":
        return ()
    if name == "dense-stream":
        return ("dense-stream",)
    if name in ("packet", "phase-switched"):  # phase-switched's decode calls are packets
        return ("packet",) if params.get("gather", "host") == "device" else ("packet-host",)
    return ("expert-cache", "forecast") if needs_forecast(name, params) else ("expert-cache",)


def compute_family(unit: str, name: str, params: dict) -> str | None:
    """The family whose own measured compute prices the policy (its first overhead family), or None."""
    families = overhead_families(unit, name, params)
    return families[0] if families else None


def overhead_ms(trace: Trace, name: str, params: dict, phase_totals: dict, machine: dict,
                own: str | None = None) -> tuple[float | None, str]:
    """(ms per decode token of the engine's fixed costs, how they add up) from the machine's
    `overhead_us` and the decode calls' counts: layers with experts, experts routed, fetched on
    demand (moved less prefetched) and prefetched, layers that received a forecast. (None, why)
    where the machine file or the model has no such term. `own`: the family whose own zero-copy
    compute the prediction uses; its per-layer and per-routed terms are in that compute already,
    so only its per-moved term is added here (with every term of the other families)."""
    m = trace.model
    families = overhead_families(m.unit, name, params)
    if families is None:
        if m.unit == "expert":  # gather=mapped: bench/moe_overhead.py measures no family for it
            return None, ("not modelled for gather=mapped (overhead_us has no family for it); the prediction is "
                          "compute + copy alone")
        return None, "not modelled for OPT rows (overhead_us holds MoE policies' families)"
    if not families:
        return 0.0, "none: resident's time is the measured compute"
    table = machine.get("overhead_us")
    if not table:
        return None, (f"missing: {machine['name']} has no overhead_us (measure it: python -m bench.moe_overhead); "
                      f"the prediction is compute + copy alone")
    lacking = [f for f in families if f not in table]
    if lacking:
        return None, (f"missing: {machine['name']}'s overhead_us has no {', '.join(lacking)} entry; "
                      f"the prediction is compute + copy alone")
    d = phase_totals["decode"]
    moe_layers = m.layers - len(set(m.layers_without_units))
    forecast_layers = sum(forecast_possible(m, layer, trace.version) for layer in range(m.layers))
    prefetched = d.get("prefetched") or 0
    # Per family, over the decode calls: (layers paying layer_us, experts paying moved_us, routed_us).
    demand = (d["calls"] * moe_layers, d["rows_copied"] - prefetched, d["active_rows"])
    counts = {"forecast": (d["calls"] * forecast_layers, prefetched, 0)}
    total, parts = 0.0, []
    for f in families:
        layers, moved, routed = counts.get(f, demand)
        terms = [t for t in OVERHEAD_TERMS if t in table[f] and not (f == own and t in IN_OWN_COMPUTE)]
        us = {term: float(table[f][term]["value"]) if term in terms else 0.0 for term in OVERHEAD_TERMS}
        part = (layers * us["layer_us"] + moved * us["moved_us"] + routed * us["routed_us"]) / d["tokens"] / 1e3
        total += part
        per_token = {"layer_us": (layers, "layers"), "moved_us": (moved, "moved"), "routed_us": (routed, "routed")}
        held = " (its layers and routed experts: in its own compute)" if f == own else ""
        parts.append(f"{f} {part:.2f} ms (" + (" + ".join(
            f"{n / d['tokens']:g} {what} x {us[term]:g} us" for term, (n, what) in per_token.items() if term in terms)
            or "no term left") + ")" + held)
    return total, "; ".join(parts) + " per token"


def compute_ms(machine: dict, model: TraceModel, family: str | None = None) -> tuple[float, str, str | None] | None:
    """(ms of compute per decode token, how it was found, the family whose own figure it is or None
    for resident's) at the trace's shape and depth: the measured entry of that depth, or one of the
    same shape scaled by layers; the entry's `families[family]` where it has one, else its resident
    value; None without an entry."""
    entries = machine.get("decode_compute_ms", {})
    if model.shape is None:
        return None
    key = f"{model.shape}:{model.layers}"
    if key not in entries:
        key = next((k for k in sorted(entries) if k.rpartition(":")[0] == model.shape), None)
        if key is None:
            return None
    v, layers = entries[key], int(key.rpartition(":")[2])
    own = v.get("families", {}).get(family) if family else None
    figure = own or v
    value = float(figure["value"]) * model.layers / layers
    whose = "" if family is None else f"{family}'s own zero-copy compute, " if own else \
        f"resident compute (the entry has no {family} figure; overhead_us adds its layer and routed terms), "
    if layers == model.layers:
        return value, f"{whose}measured at {key} ({figure['source']})", family if own else None
    return value, (f"{whose}scaled by layers from {key}'s {figure['value']} ms ({figure['source']}): "
                   f"{model.layers}/{layers} of it"), family if own else None


def predict(trace: Trace, name: str, params: dict, calls: list[dict], machine: dict) -> dict:
    """The predicted decode ms per token of `name` on `machine` from its ledger `calls` (module
    doc: the model): compute + copy (the larger of the two where overlapped; a forecast's prefetch
    less what its layer's compute hides, `prefetch_hidden_ms`) + the engine's fixed costs where the
    machine file measured them (`overhead_ms_per_token`, None and `overhead` saying so where it did
    not), the mean over the decode calls; and `steady_call_ms`, the steady decode call a screen
    reports (each call priced alone by the same model, per episode the median over its decode calls
    but the first, then the median over episodes; None without a second decode call). The two differ
    where calls differ in bytes: a cache whose misses clump in a few calls has a median call below
    its mean."""
    m = trace.model
    rate = float(machine["pinned_h2d_gbps"]["value"])
    d = totals(calls)["decode"]
    forecasting = m.unit == "expert" and needs_forecast(name, params)
    out = {"machine": machine["name"], "pinned_h2d_gbps": rate,
           "overlap": "overlapped" if (m.unit, name) in OVERLAPPED else
           "serial, a prefetch hidden by its layer's compute" if forecasting else "serial"}
    if not d["tokens"]:
        return {**out, "decode_ms_per_token": None, "why": "the trace has no decode call"}
    out["copy_ms_per_token"] = (d["h2d_weight_bytes"] + d["h2d_index_bytes"]) / d["tokens"] / (rate * 1e9) * 1e3
    found = compute_ms(machine, m, compute_family(m.unit, name, params))
    if found is None:
        return {**out, "decode_ms_per_token": None,
                "why": f"{machine['name']} has no measured compute rate for {m.shape or 'this unnamed shape'}; "
                       f"add decode_compute_ms['{m.shape or 'SHAPE'}:{m.layers}'] to the machine file"}
    compute, how, own = found

    def per_token(mine: list[dict]) -> tuple[float, float | None, float | None, str]:
        """(ms per token, prefetch hidden, overhead, how the overhead adds up) over decode calls `mine`."""
        t = totals(mine)
        moved = t["decode"]["h2d_weight_bytes"] + t["decode"]["h2d_index_bytes"]
        copy = moved / t["decode"]["tokens"] / (rate * 1e9) * 1e3
        total = max(compute, copy) if out["overlap"] == "overlapped" else compute + copy
        hidden = prefetch_hidden_ms(m, mine, compute, rate) if forecasting else None
        extra, what = overhead_ms(trace, name, params, t, machine, own=own)
        return total - (hidden or 0.0) + (extra or 0.0), hidden, extra, what

    decode = [c for c in calls if c["phase"] == "decode"]
    total, hidden, extra, what = per_token(decode)
    if forecasting:
        out["prefetch_hidden_ms_per_token"] = hidden
    episodes: dict[int, list[dict]] = {}
    for call in decode:
        episodes.setdefault(call["episode"], []).append(call)
    medians = [statistics.median(per_token([c])[0] * c["tokens"] for c in sorted(mine, key=lambda c: c["index"])[1:])
               for mine in episodes.values() if len(mine) > 1]
    return {**out, "compute_ms_per_token": compute, "compute_source": how, "compute_family": own,
            "overhead_ms_per_token": extra, "overhead": what, "decode_ms_per_token": total,
            "steady_call_ms": statistics.median(medians) if medians else None}


def prefetch_hidden_ms(model: TraceModel, calls: list[dict], compute_ms: float, rate_gbps: float) -> float:
    """Per decode token, the copy time of forecast prefetches that compute hides. The engine issues
    layer L's prefetch on a side stream once the layer with experts before it has routed, and waits
    for it only when layer L's experts run: the copy overlaps about one layer's compute (that
    layer's experts, then layer L's attention). So per decode call and layer, the hidden part is
    the smaller of the prefetch's copy (its experts at the pinned rate) and one layer's share of
    the call's compute (compute per token / layers x the call's tokens); a prefetch longer than that
    is charged the rest, in series, as every other copy is."""
    layer_ms = compute_ms / model.layers
    hidden, tokens = 0.0, 0
    for call in calls:
        if call["phase"] != "decode":
            continue
        tokens += call["tokens"]
        for n in call["prefetched"]:
            if n:
                hidden += min(n * model.unit_bytes / (rate_gbps * 1e9) * 1e3, layer_ms * call["tokens"])
    return hidden / tokens if tokens else 0.0
