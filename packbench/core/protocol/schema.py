"""The protocol schema: a YAML mapping or any frozen body validated into the full form (schema 2's;
`schema: 5` where a competitor or the fidelity gate needs it).

`validate` gives the frozen form (the lowest schema that says the meaning, see compat.py);
`full_form` gives the full schema-2 dict that `core.protocol.spec.Protocol` is built from.
Schema 3 is schema 2 with newer defaults for parameters a condition leaves out
(core.registry.SCHEMA3_DEFAULTS); schema 4 is schema 3 where phase-switched gathers on the device
(SCHEMA4_DEFAULTS) and a `model.synth` without `sparsity`
or `profile` means the calibrated profile (core.registry.DEFAULT_PROFILE). Both write their
defaults out, so a protocol always freezes as schema 2 or 1 and no body ever says 3 or 4.
Schema 5 adds what no earlier schema can say: competitor conditions (`quantized`, a condition
kind whose `since` is 5, core/conditions/) and the `fidelity` gate; a protocol using either freezes as
schema 5 (the lowest that says it), any other still as 2 or 1, so every old hash holds.
Schema 6 adds the `accelerate` competitor and every competitor's `mode` (eager, graph, compile):
it writes a competitor's omitted mode out (core.registry.FASTEST_MODE), so a protocol with a
competitor freezes as schema 6; one without any still freezes as 5, 2 or 1. A schema-5 body's
competitors have no mode and run eager. Schema 6 also adds parameters no earlier schema can say
(a registry param's `since`: `weights` of dense-stream and packet, core.registry.WEIGHT_FORMATS);
a condition giving one freezes as 6. Schema 6 also adds `batch`, the sequences decoded together
(1 to MAX_BATCH, at most the prompt count): a batch above 1 freezes as 6, batch 1 is left out
(every protocol without the field keeps its body and hash).
Schema 7 adds `passes`: `together` (the default, left out of the body: one measured run an
episode, its ledger and sampler inside the timed calls) or `separate` (a timing pass with the
ledger and the sampler off, then a recording pass with them on; engine/worker.py). A protocol
with `passes: separate` freezes as 7; any other keeps the body and hash it had.
Schema 8 is schema 7 where a `model.synth` without `sparsity` or `profile` means profile `opt2`
(core.registry.NEWEST_PROFILE: `opt`'s statistics and real OPT's response to weight quantization),
written out like schema 4's, so it freezes as the schema 7 and lower bodies do and no body says 8.
Schema 9 is schema 8 where such a `model.synth` means profile `opt3` (core.registry.PROFILE_SCHEMAS: `opt2`
with salient input channels, real OPT's per-channel / group-128 response to weight quantization), written
out the same way, so no body says 9 and every older file keeps its meaning and hash.
Schema 10 adds `scored_prompts`: the scored episodes of each repetition start at the first N prompts
only (default: every prompt, left out of the body). With `batch` B each episode still decodes B
prompts, so a batched screen can score one batch of 32 prompts per repetition instead of 32
overlapping ones (32x the logits in the archive). A protocol giving it freezes as 10. The `flexgen`
competitor (its kind's `since` is 10) came with no schema of its own: a new kind moves no older
body (its name was not sayable) and every earlier reader refuses the unknown policy in one line;
a protocol naming it freezes as 10.
Schema 11 is schema 10 where a `model.synth` without `sparsity` or `profile` means profile `opt4`
(`opt3` calibrated at the outlier shapes too), written out as schema 8's and 9's were, so no body
says 11 and every older file keeps its meaning and hash.
Every rule a field obeys is written once, here; docs/protocol.md describes them for users.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packbench.core.errors import ProtocolError
from packbench.core.protocol.compat import schema1_form
from packbench.core.protocol.fields import (bool_field, choice_field, fail, int_field, join_path, mapping_field,
                                            number_field, optional_mapping_field, shown, string_field,
                                            token_lists_field)
from packbench.core.protocol.prompt_files import TEXT_SEPARATOR, read_prompt_file
# Policies and their parameters, dtypes and synthetic shapes live in one registry shared with the
# engine and the CLI; re-exported here for code that imports them from core.protocol.
from packbench.core.conditions import CONDITIONS
from packbench.core.moe import family_refusal
from packbench.core.moe import MAX_POSITIONS as MOE_MAX_POSITIONS
from packbench.core.moe import MoeShape, family_of_shape, is_moe_shape, moe_synth_spec, shape_refusal
from packbench.core.registry import (
    DTYPE_NAMES,
    MAX_SEED,
    POLICY_NAMES,
    POLICY_PARAMS,
    SCHEMA3_DEFAULTS,
    SHAPES,
    SYNTH_SHAPES,
    default_profile,
    fastest_mode,
    exact_reference,
    mode_refusal,
    newer_defaults,
    tier_of,
    weights_of,
    ChoiceParam,
    IntParam,
    SynthArgumentError,
    synth_spec,
)

SCHEMA_VERSION = 11  # the newest schema this packbench reads: what a YAML without `schema:` means
SCHEMAS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)  # every schema it reads; frozen bodies say 1, 2, 5, 6, 7 or 10 (module docstring)
COMPETITOR_SCHEMA = 5  # the first schema that can say a competitor condition or a fidelity gate
MODE_SCHEMA = 6  # the first schema that can say a competitor's `mode` (a kind's own schema: its `since`)
PASSES_SCHEMA = 7  # the first schema that can say `passes`
SCORED_SCHEMA = 10  # the first schema that can say `scored_prompts`
# How an episode is measured: one run with the ledger and the sampler inside its timed calls
# (`together`, every schema's meaning), or a timing pass with them off, then a recording pass.
PASSES = ("together", "separate")
MIB = 1 << 20
# Bounds no real screen reaches: a hostile protocol.json must not make a plan or the generated
# prompts exhaust an auditor's memory.
MAX_TOKENS = 1 << 16  # prefix_tokens
MAX_CONTINUATION = 8192  # continuation_tokens: calls per episode (ledger and logits rows)
MAX_EPISODES = 100_000  # planned episodes, warmups included
MAX_TRACED_EPISODES = (3 * MAX_EPISODES) // 4  # record, logits, memory trace and active sets: within the archive's members
MAX_CONDITIONS = 16
MAX_PROMPTS = 100_000
MAX_PROMPT_TOKENS = 1 << 21  # prompts x prefix_tokens: the token ids plan.json holds (<= ~13 MB of JSON)
MAX_NAME = 200  # a protocol's name: `screens list` prints it in every row
MAX_BATCH = 64  # sequences decoded together (docs/experiments/batched.md measures 1 to 32)
MAX_RESAMPLES = 100_000  # per runtime gate entry
# 16 TiB, more than any device holds; in bytes far inside a signed 64-bit integer (the gates'
# thresholds, the database's columns): 2**63 MiB validated and overflowed later.
MAX_ALLOWANCE_MIB = 1 << 24
# Draws of every runtime bootstrap of a screen together: sum over runtime entries and compared
# conditions of resamples x pairs. 2**27 draws take ~2-4 s on one core (docs/benchmarks.md).
MAX_BOOTSTRAP_DRAWS = 1 << 27


ORDERS = ("alternating", "abba", "latin-square")
ENGINE_MODES = ("eager", "graph")  # engine/graph.py MODES is this tuple
PHASES = ("all", "prefill", "decode")
GATE_NAMES = ("faithfulness", "resources", "capacity", "acquisition", "runtime", "useful_latency", "fidelity")
# The fidelity gate's thresholds (core/fidelity.py figures), each bounding every scored episode.
FIDELITY_BOUNDS = ("max_mean_kl", "max_p99_kl", "min_top1", "max_abs_logit", "min_divergence_step")
PROMPT_SOURCES = ("token_ids", "token_file", "text_file", "generator")

_CONDITION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_CONDITION_NAME = 200  # as a protocol's name: a 100,000-character one made a 100 KB error line
_SHA256 = re.compile(r"[0-9a-f]{64}")


# ----------------------------------------------------------------------------- sections


def _model(value: Any, *, schema: int) -> dict:
    m = mapping_field(value, "model", allowed={"path": False, "synth": False, "sha256": False})
    if ("path" in m) == ("synth" in m):
        fail("model", "give exactly one of path (a local checkpoint directory) or synth (a synthetic spec)")
    if "sha256" in m and "path" not in m:
        fail("model.sha256", "pins a model.path checkpoint's content (a synthetic model is pinned by its spec)")
    if "path" in m:
        out = {"path": string_field(m["path"], "model.path", "a path to a local Hugging Face OPT directory")}
        if "sha256" in m:
            # The checkpoint's content digest (core.provenance.checkpoint_digest; the start record of a run shows it):
            # a worker whose checkpoint hashes otherwise refuses the screen before loading it.
            if not isinstance(m["sha256"], str) or not _SHA256.fullmatch(m["sha256"]):
                fail("model.sha256", f"{shown(m['sha256'])} is not allowed; expected 64 lowercase hex digits")
            out["sha256"] = m["sha256"]
        return out
    # A profile (calibrated activation statistics, core/registry.py PROFILES) or the uniform recipe
    # (sparsity, hot neurons). Schema 4 gives a synth with neither the default profile, written
    # out; schemas 1-3 require sparsity, so every body they froze keeps its meaning and hash.
    if isinstance(m["synth"], dict) and is_moe_shape(m["synth"].get("shape")):
        # An MoE shape (core/moe.py MOE_SHAPES, refused by every earlier packbench: no old body says
        # one): its own fields, every one written out, the routing profile instead of an activation one.
        s = mapping_field(m["synth"], "model.synth", allowed={
            "shape": True, "dtype": True, "seed": True, "layers": False, "routing": False})
        try:
            return {"synth": moe_synth_spec(**s)}
        except SynthArgumentError as e:
            fail(f"model.synth.{e.arg}", e.reason)
    uniform = "profile" not in m["synth"] if isinstance(m["synth"], dict) else True
    s = mapping_field(m["synth"], "model.synth", allowed={
        "shape": True, "dtype": True, "sparsity": uniform and schema < 4, "seed": True, "hot_fraction": False,
        "hot_bias": False, "profile": False})
    if "profile" not in s and "sparsity" not in s:
        s = {**s, "profile": default_profile(schema)}
    try:
        return {"synth": synth_spec(**s)}
    except SynthArgumentError as e:
        fail(f"model.synth.{e.arg}", e.reason)


def _prompt_file(kind: str, value: Any, *, base_dir: Path | None, prefix_tokens: int) -> dict:
    path = f"prompts.{kind}"
    spec = {"path": value} if isinstance(value, str) else mapping_field(
        value, path, allowed={"path": True, "sha256": False, "count": False})
    rel = string_field(spec["path"], f"{path}.path", "a path relative to the protocol file")
    if "sha256" in spec and (not isinstance(spec["sha256"], str) or not _SHA256.fullmatch(spec["sha256"])):
        fail(f"{path}.sha256", f"{shown(spec['sha256'])} is not allowed; expected 64 lowercase hex digits")
    if "count" in spec:
        int_field(spec["count"], f"{path}.count", minimum=1, maximum=MAX_PROMPTS)
    if base_dir is None:
        # A frozen body (re-read from a database or an archive): the file is not at hand.
        if "sha256" not in spec or "count" not in spec:
            fail(path, "needs the protocol file's folder to read the file; load the protocol from its file "
                       "(a frozen body carries path, sha256 and count)")
        return {"path": rel, "sha256": spec["sha256"], "count": spec["count"]}
    data, items = read_prompt_file(kind, base_dir / rel, field=path)
    digest, count = hashlib.sha256(data).hexdigest(), len(items)
    if spec.get("sha256", digest) != digest:
        fail(f"{path}.sha256", f"{spec['sha256']} does not match {rel} (sha256 {digest}); "
                               f"the file changed since the protocol was written")
    if spec.get("count", count) != count:
        fail(f"{path}.count", f"{spec['count']} does not match the {count} prompts in {rel}")
    if kind == "token_file":
        for i, ids in enumerate(items):
            if len(ids) < prefix_tokens:
                fail(f"{path}", f"prompt {i} of {rel} has {len(ids)} ids, fewer than prefix_tokens={prefix_tokens}")
    return {"path": rel, "sha256": digest, "count": count}


def _prompts(value: Any, *, base_dir: Path | None, prefix_tokens: int) -> dict:
    p = mapping_field(value, "prompts", allowed={name: False for name in PROMPT_SOURCES})
    if len(p) != 1:
        fail("prompts", f"give exactly one of {', '.join(PROMPT_SOURCES)}; got {', '.join(p) or 'none'}")
    (kind, spec), = p.items()
    if kind == "generator":
        g = mapping_field(spec, "prompts.generator", allowed={"seed": True, "count": True})
        return {"generator": {"seed": int_field(g["seed"], "prompts.generator.seed", minimum=0, maximum=MAX_SEED),
                              "count": int_field(g["count"], "prompts.generator.count", minimum=1, maximum=MAX_PROMPTS)}}
    if kind == "token_ids":
        ids = token_lists_field(spec, "prompts.token_ids")
        if len(ids) > MAX_PROMPTS:
            fail("prompts.token_ids", f"{len(ids)} prompts, more than {MAX_PROMPTS}")
        for i, prompt in enumerate(ids):
            if len(prompt) > MAX_TOKENS:
                fail(f"prompts.token_ids[{i}]", f"has {len(prompt)} ids, more than {MAX_TOKENS}")
            if len(prompt) < prefix_tokens:
                fail(f"prompts.token_ids[{i}]", f"has {len(prompt)} ids, fewer than prefix_tokens={prefix_tokens}")
        return {"token_ids": ids}
    return {kind: _prompt_file(kind, spec, base_dir=base_dir, prefix_tokens=prefix_tokens)}


def _params(policy: str, value: Any, path: str, *, schema: int) -> dict:
    spec = CONDITIONS[policy].params
    newer = newer_defaults(schema).get(policy, {})
    if value is None:
        value = {}
    if not isinstance(value, dict):
        fail(path, f"expected a mapping, got {shown(value)}")
    for key in value:
        if key not in spec:
            takes = f"takes {', '.join(sorted(spec))}" if spec else "takes no params"
            fail(join_path(path, str(key)), f"unknown param; policy {policy} {takes}")
    out = {}
    for key, param in spec.items():
        if key in value and getattr(param, "since", 1) > schema:
            fail(join_path(path, key), f"needs schema {param.since}; write schema: {param.since} or omit `schema:`")
        if isinstance(param, ChoiceParam):
            if key in value:
                given = value[key]
                if isinstance(given, bool) and set(param.choices) == {"off", "on"}:
                    given = "on" if given else "off"  # YAML 1.1 reads a bare `on`/`off` as a boolean
                out[key] = choice_field(given, join_path(path, key), param.choices)
            elif param.default is None:
                fail(join_path(path, key), f"is required by policy {policy} (one of {', '.join(param.choices)})")
            elif key in newer:  # schema 3/4: written out, so the frozen (schema-2) body says what runs
                out[key] = newer[key]
            # else omitted in schema 1 or 2: left out, meaning the registry's default (old hashes hold)
            continue
        if key not in value and param.default is None:
            if param.optional:  # chosen on the worker (flexgen's w_gpu_percent): left out of the body
                continue
            fail(join_path(path, key), f"is required by policy {policy} (an integer >= {param.minimum})")
        out[key] = int_field(value.get(key, param.default), join_path(path, key), minimum=param.minimum,
                             maximum=param.maximum)
    return out


def _conditions(value: Any, *, schema: int, batch: int = 1) -> list[dict]:
    if not isinstance(value, list) or not value:
        fail("conditions", f"{shown(value)} is not allowed; expected a non-empty list of {{name, policy, params}}")
    if len(value) > MAX_CONDITIONS:
        fail("conditions", f"{len(value)} conditions, more than {MAX_CONDITIONS}; split the screen")
    out, names = [], set()
    for i, c in enumerate(value):
        path = f"conditions[{i}]"
        c = mapping_field(c, path, allowed={"name": False, "policy": True, "params": False})
        policy = choice_field(c["policy"], f"{path}.policy", tuple(CONDITIONS))
        kind = CONDITIONS[policy]
        needs = kind.since
        if schema < needs:
            fail(f"{path}.policy", f"{policy!r} needs schema {needs}; write schema: {needs} or omit `schema:`")
        name = c.get("name", policy)
        if not isinstance(name, str) or not _CONDITION_NAME.fullmatch(name):
            fail(f"{path}.name", f"{shown(name)} is not allowed; use letters, digits, '.', '_' and '-'")
        if len(name) > MAX_CONDITION_NAME:  # stored in every episode row, printed in every table and error
            fail(f"{path}.name", f"{len(name)} characters, more than {MAX_CONDITION_NAME}; give a shorter name")
        if name in names:
            fail(f"{path}.name", f"{name!r} is already used; condition names are unique")
        names.add(name)
        params = _params(policy, c.get("params"), f"{path}.params", schema=schema)
        if kind.competitor is not None:
            params = _competitor_mode(policy, params, f"{path}.params.mode", schema=schema, batch=batch)
        out.append({"name": name, "policy": policy, "params": params})
    return out


def _competitor_mode(policy: str, params: dict, path: str, *, schema: int, batch: int = 1) -> dict:
    """Schema 6 writes a competitor's mode out (given, or the fastest its library runs in; eager
    at a batch above 1); an earlier schema cannot say one (its competitors run eager). A mode the
    library cannot run is refused here, before anything is queued."""
    if schema < MODE_SCHEMA:
        if "mode" in params:
            fail(path, f"needs schema {MODE_SCHEMA}; write schema: {MODE_SCHEMA} or omit `schema:`")
        return params
    # An omitted mode at a batch stays eager, as frozen before captured batches ran: FASTEST_MODE
    # was measured at batch 1.
    mode = params.get("mode") or ("eager" if batch > 1 else fastest_mode(policy, params))
    why = mode_refusal(policy, params, mode)
    if why is not None:
        fail(path, f"{mode} is not possible for {params.get('method', policy)} ({why}); use mode eager")
    return {**params, "mode": mode}


def _warmups(value: Any, names: tuple[str, ...]) -> dict[str, int]:
    if isinstance(value, dict):
        for key in value:
            if key not in names:
                fail(f"warmups.{key}", f"unknown condition; use one of {', '.join(names)}")
        for name in names:
            if name not in value:
                fail(f"warmups.{name}", "is required; list every condition or give one integer")
        return {name: int_field(value[name], f"warmups.{name}", minimum=0, maximum=MAX_EPISODES) for name in names}
    n = int_field(value, "warmups", minimum=0, maximum=MAX_EPISODES)
    return {name: n for name in names}


def _comparisons(value: Any, path: str, names: tuple[str, ...], *, extra: dict[str, bool]) -> list[dict]:
    """acquisition/runtime: one mapping or a list of them, one per phase."""
    items = value if isinstance(value, list) else [value]
    if not items:
        fail(path, "expected a mapping or a non-empty list of mappings (one per phase)")
    out, phases = [], set()
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        g = mapping_field(item, where, allowed={"control": True, "max_ratio": True, "phase": False, **extra})
        control = choice_field(g["control"], f"{where}.control", names)
        if len(names) < 2:
            fail(f"{where}.control", f"{control!r} has no other condition to compare with")
        phase = choice_field(g.get("phase", "all"), f"{where}.phase", PHASES)
        if phase in phases:
            fail(f"{where}.phase", f"{phase!r} is already gated; give one entry per phase")
        phases.add(phase)
        # A byte ratio of 0 is a real bound (move nothing); a time ratio of 0 could never pass.
        timed = "confidence" in extra
        out.append({"control": control, "phase": phase,
                    "max_ratio": number_field(g["max_ratio"], f"{where}.max_ratio", minimum=0.0, exclusive=timed)})
        if timed:
            out[-1].update(
                confidence=number_field(g.get("confidence", 0.95), f"{where}.confidence", minimum=0.0, exclusive=True,
                                   maximum=1.0),
                resamples=int_field(g.get("resamples", 10000), f"{where}.resamples", minimum=100, maximum=MAX_RESAMPLES),
                seed=int_field(g.get("seed", 0), f"{where}.seed", minimum=0, maximum=MAX_SEED))
    return sorted(out, key=lambda g: PHASES.index(g["phase"]))


def _fidelity(value: Any, conditions: list[dict], *, reference: str) -> list[dict]:
    """One mapping (every approximate condition) or a list of them naming a `condition`; each
    holds at least one threshold. Frozen as a list, one entry per condition, in protocol order."""
    names = tuple(c["name"] for c in conditions)
    policy = {c["name"]: c["policy"] for c in conditions}
    approximate = tuple(n for n in names if tier_of(policy[n]) == "approximate")
    items = value if isinstance(value, list) else [value]
    if not items:
        fail("gates.fidelity", "expected a mapping or a non-empty list of mappings (one per condition)")
    out: dict[str, dict] = {}
    for i, item in enumerate(items):
        where = f"gates.fidelity[{i}]" if isinstance(value, list) else "gates.fidelity"
        g = mapping_field(item, where, allowed={"condition": False, **{b: False for b in FIDELITY_BOUNDS}})
        bounds: dict[str, Any] = {}
        for b in FIDELITY_BOUNDS:
            if b not in g:
                continue
            if b == "min_divergence_step":
                bounds[b] = int_field(g[b], f"{where}.{b}", minimum=0, maximum=MAX_CONTINUATION)
            else:
                bounds[b] = number_field(g[b], f"{where}.{b}", minimum=0.0)
                if b == "min_top1" and bounds[b] > 1:
                    fail(f"{where}.{b}", f"{shown(g[b])} is not a fraction in [0, 1] (top-1 agreement)")
        if not bounds:
            fail(where, f"give at least one threshold: {', '.join(FIDELITY_BOUNDS)}")
        if "condition" in g:
            name = choice_field(g["condition"], f"{where}.condition", names)
            if name == reference:
                fail(f"{where}.condition", f"{name!r} is the reference: fidelity compares another condition with it; "
                                           f"name an approximate condition ({', '.join(approximate) or 'none here'})")
            if tier_of(policy[name]) != "approximate":
                fail(f"{where}.condition", f"{name!r} is exact: the faithfulness gate judges it bit for bit; "
                                           f"name an approximate condition ({', '.join(approximate) or 'none here'})")
            targets: tuple[str, ...] = (name,)
        else:
            if not approximate:
                fail(where, "no approximate condition to judge; add a quantized condition or drop the gate")
            targets = approximate
        for name in targets:
            if name in out:
                fail(where, f"{name!r} is already gated; give one entry per condition")
            out[name] = {"condition": name, **bounds}
    return [out[n] for n in names if n in out]


def _gates(value: Any, names: tuple[str, ...], conditions: list[dict], *, reference: str, schema: int) -> dict:
    g = mapping_field(value, "gates", allowed={name: False for name in GATE_NAMES})
    out: dict[str, Any] = {}
    if "faithfulness" in g:
        f = optional_mapping_field(g["faithfulness"], "gates.faithfulness", allowed={"tolerance": False})
        tolerance = number_field(f.get("tolerance", 0.0), "gates.faithfulness.tolerance", minimum=0.0)
        out["faithfulness"] = {"tolerance": tolerance}
    for name in ("resources", "capacity"):
        if name in g:
            out[name] = dict(optional_mapping_field(g[name], f"gates.{name}", allowed={}))
    if "acquisition" in g:
        out["acquisition"] = _comparisons(g["acquisition"], "gates.acquisition", names, extra={})
    if "runtime" in g:
        out["runtime"] = _comparisons(g["runtime"], "gates.runtime", names,
                                      extra={"confidence": False, "resamples": False, "seed": False})
    if "useful_latency" in g:
        u = mapping_field(g["useful_latency"], "gates.useful_latency",
                          allowed={"max_first_episode_s": True, "max_cold_start_s": True})
        out["useful_latency"] = {
            key: number_field(u[key], f"gates.useful_latency.{key}", minimum=0.0, exclusive=True)
            for key in ("max_first_episode_s", "max_cold_start_s")}
    if "fidelity" in g:
        if schema < COMPETITOR_SCHEMA:
            fail("gates.fidelity", f"needs schema {COMPETITOR_SCHEMA}; write schema: {COMPETITOR_SCHEMA} or omit `schema:`")
        out["fidelity"] = _fidelity(g["fidelity"], conditions, reference=reference)
    if not out:
        fail("gates", f"declare at least one gate: {', '.join(GATE_NAMES)}")
    return out


def _engine(value: Any) -> dict:
    """How the engine executes each call: `mode: eager` (stock transformers, the default) or
    `graph` (packbench's static decoder, decode steps replayed as CUDA graphs where the policy
    makes no host decision; engine/graph.py). Only a non-default mode is kept."""
    if value is None:
        return {}
    e = mapping_field(value, "engine", allowed={"mode": False})
    mode = choice_field(e.get("mode", "eager"), "engine.mode", ENGINE_MODES)
    return {} if mode == "eager" else {"mode": mode}


def _batch(value: Any, *, schema: int, given: bool) -> int:
    """Sequences decoded together: every call feeds `batch` prompts at once (core/plan.py
    `batch_prompts` says which), the packet being the union of their active rows."""
    if given and schema < MODE_SCHEMA:
        fail("batch", f"needs schema {MODE_SCHEMA}; write schema: {MODE_SCHEMA} or omit `schema:`")
    return int_field(value, "batch", minimum=1, maximum=MAX_BATCH)


def _scored_prompts(value: Any, *, schema: int) -> int:
    """How many prompts start a scored episode in each repetition: the first N (core/plan.py)."""
    if schema < SCORED_SCHEMA:
        fail("scored_prompts", f"needs schema {SCORED_SCHEMA}; write schema: {SCORED_SCHEMA} or omit `schema:`")
    return int_field(value, "scored_prompts", minimum=1, maximum=MAX_PROMPTS)


def _passes(value: Any, *, schema: int, given: bool) -> str:
    """How each episode is measured (PASSES): `separate` times a pass with the ledger and the
    sampler off, then records a second pass with them on (engine/worker.py)."""
    if given and schema < PASSES_SCHEMA:
        fail("passes", f"needs schema {PASSES_SCHEMA}; write schema: {PASSES_SCHEMA} or omit `schema:`")
    return choice_field(value, "passes", PASSES)


def _placement(value: Any) -> dict:
    """Where a screen may run: a GPU type (Ray's accelerator_type, e.g. H200), a node (Ray node
    id), and whether it wants its node to itself. Only what is given is kept."""
    if value is None:
        return {}
    p = mapping_field(value, "placement", allowed={"accelerator_type": False, "node": False, "exclusive_node": False,
                                                   "resources": False})
    out: dict[str, Any] = {}
    if "accelerator_type" in p:
        out["accelerator_type"] = string_field(p["accelerator_type"], "placement.accelerator_type", "a GPU type, e.g. H200")
    if "node" in p:
        out["node"] = string_field(p["node"], "placement.node", "a Ray node id (`ray list nodes`)")
    if bool_field(p.get("exclusive_node", False), "placement.exclusive_node"):
        out["exclusive_node"] = True
    resources = _resources(p.get("resources"))
    if resources:  # absent or empty: left out, so protocols written before it keep their hash
        out["resources"] = resources
    return out


def _resources(value: Any) -> dict[str, int | float]:
    """Custom Ray resources the screen's node must declare (`ray start --resources`), e.g.
    {fast_nvme: 1}: name -> amount > 0. A whole float is kept as an int (1.0 and 1 freeze alike)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        fail("placement.resources", f"{shown(value)} is not a mapping; write e.g. {{fast_nvme: 1}}")
    out: dict[str, int | float] = {}
    for name, amount in value.items():
        where = f"placement.resources.{name}"
        if not isinstance(name, str) or not name.strip():
            fail("placement.resources", f"{shown(name)} is not a resource name; use the name a node declares "
                                        f"with `ray start --resources`")
        if is_builtin_resource(name):
            fail(where, f"{name} is Ray's own resource (every worker gets its GPU and CPUs); name a custom "
                        f"resource a node declares with `ray start --resources`, e.g. fast_nvme")
        number = number_field(amount, where, minimum=0.0, exclusive=True, maximum=MAX_RESOURCE)
        out[name] = int(number) if float(number).is_integer() else float(number)
    return out


