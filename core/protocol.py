"""Protocols: a YAML screen description, validated, canonicalised and frozen by SHA-256.

The frozen form is the validated dict with every default filled in; its canonical JSON
(core.canonical) is what the hash covers, so key order, comments and whitespace in the YAML
never change the hash, while any change of meaning does. See docs/protocol.md.

Two schema versions exist. Schema 1 is what packbench 0.1 froze (inline or generated prompts,
resident/dense-stream/packet, faithfulness and whole-episode acquisition gates). Schema 2 adds
everything else. A protocol is frozen in the LOWEST schema that expresses its meaning, so every
protocol that schema 1 could say keeps its old hash; `expand` turns any frozen body into the
full schema-2 form that the plan and the gates read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from core.canonical import canonical_json, sha256_hex
from core.errors import ProtocolError
# Policies and their parameters, dtypes and synthetic shapes live in one registry shared with the
# engine and the CLI; re-exported here for code that imports them from core.protocol.
from core.registry import (
    DTYPE_NAMES,
    POLICY_NAMES,
    POLICY_PARAMS,
    SYNTH_SHAPES,
    ChoiceParam,
    IntParam,
    SynthArgumentError,
    synth_spec,
)

SCHEMA_VERSION = 2  # the newest schema this packbench reads and writes
MIB = 1 << 20
# Bounds no real screen reaches: a hostile protocol.json must not make a plan or the generated
# prompts exhaust an auditor's memory.
MAX_TOKENS = 1 << 16  # prefix_tokens, continuation_tokens
MAX_EPISODES = 100_000  # planned episodes, warmups included


ORDERS = ("alternating", "abba", "latin-square")
PHASES = ("all", "prefill", "decode")
GATE_NAMES = ("faithfulness", "resources", "capacity", "acquisition", "runtime", "useful_latency")
PROMPT_SOURCES = ("token_ids", "token_file", "text_file", "generator")
TEXT_SEPARATOR = "---"  # a line holding only this separates prompts in a text_file

_SCHEMA1_POLICIES = ("resident", "dense-stream", "packet")
_CONDITION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


# ----------------------------------------------------------------------------- field checks


def _fail(path: str, message: str) -> None:
    raise ProtocolError(f"protocol field `{path}`: {message}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _mapping(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """Check `value` is a mapping with only `allowed` keys (key -> required)."""
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping, got {_show(value)}")
    for key in value:
        if key not in allowed:
            _fail(_join(path, str(key)), f"unknown field; allowed fields are {', '.join(sorted(allowed))}")
    for key, required in allowed.items():
        if required and key not in value:
            _fail(_join(path, key), "is required")
    return value


def _optional_mapping(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """A gate written as `name:` (null) or `name: {}` means: the gate with its defaults."""
    return _mapping({} if value is None else value, path, allowed=allowed)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, path: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        _fail(path, f"{_show(value)} is not an integer {bound}")
    return value


def _number(value: Any, path: str, *, minimum: float, exclusive: bool = False, maximum: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > minimum if exclusive else value >= minimum)
    ok = ok and (maximum is None or value < maximum)
    if not ok:
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        if maximum is not None:
            bound += f" and < {maximum}"
        _fail(path, f"{_show(value)} is not a finite number {bound}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"{_show(value)} is not allowed; use true or false")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        _fail(path, f"{_show(value)} is not allowed; use one of {', '.join(choices)}")
    return value


def _string(value: Any, path: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        _fail(path, f"{_show(value)} is not allowed; expected {what}")
    return value


# ----------------------------------------------------------------------------- sections


def _model(value: Any) -> dict:
    m = _mapping(value, "model", allowed={"path": False, "synth": False})
    if ("path" in m) == ("synth" in m):
        _fail("model", "give exactly one of path (a local checkpoint directory) or synth (a synthetic spec)")
    if "path" in m:
        return {"path": _string(m["path"], "model.path", "a path to a local Hugging Face OPT directory")}
    s = _mapping(m["synth"], "model.synth", allowed={
        "shape": True, "dtype": True, "sparsity": True, "seed": True, "hot_fraction": False, "hot_bias": False})
    try:
        return {"synth": synth_spec(**s)}
    except SynthArgumentError as e:
        _fail(f"model.synth.{e.arg}", e.reason)


def _token_lists(ids: Any, path: str) -> list[list[int]]:
    if not isinstance(ids, list) or not ids:
        _fail(path, f"{_show(ids)} is not allowed; expected a non-empty list of token-id lists")
    for i, prompt in enumerate(ids):
        if not isinstance(prompt, list) or not prompt:
            _fail(f"{path}[{i}]", f"{_show(prompt)} is not allowed; expected a non-empty list of token ids")
        for j, t in enumerate(prompt):
            _int(t, f"{path}[{i}][{j}]", minimum=0)
    return ids


def split_texts(text: str) -> list[str]:
    """The prompts of a text_file: blocks separated by lines holding only `---`, stripped."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip() == TEXT_SEPARATOR:
            blocks.append("\n".join(current))
            current = []
        else:
            current.append(line)
    blocks.append("\n".join(current))
    return [b.strip() for b in blocks if b.strip()]


