"""`flexgen`: FlexGen 0.1.8's OPT runtime (FMInference/FlexLLMGen, `flexgen.flex_opt.OptLM`) under
a placement policy: the percentages of weights and KV cache on the GPU, the rest in pinned host
memory, activations on the GPU or the CPU, compression off (FlexGen's group-wise quantization is
not offered). A competitor in tier approximate: its kernels are its own (`TorchDevice.mha`,
`mlp`, `opt_output_embed`), not stock transformers'. Its runtime is engine/conditions/flexgen.py
over engine/flexgen.py.

The policy is frozen in the protocol where the condition gives it. `w_gpu_percent` omitted, the
worker chooses the largest weights share that fits the allowance (`choose_policy`), by FlexGen's
own placement rule (flex_opt.py `init_weight_list`: each layer's weight list is cut at the
percentage by the midpoint of each tensor's cumulative size, so a tensor is wholly on one device
and a layer's real GPU share is coarser than the percentage) and its own byte counts (the token
embedding held twice, by `InputEmbed` and `OutputEmbed`; the KV cache as `init_cache_one_gpu_batch`
allocates it), plus FlexGen's working space (`working_bytes`). The probe's arithmetic
(bench/flexgen_probe.py, `OptConfig.model_bytes` less the cache and 512 MiB) chose 81 % for OPT-2.7B
at batch 1 under 4800 MiB and peaked at 5160 MiB allocated on the H200: by the placement rule 81 %
puts 4903 MiB of weights on the GPU (model_bytes counts the embedding once and the percentage is
not what the rule places), the cache 165 MiB, leaving 92 MiB of working space, which
`working_bytes` bounds from above. FlexGen's cost model and policy search
(`experimental/cost_model.py`) are not in the 0.1.8 wheel. The policy used is written into every
episode record (`flexgen.policy`).

Torch-free: core. `config` below is an OPT config.json's fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from packbench.core.conditions.base import (MODE_PARAM, CallInputs, ChoiceParam, Competitor, ConditionKind, IntParam,
                                            RecordContext, differs, int_fields, recorded_plan)
from packbench.core.errors import PlacementDoesNotFit

LIBRARY = "flexgen"
EXTRA = "offload"  # pyproject.toml's [offload] extra brings it (flexgen==0.1.8)
MIB = 1 << 20
FP16 = 2  # FlexGen's OPT runs in float16 only (OptConfig.dtype)
SLACK = 64 * MIB  # the CUDA caching allocator's rounding, beside the estimate (engine/zero_inference.py's)
CAPTURE_REFUSAL = "FlexGen's OptLM runs its own Python schedule, synchronising after every layer"
CPU_REFUSAL = "FlexGen's OptLM makes CUDA streams (flex_opt.py OptLM.__init__: torch.cuda.Stream())"


def weight_layers(config: Mapping[str, Any]) -> list[list[int]]:
    """The element counts of each FlexGen layer's weight list, in its `init_weight` order: the input
    embedding (token, positions), per decoder layer the attention (q, k, v, out projections with
    their biases, the LayerNorm) and the MLP (fc1, fc2 with biases, the LayerNorm) as two layers
    (`sep_layer`), then the output embedding (final LayerNorm, the token embedding again)."""
    h, v = config["hidden_size"], config["vocab_size"]
    f = 4 * h  # FlexGen's MLP is (4h, h) whatever config.json says: `check_shape` refuses another
    out = [[v * h, (config["max_position_embeddings"] + 2) * h]]
    for _ in range(config["num_hidden_layers"]):
        out.append([h * h, h, h * h, h, h * h, h, h * h, h, h, h])
        out.append([f * h, f, h * f, h, h, h])
    out.append([h, h, v * h])
    return out


def check_shape(config: Mapping[str, Any]) -> str | None:
    """Why FlexGen's OPT cannot run `config` (None: it can): its MLP is hard-wired to 4 x hidden."""
    if config["ffn_dim"] != 4 * config["hidden_size"]:
        return (f"FlexGen's OPT MLP is 4 x hidden ({4 * config['hidden_size']}), this model's ffn_dim is "
                f"{config['ffn_dim']}")
    return None


def placement(config: Mapping[str, Any], w_gpu_percent: int) -> tuple[int, list[int]]:
    """(bytes of weights FlexGen places on the GPU, bytes each layer keeps on the CPU) at
    `w_gpu_percent`, by flex_opt.py init_weight_list / get_choice: the tensor whose cumulative
    midpoint lies below 100 - w_gpu_percent % of its layer's elements goes to the CPU."""
    gpu, cpu = 0, []
    for sizes in weight_layers(config):
        total, run, on_cpu = sum(sizes), 0, 0
        for n in sizes:
            run += n
            mid = 100 * (run - n / 2) / total
            if mid < 100 - w_gpu_percent:
                on_cpu += n * FP16
            else:
                gpu += n * FP16
        cpu.append(on_cpu)
    return gpu, cpu


