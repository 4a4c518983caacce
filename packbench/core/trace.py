"""Trace files: the active set of every call and layer of a run (OPT's active neurons, or an MoE
model's routed experts), with what pricing them needs; docs/traces.md is the format's reference.

A trace file is a zip of three members:

- `header.json`: `format` ("packbench-trace"), `version` (3; 1 and 2 are still read), `model` (family, unit "row" or
  "expert", layers, units per layer, unit_bytes, hidden, dtype, index_bytes, k, shape,
  layers_without_units), `source` (checkpoint, protocol, episode, tool: free provenance) and
  `calls` (per call: episode, phase "prefill" or "decode", tokens);
- `offsets.npy`: int64 (calls x layers + 1,) offsets into `indices`, call-major: the set of call
  c, layer l is `indices[offsets[c * layers + l]:offsets[c * layers + l + 1]]`;
- `indices.npy`: uint32 (n,) the sets' unit ids, each set strictly increasing;
- version 2 and 3, optional (both or neither): `forecast_offsets.npy` and `forecast_indices.npy`,
  the same layout, for an MoE model: the set of call c, layer l is the experts layer l's router
  picks from the MoE input of the layer with units before it (what `expert-forecast`
  prefetches), empty where no forecast can be made (`forecast_possible`): in version 3, a layer
  without units and the first layer with units; in version 2 a forecast came only from layer
  l-1, so layer 0 and a layer with or after a layer without units have none.

Version 1 files (no forecast members) and version 2 files are still read, each by its own rule.
Writing gives version 3 (version 2 for a trace read from a version-2 file with forecasts: its
sets keep their meaning).

Reading is bounded: the file's size, each member's stated and actual size, the number of calls
and layers, and every id are checked before use, and a bad file raises `TraceError` naming the
cause. Pure: numpy, zipfile, json and core/text.py only.

Layer rule: core. numpy only.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import secrets
import stat
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packbench.core.text import show

FORMAT = "packbench-trace"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
HEADER_NAME, OFFSETS_NAME, INDICES_NAME = "header.json", "offsets.npy", "indices.npy"
MEMBERS = (HEADER_NAME, OFFSETS_NAME, INDICES_NAME)
FORECAST_OFFSETS_NAME, FORECAST_INDICES_NAME = "forecast_offsets.npy", "forecast_indices.npy"
FORECAST_MEMBERS = (FORECAST_OFFSETS_NAME, FORECAST_INDICES_NAME)
UNITS = ("row", "expert")
PHASES = ("prefill", "decode")

# Bounds a reader holds to (docs/traces.md, "Bounds"), so that reading costs at most a few GiB of
# memory whatever a file claims: OPT-175B (96 layers x 49,152 rows) decoding at 3 % density is
# ~140,000 ids a call, so 2^28 ids hold ~1,900 of its decode calls; 2^22 sets, 43,000 calls of it.
MAX_FILE_BYTES = 2 * 2**30
MAX_HEADER_BYTES = 64 * 2**20
MAX_INDICES = 2**28  # 1 GiB of uint32 ids
MAX_SETS = 2**22  # calls x layers: one array object each once read
MAX_CALLS = 1_000_000
MAX_LAYERS = 4096
MAX_UNITS = 2**31 - 1


class TraceError(ValueError):
    """A trace file packbench cannot read or a trace it cannot write (the message names the fix)."""


@dataclass(frozen=True)
class TraceModel:
    """What pricing a trace needs of its model."""

    family: str  # "opt", or an MoE family (core/moe.py FAMILIES), or a name a user gives
    unit: str  # "row": an OPT outgoing row; "expert": an MoE expert
    layers: int
    units: int  # rows (ffn) or experts per layer
    unit_bytes: int  # one unit as it travels in the model's dtype
    hidden: int = 0  # OPT: a row's values (an int8 row is hidden + 4 bytes); 0 when unknown
    dtype: str = ""
    index_bytes: int = 8
    k: int = 0  # MoE: experts per token; 0 for OPT
    shape: str | None = None  # a preset name (core/registry.py SHAPES, core/moe.py MOE_SHAPES), if one fits
    layers_without_units: tuple[int, ...] = ()  # MoE dense layers: nothing to move there

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["layers_without_units"] = list(self.layers_without_units)
        return d


@dataclass(frozen=True)
class TraceCall:
    episode: int
    phase: str
    tokens: int


@dataclass
class Trace:
    model: TraceModel
    calls: list[TraceCall]
    sets: list[list[np.ndarray]]  # [call][layer] sorted int64 unit ids
    source: dict = field(default_factory=dict)
    # [call][layer] sorted int64 expert ids forecast for the layer (module docstring), or None:
    # a trace without forecasts (OPT, a version-1 file, or one written from a routing dump).
    forecasts: list[list[np.ndarray]] | None = None
    # The format version whose rule places the forecast sets (`forecast_possible`): a trace read
    # from a version-2 file keeps 2.
    version: int = VERSION

    def episodes(self) -> list[list[int]]:
        """Call indices grouped by episode, in trace order (a new episode starts where the
        episode number changes)."""
        out: list[list[int]] = []
        last = None
        for i, c in enumerate(self.calls):
            if c.episode != last:
                out.append([])
                last = c.episode
            out[-1].append(i)
        return out


def forecast_possible(model: TraceModel, layer: int, version: int = VERSION) -> bool:
    """Whether the engine forecasts `layer` (engine/moe/model.py): from the MoE input of the layer
    with experts before it, so `layer` has experts and some layer before it has. Version-2 files
    were written by an engine that forecast only from the layer right before (none after a
    layer without units): they are read by that rule."""
    skip = set(model.layers_without_units)
    if version < 3:
        return model.unit == "expert" and layer > 0 and layer not in skip and layer - 1 not in skip
    return model.unit == "expert" and layer not in skip and any(i not in skip for i in range(layer))


def no_forecast_where(version: int = VERSION) -> str:
    """Where `forecast_possible` says no forecast is made, in words."""
    if version < 3:
        return "layer 0, or a layer with or after a layer without units"
    return "a layer without units, or the first layer with units"


def _check_model(m: dict) -> TraceModel:
    if not isinstance(m, dict):
        raise TraceError("header.json's model is not an object; write the fields docs/traces.md lists")

    def num(key: str, lo: int, hi: int, default: int | None = None) -> int:
        v = m.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise TraceError(f"header.json's model.{key} is {v!r}; it must be an integer in {lo}..{hi}")
        return v

    unit = m.get("unit")
    if unit not in UNITS:
        raise TraceError(f"header.json's model.unit is {unit!r}; use one of {', '.join(UNITS)}")
    family = m.get("family")
    if not isinstance(family, str) or not family:
        raise TraceError("header.json's model.family is missing; name the model family (opt, mixtral, ...)")
    layers = num("layers", 1, MAX_LAYERS)
    skip = m.get("layers_without_units", [])
    if not isinstance(skip, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                             for i in skip):
        raise TraceError(f"header.json's model.layers_without_units must list layer numbers in 0..{layers - 1}")
    shape = m.get("shape")
    if shape is not None and not isinstance(shape, str):
        raise TraceError("header.json's model.shape must be a string or null")
    dtype = m.get("dtype", "")
    if not isinstance(dtype, str):
        raise TraceError("header.json's model.dtype must be a string")
    model = TraceModel(family=family, unit=unit, layers=layers, units=num("units", 1, MAX_UNITS),
                       unit_bytes=num("unit_bytes", 1, 2**40), hidden=num("hidden", 0, 2**24, 0), dtype=dtype,
                       index_bytes=num("index_bytes", 1, 16, 8), k=num("k", 0, MAX_UNITS, 0), shape=shape,
                       layers_without_units=tuple(sorted(set(skip))))
    problem = preset_problem(model)
    if problem:
        raise TraceError(problem)
    return model


def preset_problem(model: TraceModel) -> str | None:
    """Why `model.shape`, a name of one of packbench's presets (core/registry.py's OPT shapes,
    core/moe.py's MoE shapes), is not this trace's model, or None (an unknown name is free text).
    The shape is how a machine file's compute is found: an MoE trace that named opt-13b was
    predicted with an OPT model's measured compute. The tracer names a preset only when the
    checkpoint fits it; `hidden` and `k` of 0 (unknown, as a published dump may leave them) are
    not compared."""
    from packbench.core.moe import MOE_SHAPES
    from packbench.core.registry import SHAPES

    if model.shape in SHAPES:
        d = SHAPES[model.shape]
        want = {"family": "opt", "unit": "row", "units": d["ffn"], "hidden": d["hidden"], "k": 0}
    elif model.shape in MOE_SHAPES:
        d = MOE_SHAPES[model.shape]
        want = {"family": d["family"], "unit": "expert", "units": d["experts"], "hidden": d["hidden"], "k": d["k"]}
    else:
        return None
    for key, value in want.items():
        got = getattr(model, key)
        if got != value and not (key in ("hidden", "k") and got == 0):
            preset = ", ".join(f"{k} {v!r}" for k, v in want.items())
            return (f"header.json's model.shape {model.shape!r} is packbench's preset ({preset}), but model.{key} "
                    f"is {show(got)}; give the shape the trace was recorded from, or null")
    return None


def _check_calls(calls) -> list[TraceCall]:
    if not isinstance(calls, list) or not calls:
        raise TraceError("header.json's calls must be a non-empty list of {episode, phase, tokens}")
    if len(calls) > MAX_CALLS:
        raise TraceError(f"the trace has {len(calls)} calls, more than {MAX_CALLS}; split it into several files")
    out = []
    for i, c in enumerate(calls):
        if not isinstance(c, dict) or c.get("phase") not in PHASES:
            raise TraceError(f"header.json's calls[{i}].phase must be one of {', '.join(PHASES)}")
        ep, tokens = c.get("episode"), c.get("tokens")
        for name, v in (("episode", ep), ("tokens", tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "episode" else 1) or v > 2**40:
                raise TraceError(f"header.json's calls[{i}].{name} is {v!r}; it must be an integer "
                                 f"{'>= 0' if name == 'episode' else '>= 1'}")
        out.append(TraceCall(episode=ep, phase=c["phase"], tokens=tokens))
    return out


class StrictJSONError(ValueError):
    """JSON that Python's parser takes and the standard does not have, or that readers disagree on."""


