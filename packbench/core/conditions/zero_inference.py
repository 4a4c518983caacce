"""`zero-inference`: DeepSpeed ZeRO-Inference, ZeRO stage 3 with every parameter offloaded to host
memory and gathered onto the device layer by layer with DeepSpeed's own prefetching (a competitor;
stock transformers' modules, so tier exact, judged for faithfulness); its runtime is
engine/conditions/zero_inference.py over engine/zero_inference.py."""

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from packbench.core.conditions.base import (MODE_PARAM, CallInputs, Competitor, ConditionKind, RecordContext, differs,
                                            int_fields)
from packbench.core.errors import PlacementDoesNotFit

LIBRARY = "deepspeed"
EXTRA = "offload"  # pyproject.toml's [offload] extra brings it
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SLACK = 64 * MIB  # the CUDA caching allocator's rounding and the collectives' buffers, beside the estimate


def activation_bytes(config: Mapping[str, Any], *, capacity: int, batch: int, element_bytes: int) -> int:
    """One call's activations, at most: a prefill of `capacity` tokens of each of `batch` sequences
    (hidden states, query/key/value and the FFN's hidden, eager attention's scores; logits of one
    position, float32). `config`: an OPT config.json's fields."""
    e, t = element_bytes, capacity * batch
    return (t * (6 * config["hidden_size"] + config["ffn_dim"]) * e
            + batch * config["num_attention_heads"] * capacity * capacity * e * 2 + batch * config["vocab_size"] * 4)


def model_terms(config: Mapping[str, Any], *, dtype: str, capacity: int, batch: int) -> dict[str, int]:
    """What an OPT `config` (config.json) costs DeepSpeed beside the gathered parameters, as ZeroBudget
    names it (the CUDA context, what the worker holds and the allocator's slack aside): the
    persistence threshold (`hidden`), the largest module in elements (the tied token embedding,
    vocab x hidden), the persistent vectors (DeepSpeed keeps every parameter of at most `hidden`
    elements on the device: per layer the four attention biases, fc2's bias and two LayerNorms,
    9 x hidden, and the final LayerNorm), the KV cache and one call's activations."""
    e = DTYPE_BYTES[dtype]
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    return {"threshold": h, "largest_module": config["vocab_size"] * h, "persistent": (9 * layers + 2) * h * e,
            "kv": 2 * layers * capacity * h * e * batch,
            "activations": activation_bytes(config, capacity=capacity, batch=batch, element_bytes=e)}


def minimum_allowance(config: Mapping[str, Any], *, dtype: str, capacity: int, batch: int) -> int:
    """The smallest allowance DeepSpeed's ZeRO-3 offload can run an OPT `config` (config.json) in,
    the CUDA context aside: the largest module's parameters gathered (the tied token embedding),
    the KV cache, one call's activations and the persistent vectors (`model_terms`; engine/zero_inference.py
    ZeroBudget, torch-free; the worker adds the measured context and refuses with the same words)."""
    t = model_terms(config, dtype=dtype, capacity=capacity, batch=batch)
    return t["largest_module"] * DTYPE_BYTES[dtype] + t["kv"] + t["activations"] + t["persistent"]


def allowance_refusal(config: Mapping[str, Any], *, dtype: str, capacity: int, batch: int,
                      allowance_bytes: int) -> str | None:
    """One line where the allowance is below `minimum_allowance`, naming the allowance it needs."""
    need = minimum_allowance(config, dtype=dtype, capacity=capacity, batch=batch)
    if allowance_bytes >= need:
        return None
    return (f"condition policy zero-inference needs an allowance of at least {-(-need // MIB)} MiB beside the CUDA "
            f"context (the token embedding's {config['vocab_size'] * config['hidden_size']} parameters gathered "
            f"beside the KV cache and activations), the protocol gives {allowance_bytes // MIB} MiB: raise "
            f"allowance_mib or drop the condition")


