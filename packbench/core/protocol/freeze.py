"""Freezing: a protocol file read (YAML, duplicate keys refused), validated, hashed.

The frozen form's canonical JSON (core.canonical) is what the SHA-256 covers, so key order,
comments and whitespace in the YAML never change the hash, while any change of meaning does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from packbench.core.canonical import canonical_json, sha256_hex
from packbench.core.errors import ProtocolError
from packbench.core.files import NotReadable, read_bounded
from packbench.core.protocol.schema import SCHEMA_VERSION, validate
from packbench.core.protocol.spec import Protocol, expand
from packbench.core.text import one_line, show


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
    """safe_load that refuses a key given twice (YAML would silently keep the last one), and
    bounds nesting and alias expansion as it parses (_Shape)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._shape = _Shape()

    def get_event(self) -> yaml.Event:  # the composer takes every event through here, once
        event = super().get_event()
        self._shape.see(event)
        return event

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """A scalar its tag cannot hold (`!!bool maybe`, `!!int abc`, a timestamp of month 13, as
        plain `2001-13-45 10:00:00` is one) is one line naming its line; PyYAML's constructors
        raised KeyError, ValueError or AttributeError, exit 70."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, KeyError, AttributeError, TypeError, OverflowError):
            tag = node.tag.rsplit(":", 1)[-1]
            raise ProtocolError(f"protocol line {node.start_mark.line + 1}: {show(node.value)} is not a valid YAML {tag}; "
                                f"fix it, or quote it if it is text") from None


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (list, dict)):  # `? [1, 2]` is a YAML key; a set of such keys cannot be checked
            raise ProtocolError(one_line(f"protocol line {key_node.start_mark.line + 1}: key `{show(key)}` is a "
                                         f"{type(key).__name__}; a protocol's keys are names"))
        if key in seen:
            shown = key if isinstance(key, str) and len(key) <= 60 else show(key)
            raise ProtocolError(one_line(f"protocol line {key_node.start_mark.line + 1}: key `{shown}` is given twice; "
                                         f"keep one"))
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(path: Path) -> FrozenProtocol:
    """Read, validate and freeze a protocol YAML file.

    The file is bounded before it is parsed (size, encoding, nesting, alias expansion, integer
    length): each limit is a one-line ProtocolError naming it, never a crash of the parser.
    """
    path = Path(path)
    if not path.exists():
        raise ProtocolError(
            f"no protocol file at {path}; pass the path of a protocol YAML (see protocols/quickstart.yaml)")
    raw = _parse(_read_text(path), path)
    if raw is None:  # an empty file, or comments only
        raise ProtocolError(f"{path} holds no protocol (it is empty or only comments); write its fields, "
                            f"see protocols/quickstart.yaml")
    if not isinstance(raw, dict):
        raise ProtocolError(f"{path} holds a YAML {type(raw).__name__}, not a protocol; a protocol is a mapping of "
                            f"fields (name:, model:, ...), see protocols/quickstart.yaml")
    return freeze(raw, source=path.resolve())


# Bounds far beyond any real protocol (the largest inline prompt set the schema allows,
# MAX_PROMPT_TOKENS ids, is ~16 MiB written as a flow list), so only a hostile file meets them.
MAX_PROTOCOL_BYTES = 16 << 20
MAX_DEPTH = 32  # a protocol nests 4 levels (prompts.token_ids[i][j]); validation recurses per level
MAX_VALUES = 1 << 22  # every scalar and collection, each alias counted as what it expands to
MAX_INT_DIGITS = 100  # the largest bound any field has is 20 digits (2**64)


def _read_text(path: Path) -> str:
    try:
        data = read_bounded(path, limit=MAX_PROTOCOL_BYTES)
    except NotReadable as e:
        if e.too_large:
            size = path.stat().st_size
            raise ProtocolError(f"{path} is {size} bytes; a protocol file is at most {MAX_PROTOCOL_BYTES >> 20} MiB "
                                f"(put a large prompt set in prompts.token_file)") from None
        raise ProtocolError(f"the protocol {path} {e}; pass the path of a protocol YAML file "
                            f"(see protocols/quickstart.yaml)") from None
    except OSError as e:
        raise ProtocolError(f"cannot read the protocol file {path} ({e.strerror}); check its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
                            f"save it as UTF-8") from None


def parse_value(text: str, what: str) -> Any:
    """One value written in YAML on a command line (`--sweep FIELD=V1,V2`'s values), read by the
    protocol file's own loader: bounded, no arbitrary tags, a value its tag cannot hold refused;
    a ProtocolError naming `what` where it is no YAML (`[`, `*a`, `!!python/object:...`)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        problem = one_line(str(getattr(e, "problem", None) or "cannot be parsed"))[:100]
        raise ProtocolError(f"{what}: {show(text)} is not a YAML value ({problem}); quote it if it is text") from None
    except ProtocolError as e:
        raise ProtocolError(f"{what}: {e}") from None


def _parse(text: str, path: Path) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ProtocolError(f"{path} is not valid YAML{at}; fix the syntax") from None


class _Shape:
    """Nesting depth and alias expansion, counted on the parser's events as the composer takes
    them: the composer recurses once per level, and an alias bomb is small until expanded, so
    both are refused before any tree is built or constructed."""

    def __init__(self) -> None:
        self.anchored: dict[str, tuple[int, int]] = {}  # anchor -> (values it expands to, levels it nests)
        self.open: list[tuple[str | None, int]] = []  # per open collection: its anchor, the values before it
        self.deepest = [0] * (MAX_DEPTH + 2)  # per open depth: the deepest level reached in it (aliases expanded)
        self.total = 0

    def see(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.AliasEvent):
            values, levels = self.anchored.get(event.anchor, (1, 0))  # an unknown alias: the composer names it
            self._reach(len(self.open) + levels, event)
            self.total += values
        elif isinstance(event, yaml.ScalarEvent):
            self.total += 1
            if event.anchor is not None:
                self.anchored[event.anchor] = (1, 0)
        elif isinstance(event, yaml.CollectionStartEvent):
            self.open.append((event.anchor, self.total))
            self.total += 1
            self.deepest[len(self.open)] = len(self.open)
            self._reach(len(self.open), event)
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before = self.open.pop()
            depth = len(self.open) + 1
            self.deepest[depth - 1] = max(self.deepest[depth - 1], self.deepest[depth])
            if anchor is not None:
                self.anchored[anchor] = (self.total - before, self.deepest[depth] - depth + 1)
        if self.total > MAX_VALUES:
            raise ProtocolError(f"protocol line {_line(event)}: the file expands to more than {MAX_VALUES} values, "
                                f"the limit (YAML aliases count as what they repeat); write the values out, or put a "
                                f"large prompt set in prompts.token_file")

    def _reach(self, level: int, event: yaml.Event) -> None:
        if level > MAX_DEPTH:
            raise ProtocolError(f"protocol line {_line(event)}: values nest deeper than {MAX_DEPTH} levels, the "
                                f"limit; a protocol nests 4 (see docs/protocol.md)")
        depth = len(self.open)
        self.deepest[depth] = max(self.deepest[depth], level)


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int:
    if len(node.value) > MAX_INT_DIGITS:  # int() of over 4300 digits raises, and slowly below that
        raise ProtocolError(f"protocol line {node.start_mark.line + 1}: an integer written with {len(node.value)} "
                            f"characters; integers have at most {MAX_INT_DIGITS} digits")
    return loader.construct_yaml_int(node)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _construct_str(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> str:
    value = loader.construct_yaml_str(node)
    if any("\ud800" <= ch <= "\udfff" for ch in value):  # "\ud800" in double quotes: no UTF-8 encodes it
        raise ProtocolError(f"protocol line {node.start_mark.line + 1}: a string holds a lone surrogate "
                            f"({show(value)}); write the character itself, or its pair")
    return value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:str", _construct_str)
