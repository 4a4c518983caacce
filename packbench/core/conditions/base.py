"""What every condition kind declares, torch-free: its parameters and their defaults, its tier,
the first schema that can say it, its byte estimate and, for a competitor, its library, modes
and refusals (`ConditionKind`). The protocol schema, `protocol plan`, the estimate, the worker
and the report read these declarations; the runtime half of a kind (builder and lifecycle)
lives in engine/conditions/ under the same module name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # annotations only: core/estimate.py imports this package
    from packbench.core.estimate import Activity, ModelShape


MAX_INT_PARAM = (1 << 31) - 1


@dataclass(frozen=True)
class IntParam:
    """An integer policy parameter; `default` None means the condition must give it (unless `optional`)."""

    minimum: int
    default: int | None = None
    # Every count a policy takes (rows, blocks, experts) is far below this; a larger value would
    # reach numpy's and torch's 64-bit integers at run time (an OverflowError), so it is refused.
    maximum: int = MAX_INT_PARAM
    # Omitted (with `default` None): left out of the frozen body, and the runtime chooses the value
    # on the worker (flexgen's `w_gpu_percent`, from the allowance); given, it is frozen.
    optional: bool = False

    def check(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.minimum <= value <= self.maximum:
            raise ValueError(f"{name} must be an integer in [{self.minimum}, {self.maximum}], got {value!r}")
        return value


@dataclass(frozen=True)
class ChoiceParam:
    """A policy parameter taking one of `choices`; omitted in schema 1 or 2, it is left out of
    the frozen form and means `default` (so protocols written before the parameter existed keep
    their hash); schema 3 may write a newer default into the body instead (`schema_defaults`).
    `default` None: the condition must give it (and the frozen body always holds it)."""

    choices: tuple[str, ...]
    default: str | None
    # The first schema that may say this parameter: a protocol of a lower schema is refused when it
    # gives it, and a condition giving it freezes in that schema (core/protocol/schema.py). Omitted,
    # it is left out of every frozen body and means `default`, so no older hash moves.
    since: int = 1

    def check(self, name: str, value: Any) -> str:
        if value not in self.choices:
            raise ValueError(f"{name} must be one of {', '.join(self.choices)}, got {value!r}")
        return value


Param = IntParam | ChoiceParam

# How the outgoing weights travel (engine/policies/int8.py): `dtype`, the protocol's precision
# as the checkpoint holds it; `int8`, weight-only int8 rows with one float32 absmax scale per
# outgoing row, dequantized on the device after the copy (about half of fp16's bytes per row).
# An int8 loader is exact against the int8 dense-stream (faithfulness) and approximate against a
# reference of the protocol's precision. Sayable from schema 6.
WEIGHT_FORMATS = ("dtype", "int8")
INT8_SCALE_BYTES = 4  # one float32 scale per int8 row: a row moves hidden + 4 bytes
WEIGHTS_SCHEMA = 6
WEIGHTS_PARAM = ChoiceParam(choices=WEIGHT_FORMATS, default="dtype", since=WEIGHTS_SCHEMA)
GATHER_PARAM = ChoiceParam(choices=("host", "device"), default="host")
# packet's and phase-switched's: also `mapped`, an MoE model's sync-free expert gather (the device
# reads the routed experts from mapped host memory, indexed by the router's top-k on the device;
# engine/moe/policies.py). Refused for OPT models (core/protocol/schema.py, service/submit.py),
# whose device gather already reads mapped memory. No earlier body says it, so no hash moves.
PACKET_GATHER_PARAM = ChoiceParam(choices=("host", "device", "mapped"), default="host")

# How a competitor runs its calls (schema 6, `params.mode`): eager; "graph", one CUDA graph per
# decode step over a static KV cache; "compile", the decode step compiled by torch.compile over
# the same cache and captured as one CUDA graph (engine/quantized.py). Omitted in a schema-5 body: eager.
COMPETITOR_MODES = ("eager", "graph", "compile")
MODE_PARAM = ChoiceParam(choices=COMPETITOR_MODES, default="eager")

# A condition is exact (bit-identical to its reference: every packbench loader) or approximate
# (a low-bit resident model); the two tiers are never ranked together unlabelled.
TIERS = ("exact", "approximate")
# How a kind's byte estimate bounds what it will move (printed beside its numbers by `protocol plan`).
BOUNDS = ("about", "at most", "at least")
# The model families a kind runs on: OPT's ReLU FFN rows, or an MoE model's experts (core/moe.py).
# A protocol naming a kind on a family it does not fit is refused before anything is queued.
MODEL_FAMILIES = ("opt", "moe")
INDEX_BYTES = 8  # every index travels as int64: core/charges.py INDEX_BYTES, the ledger's rule (kept numpy-free here)


@dataclass(frozen=True)
class CallInputs:
    """One forward call as the byte estimate sees it (core/estimate.py builds it): its phase
    (`prefill` or `decode`), the tokens whose active rows it needs (a batch's union), the model's
    shape, the bytes of one outgoing row as it travels, the expected activity and the allowance."""

    phase: str
    tokens: int
    shape: ModelShape
    row_bytes: int
    activity: Activity
    allowance_bytes: int = 0

    def dense(self) -> float:
        """Every outgoing row of every layer (dense-stream's copy)."""
        return float(self.shape.ffn * self.row_bytes) * self.shape.layers

    def active(self) -> float:
        """The expected active rows of one layer in this call (the union over its tokens)."""
        return self.shape.ffn * self.activity.union_fraction(self.tokens)

    def packet(self, *, index: bool = True) -> float:
        """The expected active rows of every layer and their int64 indices (an exact packet);
        `index` False: the rows alone (a device gather sends no index)."""
        return self.active() * (self.row_bytes + (INDEX_BYTES if index else 0)) * self.shape.layers


def nothing_moves(params: Mapping[str, Any], call: CallInputs) -> float:
    """The byte estimate of a kind whose weights were placed once at start."""
    return 0.0 * call.shape.layers


def holds_incoming(params: Mapping[str, Any]) -> str | None:
    """What a packbench loader keeps on the device under the allowance: every weight but the
    outgoing rows, which stay on the host (core/estimate.py loader_device)."""
    return "incoming"


@dataclass(frozen=True)
class RecordContext:
    """What the auditor knows of a competitor episode beyond its record (core/audit.py): the
    protocol's allowance, dtype, batch and capacity (prefix + continuation tokens), whether the
    worker ran on CUDA (worker.json's start device), and the model's config.json fields where the
    protocol's synthetic shape gives them (None for a checkpoint: the archive does not hold it)."""

    allowance_bytes: int
    dtype: str
    batch: int
    capacity: int
    cuda: bool
    config: Mapping[str, Any] | None = None


def int_fields(section: Any, names) -> dict[str, int] | None:
    """`section`'s `names` where it is a mapping holding each as an integer of at least 0 (None otherwise)."""
    if not isinstance(section, Mapping):
        return None
    got = {n: section.get(n) for n in names}
    if not all(type(v) is int and v >= 0 for v in got.values()):
        return None
    return got


def differs(got: Any, want: Mapping[str, Any], prefix: str = "") -> str | None:
    """Where `got` differs from `want` (None: nowhere), as `KEY recorded X, expected Y` at the first
    such key in `want`'s order (then keys `want` lacks), nested keys dotted; the JSON type counts
    (true is not 1, 1.0 is not 1). What a record holds is shown on one line, at most 80 characters."""
    from packbench.core.text import one_line

    def show(v: Any) -> str:
        return one_line(str(v))[:80]

    if not isinstance(got, Mapping):
        return f"{prefix.rstrip('.') or 'value'} recorded {show(got)}, expected a mapping"
    for k in [*want, *(k for k in got if k not in want)]:
        if k not in want:
            return f"{prefix}{show(k)} recorded but never written"
        if k not in got:
            return f"{prefix}{k} missing, expected {want[k]}"
        if isinstance(want[k], Mapping):
            inner = differs(got[k], want[k], f"{prefix}{k}.")
            if inner:
                return inner
        elif type(got[k]) is not type(want[k]) or got[k] != want[k]:
            return f"{prefix}{k} recorded {show(got[k])}, expected {want[k]}"
    return None


def recorded_plan(record: Mapping[str, Any], key: str, cls: type, what: str) -> tuple[Any, list[str]]:
    """A competitor's placement as an episode recorded it in `offload.<key>`, rebuilt as `cls` (a
    dataclass of integers and a bool `chosen`, whose `as_dict` adds its derived sums), and what is
    wrong with it: the record must be exactly `as_dict`'s (sums included). (None, one line) where it
    is not such a record at all."""
    offload = record.get("offload")
    got = offload.get(key) if isinstance(offload, Mapping) else None
    names = [f.name for f in fields(cls) if f.name != "chosen"]
    base = int_fields(got, names)
    if base is None or type(got.get("chosen")) is not bool:
        return None, [f"offload.{key}: not {what} (integers {', '.join(names)} and chosen)"]
    plan = cls(**base, chosen=got["chosen"])
    wrong = differs(got, plan.as_dict())
    return plan, [f"offload.{key}: {wrong} (recomputed from its own figures)"] if wrong else []


@dataclass(frozen=True)
class Competitor:
    """What a competitor (a condition that is not packbench's own loader: it runs its own model
    on a library) declares beyond a loader: each as a function of the condition's params."""

    library: Callable[[Mapping[str, Any]], str]  # the library it runs on (imported only on a worker)
    # The mode an omitted `mode` is written out as at batch 1 (measured fastest on the H200).
    fastest_mode: Callable[[Mapping[str, Any]], str]
    # Why its calls cannot be captured (None: they can): a mode other than eager is refused.
    capture_refusal: Callable[[Mapping[str, Any]], str | None] = lambda params: None
    # Why `mode` failed on the measured CUDA stack (None: it ran): a CUDA worker refuses it at load.
    stack_refusal: Callable[[Mapping[str, Any], str], str | None] = lambda params, mode: None
    # The pyproject extra that installs `library` (the fix printed when it is missing at submit).
    extra: str = "lowbit"
    # Why a CPU worker refuses it before any episode (None: it runs on the CPU too); `protocol plan`
    # says so on a machine without a GPU, where a screen dispatched there runs on the CPU.
    cpu_refusal: str | None = None
    # What the auditor finds wrong with a finished episode's record of this kind (its configuration
    # as the worker wrote it, against the condition's params and the RecordContext): one line each.
    record_problems: Callable[[Mapping[str, Any], Mapping[str, Any], RecordContext], list[str]] = \
        lambda params, record, ctx: []


@dataclass(frozen=True)
class ConditionKind:
    """One kind of condition, as a protocol names it in `policy`.

    `params`: the keyword-only parameters its engine builder takes, with their defaults;
    `h2d_bytes(params, call)`: the expected host-to-device bytes of one call, all layers (the
    transfer floor is these bytes at a stated rate), and `bound` how they bound the truth;
    `since`: the first schema that can say this kind (a protocol naming it freezes there);
    `schema_defaults`: per schema, what an omitted parameter means where that differs from its
    default (written into the frozen body, so old hashes hold); `competitor`: set for a kind
    that is not packbench's own loader; `families`: the model families it runs on (MODEL_FAMILIES);
    `holds(params)`: what a loader keeps on the device under the allowance beside its KV cache,
    "incoming" (every weight but the outgoing rows) or "all", or None where it is not held to the
    allowance (a competitor sizes its own placement).
    """

    name: str
    summary: str
    params: Mapping[str, Param]
    h2d_bytes: Callable[[Mapping[str, Any], CallInputs], float]
    tier: str = "exact"
    bound: str = "about"
    since: int = 1
    schema_defaults: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    competitor: Competitor | None = None
    families: tuple[str, ...] = ("opt",)
    holds: Callable[[Mapping[str, Any]], str | None] = holds_incoming

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"condition kind {self.name}: tier must be one of {', '.join(TIERS)}, got {self.tier!r}")
        if self.bound not in BOUNDS:
            raise ValueError(f"condition kind {self.name}: bound must be one of {', '.join(BOUNDS)}, got {self.bound!r}")
        if not self.families or not set(self.families) <= set(MODEL_FAMILIES):
            raise ValueError(f"condition kind {self.name}: families must be some of {', '.join(MODEL_FAMILIES)}, "
                             f"got {self.families!r}")
        if isinstance(self.since, bool) or not isinstance(self.since, int) or self.since < 1:
            raise ValueError(f"condition kind {self.name}: since must be a schema >= 1, got {self.since!r}")
