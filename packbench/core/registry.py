"""The one source of what can be named: loader policies and their parameters, dtypes,
synthetic checkpoint shapes, and the check of a synthetic model's arguments.

Pure data and pure functions (no torch): the protocol validates against it, the engine's
policy constructors take their defaults from it, the CLI checks `model synth` with it.
`tests/engine/test_policy_registry.py` proves the engine's constructors agree with it.

Changing a default here changes what frozen protocols mean: defaults are filled into the
frozen body (core/protocol/schema.py), so a new default needs a new schema, never an edit
(SCHEMA3_DEFAULTS is one).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from packbench.core.errors import PackbenchError
from packbench.core.text import show


@dataclass(frozen=True)
class IntParam:
    """An integer policy parameter; `default` None means the condition must give it."""

    minimum: int
    default: int | None = None

    def check(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
            raise ValueError(f"{name} must be an integer >= {self.minimum}, got {value!r}")
        return value


@dataclass(frozen=True)
class ChoiceParam:
    """A policy parameter taking one of `choices`; omitted in schema 1 or 2, it is left out of
    the frozen form and means `default` (so protocols written before the parameter existed keep
    their hash); schema 3 may write a newer default into the body instead (SCHEMA3_DEFAULTS).
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


# How the outgoing weights travel (engine/policies/int8.py): `dtype`, the protocol's precision
# as the checkpoint holds it; `int8`, weight-only int8 rows with one float32 absmax scale per
# outgoing row, dequantized on the device after the copy (about half of fp16's bytes per row).
# An int8 loader is exact against the int8 dense-stream (faithfulness) and approximate against a
# reference of the protocol's precision. Sayable from schema 6.
WEIGHT_FORMATS = ("dtype", "int8")
INT8_SCALE_BYTES = 4  # one float32 scale per int8 row: a row moves hidden + 4 bytes
WEIGHTS_SCHEMA = 6
WEIGHTS_PARAM = ChoiceParam(choices=WEIGHT_FORMATS, default="dtype", since=WEIGHTS_SCHEMA)

# Loader policies and their parameters: engine.policies.POLICIES has one constructor per name,
# whose keyword-only parameters are exactly these, with these defaults.
POLICY_PARAMS: dict[str, dict[str, IntParam | ChoiceParam]] = {
    # `allowance: unbounded` runs resident without the protocol's allowance on the device: the
    # speed reference where the model does not fit (its resources verdict still says so). Schema 6.
    "resident": {"allowance": ChoiceParam(choices=("held", "unbounded"), default="held", since=WEIGHTS_SCHEMA)},
    "dense-stream": {"weights": WEIGHTS_PARAM},
    "sparse-extents": {"block_rows": IntParam(minimum=1, default=128)},
    # `packet` without params froze as gather host (schemas 1 and 2): this default may never
    # move. Schema 3 writes gather device for it instead (SCHEMA3_DEFAULTS).
    "packet": {"gather": ChoiceParam(choices=("host", "device"), default="host"), "weights": WEIGHTS_PARAM},
    # Added after schemas 1-3 froze phase-switched without params: host there; schema 4 writes
    # device for it (SCHEMA4_DEFAULTS).
    "phase-switched": {"gather": ChoiceParam(choices=("host", "device"), default="host")},
    # No default: a cache size is a claim about the GPU, so a protocol states it.
    "row-retention": {"rows_per_layer": IntParam(minimum=1)},
    # Added after schemas 1-3 froze early-forecast without params: host in every schema.
    "early-forecast": {"gather": ChoiceParam(choices=("host", "device"), default="host")},
}
POLICY_NAMES = tuple(POLICY_PARAMS)

# Low-bit methods of the `quantized` competitor and the library each needs (engine/quantized.py).
QUANT_METHODS: dict[str, str] = {
    "int8-weight-only": "torchao",
    "int4-weight-only": "torchao",
    "nf4": "bitsandbytes",
    "llm-int8": "bitsandbytes",
}
LOWBIT_EXTRA = "lowbit"

# How a competitor runs its calls (schema 6, `params.mode`): eager; "graph", one CUDA graph per
# decode step over a static KV cache; "compile", the decode step compiled by torch.compile over
# the same cache and captured as one CUDA graph (engine/quantized.py). Omitted in a schema-5 body: eager.
COMPETITOR_MODES = ("eager", "graph", "compile")

