"""The one source of what can be named: condition kinds (read from their table,
core/conditions/) and the functions over them, dtypes, synthetic checkpoint shapes, and the
check of a synthetic model's arguments.

Pure data and pure functions (no torch): the protocol validates against it, the engine's
builders take their defaults from it, the CLI checks `model synth` with it.
`tests/engine/test_policy_registry.py` proves the engine's builders agree with it.

Changing a default changes what frozen protocols mean: defaults are filled into the frozen
body (core/protocol/schema.py), so a new default needs a new schema, never an edit (a kind's
`schema_defaults` is one).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from packbench.core.conditions import CONDITIONS
from packbench.core.conditions import accelerate as accelerate_kind
from packbench.core.conditions import quantized as quantized_kind
from packbench.core.conditions.base import (COMPETITOR_MODES, INT8_SCALE_BYTES, TIERS, WEIGHT_FORMATS, WEIGHTS_PARAM,
                                            WEIGHTS_SCHEMA, ChoiceParam, ConditionKind, IntParam)
from packbench.core.errors import PackbenchError
from packbench.core.text import show

# Views of the table of condition kinds (core/conditions/), by role. Code that must see a kind
# added at run time (a test's toy kind) reads CONDITIONS or the functions below, not these.
CONDITION_PARAMS: dict[str, dict[str, IntParam | ChoiceParam]] = {n: dict(k.params) for n, k in CONDITIONS.items()}
CONDITION_POLICIES = tuple(CONDITIONS)  # what a condition's `policy` may name
# Loader policies (packbench's own) and competitors (conditions that are not packbench's loaders).
POLICY_PARAMS = {n: p for n, p in CONDITION_PARAMS.items() if CONDITIONS[n].competitor is None}
POLICY_NAMES = tuple(POLICY_PARAMS)
COMPETITOR_PARAMS = {n: p for n, p in CONDITION_PARAMS.items() if CONDITIONS[n].competitor is not None}
APPROXIMATE_POLICIES = tuple(n for n, k in CONDITIONS.items() if k.tier == "approximate")
LOWBIT_EXTRA = "lowbit"
# The competitors' own tables (core/conditions/quantized.py, accelerate.py), seen from here.
QUANT_METHODS, STACK_REFUSALS = quantized_kind.QUANT_METHODS, quantized_kind.STACK_REFUSALS
COMPETITOR_LIBRARIES = (*dict.fromkeys(QUANT_METHODS.values()), accelerate_kind.LIBRARY)
# Why a method's or a library's calls cannot be captured.
CAPTURE_REFUSALS: dict[str, str] = {**quantized_kind.CAPTURE_REFUSALS, accelerate_kind.LIBRARY: accelerate_kind.CAPTURE_REFUSAL}
# The fastest mode of each method, or of a competitor without one.
FASTEST_MODE: dict[str, str] = {**quantized_kind.FASTEST_MODE, "accelerate": "eager"}


def kind_of(policy: str) -> ConditionKind:
    """The declaration of condition kind `policy` (CONDITIONS); a KeyError names an unknown one."""
    return CONDITIONS[policy]


def stack_refusal(policy: str, params: Mapping[str, Any]) -> str | None:
    """Why a competitor's frozen mode fails on the measured CUDA stack (its kind's stack_refusal), or None."""
    competitor = kind_of(policy).competitor
    return None if competitor is None else competitor.stack_refusal(params, params.get("mode", "eager"))


def fastest_mode(policy: str, params: Mapping[str, Any]) -> str:
    """The mode an omitted `mode` of a competitor condition is written out as (its kind's fastest_mode)."""
    return kind_of(policy).competitor.fastest_mode(params)


def competitor_library(policy: str, params: Mapping[str, Any]) -> str:
    """The library a competitor condition runs on (COMPETITOR_LIBRARIES)."""
    return kind_of(policy).competitor.library(params)


def mode_refusal(policy: str, params: Mapping[str, Any], mode: str) -> str | None:
    """Why a competitor cannot run in `mode` (None: it can): `cannot be captured: ...`."""
    competitor = kind_of(policy).competitor
    why = None if competitor is None else competitor.capture_refusal(params)
    return None if mode == "eager" or why is None else f"cannot be captured: {why}"


def tier_of(policy: str) -> str:
    """`exact` or `approximate` (TIERS) for a condition's policy name (exact for a name no kind has)."""
    kind = CONDITIONS.get(policy)
    return "exact" if kind is None else kind.tier


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


# Extras with an sdist whose build imports torch (deepspeed): pip's isolated build has no torch
# (pyproject.toml, the [offload] extra), so they install with --no-build-isolation.
BUILDS_AGAINST_TORCH = ("offload",)


def lowbit_fix(extra: str = LOWBIT_EXTRA) -> str:
    """The install command that brings `extra`."""
    flag = "--no-build-isolation " if extra in BUILDS_AGAINST_TORCH else ""
    return f"pip install {flag}'packbench[{extra}]'"


def library_fix(policy: str) -> str:
    """The install command that brings competitor `policy`'s library (its kind's extra)."""
    return lowbit_fix(kind_of(policy).competitor.extra)


def missing_library(method: str) -> str | None:
    """The library `method` (a QUANT_METHODS name, or `accelerate`) needs when it is not
    installed here (None when it is), found without importing it (importing torchao imports torch)."""
    import importlib.util

    name = QUANT_METHODS.get(method, method)
    return None if importlib.util.find_spec(name) is not None else name


def newer_defaults(schema: int) -> dict[str, dict[str, str]]:
    """What a protocol of `schema` means by a parameter a condition leaves out, where that differs
    from the kind's default (which schemas 1 and 2 froze): each kind's `schema_defaults` up to `schema`."""
    out: dict[str, dict[str, str]] = {}
    for policy, kind in CONDITIONS.items():
        for since, params in sorted(kind.schema_defaults.items()):
            if schema >= since:
                out[policy] = {**out.get(policy, {}), **params}
    return out


# What schema 3 and schema 4 write for a parameter a condition leaves out (views of the kinds'
# `schema_defaults`: packet gathers on the device from 3, phase-switched from 4).
SCHEMA3_DEFAULTS: dict[str, dict[str, str]] = newer_defaults(3)
SCHEMA4_DEFAULTS: dict[str, dict[str, str]] = {p: d for p, d in newer_defaults(4).items() if p not in SCHEMA3_DEFAULTS}


def check_param(policy: str, name: str, value: Any) -> Any:
    """`value` if policy `policy` accepts it for parameter `name`, else a ValueError naming what it allows."""
    return kind_of(policy).params[name].check(name, value)


def param_default(policy: str, name: str) -> Any:
    """The kind's default of a policy parameter (None: the condition must give it)."""
    return kind_of(policy).params[name].default


def resolved_params(policy: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` of a frozen condition with every default spelled out: what the engine's
    constructor runs with (a `packet` whose frozen params omit gather gathers on the host).
    A parameter of a later schema (`since` > 1) appears only where the condition gives it, so
    what plans and reports print for a protocol written before it stays as it was."""
    return {name: params.get(name, param.default) for name, param in kind_of(policy).params.items()
            if name in params or getattr(param, "since", 1) == 1}


def weights_of(policy: str, params: Mapping[str, Any]) -> str:
    """How condition (`policy`, `params`)'s outgoing weights travel: `dtype` or `int8`
    (WEIGHT_FORMATS); `dtype` for a policy without the parameter."""
    kind = CONDITIONS.get(policy)
    return params.get("weights", "dtype") if kind is not None and "weights" in kind.params else "dtype"


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


def shape_config(shape: str) -> dict[str, int]:
    """A preset OPT shape as the config.json fields the offloading peers read (hidden_size, ffn_dim, ...)."""
    s = SHAPES[shape]
    return {"hidden_size": s["hidden"], "ffn_dim": s["ffn"], "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"], "vocab_size": s["vocab"], "max_position_embeddings": s["max_positions"]}


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
    # Salient input channels (None: none): (share, scale). In every decoder Linear a `share` of the
    # input channels (at least one) has its weight column multiplied by `scale`, and what feeds that
    # channel divided by it (a LayerNorm's gain and bias, fc1's row and bias, v_proj's row and bias),
    # so the function is the same in real arithmetic while a row's range is set by a few columns, as
    # in trained weights (AWQ: ~1 % salient channels). A per-row quantizer's step grows with them;
    # a group-128 one's only in the groups that hold one (docs/workloads.md, "Robustness").
    salient: tuple[float, float] | None = None
    # Salient channels per Linear as a count, whatever its width (None: `salient`'s share of the width; set,
    # the share is unused and `salient`'s scale applies). A fixed count keeps a row's range the same at every
    # width; a candidate field (bench/robustness.py salient_count=N), no profile uses it: on the CPU
    # proxies 4 x8 left per-channel RTN as flat with size as opt3's; on the H200 26 x4 met the per-channel
    # target at opt-6.7b and 13b but made opt-2.7b too robust (docs/workloads.md, "A fixed count").
    salient_count: int | None = None
    # Where a layer carries outlier dims (`outliers`), which of its Linears lose their salient columns (None:
    # none lose them): "inputs", the ones reading its LayerNorms (q, k, v, fc1), whose large inputs are then the
    # outlier features themselves (LLM.int8's emergent features from ~6.7B on: the magnitude sits in the
    # activation, not in the weight column); "layer", all six. Profile opt4 is opt3 with "inputs"
    # (docs/workloads.md, "opt4").
    outlier_salience: str | None = None
    # The stream's readers at OPT's weight scale (False: as `rank` leaves them): in a low-rank stream
    # (`rank`), q, k, v and fc1 read `dims` directions with entries INIT_STD * sqrt(dims / hidden), ~10x
    # smaller than OPT's (0.0022 against 0.02 at opt-13b) while their outputs are the same, so a kernel that
    # multiplies activations by int8 weights before scaling (torchao's int8 weight-only: x @ W_int8, then the
    # row scales) overflows float16 (int8 units of 107,000 at opt-13b; 65,504 is float16's largest). True:
    # those weights times s, the LayerNorms feeding them divided by s, s the power of two nearest
    # sqrt(hidden / dims) (8 from opt-1.3b to opt-13b): the function, exactly as before in real arithmetic
    # and in binary floating point (both factors scale exponents only), with readers of std ~0.02.
    opt_scale_readers: bool = False

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
# `opt` with its weights in a low-rank residual stream: the same activation statistics, and a response
# to weight quantization far nearer real OPT's than opt's (engine/robustness.py REAL_OPT, docs/workloads.md),
# but per-channel and group-128 RTN alike (Gaussian rows): too robust per-channel, too fragile per group.
PROFILES["opt2"] = dataclasses.replace(PROFILES["opt"], rank=160)
# `opt2` with 1 % salient input channels (x4) in every decoder Linear, by exact reparameterisation, and
# a narrower stream: per-channel RTN 3-7x as fragile as group-128 (CPU: 3.2 at opt-125m, 6.6 on an opt-2.7b-wide
# proxy), as real OPT's 4-7x (docs/workloads.md). 4 is a power of two: the reparameterisation is exact in floats too.
PROFILES["opt3"] = dataclasses.replace(PROFILES["opt"], rank=60, salient=(0.01, 4.0))
# `opt3` where outlier features emerge (opt-6.7b, opt-13b): in a layer with outlier dims, the Linears that read
# its LayerNorms (q, k, v, fc1) keep no salient columns, their large inputs being the outlier features themselves
# (LLM.int8). At opt-2.7b and below (no outlier dims) it computes opt3's function. On the H200 it brings int4
# per-channel RTN from opt3's 1.7-1.9x real OPT's to 1.02x (6.7b) and 1.14x (13b), as real OPT's falls with
# size (docs/workloads.md, "opt4").
# Its stream's readers carry OPT's weight scale (`opt_scale_readers`): the same function, int8 kernels that
# accumulate in float16 stay finite as on real OPT.
PROFILES["opt4"] = dataclasses.replace(PROFILES["opt3"], outlier_salience="inputs", opt_scale_readers=True)
# Where a profile's response to weight quantization is measured within the targets of real OPT's published
# figures (engine/robustness.py REAL_OPT; docs/workloads.md, "Robustness"): int8 per-channel <= 0.003 nats,
# int4 per-channel RTN within 1.5x of GPTQ's figure (opt-125m, 2.7b, 6.7b, 13b), int4 group-128 within 1.5x
# of AWQ's (1.3b to 13b). opt2 met all of its targets at opt-125m (CPU) only: on the H200, int8 everywhere,
# per-channel at 6.7b only, group-128 at 1.3b only. opt3 joins a shape when the H200 measures it within them.
# opt3 at opt-2.7b: every target met on the H200 (docs/workloads.md); at opt-1.3b int8 is 0.0036 (target
# <= 0.003), at opt-6.7b and opt-13b int4 per-channel 1.7-1.9x real OPT's (target within 1.5x).
# opt4 computes opt3's function at opt-125m to opt-2.7b (no outlier dims) and met every target at opt-6.7b and
# opt-13b. At opt-1.3b (opt3's weights there), 32 prompts gave int8 0.0011 where 8 had given 0.0036 (0.0014..0.0059).
ROBUSTNESS_SHAPES: dict[str, tuple[str, ...]] = {"opt2": ("opt-125m",), "opt3": ("opt-125m", "opt-1.3b", "opt-2.7b"),
                                                 "opt4": ("opt-125m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b")}


def robustness_caveat(synth: Mapping[str, Any]) -> str | None:
    """For a synthetic checkpoint's recipe (config.json's packbench_synth, a protocol's model.synth):
    None where its response to quantization is calibrated to real OPT, else the line a fidelity
    figure on it carries."""
    shape, profile = synth.get("shape"), synth.get("profile")
    if profile is not None and shape in ROBUSTNESS_SHAPES.get(profile, ()):
        return None
    recipe = (f"profile {profile}" if profile is not None else
              f"routing {synth['routing']}" if synth.get("routing") is not None else "the uniform recipe")  # an MoE shape
    where = "; ".join(f"{p} at {', '.join(shapes)}" for p, shapes in ROBUSTNESS_SHAPES.items())
    return (f"synthetic checkpoint ({recipe}, {shape}) is not calibrated for robustness: its fidelity to low-bit "
            f"weights need not be real OPT's (calibrated: {where})")


DEFAULT_PROFILE = "opt"  # what a schema-4 to -7 model.synth without profile or sparsity gets
# From each schema on, the profile such a model.synth gets (schema 8: opt2; 9: opt3, calibrated for robustness
# per channel and per group; 11: opt4, calibrated at the outlier shapes too); frozen protocols write it out, so
# their bodies and hashes never move.
PROFILE_SCHEMAS: dict[int, str] = {4: DEFAULT_PROFILE, 8: "opt2", 9: "opt3", 11: "opt4"}
NEWEST_PROFILE = PROFILE_SCHEMAS[max(PROFILE_SCHEMAS)]  # `model synth`'s default: the newest schema's


def default_profile(schema: int) -> str:
    """The profile a protocol of `schema` (4 or later) means by a model.synth without profile or sparsity."""
    return PROFILE_SCHEMAS[max(s for s in PROFILE_SCHEMAS if s <= max(schema, min(PROFILE_SCHEMAS)))]


def _show(value: Any) -> str:
    return show(value, 60)  # built to 60 characters: a hostile value is never rendered whole


# |hot_bias| below this: its fc1 bias (hot_bias x 0.02 x sqrt(hidden), at most ~2,200 at the
# largest shape) stays finite in float16; 1e308 validated and synthesised infinite weights.
MAX_HOT_BIAS = 1000.0
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer (larger: a ValueError)


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
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:  # torch's seed: 64 bits
        raise SynthArgumentError("seed", seed, f"an integer in [0, {MAX_SEED}]", choice=False)
    if profile is not None:
        return {"shape": shape, "dtype": dtype, "seed": seed, "profile": profile}
    return {
        "shape": shape,
        "dtype": dtype,
        "sparsity": sparsity,
        "seed": seed,
        "hot_fraction": _number("hot_fraction", 0.0 if hot_fraction is None else hot_fraction, low=0.0,
                                low_open=False, high=1.0),
        "hot_bias": _number("hot_bias", 0.0 if hot_bias is None else hot_bias, low=-MAX_HOT_BIAS, low_open=False,
                            high=MAX_HOT_BIAS),
    }
