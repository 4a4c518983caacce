"""The auditor's check of the offloading peers' recorded configuration (core/conditions/zero_inference.py
and flexgen.py `record_problems`), torch-free, on records built by the same arithmetic the worker runs.

The bug they catch: an archive whose zero-inference episode said ZeRO stage 2, no offload, another
allowance or a budget whose sums did not add up, or whose flexgen episode said another placement,
a chosen share where the condition froze one, or compression on, audited AGREE: nothing read
`offload` (nor the record's `policy` and `params`: tests/engine/test_zero_inference.py forges a real archive)."""

import copy

import pytest

from packbench.core.conditions.base import RecordContext, differs
from packbench.core.conditions.flexgen import choose_policy
from packbench.core.conditions.flexgen import record_problems as flexgen_problems
from packbench.core.conditions.zero_inference import SLACK, ZeroBudget, model_terms, zero_config
from packbench.core.conditions.zero_inference import record_problems as zero_problems
from packbench.core.registry import shape_config
from packbench.core.text import one_line

MIB = 1 << 20
TINY = shape_config("tiny")


def zero_record(*, cuda: bool = False, allowance: int = 64 * MIB, dtype: str = "float32") -> dict:
    """A zero-inference record's `offload` as the worker writes it for the tiny shape (capacity 22, batch 1)."""
    terms = model_terms(TINY, dtype=dtype, capacity=22, batch=1)
    terms["activations"] += SLACK if cuda else 0
    plan = ZeroBudget(allowance=allowance, context=100 * MIB if cuda else 0, held=0,
                      element_bytes={"float32": 4, "float16": 2}[dtype], **terms)
    return {"offload": {"budget": plan.as_dict(), "library_version": "0.19.8", "state": "cold",
                        "ds_config": zero_config(hidden=64, dtype=dtype, pin_memory=cuda, plan=plan)}}


def ctx(*, cuda: bool = False, allowance: int = 64 * MIB, dtype: str = "float32", config=TINY, batch: int = 1,
        capacity: int = 22) -> RecordContext:
    return RecordContext(allowance_bytes=allowance, dtype=dtype, batch=batch, capacity=capacity, cuda=cuda,
                         config=config)


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("config", [TINY, None])
def test_a_zero_inference_record_as_the_worker_writes_it_has_no_problem(cuda, config):
    allowance = (256 if cuda else 64) * MIB  # the CUDA context and the allocator's slack beside the model
    assert zero_problems({"mode": "eager"}, zero_record(cuda=cuda, allowance=allowance),
                         ctx(cuda=cuda, allowance=allowance, config=config)) == []


def edited(record: dict, path: str, value) -> dict:
    out = copy.deepcopy(record)
    *keys, last = path.split(".")
    node = out
    for k in keys:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return out


@pytest.mark.parametrize("path, value, line", [
    ("offload.ds_config.zero_optimization.stage", 2,
     "offload.ds_config: zero_optimization.stage recorded 2, expected 3 (the configuration its budget gives)"),
    ("offload.ds_config.zero_optimization.offload_param.device", "none",
     "offload.ds_config: zero_optimization.offload_param.device recorded none, expected cpu"),
    ("offload.ds_config.zero_optimization.offload_param.pin_memory", True,
     "offload.ds_config: zero_optimization.offload_param.pin_memory recorded True, expected False"),
    ("offload.ds_config.zero_optimization.stage3_max_reuse_distance", KeyError,
     "offload.ds_config: zero_optimization.stage3_max_reuse_distance missing, expected 0"),
    ("offload.ds_config.zero_optimization.stage3_max_live_parameters", 16686305,
     "offload.ds_config: zero_optimization.stage3_max_live_parameters recorded 16686305, expected 16686304"),
    ("offload.ds_config.fp16.enabled", 0, "offload.ds_config: fp16.enabled recorded 0, expected False"),
    ("offload.ds_config.zero_optimization.compress", True,
     "offload.ds_config: zero_optimization.compress recorded but never written"),
    ("offload.budget.max_live_parameters", 5,
     "offload.budget: max_live_parameters recorded 5, expected 16686304 (recomputed from its inputs)"),
    ("offload.budget.gather_bytes", 67007360.0,
     "offload.budget: gather_bytes recorded 67007360.0, expected 67007360"),
    ("offload.budget.allowance", 32 * MIB, "offload.budget: allowance 33554432 is not the protocol's 67108864"),
    ("offload.budget.element_bytes", 2, "offload.budget: element_bytes 2 is not float32's 4"),
    ("offload.budget.kv", -1, "offload.budget: not the allowance's arithmetic (integers allowance, context, held, "
                              "persistent, kv, activations, largest_module, element_bytes, threshold)"),
    ("offload.budget.threshold", True, "offload.budget: not the allowance's arithmetic"),
    ("offload.budget", None, "offload.budget: not the allowance's arithmetic"),
    ("offload", KeyError, "offload: no DeepSpeed configuration recorded (offload.ds_config, offload.budget)"),
])
def test_an_edited_zero_inference_configuration_is_named(path, value, line):
    problems = zero_problems({"mode": "eager"}, edited(zero_record(), path, value), ctx())
    assert any(p.startswith(line) for p in problems), problems