def _no_constant(token: str):
    raise StrictJSONError(f"holds {token}, which JSON does not have")


def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise StrictJSONError(f"gives the key {show(dup)} twice (another reader may keep the other value)")
    return out


def _finite(text: str) -> float:
    # 1e999 is a JSON number that Python reads as inf, which `simulate --json` printed back as
    # Infinity (its output no JSON): a number beyond a double's range is refused like Infinity.
    value = float(text)
    if not math.isfinite(value):
        raise StrictJSONError(f"holds the number {show(text[:40])}, beyond a double's range (read as infinity)")
    return value


# Python refuses to read an integer of more digits than this (sys.get_int_max_str_digits' default).
MAX_INT_DIGITS = 4300


def _integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise StrictJSONError(f"holds an integer of {digits} digits, more than {MAX_INT_DIGITS}")
    return int(text)


def strict_json(data: bytes):
    """JSON as the standard has it: NaN and Infinity (which `simulate --json` printed back, so its
    output was no JSON), a number beyond a double's range (1e999, read as infinity), an integer of
    more digits than Python reads, and a key given twice (Python keeps the last, other readers the
    first) raise StrictJSONError saying which; anything else that is not JSON raises ValueError or
    RecursionError."""
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite, parse_int=_integer,
                      object_pairs_hook=_no_duplicates)