@dataclass(frozen=True)
class ZeroBudget:
    """What the allowance leaves DeepSpeed for gathered parameters, and the configuration derived
    from it (every number in bytes unless it says elements; written into every episode record).

    DeepSpeed fetches a module's own parameters whenever it runs, whatever `stage3_max_live_parameters`
    says; the limit only stops prefetching, and its prefetch loop (PartitionedParameterCoordinator
    .fetch_sub_module) adds parameters while the count is still under the limit, so the last one
    goes past it by up to one parameter. The gathered parameters of a call therefore stay within
    `max_live + 2 x largest module` elements (the module's own fetch, the prefetch's overshoot), and
    the live limit is the budget less twice the largest module (OPT's token embedding, gathered
    again by the tied `lm_head`), never below 0 (no prefetch). On the H200 the limit of the budget
    less one largest module went over it (OPT-2.7B, 4800 MiB: a decode call's prefetch asked for
    the embedding's 246 MiB with 3.78 GiB allocated; `python -m bench.zero_memory_probe`). The
    prefetch bucket may take all of it (DeepSpeed's own prefetching, as far ahead as the allowance lets it run).
    Reuse distance 0: a parameter is freed as soon as its module ran (DeepSpeed's default, 1e9
    elements, keeps the tied embedding gathered through the whole call of a model under 1e9)."""

    allowance: int
    context: int  # the CUDA context (measured by the worker); 0 on the CPU
    held: int  # what the worker holds on the device beside this model
    persistent: int  # parameters of at most `threshold` elements: DeepSpeed keeps them on the device
    kv: int  # the episode's KV cache at its batch
    activations: int  # one call's activations at its batch (estimate), plus SLACK on CUDA
    largest_module: int  # elements: the largest set of parameters one module fetches
    element_bytes: int
    threshold: int  # stage3_param_persistence_threshold, elements

    @property
    def gather_bytes(self) -> int:
        """What is left for gathered parameters at the peak of a call."""
        return self.allowance - self.context - self.held - self.persistent - self.kv - self.activations

    @property
    def needed(self) -> int:
        """The smallest allowance DeepSpeed can run in: the largest module gathered, nothing prefetched."""
        return self.allowance - self.gather_bytes + self.largest_module * self.element_bytes

    @property
    def fits(self) -> bool:
        """Whether the largest module can be gathered at all (the allowance is at least `needed`)."""
        return self.gather_bytes >= self.largest_module * self.element_bytes

    @property
    def max_live(self) -> int:
        return max(0, self.gather_bytes // self.element_bytes - 2 * self.largest_module)

    def as_dict(self) -> dict:
        return {**asdict(self), "gather_bytes": self.gather_bytes, "needed_bytes": self.needed,
                "max_live_parameters": self.max_live}


def replay_budget(recorded: Mapping[str, Any], *, context: int, held: int) -> ZeroBudget:
    """The archived budget `recorded` (an episode's `offload.budget`) to configure DeepSpeed with
    again as it is, on a worker that measured `context` and `held` (a re-execution: sizing again at
    another context would give another prefetch bucket and live-parameter limit). PlacementDoesNotFit
    (one line) where the allowance, less them, no longer leaves the archived live limit."""
    names = [f.name for f in fields(ZeroBudget)]
    base = int_fields(recorded, names)
    if base is None or base["element_bytes"] == 0:
        raise ValueError(f"the archived offload.budget is not DeepSpeed's budget (integers {', '.join(names)})")
    plan = ZeroBudget(**base)
    here = replace(plan, context=context, held=held)
    if not here.fits or here.max_live < plan.max_live:
        raise PlacementDoesNotFit(
            f"the archived zero-inference configuration (max live parameters {plan.max_live}) needs "
            f"{-(-(plan.gather_bytes - here.gather_bytes) // MIB)} MiB more than the allowance of "
            f"{plan.allowance // MIB} MiB leaves beside this worker's context {context // MIB} MiB and "
            f"{held // MIB} MiB held (the archive's {plan.context // MIB} and {plan.held // MIB})")
    return plan


def zero_config(*, hidden: int, dtype: str, pin_memory: bool, plan: ZeroBudget | None = None) -> dict:
    """DeepSpeed's ZeRO-Inference configuration, a plain dict, for a model of `hidden` in `dtype`
    (a DTYPE_BYTES name). With `plan`, prefetch bucket and live parameters from the allowance
    (ZeroBudget) and reuse distance 0; without, DeepSpeedExamples' latency settings (2 x hidden^2
    for both, reuse distance left at DeepSpeed's default)."""
    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": pin_memory},
        "stage3_prefetch_bucket_size": 2 * hidden * hidden,
        "stage3_param_persistence_threshold": hidden,
        "stage3_max_live_parameters": 2 * hidden * hidden,
        # On (DeepSpeed's default), zero.Init replaces torch.nn.functional.linear for the whole process
        # ("This will persist unless manually reset"): every condition after this one in the worker would
        # compute its Linear layers through DeepSpeed's autograd function. It saves memory in training only.
        "memory_efficient_linear": False,
    }
    if plan is not None:
        zero.update(stage3_prefetch_bucket_size=plan.max_live, stage3_max_live_parameters=plan.max_live,
                    stage3_max_reuse_distance=0, stage3_param_persistence_threshold=plan.threshold)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": dtype == "float16"},
        "bf16": {"enabled": dtype == "bfloat16"},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