def cache_bytes(config: Mapping[str, Any], *, batch: int, prompt: int, gen: int) -> int:
    """FlexGen's KV cache of one GPU batch, every layer (pytorch_backend.py init_cache_one_gpu_batch:
    keys and values of (prompt + gen - 1) positions, float16)."""
    return 2 * (prompt + gen - 1) * batch * config["hidden_size"] * FP16 * config["num_hidden_layers"]


def working_bytes(config: Mapping[str, Any], *, batch: int, prompt: int, cpu_layers: list[int], cuda: bool) -> int:
    """FlexGen's working space at the peak of a prefill, from above: the host-homed weights of the two
    largest layers on the device at once (with `overlap` it loads layer j + 1 while j computes), and
    the prefill's activations in its kernels (pytorch_backend.py `mha`: the hidden, q, k, v and the
    output, the attention scores and their softmax; `mlp`: fc1's (b, s, 4h); `opt_output_embed`:
    logits of every position, float16, and the float32 copy of the last one the condition keeps),
    plus the allocator's slack on CUDA."""
    h, heads, v = config["hidden_size"], config["num_attention_heads"], config["vocab_size"]
    t = batch * prompt
    two = sum(sorted(cpu_layers)[-2:])
    activations = (5 * t * h + 2 * batch * heads * prompt * prompt + t * 4 * h + t * v) * FP16 + batch * v * 4
    return two + activations + (SLACK if cuda else 0)


@dataclass(frozen=True)
class PolicyPlan:
    """FlexGen's placement for one screen and the allowance's arithmetic behind it (bytes; written
    into every episode record). `chosen`: the weights share was chosen here (the condition did not give it)."""

    w_gpu_percent: int
    cache_gpu_percent: int
    act_gpu_percent: int
    gpu_batch_size: int
    chosen: bool
    allowance: int
    context: int
    held: int
    weights_gpu: int
    cache_gpu: int
    working: int

    @property
    def needed(self) -> int:
        return self.context + self.held + self.weights_gpu + self.cache_gpu + self.working

    def as_dict(self) -> dict:
        return {**asdict(self), "needed_bytes": self.needed, "num_gpu_batches": 1, "overlap": True,
                "sep_layer": True, "pin_weight": True, "cpu_cache_compute": False, "compress_weight": False,
                "compress_cache": False}


class PolicyRefused(ValueError):
    """The allowance cannot hold FlexGen's smallest placement (one line, naming what it needs)."""


def choose_policy(config: Mapping[str, Any], params: Mapping[str, Any], *, allowance: int, context: int, held: int,
                  batch: int, prompt: int, gen: int, cuda: bool) -> PolicyPlan:
    """The placement a condition runs with: its frozen `w_gpu_percent`, or the largest one whose
    weights, cache and working space fit `allowance` less the CUDA context and what the worker holds.
    PolicyRefused (one line) where not even 0 % fits, or a frozen share does not."""
    cache_pct = params.get("cache_gpu_percent", 100)
    act = 100 if params.get("activations", "gpu") == "gpu" else 0
    cache = cache_bytes(config, batch=batch, prompt=prompt, gen=gen) * cache_pct // 100

    def plan(g: int, chosen: bool) -> PolicyPlan:
        gpu, cpu = placement(config, g)
        return PolicyPlan(w_gpu_percent=g, cache_gpu_percent=cache_pct, act_gpu_percent=act, gpu_batch_size=batch,
                          chosen=chosen, allowance=allowance, context=context, held=held, weights_gpu=gpu,
                          cache_gpu=cache, working=working_bytes(config, batch=batch, prompt=prompt, cpu_layers=cpu,
                                                                 cuda=cuda))

    given = params.get("w_gpu_percent")
    if given is not None:
        p = plan(given, False)
        if p.needed > allowance:
            raise PolicyRefused(f"condition policy flexgen with w_gpu_percent {given} needs {-(-p.needed // MIB)} MiB "
                                f"(weights {p.weights_gpu // MIB}, KV cache {p.cache_gpu // MIB}, working space "
                                f"{p.working // MIB}), the protocol gives {allowance // MIB} MiB: lower "
                                f"w_gpu_percent or omit it")
        return p
    for g in range(100, -1, -1):
        p = plan(g, True)
        if p.needed <= allowance:
            return p
    raise PolicyRefused(f"condition policy flexgen needs an allowance of at least {-(-p.needed // MIB)} MiB with "
                        f"every weight on the CPU (KV cache {p.cache_gpu // MIB}, working space {p.working // MIB}), "
                        f"the protocol gives {allowance // MIB} MiB: raise allowance_mib, lower cache_gpu_percent "
                        f"or drop the condition")


