"""Protocols: a YAML screen description, validated, canonicalised and frozen by SHA-256.

The frozen form is the validated dict with every default filled in; its canonical JSON
(core.canonical) is what the hash covers, so key order, comments and whitespace in the YAML
never change the hash, while any change of meaning does. See docs/protocol.md.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from core.canonical import canonical_json, sha256_hex
from core.errors import ProtocolError

POLICY_NAMES = ("resident", "dense-stream", "packet")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
GATE_NAMES = ("faithfulness", "acquisition")
SCHEMA_VERSION = 1


def _fail(path: str, message: str) -> None:
    raise ProtocolError(f"protocol field `{path}`: {message}")


def _mapping(value: Any, path: str, *, allowed: dict[str, bool]) -> dict:
    """Check `value` is a mapping with only `allowed` keys (key -> required)."""
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            _fail(f"{path}.{key}" if path else key, f"unknown field; allowed fields are {', '.join(sorted(allowed))}")
    for key, required in allowed.items():
        if required and key not in value:
            _fail(f"{path}.{key}" if path else key, "is required")
    return value


def _int(value: Any, path: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"{value!r} is not an integer >= {minimum}")
    return value


def _number(value: Any, path: str, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        _fail(path, f"{value!r} is not a number >= {minimum}")
    return float(value)


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        _fail(path, f"{value!r} is not allowed; use one of {', '.join(choices)}")
    return value


def _prompts(value: Any) -> dict:
    p = _mapping(value, "prompts", allowed={"token_ids": False, "generator": False})
    if ("token_ids" in p) == ("generator" in p):
        _fail("prompts", "give exactly one of token_ids or generator")
    if "generator" in p:
        g = _mapping(p["generator"], "prompts.generator", allowed={"seed": True, "count": True})
        return {"generator": {"seed": _int(g["seed"], "prompts.generator.seed", minimum=0),
                              "count": _int(g["count"], "prompts.generator.count", minimum=1)}}
    ids = p["token_ids"]
    if not isinstance(ids, list) or not ids:
        _fail("prompts.token_ids", "expected a non-empty list of token-id lists")
    for i, prompt in enumerate(ids):
        if not isinstance(prompt, list) or not prompt:
            _fail(f"prompts.token_ids[{i}]", "expected a non-empty list of token ids")
        for j, t in enumerate(prompt):
            _int(t, f"prompts.token_ids[{i}][{j}]", minimum=0)
    return {"token_ids": ids}


def _conditions(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        _fail("conditions", "expected a non-empty list of {name, policy}")
    out, names = [], set()
    for i, c in enumerate(value):
        path = f"conditions[{i}]"
        c = _mapping(c, path, allowed={"name": False, "policy": True})
        policy = _choice(c["policy"], f"{path}.policy", POLICY_NAMES)
        name = c.get("name", policy)
        if not isinstance(name, str) or not name or name in names:
            _fail(f"{path}.name", f"{name!r} must be a unique non-empty string")
        names.add(name)
        out.append({"name": name, "policy": policy})
    return out


def _gates(value: Any, conditions: set[str]) -> dict:
    g = _mapping(value, "gates", allowed={name: False for name in GATE_NAMES})
    out: dict[str, dict] = {}
    if "faithfulness" in g:
        f = _mapping(g["faithfulness"] or {}, "gates.faithfulness", allowed={"tolerance": False})
        out["faithfulness"] = {"tolerance": _number(f.get("tolerance", 0.0), "gates.faithfulness.tolerance", minimum=0.0)}
    if "acquisition" in g:
        a = _mapping(g["acquisition"], "gates.acquisition", allowed={"control": True, "max_ratio": True})
        _choice(a["control"], "gates.acquisition.control", tuple(sorted(conditions)))
        out["acquisition"] = {"control": a["control"],
                              "max_ratio": _number(a["max_ratio"], "gates.acquisition.max_ratio", minimum=0.0)}
    if not out:
        _fail("gates", f"declare at least one gate: {', '.join(GATE_NAMES)}")
    return out


def validate(raw: Any) -> dict:
    """The frozen form of a protocol mapping, or a ProtocolError naming the field path."""
    p = _mapping(raw, "", allowed={
        "name": True, "model": True, "dtype": True, "prompts": True, "prefix_tokens": True,
        "continuation_tokens": True, "conditions": True, "reference": True, "warmups": False,
        "allowance_mib": True, "gates": True, "schema": False,
    })
    if p.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
        _fail("schema", f"{p['schema']!r} is not supported; this packbench reads schema {SCHEMA_VERSION}")
    if not isinstance(p["name"], str) or not p["name"].strip():
        _fail("name", "expected a non-empty string")
    model = _mapping(p["model"], "model", allowed={"path": True})
    if not isinstance(model["path"], str) or not model["path"]:
        _fail("model.path", "expected a path to a local Hugging Face OPT directory")
    conditions = _conditions(p["conditions"])
    names = tuple(c["name"] for c in conditions)
    frozen = {
        "schema": SCHEMA_VERSION,
        "name": p["name"],
        "model": {"path": model["path"]},
        "dtype": _choice(p["dtype"], "dtype", DTYPE_NAMES),
        "prompts": _prompts(p["prompts"]),
        "prefix_tokens": _int(p["prefix_tokens"], "prefix_tokens", minimum=1),
        "continuation_tokens": _int(p["continuation_tokens"], "continuation_tokens", minimum=1),
        "conditions": conditions,
        "reference": _choice(p["reference"], "reference", names),
        "warmups": _int(p.get("warmups", 1), "warmups", minimum=0),
        "allowance_mib": _int(p["allowance_mib"], "allowance_mib", minimum=1),
        "gates": _gates(p["gates"], set(names)),
    }
    if "token_ids" in frozen["prompts"]:
        for i, prompt in enumerate(frozen["prompts"]["token_ids"]):
            if len(prompt) < frozen["prefix_tokens"]:
                _fail(f"prompts.token_ids[{i}]", f"has {len(prompt)} ids, fewer than prefix_tokens={frozen['prefix_tokens']}")
    return frozen


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

    def model_dir(self) -> Path:
        """model.path, resolved against the protocol file's folder when relative."""
        path = Path(self.body["model"]["path"]).expanduser()
        if not path.is_absolute() and self.source is not None:
            path = self.source.parent / path
        return path.resolve()


def freeze(raw: Any, *, source: Path | None = None) -> FrozenProtocol:
    body = validate(raw)
    return FrozenProtocol(body=body, sha256=sha256_hex(canonical_json(body)), source=source)


def load(path: Path) -> FrozenProtocol:
    """Read, validate and freeze a protocol YAML file."""
    path = Path(path)
    if not path.is_file():
        raise ProtocolError(f"no protocol file at {path}; pass the path of a protocol YAML (see protocols/quickstart.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ProtocolError(f"{path} is not valid YAML{at}; fix the syntax") from None
    return freeze(raw, source=path.resolve())