CAPTURE_REFUSAL = "DeepSpeed's ZeRO-3 hooks gather and free each module's parameters in Python on every call"


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """Every parameter every call, OPT's tied embedding twice (the embedding, then `lm_head`): about,
    since the persistent vectors (<= hidden elements) stay on the device after the first calls, and
    an allowance with room to keep the embedding gathered through the call moves it once."""
    shape = call.shape
    return float((shape.param_count() + shape.vocab * shape.hidden) * (call.row_bytes // shape.hidden))


def record_problems(params: Mapping[str, Any], record: Mapping[str, Any], ctx: RecordContext) -> list[str]:
    """What the auditor finds wrong with a finished zero-inference episode's `offload`: its budget
    must be the arithmetic of its own inputs at the protocol's allowance and dtype, fit (the worker
    refuses one that does not), and, for a synthetic shape, hold that shape's persistent vectors, KV
    cache, activations and largest module; its `ds_config` must be the one that budget gives
    (`zero_config`, pinned on CUDA), so an edited configuration or budget DISAGREEs."""
    offload = record.get("offload")
    if not isinstance(offload, Mapping):
        return ["offload: no DeepSpeed configuration recorded (offload.ds_config, offload.budget)"]
    names = [f.name for f in fields(ZeroBudget)]
    base = int_fields(offload.get("budget"), names)
    if base is None or base["element_bytes"] == 0 or base["threshold"] == 0:
        return [f"offload.budget: not the allowance's arithmetic (integers {', '.join(names)})"]
    plan = ZeroBudget(**base)
    out = []
    wrong = differs(offload["budget"], plan.as_dict())
    if wrong:
        out.append(f"offload.budget: {wrong} (recomputed from its inputs)")
    if plan.allowance != ctx.allowance_bytes:
        out.append(f"offload.budget: allowance {plan.allowance} is not the protocol's {ctx.allowance_bytes}")
    if plan.element_bytes != DTYPE_BYTES[ctx.dtype]:
        out.append(f"offload.budget: element_bytes {plan.element_bytes} is not {ctx.dtype}'s {DTYPE_BYTES[ctx.dtype]}")
    if not plan.fits:
        out.append(f"offload.budget: needs {plan.needed} bytes, over the allowance of {plan.allowance}: the worker "
                   f"refuses such a budget")
    if ctx.config is not None:
        want = model_terms(ctx.config, dtype=ctx.dtype, capacity=ctx.capacity, batch=ctx.batch)
        want["activations"] += SLACK if ctx.cuda else 0
        out += [f"offload.budget: {k} {base[k]} is not the {v} of this model at the protocol's batch and capacity"
                for k, v in want.items() if base[k] != v]
    wrong = differs(offload.get("ds_config"), zero_config(hidden=plan.threshold, dtype=ctx.dtype, pin_memory=ctx.cuda,
                                                          plan=plan))
    if wrong:
        out.append(f"offload.ds_config: {wrong} (the configuration its budget gives)")
    return out


KIND = ConditionKind(
    name="zero-inference",
    summary="DeepSpeed ZeRO-Inference: ZeRO-3 parameters in host memory, gathered layer by layer with prefetch",
    params={"mode": MODE_PARAM},  # DeepSpeed's ZeRO-Inference settings: engine/zero_inference.py ds_config
    h2d_bytes=h2d_bytes,
    since=7,
    competitor=Competitor(library=lambda params: LIBRARY, fastest_mode=lambda params: "eager",
                          capture_refusal=lambda params: CAPTURE_REFUSAL, extra=EXTRA,
                          record_problems=record_problems),
)