def replay_policy(recorded: Mapping[str, Any], *, context: int, held: int) -> PolicyPlan:
    """The archived placement `recorded` (an episode's `offload.policy`) to run again as it is, on
    a worker that measured `context` and `held` (a re-execution: choosing again at another context
    would place other weights and move other bytes). PlacementDoesNotFit (one line) where its
    weights, cache and working space no longer fit the allowance beside them."""
    names = [f.name for f in fields(PolicyPlan) if f.name != "chosen"]
    base = int_fields(recorded, names)
    if base is None or type(recorded.get("chosen")) is not bool:
        raise ValueError(f"the archived offload.policy is not FlexGen's placement (integers {', '.join(names)} "
                         f"and chosen)")
    plan = PolicyPlan(**base, chosen=recorded["chosen"])
    here = replace(plan, context=context, held=held).needed
    if here > plan.allowance:
        raise PlacementDoesNotFit(
            f"the archived flexgen placement (w_gpu_percent {plan.w_gpu_percent}) needs {-(-here // MIB)} MiB on this "
            f"worker (context {context // MIB} MiB, holding {held // MIB} MiB; the archive's "
            f"{plan.context // MIB} and {plan.held // MIB}), over the allowance of {plan.allowance // MIB} MiB")
    return plan


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """The host-homed weights, every call (FlexGen copies them layer by layer each step): by its
    placement rule at a frozen `w_gpu_percent`; omitted, at the largest share whose GPU weights
    alone fit the allowance (the worker's choice also leaves room for the cache, working space and
    context, so it may place less on the GPU). About: the cache's host part and activations aside."""
    s = call.shape
    config = {"hidden_size": s.hidden, "vocab_size": s.vocab, "max_position_embeddings": s.max_positions,
              "num_hidden_layers": s.layers}
    share = params.get("w_gpu_percent")
    if share is None:
        share = next((g for g in range(100, -1, -1) if placement(config, g)[0] <= call.allowance_bytes), 0)
    return float(sum(placement(config, share)[1]))


def record_problems(params: Mapping[str, Any], record: Mapping[str, Any], ctx: RecordContext) -> list[str]:
    """What the auditor finds wrong with a finished flexgen episode's `offload.policy`: it must be a
    PolicyPlan's record (its sum and FlexGen's fixed settings, compression off, as `as_dict` writes
    them) at the protocol's allowance and batch, the condition's frozen `cache_gpu_percent`,
    `activations` and `w_gpu_percent` (chosen on the worker exactly where the condition omits it),
    and fit the allowance; for a synthetic shape, the whole plan is `choose_policy`'s at the
    recorded context and holdings (its weights, cache and working space, and a chosen share the
    largest that fits). An edited policy DISAGREEs."""
    plan, out = recorded_plan(record, "policy", PolicyPlan, "FlexGen's placement")
    if plan is None:
        return out
    policy = record["offload"]["policy"]
    given = params.get("w_gpu_percent")
    want = {"cache_gpu_percent": params.get("cache_gpu_percent", 100),
            "act_gpu_percent": 100 if params.get("activations", "gpu") == "gpu" else 0,
            "gpu_batch_size": ctx.batch, "allowance": ctx.allowance_bytes, "chosen": given is None,
            **({} if given is None else {"w_gpu_percent": given})}
    out += [f"offload.policy: {k} {policy[k]} is not the protocol's {v}" for k, v in want.items() if policy[k] != v]
    if not 0 <= plan.w_gpu_percent <= 100:
        out.append(f"offload.policy: w_gpu_percent {plan.w_gpu_percent} is not a percentage")
    if plan.needed > plan.allowance:
        out.append(f"offload.policy: needs {plan.needed} bytes, over the allowance of {plan.allowance}: the worker "
                   f"refuses such a placement")
    if ctx.config is not None and not out and check_shape(ctx.config) is None:
        try:
            chosen = choose_policy(ctx.config, params, allowance=ctx.allowance_bytes, context=plan.context,
                                   held=plan.held, batch=ctx.batch, prompt=ctx.capacity, gen=0, cuda=ctx.cuda)
        except PolicyRefused as e:
            return [f"offload.policy: recorded a placement where FlexGen's rule refuses: {e}"]
        wrong = differs(policy, chosen.as_dict())
        if wrong:
            out.append(f"offload.policy: {wrong} (FlexGen's placement of this model at its context)")
    return out


PERCENT = dict(minimum=0, maximum=100)
KIND = ConditionKind(
    name="flexgen",
    summary="FlexGen's OPT runtime: weights split GPU/CPU by its placement policy, streamed layer by layer",
    params={"w_gpu_percent": IntParam(**PERCENT, optional=True),
            "cache_gpu_percent": IntParam(**PERCENT, default=100),
            "activations": ChoiceParam(choices=("gpu", "cpu"), default="gpu"),
            "mode": MODE_PARAM},
    h2d_bytes=h2d_bytes,
    tier="approximate",
    # A new kind needs no new schema: every earlier reader refuses an unknown policy in one line, and
    # no body frozen before it changes. Its first schema is the newest when it was added.
    since=10,
    competitor=Competitor(library=lambda params: LIBRARY, fastest_mode=lambda params: "eager",
                          capture_refusal=lambda params: CAPTURE_REFUSAL, extra=EXTRA,
                          record_problems=record_problems, cpu_refusal=CPU_REFUSAL),
)