def test_a_consistent_budget_of_another_model_or_allowance_is_named():
    """Every sum redone after the edit: only the shape (for a synthetic model) and the protocol tell."""
    import dataclasses

    real = zero_record()["offload"]["budget"]
    base = {f.name: real[f.name] for f in dataclasses.fields(ZeroBudget)}
    plan = ZeroBudget(**{**base, "persistent": 0})
    forged = {"offload": {**zero_record()["offload"], "budget": plan.as_dict(),
                          "ds_config": zero_config(hidden=64, dtype="float32", pin_memory=False, plan=plan)}}
    assert zero_problems({}, forged, ctx()) == [
        "offload.budget: persistent 0 is not the 5120 of this model at the protocol's batch and capacity"]
    assert zero_problems({}, forged, ctx(config=None)) == []  # a checkpoint's shape is not in the archive
    # a budget that could not hold the embedding: the worker refuses it, so no episode can say it
    small = ZeroBudget(**{**base, "allowance": 1000})
    record = {"offload": {"budget": small.as_dict(),
                          "ds_config": zero_config(hidden=64, dtype="float32", pin_memory=False, plan=small)}}
    assert zero_problems({}, record, ctx(allowance=1000, config=None)) == [
        "offload.budget: needs 232576 bytes, over the allowance of 1000: the worker refuses such a budget"]
    # the CUDA worker's budget pins its host memory and counts the allocator's slack
    assert zero_problems({}, zero_record(cuda=True, allowance=256 * MIB), ctx(allowance=256 * MIB))[0].startswith(
        "offload.budget: activations 67182720 is not the 73856 of this model")
    assert zero_problems({}, zero_record(), ctx(cuda=True, config=None)) == [
        "offload.ds_config: zero_optimization.offload_param.pin_memory recorded False, expected True "
        "(the configuration its budget gives)"]
    assert zero_problems({}, zero_record(dtype="float16"), ctx(dtype="float16")) == []
    assert zero_problems({}, zero_record(), ctx(capacity=23))[0].startswith("offload.budget: kv 22528 is not the 23552")


def flexgen_record(params: dict, *, allowance: int = 256 * MIB, context: int = 0, held: int = 0,
                   cuda: bool = True) -> dict:
    plan = choose_policy(TINY, params, allowance=allowance, context=context, held=held, batch=1, prompt=22, gen=0,
                         cuda=cuda)
    return {"offload": {"policy": plan.as_dict(), "library_version": "0.1.8", "state": "cold"}}


@pytest.mark.parametrize("params", [{}, {"w_gpu_percent": 50}, {"w_gpu_percent": 0, "cache_gpu_percent": 0,
                                                                "activations": "cpu"}])
@pytest.mark.parametrize("config", [TINY, None])
def test_a_flexgen_record_as_the_worker_writes_it_has_no_problem(params, config):
    assert flexgen_problems(params, flexgen_record(params), ctx(cuda=True, allowance=256 * MIB, config=config)) == []