def _read_npy(data: bytes, name: str, dtype: str) -> np.ndarray:
    # The header is checked against the member's bytes before any array is made: numpy's
    # read_array allocates the shape a header states first, so a member of 200 bytes stating
    # 2^50 offsets asked for 8 PiB (MemoryError, exit 70) whatever the member's bound.
    fp = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(fp)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"unsupported .npy version {version[0]}.{version[1]}")
        # 3.0's header has 2.0's layout (UTF-8 text, which an ASCII header of a numeric dtype is)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, got = read_header(fp)
    except (ValueError, OSError, EOFError) as e:
        raise TraceError(f"{name} is not a readable .npy array ({e}); rewrite the trace") from None
    if len(shape) != 1 or got != np.dtype(dtype):
        raise TraceError(f"{name} must be a 1-D {np.dtype(dtype).str} array, got {got.str} of shape {shape}")
    held = len(data) - fp.tell()
    if held != shape[0] * got.itemsize:
        raise TraceError(f"{name} states {shape[0]} values ({shape[0] * got.itemsize} bytes) but holds {held} "
                         f"bytes of them; the file is truncated or inconsistent, rewrite the trace")
    return np.frombuffer(data, dtype=got, count=shape[0], offset=fp.tell())


def parse_trace(zf: zipfile.ZipFile, *, cap: int | None = None) -> Trace:
    """A Trace from an open zip, every field and id checked (raises TraceError). `cap` lowers
    every member's bound (the auditor reads an archived trace under its own budget)."""
    infos = {i.filename: i for i in zf.infolist()}
    names = [i.filename for i in zf.infolist()]
    twice = next((n for n in (*MEMBERS, *FORECAST_MEMBERS) if names.count(n) > 1), None)
    if twice is not None:  # the dict above keeps the last; an unzip may extract the first
        raise TraceError(f"the trace holds {twice} twice: which is the trace's cannot be told; rewrite the trace")
    missing = [n for n in MEMBERS if n not in infos]
    traces = sorted(n for n in infos if n.startswith("active/") and n.endswith(".trace"))
    if missing and (traces or "manifest.json" in infos):  # a screen's raw archive, given whole
        held = f"its traces are {', '.join(traces[:3])}{', ...' if len(traces) > 3 else ''}" if traces else \
            "it holds no trace (its protocol did not say trace: true)"
        raise TraceError(f"this is a screen's archive, not a trace file: {held}; extract one with "
                         f"`unzip ARCHIVE active/NNNNN.trace` and give that file (docs/traces.md)")
    if missing:
        raise TraceError(f"the trace has no {missing[0]}; a trace file holds {', '.join(MEMBERS)} (docs/traces.md)")
    present = [n for n in FORECAST_MEMBERS if n in infos]
    if len(present) == 1:
        raise TraceError(f"the trace has {present[0]} without its pair; a trace holds both "
                         f"{' and '.join(FORECAST_MEMBERS)} or neither; rewrite it")
    limits = {HEADER_NAME: MAX_HEADER_BYTES, OFFSETS_NAME: 8 * (MAX_SETS + 1) + 256,
              INDICES_NAME: 4 * MAX_INDICES + 256, FORECAST_OFFSETS_NAME: 8 * (MAX_SETS + 1) + 256,
              FORECAST_INDICES_NAME: 4 * MAX_INDICES + 256}
    if cap is not None:
        limits = {name: min(limit, cap) for name, limit in limits.items()}
    raw = {}
    for name in (*MEMBERS, *present):
        info = infos[name]
        if info.file_size > limits[name]:
            raise TraceError(f"{name} states {info.file_size} bytes, over the bound of {limits[name]}; "
                             f"split the trace into several files")
        with zf.open(info) as f:
            data = f.read(limits[name] + 1)  # never more than the bound, whatever the entry claims
        if len(data) > limits[name]:
            raise TraceError(f"{name} holds more than {limits[name]} bytes; split the trace into several files")
        raw[name] = data
    try:
        header = strict_json(raw[HEADER_NAME])
    except StrictJSONError as e:
        raise TraceError(f"header.json {e}; rewrite the trace") from None
    except (ValueError, RecursionError):
        raise TraceError("header.json is not JSON; rewrite the trace") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f"header.json does not say format {FORMAT!r}; this is not a packbench trace file")
    if type(header.get("version")) is not int or header["version"] not in READABLE_VERSIONS:  # not true, not 2.0
        raise TraceError(f"trace version {header.get('version')!r} is not one this packbench reads "
                         f"({', '.join(map(str, READABLE_VERSIONS))}); upgrade packbench or rewrite the trace "
                         f"in version {VERSION}")
    if present and header["version"] < 2:
        raise TraceError("a version-1 trace holds no forecast members; drop them or write version 3")
    model = _check_model(header.get("model"))
    calls = _check_calls(header.get("calls"))
    if len(calls) * model.layers > MAX_SETS:
        raise TraceError(f"{len(calls)} calls x {model.layers} layers is more than {MAX_SETS} sets; "
                         f"split the trace into several files")
    source = header.get("source", {})
    if not isinstance(source, dict):
        raise TraceError("header.json's source must be an object")
    sets = _read_sets(raw[OFFSETS_NAME], raw[INDICES_NAME], model, len(calls), (OFFSETS_NAME, INDICES_NAME))
    _check_routed(sets, calls, model, "routes")
    forecasts = None
    if present:
        forecasts = _read_sets(raw[FORECAST_OFFSETS_NAME], raw[FORECAST_INDICES_NAME], model, len(calls),
                               FORECAST_MEMBERS)
        if model.unit != "expert":
            raise TraceError("forecast members are for a trace of experts; drop them from a trace of rows")
        _check_routed(forecasts, calls, model, "forecasts")
        for c, row in enumerate(forecasts):
            for layer, f in enumerate(row):
                if f.size and not forecast_possible(model, layer, header["version"]):
                    raise TraceError(f"call {c} has a forecast for layer {layer}, where none can be made "
                                     f"({no_forecast_where(header['version'])}); empty it")
    return Trace(model=model, calls=calls, sets=sets, source=source, forecasts=forecasts, version=header["version"])


