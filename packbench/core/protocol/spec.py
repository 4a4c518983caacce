"""The typed protocol: what plan, gates, worker and auditor read, validated once.

`expand(body)` validates a frozen body of any schema ONCE and returns a frozen `Protocol`; every
later step takes that object instead of re-validating a dict. The frozen body itself (the
lowest schema that says its meaning, see compat.py) stays in `Protocol.body`: it is what is
hashed, stored in the database and written to archives, so old hashes never move.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from packbench.core.canonical import canonical_json, sha256_hex
from packbench.core.protocol.compat import schema1_form
from packbench.core.protocol.schema import MIB, full_form, scored_total
from packbench.core.registry import resolved_params, tier_of


@dataclass(frozen=True)
class SynthSpec:
    """A synthetic checkpoint the worker generates: OPT (engine/synth.py) or, with `routing`, an MoE
    shape (engine/moe/synth.py; core/moe.py moe_synth_spec)."""

    shape: str
    dtype: str
    seed: int
    sparsity: float | None = None  # the uniform recipe (with hot_fraction, hot_bias); None with a profile
    hot_fraction: float | None = None
    hot_bias: float | None = None
    profile: str | None = None  # a calibrated recipe (core.registry.PROFILES)
    layers: int | None = None  # an MoE shape: the layers generated (its depth, or fewer, stated)
    routing: str | None = None  # an MoE shape: its routing profile (core/moe.py ROUTING_PROFILES)

    @property
    def is_moe(self) -> bool:
        return self.routing is not None

    def as_dict(self) -> dict:
        """The frozen `model.synth` (core.registry.synth_spec's or core.moe.moe_synth_spec's form):
        synth_checkpoint's or synth_moe's arguments."""
        if self.routing is not None:
            return {"shape": self.shape, "dtype": self.dtype, "seed": self.seed, "layers": self.layers,
                    "routing": self.routing}
        if self.profile is not None:
            return {"shape": self.shape, "dtype": self.dtype, "seed": self.seed, "profile": self.profile}
        return {"shape": self.shape, "dtype": self.dtype, "sparsity": self.sparsity, "seed": self.seed,
                "hot_fraction": self.hot_fraction, "hot_bias": self.hot_bias}


@dataclass(frozen=True)
class ModelSpec:
    """Exactly one of `path` (a local Hugging Face OPT directory, as written) or `synth`."""

    path: str | None
    synth: SynthSpec | None
    sha256: str | None = None  # a model.path checkpoint's pinned content digest (core.provenance)


@dataclass(frozen=True)
class PromptSpec:
    """Where the prompts come from: `source` is token_ids, token_file, text_file or generator."""

    source: str
    count: int
    token_ids: tuple[tuple[int, ...], ...] | None = None  # token_ids
    path: str | None = None  # token_file / text_file, relative to the protocol file
    sha256: str | None = None  # token_file / text_file, frozen
    seed: int | None = None  # generator


@dataclass(frozen=True)
class Condition:
    name: str
    policy: str
    params: Mapping[str, Any]  # read-only, as frozen: integer defaults filled in, an omitted choice left out

    @property
    def resolved_params(self) -> dict[str, Any]:
        """Every parameter the engine runs this condition with, defaults spelled out (a frozen
        `packet` without gather: gather host; schema 3 writes gather device into the body)."""
        return resolved_params(self.policy, self.params)

    @property
    def tier(self) -> str:
        """`exact` (a packbench loader: bit-identical to its reference) or `approximate` (a low-bit competitor)."""
        return tier_of(self.policy)


@dataclass(frozen=True)
class Comparison:
    """One acquisition or runtime gate entry: `condition / control <= max_ratio` over `phase`."""

    control: str
    phase: str
    max_ratio: float
    confidence: float | None = None  # runtime only: bootstrap interval
    resamples: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class UsefulLatency:
    max_first_episode_s: float
    max_cold_start_s: float


@dataclass(frozen=True)
class FidelityBounds:
    """One fidelity gate entry: thresholds every scored episode of `condition` must meet
    (None: not judged). core/fidelity.py defines the figures."""

    condition: str
    max_mean_kl: float | None = None
    max_p99_kl: float | None = None
    min_top1: float | None = None
    max_abs_logit: float | None = None
    min_divergence_step: int | None = None


@dataclass(frozen=True)
class Gates:
    """The gates a protocol declares; absent ones are None or empty."""

    faithfulness_tolerance: float | None = None
    resources: bool = False
    capacity: bool = False
    acquisition: tuple[Comparison, ...] = ()
    runtime: tuple[Comparison, ...] = ()
    useful_latency: UsefulLatency | None = None
    fidelity: tuple[FidelityBounds, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where a screen may run (all optional): a GPU type, a node, the node to itself."""

    accelerator_type: str | None = None
    node: str | None = None
    exclusive_node: bool = False
    # Custom Ray resources its node must have free, as sorted (name, amount) pairs (hashable).
    resources: tuple[tuple[str, int | float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.resources, Mapping):
            object.__setattr__(self, "resources", tuple(sorted(self.resources.items())))

    @property
    def resources_dict(self) -> dict[str, int | float]:
        return dict(self.resources)


def resources_fit(needs: Mapping[str, float], free: Mapping[str, float]) -> bool:
    """Whether `free` (a node's custom Ray resources, or what is left of them) covers `needs`."""
    return all(free.get(name, 0.0) >= amount for name, amount in needs.items())


@dataclass(frozen=True, eq=False)
class Protocol:
    """A validated, frozen protocol. Equality and hashing go by `sha256` (its identity)."""

    body: Mapping[str, Any]  # the frozen body, as hashed and archived (read-only view)
    sha256: str
    name: str
    model: ModelSpec
    dtype: str
    prompts: PromptSpec
    prefix_tokens: int
    continuation_tokens: int
    conditions: tuple[Condition, ...]
    reference: str
    warmups: Mapping[str, int]
    repetitions: int
    order: str
    baseline_first: bool
    allowance_mib: int
    recording: bool
    gates: Gates
    placement: Placement
    engine_mode: str  # eager | graph (engine/graph.py)
    batch: int  # sequences decoded together (1: one prompt an episode, as every schema before 6)
    passes: str  # together | separate (schema 7): the timing pass apart from the recording pass
    scored_prompts: int  # prompts that start a scored episode in each repetition (schema 10; else every prompt)
    full: Mapping[str, Any]  # the full schema-2 form (read-only), as docs/protocol.md lists it

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Protocol) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    @property
    def condition_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.conditions)

    def tier(self, name: str) -> str:
        """The tier of condition `name`: exact or approximate (core.registry.TIERS)."""
        return self.condition(name).tier

    def condition(self, name: str) -> Condition:
        for c in self.conditions:
            if c.name == name:
                return c
        raise KeyError(f"no condition {name!r} in protocol {self.name!r}")

    @property
    def traced(self) -> bool:
        """Each episode archives its trace of active sets (`trace: true`, docs/traces.md)."""
        return bool(self.full.get("trace", False))

    @property
    def separate_passes(self) -> bool:
        """Each episode runs twice: timed with recording off, then recorded (core/passes.py)."""
        return self.passes == "separate"

    @property
    def allowance_bytes(self) -> int:
        return self.allowance_mib * MIB

    @property
    def prompt_count(self) -> int:
        return self.prompts.count

    def body_dict(self) -> dict:
        """A plain (mutable) copy of the frozen body, e.g. to write as protocol.json."""
        return _thaw(self.body)

    def full_dict(self) -> dict:
        """A plain (mutable) copy of the full schema-2 form."""
        return _thaw(self.full)

    def __reduce__(self):
        # Ray and multiprocessing pickle by re-validating the frozen body: cheap and always valid.
        return (expand, (_thaw(self.body),))