# Competitors: conditions that are not packbench's own loaders (engine/quantized.py,
# engine/accelerate.py), named in a protocol's `policy` field like a loader policy. `quantized`
# needs schema 5, `accelerate` and `mode` schema 6 (core/protocol/schema.py).
COMPETITOR_PARAMS: dict[str, dict[str, IntParam | ChoiceParam]] = {
    # No default: which low-bit format is the whole claim, so a protocol states it.
    "quantized": {"method": ChoiceParam(choices=tuple(QUANT_METHODS), default=None),
                  "mode": ChoiceParam(choices=COMPETITOR_MODES, default="eager")},
    # Hugging Face accelerate's big-model offload (device_map, max_memory = the allowance).
    "accelerate": {"mode": ChoiceParam(choices=COMPETITOR_MODES, default="eager")},
}
COMPETITOR_LIBRARIES = (*dict.fromkeys(QUANT_METHODS.values()), "accelerate")

# Why a method's or a library's calls cannot be captured (a mode other than eager is refused for
# it; a method's entry before its library's). A method or library missing here captures.
CAPTURE_REFUSALS: dict[str, str] = {
    # llm-int8 splits outlier columns by a threshold each call, a decision whose shapes depend on
    # the data. nf4 launches its kernels on shapes alone and is captured like torchao's int8, in
    # mode compile (mode graph failed on the H200: STACK_REFUSALS).
    "llm-int8": "bitsandbytes' llm-int8 splits outlier columns by a threshold on every call (data-dependent shapes)",
    "accelerate": "accelerate's hooks copy each offloaded weight from pageable host memory in Python on "
                  "every call",
}

# Modes a library supports in principle that failed on the H200 stack of docs/benchmarks.md (torch
# 2.11, transformers 5.17, torchao 0.18): a CUDA worker refuses such a condition at load, before any
# episode, and `protocol plan` says why. On the CPU nothing is captured, so nothing is refused there.
STACK_REFUSALS: dict[tuple[str, str], str] = {
    ("torchao", "graph"): "capturing transformers' OPT decode step over torchao int8 weights as one CUDA graph "
                          "failed on the H200 (cudaErrorStreamCaptureUnsupported inside the forward); mode compile, "
                          "torchao's fastest and its default, captures through torch.compile",
    ("bitsandbytes", "graph"): "capturing transformers' OPT decode step over bitsandbytes nf4 weights as one CUDA "
                               "graph failed on the H200 (cudaErrorStreamCaptureInvalidated, bench.competitor_probe); "
                               "mode compile captures the compiled step instead",
}


def stack_refusal(policy: str, params: Mapping[str, Any]) -> str | None:
    """Why a competitor's frozen mode fails on the measured CUDA stack (STACK_REFUSALS), or None."""
    return STACK_REFUSALS.get((competitor_library(policy, params), params.get("mode", "eager")))


# The fastest mode each competitor was measured in on the H200 (calibrated synthetic OPT-2.7B fp16,
# decode ms/token through one screen, docs/benchmarks.md "Every low-bit method in its modes"):
# torchao int8 weight-only compile 2.45 (eager 24.77 in an earlier screen), int4 weight-only
# compile 2.59 against eager 49.01, bitsandbytes nf4 compile 3.04 against eager 21.81; llm-int8
# and accelerate cannot be captured (CAPTURE_REFUSALS), so eager. Keyed by method, or by library
# for a competitor without one. What schema 6 writes for an omitted `mode` at batch 1; a protocol
# frozen before keeps the mode it wrote out.
FASTEST_MODE: dict[str, str] = {"int8-weight-only": "compile", "int4-weight-only": "compile", "nf4": "compile",
                                "llm-int8": "eager", "accelerate": "eager"}


def fastest_mode(policy: str, params: Mapping[str, Any]) -> str:
    """The mode an omitted `mode` of a competitor condition is written out as (FASTEST_MODE)."""
    return FASTEST_MODE[params["method"] if policy == "quantized" else policy]


def competitor_library(policy: str, params: Mapping[str, Any]) -> str:
    """The library a competitor condition runs on (COMPETITOR_LIBRARIES)."""
    return QUANT_METHODS[params["method"]] if policy == "quantized" else policy


def mode_refusal(policy: str, params: Mapping[str, Any], mode: str) -> str | None:
    """Why a competitor cannot run in `mode` (None: it can): `cannot be captured: ...`."""
    why = CAPTURE_REFUSALS.get(params.get("method", ""), CAPTURE_REFUSALS.get(competitor_library(policy, params)))
    return None if mode == "eager" or why is None else f"cannot be captured: {why}"
CONDITION_PARAMS: dict[str, dict[str, IntParam | ChoiceParam]] = {**POLICY_PARAMS, **COMPETITOR_PARAMS}
CONDITION_POLICIES = tuple(CONDITION_PARAMS)  # what a condition's `policy` may name