def _check_routed(sets: list[list[np.ndarray]], calls: list[TraceCall], model: TraceModel, what: str) -> None:
    """An MoE trace that states k: no call's set in a layer holds more experts than its tokens
    route (tokens x k; a decode call at batch 1 routes k). A set of 8 experts in a one-token call
    of top-2 routing was read and replayed as if the router had chosen them."""
    if model.unit != "expert" or not model.k:
        return
    for c, (call, row) in enumerate(zip(calls, sets)):
        most = call.tokens * model.k
        layer = next((layer for layer, s in enumerate(row) if s.size > most), None)
        if layer is not None:
            raise TraceError(f"call {c} {what} {row[layer].size} experts in layer {layer}, more than its {call.tokens} "
                             f"token{'s' if call.tokens != 1 else ''} x k {model.k}; fix model.k or the call's tokens")


def _read_sets(offsets_raw: bytes, indices_raw: bytes, model: TraceModel, ncalls: int,
               names: tuple[str, str]) -> list[list[np.ndarray]]:
    """[call][layer] sets from an offsets and an indices member, every id and bound checked."""
    offsets_name, indices_name = names
    offsets = _read_npy(offsets_raw, offsets_name, "<i8")
    indices = _read_npy(indices_raw, indices_name, "<u4")
    n = ncalls * model.layers
    if offsets.size != n + 1 or offsets[0] != 0 or offsets[-1] != indices.size or np.any(np.diff(offsets) < 0):
        raise TraceError(f"{offsets_name} must hold calls x layers + 1 = {n + 1} non-decreasing offsets from 0 to "
                         f"{indices_name}' {indices.size}; the file is truncated or inconsistent")
    ids = indices.astype(np.int64)
    if ids.size and ids.max() >= model.units:
        raise TraceError(f"unit id {int(ids.max())} is out of range: the model has {model.units} {model.unit}s "
                         f"per layer; fix model.units or the sets")
    # Each set strictly increasing: a step <= 0 inside a set (not across a set boundary) is refused.
    steps = np.diff(ids)
    inside = np.ones(max(ids.size - 1, 0), dtype=bool)
    boundaries = offsets[1:-1]
    inside[boundaries[(boundaries > 0) & (boundaries < ids.size)] - 1] = False
    if np.any((steps <= 0) & inside):
        raise TraceError(f"a set in {indices_name} is not strictly increasing; sort each set and drop repeats")
    skip = set(model.layers_without_units)
    sets = []
    for c in range(ncalls):
        row = []
        for layer in range(model.layers):
            s = ids[offsets[c * model.layers + layer]:offsets[c * model.layers + layer + 1]]
            if layer in skip and s.size:
                raise TraceError(f"call {c} has units in layer {layer}, which model.layers_without_units lists")
            row.append(s)
        sets.append(row)
    return sets