# A custom resource's amount is below this: Ray keeps amounts in fixed point (1/10,000 units) in a
# 64-bit integer, so 1e308 validated and failed at placement.
MAX_RESOURCE = 1e9
# Resources Ray defines itself: not a protocol's to ask for (the worker already holds its share).
BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
BUILTIN_RESOURCE_PREFIXES = ("node:", "accelerator_type:")


def is_builtin_resource(name: str) -> bool:
    return name in BUILTIN_RESOURCES or name.startswith(BUILTIN_RESOURCE_PREFIXES)


def _full(raw: Any, *, base_dir: Path | None) -> dict:
    """Validate `raw` (a YAML mapping or any frozen body) into the full schema-2 form."""
    p = mapping_field(raw, "", allowed={
        "schema": False, "name": True, "model": True, "dtype": True, "prompts": True, "prefix_tokens": True,
        "continuation_tokens": True, "conditions": True, "reference": True, "warmups": False,
        "repetitions": False, "order": False, "baseline_first": False, "allowance_mib": True,
        "recording": False, "gates": True, "placement": False, "engine": False, "batch": False,
        "passes": False, "trace": False, "scored_prompts": False,
    })
    declared = p.get("schema", SCHEMA_VERSION)
    if type(declared) is not int or declared not in SCHEMAS:  # 2.0 == 2: a float was read as schema 2
        readable = ", ".join(map(str, SCHEMAS[:-1])) + f" and {SCHEMAS[-1]}"
        fail("schema", f"{shown(declared)} is not supported; this packbench reads schema {readable} "
                       f"(omit `schema:` for the newest, {SCHEMA_VERSION})")
    prefix = int_field(p["prefix_tokens"], "prefix_tokens", minimum=1, maximum=MAX_TOKENS)
    batch = _batch(p.get("batch", 1), schema=declared, given="batch" in p)
    conditions = _conditions(p["conditions"], schema=declared, batch=batch)
    names = tuple(c["name"] for c in conditions)
    full = {
        "schema": 2,
        "name": string_field(p["name"], "name", f"a non-empty string of at most {MAX_NAME} characters", max_chars=MAX_NAME),
        "model": _model(p["model"], schema=declared),
        "dtype": choice_field(p["dtype"], "dtype", DTYPE_NAMES),
        "prompts": _prompts(p["prompts"], base_dir=base_dir, prefix_tokens=prefix),
        "prefix_tokens": prefix,
        "continuation_tokens": int_field(p["continuation_tokens"], "continuation_tokens", minimum=1,
                                    maximum=MAX_CONTINUATION),
        "conditions": conditions,
        "reference": (reference := choice_field(p["reference"], "reference", names)),
        "warmups": _warmups(p.get("warmups", 1), names),
        "repetitions": int_field(p.get("repetitions", 1), "repetitions", minimum=1, maximum=MAX_EPISODES),
        "order": choice_field(p.get("order", "alternating"), "order", ORDERS),
        "baseline_first": bool_field(p.get("baseline_first", True), "baseline_first"),
        "allowance_mib": int_field(p["allowance_mib"], "allowance_mib", minimum=1, maximum=MAX_ALLOWANCE_MIB),
        "recording": bool_field(p.get("recording", True), "recording"),
        "gates": _gates(p["gates"], names, conditions, reference=reference, schema=declared),
    }
    if "fidelity" in full["gates"]:
        full["schema"] = COMPETITOR_SCHEMA  # nothing lower says it: the frozen body says 5
    # A kind of a later schema (a competitor: 5 or 6) freezes in it; a competitor's mode says 6.
    full["schema"] = max([full["schema"], *(CONDITIONS[c["policy"]].since for c in conditions)])
    if any(CONDITIONS[c["policy"]].competitor is not None and "mode" in c["params"] for c in conditions):
        full["schema"] = max(full["schema"], MODE_SCHEMA)
    full["schema"] = max([full["schema"], *(getattr(CONDITIONS[c["policy"]].params[key], "since", 1)
                                             for c in conditions for key in c["params"])])
    if batch > 1:  # batch 1 (or absent) is left out, so every protocol frozen before it keeps its hash
        full["batch"] = batch
        full["schema"] = max(full["schema"], MODE_SCHEMA)  # a later kind (zero-inference: 7) keeps its schema
    if _passes(p.get("passes", "together"), schema=declared, given="passes" in p) == "separate":
        full["passes"] = "separate"  # together (or absent) is left out: every body frozen before keeps its hash
        full["schema"] = max(full["schema"], PASSES_SCHEMA)
    if "scored_prompts" in p:  # absent: every prompt, left out so every body frozen before keeps its hash
        full["scored_prompts"] = _scored_prompts(p["scored_prompts"], schema=declared)
        full["schema"] = max(full["schema"], SCORED_SCHEMA)
    engine = _engine(p.get("engine"))
    if engine:  # eager (or absent): left out, so every protocol frozen before modes keeps its hash
        full["engine"] = engine
    if bool_field(p.get("trace", False), "trace"):
        # Every episode archives its trace of active sets (docs/traces.md). false (or absent) is
        # left out: every body frozen before keeps its hash, and no schema is needed to say it.
        if not bool_field(p.get("recording", True), "recording"):
            fail("trace", "needs recording: true (a trace is recorded with the ledger); drop recording: false or trace")
        if engine:
            fail("trace", f"needs engine mode eager (a captured {engine['mode']} step runs no hooks to read the "
                          f"active sets); drop engine.mode or trace")
        full["trace"] = True
    placement = _placement(p.get("placement"))
    if placement:  # absent or empty: left out, so protocols written before it keep their hash
        full["placement"] = placement
    _cross_checks(full)
    if declared == 1 and schema1_form(full) is None:
        fail("schema", "1 cannot express this protocol (it uses schema-2 fields); write schema: 2 or drop the field")
    return full