# A condition is exact (bit-identical to its reference: every packbench loader) or approximate
# (a low-bit resident model); the two tiers are never ranked together unlabelled.
TIERS = ("exact", "approximate")
APPROXIMATE_POLICIES = ("quantized",)


def tier_of(policy: str) -> str:
    """`exact` or `approximate` (TIERS) for a condition's policy name."""
    return "approximate" if policy in APPROXIMATE_POLICIES else "exact"


def exact_reference(conditions: Mapping[str, tuple[str, Mapping[str, Any]]], reference: str,
                    name: str) -> str | None:
    """The condition whose logits exact condition `name`'s faithfulness is judged against, given
    every condition's (policy, params) by name: the protocol's `reference` where their weights
    agree (weights_of), else the first dense-stream with `name`'s weights (an int8 packet
    against the int8 dense-stream, which is its own); None where the protocol has none."""
    policy, params = conditions[name]
    weights = weights_of(policy, params)
    if weights == weights_of(*conditions[reference]):
        return reference
    for other, (p, ps) in conditions.items():
        if p == "dense-stream" and weights_of(p, ps) == weights:
            return other
    return None


def lowbit_fix() -> str:
    return f"pip install 'packbench[{LOWBIT_EXTRA}]'"


def missing_library(method: str) -> str | None:
    """The library `method` (a QUANT_METHODS name, or `accelerate`) needs when it is not
    installed here (None when it is), found without importing it (importing torchao imports torch)."""
    import importlib.util

    name = QUANT_METHODS.get(method, method)
    return None if importlib.util.find_spec(name) is not None else name

# What a schema-3 protocol (the newest) means by a parameter a condition leaves out, where that
# differs from the default above (the meaning schema 1 and 2 bodies froze). The schema writes it
# into the frozen body (core/protocol/schema.py), so the body says what runs.
SCHEMA3_DEFAULTS: dict[str, dict[str, str]] = {
    # Issue 11: the device gather is the fast exact mechanism; the host gather (the seed's v0.40
    # mechanism) stays available as `gather: host`.
    "packet": {"gather": "device"},
}


# Schema 4's (the newest's) further defaults: phase-switched decodes with the device gather, as
# packet does since schema 3 (issue 26: the host gather kept it from mode graph's capture).
SCHEMA4_DEFAULTS: dict[str, dict[str, str]] = {
    "phase-switched": {"gather": "device"},
}


def newer_defaults(schema: int) -> dict[str, dict[str, str]]:
    """What a protocol of `schema` means by a parameter a condition leaves out, where that differs
    from the registry's default (which schemas 1 and 2 froze)."""
    out: dict[str, dict[str, str]] = {}
    for since, table in ((3, SCHEMA3_DEFAULTS), (4, SCHEMA4_DEFAULTS)):
        if schema >= since:
            for policy, params in table.items():
                out[policy] = {**out.get(policy, {}), **params}
    return out


def check_param(policy: str, name: str, value: Any) -> Any:
    """`value` if policy `policy` accepts it for parameter `name`, else a ValueError naming what it allows."""
    return CONDITION_PARAMS[policy][name].check(name, value)


def param_default(policy: str, name: str) -> Any:
    """The registry's default of a policy parameter (None: the condition must give it)."""
    return CONDITION_PARAMS[policy][name].default