def read_trace(path: Path | str) -> Trace:
    """Read and check a trace file (raises TraceError with one line naming the cause and fix)."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below refuses it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror}); give a trace file") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise TraceError(f"{path} is not a regular file; give a trace file (docs/traces.md)")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_FILE_BYTES:
            raise TraceError(f"{path} is {st.st_size} bytes, over the bound of {MAX_FILE_BYTES}; split the trace")
        try:
            with zipfile.ZipFile(f) as zf:
                return parse_trace(zf)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError) as e:
            raise TraceError(f"{path} is not a readable trace zip ({e}); it is truncated or not a trace") from None
        except (RuntimeError, OSError, zlib.error) as e:  # encrypted members, CRC or decompression errors
            raise TraceError(f"{path}: a member cannot be read ({e}); rewrite the trace") from None


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _offsets_indices(sets: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    lengths, parts = [], []
    for row in sets:
        for s in row:
            a = np.asarray(s, dtype=np.int64)
            lengths.append(a.size)
            parts.append(a)
    offsets = np.zeros(len(lengths) + 1, dtype="<i8")
    np.cumsum(lengths, out=offsets[1:])
    indices = np.concatenate(parts).astype("<u4") if parts else np.zeros(0, dtype="<u4")
    return offsets, indices


def trace_bytes(trace: Trace) -> bytes:
    """The file's bytes (checked as a reader would: a trace written is a trace readable)."""
    m = trace.model
    if len(trace.sets) != len(trace.calls) or any(len(row) != m.layers for row in trace.sets):
        raise TraceError("a trace needs one set per call and layer")
    if trace.forecasts is not None and (len(trace.forecasts) != len(trace.calls)
                                        or any(len(row) != m.layers for row in trace.forecasts)):
        raise TraceError("a trace's forecasts need one set per call and layer")
    offsets, indices = _offsets_indices(trace.sets)
    # Forecast sets keep the rule they were made by (a version-2 file's, rewritten); the rest is VERSION's.
    version = trace.version if trace.forecasts is not None else VERSION
    header = {"format": FORMAT, "version": version, "model": m.as_dict(), "source": trace.source,
              "calls": [vars(c) for c in trace.calls]}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(HEADER_NAME, json.dumps(header, sort_keys=True, indent=1))
        zf.writestr(OFFSETS_NAME, _npy(offsets))
        zf.writestr(INDICES_NAME, _npy(indices))
        if trace.forecasts is not None:
            f_offsets, f_indices = _offsets_indices(trace.forecasts)
            zf.writestr(FORECAST_OFFSETS_NAME, _npy(f_offsets))
            zf.writestr(FORECAST_INDICES_NAME, _npy(f_indices))
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        parse_trace(zf)
    return data


def write_trace(trace: Trace, path: Path | str) -> Path:
    """Writes the trace to a temporary file beside `path` and links it into place: a write that
    fails part-way (a full disk) or is interrupted leaves nothing at `path`, and a path that
    exists, even one made while the trace was being recorded, is refused and kept as it was."""
    path = Path(path)
    data = trace_bytes(trace)
    tmp = path.parent / f".trace-{secrets.token_hex(8)}.partial"  # a short name: `path`'s may be at the limit
    try:
        with open(tmp, "xb") as f:  # the mode umask gives, as a plain write would
            f.write(data)
        _place(tmp, path)
    except FileExistsError:
        raise TraceError(f"{path} exists; give a new file path") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot write the trace ({e.strerror}); choose another path") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


def _place(tmp: Path, path: Path) -> None:
    """`tmp` at `path`, never over an existing path (FileExistsError): a hard link where the file
    system has them; elsewhere a rename after a check (a path made between the two is replaced)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "exists") from None
        os.replace(tmp, path)