def scored_total(full: dict) -> int:
    """Prompts that start a scored episode in each repetition (`scored_prompts`, else every prompt)."""
    return full.get("scored_prompts", prompt_total(full["prompts"]))


def positions_needed(prefix_tokens: int, continuation_tokens: int) -> int:
    """Positions an episode's sequence reaches: the prompt, then one token fed back per decode
    call (the last generated token is never fed back)."""
    return prefix_tokens + continuation_tokens - 1


def positions_refusal(prefix_tokens: int, continuation_tokens: int, *, positions: int, model: str) -> str | None:
    """Why an episode cannot fit `model`'s `positions`, or None: checked before anything is
    queued (a sequence past the last position is an IndexError inside the model, at run time)."""
    needed = positions_needed(prefix_tokens, continuation_tokens)
    if needed <= positions:
        return None
    return (f"prefix_tokens {prefix_tokens} + continuation_tokens {continuation_tokens} - 1 = {needed} positions, "
            f"but {model} has {positions}; lower prefix_tokens or continuation_tokens")


def _cross_checks(full: dict) -> None:
    """Rules that tie sections together: a protocol whose gates could never be decided is refused."""
    gates, ref = full["gates"], full["reference"]
    if "text_file" in full["prompts"] and "path" not in full["model"]:
        fail("prompts.text_file", "needs model.path: the checkpoint's tokenizer encodes the text "
                                  "(a synthetic model has none); use token_file or generator")
    if "faithfulness" in gates and full["warmups"][ref] == 0 and full["repetitions"] == 1:
        fail(f"warmups.{ref}", f"0 leaves the reference {ref!r} nothing to reproduce itself against; "
                               f"declare >= 1 reference warmup or repetitions >= 2")
    prompts_n = prompt_total(full["prompts"])
    scored_n = scored_total(full)
    if scored_n > prompts_n:
        fail("scored_prompts", f"{scored_n} scored prompts, but the protocol declares {prompts_n} prompts; "
                               f"declare more prompts or lower scored_prompts")
    episodes = sum(full["warmups"].values()) + full["repetitions"] * scored_n * len(full["conditions"])
    if episodes > MAX_EPISODES:
        fail("repetitions", f"the plan would hold {episodes} episodes, more than {MAX_EPISODES}; "
                            f"split the screen into shorter protocols")
    if full.get("trace") and episodes > MAX_TRACED_EPISODES:
        fail("trace", f"the plan would hold {episodes} episodes; a traced screen archives 4 members an episode and "
                      f"an archive holds at most 3 x {MAX_EPISODES} + 5, so at most {MAX_TRACED_EPISODES}: split the screen")
    if prompts_n > MAX_PROMPTS or prompts_n * full["prefix_tokens"] > MAX_PROMPT_TOKENS:
        fail("prompts", f"{prompts_n} prompts of {full['prefix_tokens']} tokens: more than {MAX_PROMPTS} prompts "
                        f"or {MAX_PROMPT_TOKENS} prompt tokens; split the screen")
    batch = full.get("batch", 1)
    if batch > prompts_n:
        fail("batch", f"{batch} sequences need at least {batch} prompts, the protocol declares {prompts_n}; "
                      f"declare more prompts or a smaller batch")
    if batch * full["continuation_tokens"] > MAX_CONTINUATION:
        fail("batch", f"{batch} x {full['continuation_tokens']} continuation tokens keep "
                      f"{batch * full['continuation_tokens']} logits rows an episode, more than {MAX_CONTINUATION}; "
                      f"lower batch or continuation_tokens")
    pairs = full["repetitions"] * scored_n  # scored episodes per condition: the bootstrap's pairs
    draws = sum(g["resamples"] * pairs * (len(full["conditions"]) - 1) for g in gates.get("runtime", []))
    if draws > MAX_BOOTSTRAP_DRAWS:
        fail("gates.runtime", f"the runtime bootstraps would draw {draws} pair indices (resamples x pairs x "
                              f"compared conditions), more than {MAX_BOOTSTRAP_DRAWS}; lower resamples")
    if not full["recording"] and full.get("passes") == "separate":
        fail("passes", "separate needs recording: true (its recording pass writes the ledger); "
                       "drop recording: false or write passes: together")
    if not full["recording"] and "acquisition" in gates:
        fail("gates.acquisition", "needs recording: true (byte counts come from the per-call ledger)")
    policies = {c["name"]: c["policy"] for c in full["conditions"]}
    if "faithfulness" in gates:
        _exact_references(full)
    if "fidelity" in gates:
        if tier_of(policies[ref]) == "approximate":
            fail("reference", f"{ref!r} is approximate: fidelity is judged against an exact reference "
                              f"(e.g. dense-stream)")
        if not full["baseline_first"]:
            fail("gates.fidelity", "needs baseline_first: true (each approximate episode is teacher-forced on "
                                   "the tokens of its block's reference episode, which must run first)")
    if full.get("engine", {}).get("mode", "eager") != "eager" and full["schema"] < MODE_SCHEMA:
        for i, c in enumerate(full["conditions"]):
            if CONDITIONS[c["policy"]].competitor is not None:
                fail(f"conditions[{i}].policy", f"{c['policy']!r} runs in engine mode eager only; drop "
                                                f"engine.mode {full['engine']['mode']} or the condition")
    if "synth" in full["model"]:  # a model.path checkpoint's positions are its config.json's (service/submit.py)
        shape = full["model"]["synth"]["shape"]
        moe = is_moe_shape(shape)
        refusal = positions_refusal(full["prefix_tokens"], full["continuation_tokens"],
                                    positions=MOE_MAX_POSITIONS if moe else SHAPES[shape]["max_positions"],
                                    model=f"the synthetic {shape} shape")
        if refusal:
            fail("prefix_tokens", refusal)
        if moe:
            _moe_conditions(full)
        else:
            # An OPT shape: a kind for MoE models alone does not fit it.
            refusal = family_refusal([(c["name"], c["policy"], c["params"]) for c in full["conditions"]], family="opt",
                                     model=f"the synthetic {shape} shape")
            if refusal:
                fail(*refusal)
            _no_mapped_gather(full, f"the synthetic {shape} shape")