def read_prompt_file(kind: str, path: Path, *, field: str) -> tuple[bytes, list]:
    """Bytes and parsed prompts of a token_file (id lists) or text_file (texts)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ProtocolError(f"protocol field `{field}`: cannot read {path} ({e.strerror}); "
                            f"paths are relative to the protocol file") from None
    if kind == "token_file":
        try:
            ids = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ProtocolError(f"protocol field `{field}`: {path} is not JSON ({e}); "
                                f"write a list of token-id lists") from None
        return data, _token_lists(ids, f"{field} ({Path(path).name})")
    try:
        texts = split_texts(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProtocolError(f"protocol field `{field}`: {path} is not UTF-8 text") from None
    if not texts:
        _fail(field, f"{path} holds no text; write prompts separated by `{TEXT_SEPARATOR}` lines")
    return data, texts


def _prompt_file(kind: str, value: Any, *, base_dir: Path | None, prefix_tokens: int) -> dict:
    path = f"prompts.{kind}"
    spec = {"path": value} if isinstance(value, str) else _mapping(
        value, path, allowed={"path": True, "sha256": False, "count": False})
    rel = _string(spec["path"], f"{path}.path", "a path relative to the protocol file")
    if "sha256" in spec and (not isinstance(spec["sha256"], str) or not _SHA256.fullmatch(spec["sha256"])):
        _fail(f"{path}.sha256", f"{_show(spec['sha256'])} is not allowed; expected 64 lowercase hex digits")
    if "count" in spec:
        _int(spec["count"], f"{path}.count", minimum=1)
    if base_dir is None:
        # A frozen body (re-read from a database or an archive): the file is not at hand.
        if "sha256" not in spec or "count" not in spec:
            _fail(path, "needs the protocol file's folder to read the file; load the protocol from its file "
                        "(a frozen body carries path, sha256 and count)")
        return {"path": rel, "sha256": spec["sha256"], "count": spec["count"]}
    data, items = read_prompt_file(kind, base_dir / rel, field=path)
    digest, count = hashlib.sha256(data).hexdigest(), len(items)
    if spec.get("sha256", digest) != digest:
        _fail(f"{path}.sha256", f"{spec['sha256']} does not match {rel} (sha256 {digest}); "
                                f"the file changed since the protocol was written")
    if spec.get("count", count) != count:
        _fail(f"{path}.count", f"{spec['count']} does not match the {count} prompts in {rel}")
    if kind == "token_file":
        for i, ids in enumerate(items):
            if len(ids) < prefix_tokens:
                _fail(f"{path}", f"prompt {i} of {rel} has {len(ids)} ids, fewer than prefix_tokens={prefix_tokens}")
    return {"path": rel, "sha256": digest, "count": count}


def _prompts(value: Any, *, base_dir: Path | None, prefix_tokens: int) -> dict:
    p = _mapping(value, "prompts", allowed={name: False for name in PROMPT_SOURCES})
    if len(p) != 1:
        _fail("prompts", f"give exactly one of {', '.join(PROMPT_SOURCES)}; got {', '.join(p) or 'none'}")
    (kind, spec), = p.items()
    if kind == "generator":
        g = _mapping(spec, "prompts.generator", allowed={"seed": True, "count": True})
        return {"generator": {"seed": _int(g["seed"], "prompts.generator.seed", minimum=0),
                              "count": _int(g["count"], "prompts.generator.count", minimum=1)}}
    if kind == "token_ids":
        ids = _token_lists(spec, "prompts.token_ids")
        for i, prompt in enumerate(ids):
            if len(prompt) < prefix_tokens:
                _fail(f"prompts.token_ids[{i}]", f"has {len(prompt)} ids, fewer than prefix_tokens={prefix_tokens}")
        return {"token_ids": ids}
    return {kind: _prompt_file(kind, spec, base_dir=base_dir, prefix_tokens=prefix_tokens)}


def _params(policy: str, value: Any, path: str) -> dict:
    spec = POLICY_PARAMS[policy]
    if value is None:
        value = {}
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping, got {_show(value)}")
    for key in value:
        if key not in spec:
            takes = f"takes {', '.join(sorted(spec))}" if spec else "takes no params"
            _fail(_join(path, str(key)), f"unknown param; policy {policy} {takes}")
    out = {}
    for key, param in spec.items():
        if isinstance(param, ChoiceParam):
            if key in value:
                out[key] = _choice(value[key], _join(path, key), param.choices)
            continue
        if key not in value and param.default is None:
            _fail(_join(path, key), f"is required by policy {policy} (an integer >= {param.minimum})")
        out[key] = _int(value.get(key, param.default), _join(path, key), minimum=param.minimum)
    return out


def _conditions(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        _fail("conditions", f"{_show(value)} is not allowed; expected a non-empty list of {{name, policy, params}}")
    out, names = [], set()
    for i, c in enumerate(value):
        path = f"conditions[{i}]"
        c = _mapping(c, path, allowed={"name": False, "policy": True, "params": False})
        policy = _choice(c["policy"], f"{path}.policy", POLICY_NAMES)
        name = c.get("name", policy)
        if not isinstance(name, str) or not _CONDITION_NAME.fullmatch(name):
            _fail(f"{path}.name", f"{_show(name)} is not allowed; use letters, digits, '.', '_' and '-'")
        if name in names:
            _fail(f"{path}.name", f"{name!r} is already used; condition names are unique")
        names.add(name)
        out.append({"name": name, "policy": policy, "params": _params(policy, c.get("params"), f"{path}.params")})
    return out


def _warmups(value: Any, names: tuple[str, ...]) -> dict[str, int]:
    if isinstance(value, dict):
        for key in value:
            if key not in names:
                _fail(f"warmups.{key}", f"unknown condition; use one of {', '.join(names)}")
        for name in names:
            if name not in value:
                _fail(f"warmups.{name}", "is required; list every condition or give one integer")
        return {name: _int(value[name], f"warmups.{name}", minimum=0) for name in names}
    n = _int(value, "warmups", minimum=0)
    return {name: n for name in names}


def _comparisons(value: Any, path: str, names: tuple[str, ...], *, extra: dict[str, bool]) -> list[dict]:
    """acquisition/runtime: one mapping or a list of them, one per phase."""
    items = value if isinstance(value, list) else [value]
    if not items:
        _fail(path, "expected a mapping or a non-empty list of mappings (one per phase)")
    out, phases = [], set()
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        g = _mapping(item, where, allowed={"control": True, "max_ratio": True, "phase": False, **extra})
        control = _choice(g["control"], f"{where}.control", names)
        if len(names) < 2:
            _fail(f"{where}.control", f"{control!r} has no other condition to compare with")
        phase = _choice(g.get("phase", "all"), f"{where}.phase", PHASES)
        if phase in phases:
            _fail(f"{where}.phase", f"{phase!r} is already gated; give one entry per phase")
        phases.add(phase)
        # A byte ratio of 0 is a real bound (move nothing); a time ratio of 0 could never pass.
        timed = "confidence" in extra
        out.append({"control": control, "phase": phase,
                    "max_ratio": _number(g["max_ratio"], f"{where}.max_ratio", minimum=0.0, exclusive=timed)})
        if timed:
            out[-1].update(
                confidence=_number(g.get("confidence", 0.95), f"{where}.confidence", minimum=0.0, exclusive=True,
                                   maximum=1.0),
                resamples=_int(g.get("resamples", 10000), f"{where}.resamples", minimum=100),
                seed=_int(g.get("seed", 0), f"{where}.seed", minimum=0))
    return sorted(out, key=lambda g: PHASES.index(g["phase"]))


def _gates(value: Any, names: tuple[str, ...]) -> dict:
    g = _mapping(value, "gates", allowed={name: False for name in GATE_NAMES})
    out: dict[str, Any] = {}
    if "faithfulness" in g:
        f = _optional_mapping(g["faithfulness"], "gates.faithfulness", allowed={"tolerance": False})
        tolerance = _number(f.get("tolerance", 0.0), "gates.faithfulness.tolerance", minimum=0.0)
        out["faithfulness"] = {"tolerance": tolerance}
    for name in ("resources", "capacity"):
        if name in g:
            out[name] = dict(_optional_mapping(g[name], f"gates.{name}", allowed={}))
    if "acquisition" in g:
        out["acquisition"] = _comparisons(g["acquisition"], "gates.acquisition", names, extra={})
    if "runtime" in g:
        out["runtime"] = _comparisons(g["runtime"], "gates.runtime", names,
                                      extra={"confidence": False, "resamples": False, "seed": False})
    if "useful_latency" in g:
        u = _mapping(g["useful_latency"], "gates.useful_latency",
                     allowed={"max_first_episode_s": True, "max_cold_start_s": True})
        out["useful_latency"] = {
            key: _number(u[key], f"gates.useful_latency.{key}", minimum=0.0, exclusive=True)
            for key in ("max_first_episode_s", "max_cold_start_s")}
    if not out:
        _fail("gates", f"declare at least one gate: {', '.join(GATE_NAMES)}")
    return out


# ----------------------------------------------------------------------------- schema 1 <-> 2


def _schema1(full: dict) -> dict | None:
    """The schema-1 body with the same meaning as `full`, or None when schema 1 cannot say it."""
    gates = full["gates"]
    acq = gates.get("acquisition", [{"phase": "all"}])
    expressible = (
        "path" in full["model"]
        and ("token_ids" in full["prompts"] or "generator" in full["prompts"])
        and all(c["policy"] in _SCHEMA1_POLICIES and not c["params"] for c in full["conditions"])
        and len(set(full["warmups"].values())) == 1
        and full["repetitions"] == 1 and full["order"] == "alternating" and full["baseline_first"]
        and full["recording"]
        and set(gates) <= {"faithfulness", "acquisition"}
        and len(acq) == 1 and acq[0]["phase"] == "all"
    )
    if not expressible:
        return None
    v1_gates: dict[str, dict] = {}
    if "faithfulness" in gates:
        v1_gates["faithfulness"] = dict(gates["faithfulness"])
    if "acquisition" in gates:
        v1_gates["acquisition"] = {"control": acq[0]["control"], "max_ratio": acq[0]["max_ratio"]}
    return {
        "schema": 1, "name": full["name"], "model": dict(full["model"]), "dtype": full["dtype"],
        "prompts": full["prompts"], "prefix_tokens": full["prefix_tokens"],
        "continuation_tokens": full["continuation_tokens"],
        "conditions": [{"name": c["name"], "policy": c["policy"]} for c in full["conditions"]],
        "reference": full["reference"], "warmups": next(iter(full["warmups"].values())),
        "allowance_mib": full["allowance_mib"], "gates": v1_gates,
    }


def _full(raw: Any, *, base_dir: Path | None) -> dict:
    """Validate `raw` (a YAML mapping or any frozen body) into the full schema-2 form."""
    p = _mapping(raw, "", allowed={
        "schema": False, "name": True, "model": True, "dtype": True, "prompts": True, "prefix_tokens": True,
        "continuation_tokens": True, "conditions": True, "reference": True, "warmups": False,
        "repetitions": False, "order": False, "baseline_first": False, "allowance_mib": True,
        "recording": False, "gates": True,
    })
    declared = p.get("schema", SCHEMA_VERSION)
    if isinstance(declared, bool) or declared not in (1, 2):
        _fail("schema", f"{_show(declared)} is not supported; this packbench reads schema 1 and 2")
    prefix = _int(p["prefix_tokens"], "prefix_tokens", minimum=1, maximum=MAX_TOKENS)
    conditions = _conditions(p["conditions"])
    names = tuple(c["name"] for c in conditions)
    full = {
        "schema": 2,
        "name": _string(p["name"], "name", "a non-empty string"),
        "model": _model(p["model"]),
        "dtype": _choice(p["dtype"], "dtype", DTYPE_NAMES),
        "prompts": _prompts(p["prompts"], base_dir=base_dir, prefix_tokens=prefix),
        "prefix_tokens": prefix,
        "continuation_tokens": _int(p["continuation_tokens"], "continuation_tokens", minimum=1, maximum=MAX_TOKENS),
        "conditions": conditions,
        "reference": _choice(p["reference"], "reference", names),
        "warmups": _warmups(p.get("warmups", 1), names),
        "repetitions": _int(p.get("repetitions", 1), "repetitions", minimum=1),
        "order": _choice(p.get("order", "alternating"), "order", ORDERS),
        "baseline_first": _bool(p.get("baseline_first", True), "baseline_first"),
        "allowance_mib": _int(p["allowance_mib"], "allowance_mib", minimum=1),
        "recording": _bool(p.get("recording", True), "recording"),
        "gates": _gates(p["gates"], names),
    }
    _cross_checks(full)
    if declared == 1 and _schema1(full) is None:
        _fail("schema", "1 cannot express this protocol (it uses schema-2 fields); write schema: 2 or drop the field")
    return full


def _cross_checks(full: dict) -> None:
    """Rules that tie sections together: a protocol whose gates could never be decided is refused."""
    gates, ref = full["gates"], full["reference"]
    if "text_file" in full["prompts"] and "path" not in full["model"]:
        _fail("prompts.text_file", "needs model.path: the checkpoint's tokenizer encodes the text "
                                   "(a synthetic model has none); use token_file or generator")
    if "faithfulness" in gates and full["warmups"][ref] == 0 and full["repetitions"] == 1:
        _fail(f"warmups.{ref}", f"0 leaves the reference {ref!r} nothing to reproduce itself against; "
                                f"declare >= 1 reference warmup or repetitions >= 2")
    episodes = sum(full["warmups"].values()) + full["repetitions"] * _count(full["prompts"]) * len(full["conditions"])
    if episodes > MAX_EPISODES:
        _fail("repetitions", f"the plan would hold {episodes} episodes, more than {MAX_EPISODES}; "
                             f"split the screen into shorter protocols")
    if not full["recording"] and "acquisition" in gates:
        _fail("gates.acquisition", "needs recording: true (byte counts come from the per-call ledger)")


def validate(raw: Any, *, base_dir: Path | None = None) -> dict:
    """The frozen form of a protocol mapping, or a ProtocolError naming the field path.

    `base_dir` is the protocol file's folder: token_file/text_file paths are read there and
    their SHA-256 and prompt count frozen into the body. Without it (re-validating a stored
    body) those must already be in the body. A frozen body validates to itself.
    """
    full = _full(raw, base_dir=base_dir)
    return _schema1(full) or full


def expand(body: dict) -> dict:
    """The full schema-2 form of a frozen body of any schema (defaults filled, v1 upgraded).

    The plan and the gates read this form. Raises ProtocolError for a body that is not a valid
    frozen protocol (say, a damaged archive's protocol.json).
    """
    return _full(body, base_dir=None)


def prompt_count(body: dict) -> int:
    """How many distinct prompts the protocol declares (known without reading any file)."""
    return _count(expand(body)["prompts"])


def _count(spec: dict) -> int:
    if "token_ids" in spec:
        return len(spec["token_ids"])
    (value,) = spec.values()
    return value["count"]


# ----------------------------------------------------------------------------- freezing


@dataclass(frozen=True)
class FrozenProtocol:
    """A validated protocol and its identity. `source` is where it was read (not hashed)."""

    body: dict
    sha256: str
    source: Path | None = None

    @property
    def name(self) -> str:
        return self.body["name"]

    @property
    def canonical(self) -> bytes:
        return canonical_json(self.body)

    def _resolve(self, rel: str) -> Path:
        path = Path(rel).expanduser()
        if not path.is_absolute() and self.source is not None:
            path = self.source.parent / path
        return path.resolve()

    def model_dir(self) -> Path | None:
        """model.path, resolved against the protocol file's folder when relative; None for a
        synthetic model (the worker generates it from model.synth)."""
        model = self.body["model"]
        return self._resolve(model["path"]) if "path" in model else None

    def prompt_file(self) -> Path | None:
        """The token_file/text_file, resolved like model.path; None for inline or generated prompts."""
        spec = self.body["prompts"]
        for kind in ("token_file", "text_file"):
            if kind in spec:
                return self._resolve(spec[kind]["path"])
        return None


def freeze(raw: Any, *, source: Path | None = None) -> FrozenProtocol:
    """Validate and freeze. `source` is the protocol file (its folder resolves relative paths)."""
    body = validate(raw, base_dir=None if source is None else Path(source).parent)
    return FrozenProtocol(body=body, sha256=sha256_hex(canonical_json(body)), source=source)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice (YAML would silently keep the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise ProtocolError(f"protocol line {key_node.start_mark.line + 1}: key `{key}` is given twice; keep one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(path: Path) -> FrozenProtocol:
    """Read, validate and freeze a protocol YAML file."""
    path = Path(path)
    if not path.is_file():
        raise ProtocolError(
            f"no protocol file at {path}; pass the path of a protocol YAML (see protocols/quickstart.yaml)")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ProtocolError(f"{path} is not valid YAML{at}; fix the syntax") from None
    return freeze(raw, source=path.resolve())
