"""Freezing: a protocol file read (YAML, duplicate keys refused), validated, hashed.

The frozen form's canonical JSON (core.canonical) is what the SHA-256 covers, so key order,
comments and whitespace in the YAML never change the hash, while any change of meaning does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core.canonical import canonical_json, sha256_hex
from core.errors import ProtocolError
from core.protocol.schema import SCHEMA_VERSION, validate
from core.protocol.spec import Protocol, expand


@dataclass(frozen=True)
class FrozenProtocol:
    """A validated protocol and its identity. `source` is where it was read (not hashed)."""

    body: dict
    sha256: str
    source: Path | None = None
    # The schema the mapping was read in (its `schema:`, else the newest): not part of the
    # identity, since a schema-3 file freezes as schema 2 or 1 (core/protocol/schema.py).
    read_as: int | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.body["name"]

    @property
    def protocol(self) -> Protocol:
        """The typed protocol (validated again only on first use)."""
        return expand(self.body)

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
    return FrozenProtocol(body=body, sha256=sha256_hex(canonical_json(body)), source=source,
                          read_as=raw.get("schema", SCHEMA_VERSION))  # validate() checked raw is a mapping


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