def _moe_conditions(full: dict) -> None:
    """A synthetic MoE model's conditions: expert policies only, an allowance that holds the device
    part and one layer's routed experts and each policy's buffers (core/moe.py shape_refusal)."""
    synth = full["model"]["synth"]
    refusal = shape_refusal(MoeShape.of(synth["shape"], layers=synth["layers"]), family_of_shape(synth["shape"]),
                            dtype=full["dtype"], allowance_bytes=full["allowance_mib"] * MIB,
                            model=f"the synthetic {synth['shape']} shape",
                            conditions=[(c["name"], c["policy"], c["params"]) for c in full["conditions"]])
    if refusal:
        fail(*refusal)


def _no_mapped_gather(full: dict, model: str) -> None:
    for i, c in enumerate(full["conditions"]):
        if c["params"].get("gather") == "mapped":
            fail(f"conditions[{i}].params.gather", f"mapped gathers an MoE model's experts; {model} is OPT, whose "
                                                   f"device gather already reads mapped host memory: use gather device")


def _exact_references(full: dict) -> None:
    """Every exact condition must have a condition to be judged bit for bit against: an int8
    loader needs an int8 dense-stream (core.registry.exact_reference), which must reproduce
    itself as the reference does."""
    conditions = {c["name"]: (c["policy"], c["params"]) for c in full["conditions"]}
    for i, c in enumerate(full["conditions"]):
        if tier_of(c["policy"]) != "exact":
            continue
        ref = exact_reference(conditions, full["reference"], c["name"])
        if ref is None:
            weights = weights_of(c["policy"], c["params"])
            fail(f"conditions[{i}].params.weights", f"{weights} has no dense-stream with weights {weights} to be "
                                                    f"judged against (faithfulness); add one, e.g. "
                                                    f"{{policy: dense-stream, params: {{weights: {weights}}}}}")
        if ref == c["name"] != full["reference"] and full["warmups"][ref] == 0 and full["repetitions"] == 1:
            fail(f"warmups.{ref}", f"0 leaves {ref!r}, the reference of weights "
                                   f"{weights_of(c['policy'], c['params'])}, nothing to reproduce itself against; "
                                   f"declare >= 1 warmup or repetitions >= 2")


def validate(raw: Any, *, base_dir: Path | None = None) -> dict:
    """The frozen form of a protocol mapping, or a ProtocolError naming the field path.

    `base_dir` is the protocol file's folder: token_file/text_file paths are read there and
    their SHA-256 and prompt count frozen into the body. Without it (re-validating a stored
    body) those must already be in the body. A frozen body validates to itself.
    """
    full = _full(raw, base_dir=base_dir)
    return schema1_form(full) or full


def full_form(body: Any) -> dict:
    """The full schema-2 dict of a frozen body of any schema (defaults filled, v1 upgraded).

    Raises ProtocolError for a body that is not a valid frozen protocol (say, a damaged
    archive's protocol.json). `core.protocol.expand` wraps this in the typed `Protocol`.
    """
    return _full(body, base_dir=None)


def prompt_total(spec: dict) -> int:
    if "token_ids" in spec:
        return len(spec["token_ids"])
    (value,) = spec.values()
    return value["count"]