@pytest.mark.parametrize("params, path, value, line", [
    ({"w_gpu_percent": 50}, "offload.policy.w_gpu_percent", 60,
     "offload.policy: w_gpu_percent 60 is not the protocol's 50"),
    ({"w_gpu_percent": 50}, "offload.policy.chosen", True, "offload.policy: chosen True is not the protocol's False"),
    ({}, "offload.policy.compress_weight", True,
     "offload.policy: compress_weight recorded True, expected False (recomputed from its own figures)"),
    ({}, "offload.policy.compress_cache", 0, "offload.policy: compress_cache recorded 0, expected False"),
    ({}, "offload.policy.num_gpu_batches", 2, "offload.policy: num_gpu_batches recorded 2, expected 1"),
    ({}, "offload.policy.w_disk_percent", 10, "offload.policy: w_disk_percent recorded but never written"),
    ({}, "offload.policy.cache_gpu_percent", 50, "offload.policy: cache_gpu_percent 50 is not the protocol's 100"),
    ({"activations": "cpu"}, "offload.policy.act_gpu_percent", 100,
     "offload.policy: act_gpu_percent 100 is not the protocol's 0"),
    ({}, "offload.policy.gpu_batch_size", 2, "offload.policy: gpu_batch_size 2 is not the protocol's 1"),
    ({}, "offload.policy.allowance", 128 * MIB, "offload.policy: allowance 134217728 is not the protocol's 268435456"),
    ({}, "offload.policy.needed_bytes", 1, "offload.policy: needed_bytes recorded 1, expected"),
    ({}, "offload.policy.w_gpu_percent", 101, "offload.policy: w_gpu_percent 101 is not a percentage"),
    ({}, "offload.policy.weights_gpu", -5, "offload.policy: not FlexGen's placement"),
    ({}, "offload.policy.chosen", 1, "offload.policy: not FlexGen's placement"),
    ({}, "offload", KeyError, "offload.policy: not FlexGen's placement"),
])
def test_an_edited_flexgen_policy_is_named(params, path, value, line):
    problems = flexgen_problems(params, edited(flexgen_record(params), path, value), ctx(cuda=True, allowance=256 * MIB))
    assert any(p.startswith(line) for p in problems), problems


def test_a_consistent_flexgen_policy_that_is_not_flexgens_placement_is_named():
    """Sums redone: a lower share than the largest that fits where the worker chose it, or weights
    that are not FlexGen's rule at the share, are caught against a synthetic shape's placement;
    a placement over the allowance whatever the shape."""
    import dataclasses

    from packbench.core.conditions.flexgen import PolicyPlan

    real = flexgen_record({})["offload"]["policy"]
    base = {f.name: real[f.name] for f in dataclasses.fields(PolicyPlan)}
    assert base["w_gpu_percent"] == 100 and base["chosen"]
    lower = choose_policy(TINY, {"w_gpu_percent": 40}, allowance=256 * MIB, context=0, held=0, batch=1, prompt=22,
                          gen=0, cuda=True)
    forged = {"offload": {"policy": {**dataclasses.replace(lower, chosen=True).as_dict()}}}
    assert flexgen_problems({}, forged, ctx(cuda=True, allowance=256 * MIB, config=None)) == []
    assert flexgen_problems({}, forged, ctx(cuda=True, allowance=256 * MIB)) == [
        "offload.policy: w_gpu_percent recorded 40, expected 100 (FlexGen's placement of this model at its context)"]
    light = PolicyPlan(**{**base, "weights_gpu": base["weights_gpu"] - 2})
    assert flexgen_problems({}, {"offload": {"policy": light.as_dict()}}, ctx(cuda=True, allowance=256 * MIB)) == [
        f"offload.policy: weights_gpu recorded {base['weights_gpu'] - 2}, expected {base['weights_gpu']} "
        f"(FlexGen's placement of this model at its context)"]
    over = PolicyPlan(**{**base, "context": 256 * MIB})
    assert flexgen_problems({}, {"offload": {"policy": over.as_dict()}}, ctx(cuda=True, allowance=256 * MIB)) == [
        f"offload.policy: needs {over.needed} bytes, over the allowance of {256 * MIB}: the worker refuses such a "
        f"placement"]


def test_differs_names_the_first_differing_key_and_counts_the_json_type():
    assert differs({"a": 1, "b": {"c": False}}, {"a": 1, "b": {"c": False}}) is None
    assert differs({"a": 1, "b": {"c": 0}}, {"a": 1, "b": {"c": False}}) == "b.c recorded 0, expected False"
    assert differs({"a": 1.0}, {"a": 1}) == "a recorded 1.0, expected 1"
    assert differs({"a": 1, "z": 2}, {"a": 1}) == "z recorded but never written"
    assert differs({}, {"a": 1}) == "a missing, expected 1"
    assert differs([1], {"a": 1}) == "value recorded [1], expected a mapping"
    assert differs({"b": 3}, {"b": {"c": 1}}) == "b recorded 3, expected a mapping"
    # a hostile record's keys and values: one line, at most 80 characters of each
    assert differs({"a": 1, "x\ny" * 100: 1}, {"a": 1}) == one_line("x\ny" * 100)[:80] + " recorded but never written"
    assert len(differs({"a": "z" * 10_000}, {"a": 1})) < 120