def resolved_params(policy: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` of a frozen condition with every default spelled out: what the engine's
    constructor runs with (a `packet` whose frozen params omit gather gathers on the host).
    A parameter of a later schema (`since` > 1) appears only where the condition gives it, so
    what plans and reports print for a protocol written before it stays as it was."""
    return {name: params.get(name, param.default) for name, param in CONDITION_PARAMS[policy].items()
            if name in params or getattr(param, "since", 1) == 1}


def weights_of(policy: str, params: Mapping[str, Any]) -> str:
    """How condition (`policy`, `params`)'s outgoing weights travel: `dtype` or `int8`
    (WEIGHT_FORMATS); `dtype` for a policy without the parameter."""
    return params.get("weights", "dtype") if "weights" in CONDITION_PARAMS.get(policy, {}) else "dtype"


DTYPE_NAMES = ("float32", "float16", "bfloat16")

# Real OPT dimensions (config.json of facebook/opt-*), except `tiny`, which exists for tests.
# All are pre-LayerNorm models with word_embed_proj_dim == hidden (OPT-350m is neither: not here).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, ffn=256, layers=2, heads=4, vocab=512, max_positions=256),
    "opt-125m": dict(hidden=768, ffn=3072, layers=12, heads=12, vocab=50272, max_positions=2048),
    "opt-1.3b": dict(hidden=2048, ffn=8192, layers=24, heads=32, vocab=50272, max_positions=2048),
    "opt-2.7b": dict(hidden=2560, ffn=10240, layers=32, heads=32, vocab=50272, max_positions=2048),
    "opt-6.7b": dict(hidden=4096, ffn=16384, layers=32, heads=32, vocab=50272, max_positions=2048),
    "opt-13b": dict(hidden=5120, ffn=20480, layers=40, heads=40, vocab=50272, max_positions=2048),
}
SYNTH_SHAPES = tuple(SHAPES)


# ----------------------------------------------------------------------------- synthetic model


@dataclass(frozen=True)
class SynthProfile:
    """A recipe for synthetic weights whose activation statistics match measured real OPT
    (docs/workloads.md gives each target, its source and the measurement). engine/synth.py
    turns it into weights; every statistic comes out of the model's own arithmetic (nothing is
    masked after fc1). A profile's numbers never change once published: a new recipe is a new name.
    """

    # Mean fraction of a layer's neurons active per token, averaged over layers, per shape.
    density: Mapping[str, float]
    # The last layer's density over the first's (log-linear in between): later OPT layers are
    # denser (LLM in a Flash, App. B.1; PowerInfer: early OPT-30B layers under 1 % active).
    layer_ratio: float
    # Std of the neurons' fc1 bias offsets, in pre-activation stds: heavy-tailed firing rates
    # (some neurons fire often, many almost never).
    rate_spread: float
    # Share of the embedding's variance in a smooth positional process, and its correlation
    # length in positions: nearby tokens share active neurons, distant ones do not.
    position_share: float
    position_length: float
    # Residual variance that all attention and FFN updates together add, over the embedding's.
    update_share: float
    # The last FFN's output std over the embedding's: the next token is read from it, not from
    # the input token's own embedding (which the tied lm_head would otherwise echo).
    readout: float
    # Std of the output logits: sets the next-token entropy (5.5 over 50,272 tokens: ~2.5 nats).
    logit_std: float
    # Per shape: (dims, magnitude, share of layers) of LayerNorm-output outlier features
    # (LLM.int8: from ~6.7B on, a few hidden dims of large magnitude in most layers).
    outliers: Mapping[str, tuple[int, float, float]]
    # Directions of the residual stream (None: all of `hidden`; capped at hidden / 4): every weight
    # reads and writes only these, as trained weights' activations align with a few large singular
    # directions, so weight noise that fills every direction (quantization) reaches the signal at
    # about rank / hidden of its power. A fixed rank makes larger shapes more robust (docs/workloads.md).
    rank: int | None = None

    def layer_densities(self, shape: str) -> list[float]:
        """Each layer's target density: log-linear from first to last, mean `density[shape]`."""
        layers = SHAPES[shape]["layers"]
        weights = [self.layer_ratio ** (i / max(layers - 1, 1)) for i in range(layers)]
        first = self.density[shape] * layers / sum(weights)
        return [first * w for w in weights]


PROFILES: dict[str, SynthProfile] = {
    "opt": SynthProfile(
        density={"tiny": 0.06, "opt-125m": 0.06, "opt-1.3b": 0.046, "opt-2.7b": 0.0333, "opt-6.7b": 0.03,
                 "opt-13b": 0.025},
        layer_ratio=6.0, rate_spread=0.75, position_share=0.75, position_length=5.0, update_share=0.25,
        readout=100.0, logit_std=5.5,
        outliers={"opt-6.7b": (6, 20.0, 0.75), "opt-13b": (6, 25.0, 0.75)},
    ),
}
# `opt` with its weights in a low-rank residual stream: the same activation statistics, and real
# OPT's response to weight quantization (engine/robustness.py REAL_OPT, docs/workloads.md).
PROFILES["opt2"] = dataclasses.replace(PROFILES["opt"], rank=160)
# Where a profile's response to weight quantization is calibrated to real OPT's published figures
# (engine/robustness.py REAL_OPT; opt-125m: GPTQ's per-channel RTN, checked on the CPU).
ROBUSTNESS_SHAPES: dict[str, tuple[str, ...]] = {"opt2": ("opt-125m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b")}


def robustness_caveat(synth: Mapping[str, Any]) -> str | None:
    """For a synthetic checkpoint's recipe (config.json's packbench_synth, a protocol's model.synth):
    None where its response to quantization is calibrated to real OPT, else the line a fidelity
    figure on it carries."""
    shape, profile = synth.get("shape"), synth.get("profile")
    if profile is not None and shape in ROBUSTNESS_SHAPES.get(profile, ()):
        return None
    recipe = f"profile {profile}" if profile is not None else "the uniform recipe"
    return (f"synthetic checkpoint ({recipe}, {shape}) is not calibrated for robustness: its fidelity to low-bit "
            f"weights need not be real OPT's (profile opt2 is, at {', '.join(ROBUSTNESS_SHAPES['opt2'])})")
DEFAULT_PROFILE = "opt"  # what a schema-4 to -7 model.synth without profile or sparsity gets
PROFILE_SCHEMA = 8  # from this schema on, such a model.synth gets NEWEST_PROFILE (calibrated for robustness too)
NEWEST_PROFILE = "opt2"


def default_profile(schema: int) -> str:
    """The profile a protocol of `schema` means by a model.synth without profile or sparsity."""
    return NEWEST_PROFILE if schema >= PROFILE_SCHEMA else DEFAULT_PROFILE


def _show(value: Any) -> str:
    return show(value, 60)  # built to 60 characters: a hostile value is never rendered whole


class SynthArgumentError(PackbenchError, ValueError):
    """A synthetic-model argument outside what can be generated. It names the argument and
    what it allows; each caller spells the argument its own way (`model.synth.shape` in a
    protocol, `--shape` on the command line) through `reason` or `line`."""

    def __init__(self, arg: str, value: Any, expected: str, *, choice: bool) -> None:
        self.arg, self.value, self.expected, self.choice = arg, value, expected, choice
        super().__init__(self.line(arg))

    @property
    def reason(self) -> str:
        """What is wrong, without the argument's name: `'opt-9b' is not allowed; use one of ...`."""
        if self.choice:
            return f"{_show(self.value)} is not allowed; use {self.expected}"
        return f"{_show(self.value)} is not {self.expected}"

    def line(self, name: str) -> str:
        """One line naming the argument as `name`: `unknown --shape 'opt-9b'; use one of ...`."""
        if self.choice:
            return f"unknown {name} {_show(self.value)}; use {self.expected}"
        return f"{name} {self.reason}"


def _choice(arg: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise SynthArgumentError(arg, value, f"one of {', '.join(choices)}", choice=True)
    return value


def _number(arg: str, value: Any, *, low: float, low_open: bool, high: float | None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        bound = f"> {low}" if low_open else f">= {low}"
        if high is not None:
            bound += f" and < {high}"
        raise SynthArgumentError(arg, value, f"a finite number {bound}", choice=False)
    return float(value)


def synth_spec(*, shape: Any, dtype: Any, seed: Any, sparsity: Any = None, hot_fraction: Any = None,
               hot_bias: Any = None, profile: Any = None) -> dict[str, Any]:
    """The synthetic-model arguments, checked in this order and normalised (numbers as floats):
    the dict a protocol freezes as `model.synth` and `engine.synth.synth_checkpoint` takes.

    Two recipes, never mixed: a `profile` (PROFILES: activation statistics calibrated to real
    OPT) freezes as {shape, dtype, seed, profile}; the uniform recipe (`sparsity`, optionally
    `hot_fraction`/`hot_bias`) freezes as {shape, dtype, sparsity, seed, hot_fraction, hot_bias},
    the form every protocol written before profiles froze. Raises SynthArgumentError for the first
    bad argument. Messages are the protocol's, which frozen protocols and their tests pin: change
    them only together.
    """
    shape = _choice("shape", shape, SYNTH_SHAPES)
    dtype = _choice("dtype", dtype, DTYPE_NAMES)
    if profile is not None:
        profile = _choice("profile", profile, tuple(PROFILES))
        uniform = {"sparsity": sparsity, "hot_fraction": hot_fraction, "hot_bias": hot_bias}
        given = [name for name, value in uniform.items() if value is not None]
        if given:
            raise SynthArgumentError(given[0], uniform[given[0]], f"allowed with profile {profile!r} (a profile sets "
                                     f"the activation statistics itself; drop {given[0]} or the profile)",
                                     choice=False)
    else:
        sparsity = _number("sparsity", sparsity, low=0.0, low_open=True, high=1.0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SynthArgumentError("seed", seed, "an integer >= 0", choice=False)
    if profile is not None:
        return {"shape": shape, "dtype": dtype, "seed": seed, "profile": profile}
    return {
        "shape": shape,
        "dtype": dtype,
        "sparsity": sparsity,
        "seed": seed,
        "hot_fraction": _number("hot_fraction", 0.0 if hot_fraction is None else hot_fraction, low=0.0,
                                low_open=False, high=1.0),
        "hot_bias": _number("hot_bias", 0.0 if hot_bias is None else hot_bias, low=-math.inf, low_open=False,
                            high=None),
    }