def _freeze_data(value: Any) -> Any:
    """Nested read-only views: a Protocol can be shared without anyone editing it in place."""
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze_data(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze_data(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _prompt_spec(spec: dict) -> PromptSpec:
    (source, value), = spec.items()
    if source == "token_ids":
        return PromptSpec(source, len(value), token_ids=tuple(tuple(p) for p in value))
    if source == "generator":
        return PromptSpec(source, value["count"], seed=value["seed"])
    return PromptSpec(source, value["count"], path=value["path"], sha256=value["sha256"])


def _comparison(g: dict) -> Comparison:
    return Comparison(control=g["control"], phase=g["phase"], max_ratio=g["max_ratio"],
                      confidence=g.get("confidence"), resamples=g.get("resamples"), seed=g.get("seed"))


def _gates(g: dict) -> Gates:
    u = g.get("useful_latency")
    return Gates(
        faithfulness_tolerance=g["faithfulness"]["tolerance"] if "faithfulness" in g else None,
        resources="resources" in g, capacity="capacity" in g,
        acquisition=tuple(_comparison(x) for x in g.get("acquisition", [])),
        runtime=tuple(_comparison(x) for x in g.get("runtime", [])),
        useful_latency=None if u is None else UsefulLatency(u["max_first_episode_s"], u["max_cold_start_s"]),
        fidelity=tuple(FidelityBounds(**f) for f in g.get("fidelity", [])))


def expand(body: Any) -> Protocol:
    """The typed protocol of a frozen body of any schema; a `Protocol` is returned as it is.

    Validates once. Raises ProtocolError for a body that is not a valid frozen protocol (say, a
    damaged archive's protocol.json); the auditor separately checks that the body is in frozen
    form (`validate(body) == body`).
    """
    if isinstance(body, Protocol):
        return body
    full = full_form(body)
    frozen = schema1_form(full) or full  # the lowest schema that says it: what is hashed
    model = full["model"]
    synth = model.get("synth")
    return Protocol(
        body=_freeze_data(frozen), sha256=sha256_hex(canonical_json(frozen)), name=full["name"],
        model=ModelSpec(path=model.get("path"), synth=None if synth is None else SynthSpec(**synth),
                        sha256=model.get("sha256")),
        dtype=full["dtype"], prompts=_prompt_spec(full["prompts"]), prefix_tokens=full["prefix_tokens"],
        continuation_tokens=full["continuation_tokens"],
        conditions=tuple(Condition(c["name"], c["policy"], MappingProxyType(dict(c["params"])))
                         for c in full["conditions"]),
        reference=full["reference"], warmups=MappingProxyType(dict(full["warmups"])),
        repetitions=full["repetitions"], order=full["order"], baseline_first=full["baseline_first"],
        allowance_mib=full["allowance_mib"], recording=full["recording"], gates=_gates(full["gates"]),
        placement=Placement(**full.get("placement", {})), engine_mode=full.get("engine", {}).get("mode", "eager"),
        batch=full.get("batch", 1), passes=full.get("passes", "together"),
        scored_prompts=scored_total(full), full=_freeze_data(full))


def prompt_count(body: Any) -> int:
    """How many distinct prompts the protocol declares (known without reading any file)."""
    return expand(body).prompt_count
