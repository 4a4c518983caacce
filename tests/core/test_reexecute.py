"""Re-execution audits' rules (core/reexecute.py): the seeded draw, the exact comparisons that
catch a forged ledger, and the stated tolerances on times and memory peaks."""

import copy

import numpy as np
import pytest

from bench.audit import synthetic_protocol
from packbench.core import reexecute as rx
from packbench.core.plan import plan
from packbench.core.protocol import expand, freeze


@pytest.fixture(scope="module")
def proto():
    return expand(freeze(synthetic_protocol(prompts_n=3, repetitions=2)).body)


@pytest.fixture(scope="module")
def entries(proto):
    return plan(proto)


def ok_statuses(entries):
    return {e["index"]: "ok" for e in entries}


def test_the_draw_is_seeded_and_covers_every_condition(proto, entries):
    statuses = ok_statuses(entries)
    a, b = rx.draw(proto, entries, statuses, 1, seed=7), rx.draw(proto, entries, statuses, 1, seed=7)
    assert a == b
    by = {e["index"]: e for e in entries}
    assert {by[i]["condition"] for i in a.episodes} == {"dense-stream", "packet"}  # K=1 still gives one each
    assert all(by[i]["role"] == "scored" for i in a.episodes)
    assert by[a.reference_twice]["condition"] == proto.reference
    assert [by[i]["role"] for i in a.warmups] == ["warmup", "warmup"]
    draws = {rx.draw(proto, entries, statuses, 3, seed=s).episodes for s in range(20)}
    assert len(draws) > 1 and all(len(d) == 3 for d in draws)
    every = rx.draw(proto, entries, statuses, 100, seed=0).episodes
    assert set(every) == {e["index"] for e in entries if e["role"] == "scored"}


def test_a_condition_without_finished_scored_episodes_offers_warmups_then_failures(proto, entries):
    statuses = ok_statuses(entries)
    for e in entries:
        if e["condition"] == "packet" and e["role"] == "scored":
            statuses[e["index"]] = "failed"
    by = {e["index"]: e for e in entries}
    d = rx.draw(proto, entries, statuses, 1, seed=0)
    packet = [i for i in d.episodes if by[i]["condition"] == "packet"]
    assert [by[i]["role"] for i in packet] == ["warmup"]
    for e in entries:
        if e["condition"] == "packet":
            statuses[e["index"]] = "failed"
    d = rx.draw(proto, entries, statuses, 1, seed=0)
    assert [statuses[i] for i in d.episodes if by[i]["condition"] == "packet"] == ["failed"]
    with pytest.raises(ValueError):
        rx.draw(proto, entries, statuses, 0, seed=0)


def record(**over):
    call = {"index": 1, "phase": "decode", "tokens": 1, "layers": 2, "active_rows": [3, 2], "rows_copied": [3, 2],
            "h2d_weight_bytes": [48, 32], "h2d_index_bytes": [24, 16], "d2h_bytes": [8, 8], "logits_d2h_bytes": 40,
            "wall_s": 0.01, "copy_wait_s": [0.0, 0.0]}
    rec = {"condition": "packet", "status": "ok", "tokens": [5, 6], "calls": [call], "h2d_weight_bytes": 80,
           "h2d_index_bytes": 40, "d2h_bytes": 16, "logits_d2h_bytes": 40, "rows_copied": 5, "wall_s": 0.02,
           "phases": {"decode": {"h2d_bytes": 120, "call_s": 0.01, "calls": 1}},
           "memory": {"kv_bytes": 64, "policy_device_bytes": 0, "host_outgoing_bytes": 100, "pinned_bytes": 0,
                      "device_param_bytes": 10, "peak_allocated_bytes": 1 << 30, "peak_sampled_bytes": 2 << 30},
           "logits": np.arange(10, dtype=np.float32).reshape(2, 5)}
    rec.update(over)
    return rec


def test_an_identical_rerun_has_no_problems_and_times_are_not_compared_exactly():
    archived = record()
    rerun = copy.deepcopy(archived)
    rerun["calls"][0]["wall_s"] = 0.5
    rerun["wall_s"] = 3.0
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == []


def test_policy_buffer_bytes_are_compared_within_one_engine_buffer_layout_only():
    archived = record()  # made before the layout was recorded: layout 1
    rerun = copy.deepcopy(archived)
    rerun["logits"] = archived["logits"].copy()
    rerun["memory"]["policy_device_bytes"] = 4096  # a newer engine holds another buffer
    rerun["engine"] = {"mode": "eager", "buffers": 2}
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == []
    archived["engine"] = {"mode": "eager", "buffers": 2}  # the same layout: compared exactly
    assert any("policy_device_bytes" in p for p in rx.compare_episode(4, archived, archived["logits"], rerun))
    rerun["memory"]["policy_device_bytes"] = 0
    rerun["memory"]["kv_bytes"] = 65  # every other memory count stays exact across layouts
    rerun["engine"]["buffers"] = 3
    assert [p for p in rx.compare_episode(4, archived, archived["logits"], rerun) if "memory" in p] == \
        ["episode 4 (packet): memory kv_bytes archived 64, re-executed 65"]


@pytest.mark.parametrize("edit, expected", [
    (lambda r: r["calls"][0]["h2d_weight_bytes"].__setitem__(0, 64), "call 1 (decode) h2d_weight_bytes"),
    (lambda r: r["calls"][0]["rows_copied"].__setitem__(1, 1), "call 1 (decode) rows_copied"),
    (lambda r: r.update(tokens=[5, 7]), "tokens differ"),
    (lambda r: r["logits"].__setitem__((1, 4), np.nextafter(np.float32(9), np.float32(10))), "not bit-identical"),
    (lambda r: r["phases"]["decode"].update(h2d_bytes=119), "decode h2d_bytes"),
    (lambda r: r["memory"].update(kv_bytes=65), "memory kv_bytes"),
    (lambda r: r["memory"].update(peak_allocated_bytes=(1 << 30) + (200 << 20)), "peak_allocated_bytes"),
    (lambda r: r["memory"].update(peak_sampled_bytes=None), "peak_sampled_bytes"),
    (lambda r: r.update(calls=[]), "the re-run made 0"),
    (lambda r: r.update(status="failed", error="OutOfMemoryError: x"), "re-executed 'failed'"),
])
def test_every_exact_field_is_compared(edit, expected):
    archived = record()
    rerun = copy.deepcopy(archived)
    rerun["logits"] = archived["logits"].copy()
    edit(rerun)
    problems = rx.compare_episode(4, archived, archived["logits"], rerun)
    assert problems and all(p.startswith("episode 4 (packet): ") for p in problems), problems
    assert any(expected in p for p in problems), problems


def test_a_difference_past_the_sixth_value_is_named_where_it_is():
    """Bug caught: a re-executed token or per-layer count that differed past the sixth value read
    `tokens differ (archived [462, 240, 295, 356, 111, 2, ... (8 values)], re-executed [462, 240,
    295, 356, 111, 2, ... (8 values)])`: both lists shortened alike, the difference not shown."""
    archived = record(tokens=[1, 2, 3, 4, 5, 6, 7, 8])
    rerun = copy.deepcopy(archived)
    rerun["logits"] = archived["logits"].copy()
    rerun["tokens"][7] = 9
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == [
        "episode 4 (packet): tokens differ (archived 8, re-executed 9 at [7], the first difference)"]
    rerun["tokens"] = [[1] * 8, [2] * 7 + [3]]  # a batch's token lists
    archived["tokens"] = [[1] * 8, [2] * 8]
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == [
        "episode 4 (packet): tokens differ (archived 2, re-executed 3 at [1][7], the first difference)"]
    archived, rerun = record(), record()
    for r in (archived, rerun):
        r["calls"][0].update(layers=40, h2d_weight_bytes=[16] * 40)
    rerun["calls"][0]["h2d_weight_bytes"][20] = 32
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == [
        "episode 4 (packet): call 1 (decode) h2d_weight_bytes: archived 16, re-executed 32 at [20], the first difference"]


def test_an_expert_caches_routing_and_figures_are_compared():
    """Bug caught: re-execution never compared an expert cache's `experts` section: a routing
    edited in the record and its trace alike (so the static replay agrees) with the per-call
    counts kept, and its hit rate and Belady figures recomputed, re-executed AGREE though the
    re-run routed otherwise."""
    experts = {"capacity": 2, "rule": "lru", "routes": [[[0, 1]], [[1, 2]]], "hits": 1, "belady_hits": 1,
               "hit_rate": 0.25}
    archived = record(experts=experts)
    rerun = copy.deepcopy(archived)
    rerun["logits"] = archived["logits"].copy()
    rerun["experts"]["routes"] = (((0, 1),), ((1, 2),))  # a live record's tuples read as the archive's lists
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == []
    rerun["experts"].update(routes=[[[0, 1]], [[1, 3]]], belady_hits=0)
    rerun["experts"]["ready_rate"] = 0.25  # a figure the archived section lacks (an older engine): not compared
    assert rx.compare_episode(4, archived, archived["logits"], rerun) == [
        "episode 4 (packet): experts belady_hits archived 1, re-executed 0",
        "episode 4 (packet): experts routes archived [1, 2], re-executed [1, 3] at [1][0], the first difference"]


def test_peaks_within_the_stated_tolerance_agree():
    archived = record()
    rerun = copy.deepcopy(archived)
    rerun["memory"]["peak_allocated_bytes"] += 8 << 20
    rerun["memory"]["peak_sampled_bytes"] -= 100 << 20
    assert rx.compare_episode(0, archived, archived["logits"], rerun) == []


def test_failed_episodes_must_fail_the_same_way():
    archived = record(status="failed", error="OutOfMemoryError: CUDA out of memory", logits=None)
    same = record(status="failed", error="OutOfMemoryError: other text", logits=None)
    other = record(status="failed", error="RuntimeError: boom", logits=None)
    assert rx.compare_episode(2, archived, None, same) == []
    assert "RuntimeError" in rx.compare_episode(2, archived, None, other)[0]


def test_a_reference_with_no_finished_episode_is_not_run_twice(proto, entries):
    """The reference runs twice only from an ok episode (Draw: "None: no ok reference drawn"):
    a failed one reproduces no logits to compare, and its failure is judged as any other drawn
    failure. Catches the planted bug "reexecute: a failed reference episode run twice"."""
    statuses = {e["index"]: "failed" if e["condition"] == proto.reference else "ok" for e in entries}
    d = rx.draw(proto, entries, statuses, 2, seed=0)
    by = {e["index"]: e for e in entries}
    assert proto.reference in {by[i]["condition"] for i in d.episodes}  # its failure is drawn, to fail again
    assert d.reference_twice is None


def test_forged_times_are_caught_within_the_stated_tolerance():
    problems, medians = rx.compare_times({"packet": ([0.50, 0.52, 0.49], [1.2, 1.1]),
                                          "dense-stream": ([1.0, 1.1], [1.6, 1.5]),
                                          "tiny": ([0.001], [0.009])})
    assert [p.split(":")[0] for p in problems] == ["condition packet"]
    assert medians["packet"] == {"archived_s": 0.5, "reexecuted_s": pytest.approx(1.15)}
    assert rx.compare_times({"packet": ([0.50], [1.2])}, factor=3)[0] == []


def test_a_re_run_faster_than_the_factor_is_out_of_tolerance_too():
    """The medians must agree within the factor *either way* (module docstring): a re-run 4x
    faster than the archive says is as suspect as one 4x slower (an archive whose times were
    inflated). Catches the planted bug "reexecute: only a slower re-run is out of tolerance"."""
    problems, _ = rx.compare_times({"packet": ([1.0, 1.2], [0.25, 0.3]), "dense-stream": ([1.0], [0.5])})
    assert problems == ["condition packet: median episode wall 0.2750 s re-executed against 1.1000 s archived "
                        "(tolerance 2x or 10 ms)"]


def test_a_different_checkpoint_or_parameter_bytes_are_named():
    archived = {"model_sha256": "a" * 64, "param_bytes": 10, "device_param_bytes": 4, "host_outgoing_bytes": 6}
    assert rx.compare_start(archived, dict(archived)) == []
    problems = rx.compare_start(archived, {**archived, "model_sha256": "b" * 64, "param_bytes": 11})
    assert len(problems) == 2 and "digest" in problems[0] and "param_bytes" in problems[1]


def test_the_record_digest_covers_the_draw_and_the_tolerance(proto, entries):
    d = rx.draw(proto, entries, ok_statuses(entries), 2, seed=0)
    base = dict(archive_sha256="x", protocol_sha256="y", seed=0, k=2, drawn=d, problems=[], accelerator="")
    one = rx.reexecution_record(**base)
    assert one["result"] == "agree" and rx.record_digest(one) == rx.record_digest(rx.reexecution_record(**base))
    assert rx.record_digest(rx.reexecution_record(**{**base, "time_factor": 3.0})) != rx.record_digest(one)
    assert rx.reexecution_record(**{**base, "problems": ["p"]})["result"] == "disagree"


# Competitors that choose their placement from the device memory their worker measured (the CUDA
# context, what is allocated already): a re-execution hands each episode its archived `offload`
# section. CPU twins of what tests/engine/test_flexgen_cpu.py and test_zero_inference.py run through
# a worker (their `flexgen` / `deepspeed` markers): the pure rules behind it.
TINY_OPT = {"hidden_size": 64, "ffn_dim": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512,
            "max_position_embeddings": 64}


def test_each_competitors_archived_placement_is_replayed_as_recorded_or_refused_where_it_no_longer_fits():
    """The bug it catches: a fresh worker measured another context and chose another placement
    (FlexGen's share, DeepSpeed's live limit, accelerate's device budget). Replayed, the placement
    is the archive's whatever this worker measured, as long as the allowance still holds it beside
    this worker's context; one byte short is PlacementDoesNotFit, not another placement."""
    from packbench.core.conditions.accelerate import replay_max_memory
    from packbench.core.conditions.flexgen import choose_policy, replay_policy
    from packbench.core.conditions.zero_inference import ZeroBudget, model_terms, replay_budget
    from packbench.core.errors import PlacementDoesNotFit

    mib = 1 << 20
    def policy(context, **share):
        return choose_policy(TINY_OPT, share, allowance=256 * mib if not share else 1 << 40, context=context, held=0,
                             batch=1, prompt=16, gen=0, cuda=True)

    archived = policy(256 * mib - (policy(0, w_gpu_percent=0).needed + policy(0, w_gpu_percent=100).needed) // 2)
    again = policy(0)
    assert archived.w_gpu_percent < again.w_gpu_percent == 100  # what choosing again did
    assert replay_policy(archived.as_dict(), context=0, held=0) == archived
    room = archived.allowance - archived.needed + archived.context
    with pytest.raises(PlacementDoesNotFit, match=r"w_gpu_percent \d+\) needs .* over the allowance of 256 MiB"):
        replay_policy(archived.as_dict(), context=room + 1, held=0)
    assert replay_policy(archived.as_dict(), context=room, held=0) == archived

    t = model_terms(TINY_OPT, dtype="float16", capacity=16, batch=1)
    budget = ZeroBudget(allowance=64 * mib, context=40 * mib, held=0, persistent=t["persistent"], kv=t["kv"],
                        activations=t["activations"], largest_module=t["largest_module"], element_bytes=2,
                        threshold=t["threshold"])
    assert replay_budget(budget.as_dict(), context=0, held=mib) == budget
    with pytest.raises(PlacementDoesNotFit, match="max live parameters"):
        replay_budget(budget.as_dict(), context=40 * mib, held=1)

    assert replay_max_memory({"max_memory_bytes": 30 * mib, "held_bytes": 0}, allowance=64 * mib, reserve=34 * mib) \
        == 30 * mib
    with pytest.raises(PlacementDoesNotFit, match="accelerate placement gave the device 30 MiB"):
        replay_max_memory({"max_memory_bytes": 30 * mib}, allowance=64 * mib, reserve=34 * mib + 1)


def test_the_offload_section_is_compared_and_an_unfit_placement_is_not_judged():
    """A re-run that placed the competitor otherwise (its worker ignored the handed placement) is
    named; its times, build state, held bytes and measured device bytes are not placement. An episode whose archived
    placement does not fit the re-executing device is one line and a partial result, not DISAGREE."""
    offload = {"policy": {"w_gpu_percent": 40}, "device_bytes": 100, "held_bytes": 0, "load_s": 1.0,
               "state": "cold"}
    archived = record(condition="flexgen", offload=offload)
    same = record(condition="flexgen", offload=dict(offload, held_bytes=5, load_s=2.0, state="warm", device_bytes=101))
    assert rx.compare_episode(3, archived, archived["logits"], same) == []
    other = record(condition="flexgen", offload=dict(offload, policy={"w_gpu_percent": 100}))
    assert rx.compare_episode(3, archived, archived["logits"], other) == [
        "episode 3 (flexgen): offload policy archived {'w_gpu_percent': 40}, re-executed {'w_gpu_percent': 100}"]
    assert rx.archived_placements({3: archived, 4: record()}, [3, 4]) == {3: offload}

    unfit = {"condition": "flexgen", "status": "failed", "error": "PlacementDoesNotFit: it needs 70 MiB"}
    assert rx.unjudged(3, archived, unfit) == "episode 3 (flexgen): not judged: it needs 70 MiB"
    assert rx.unjudged(3, archived, {**unfit, "error": "OutOfMemoryError: CUDA"}) is None
    drawn = rx.Draw((3,), None, ())
    rec = rx.reexecution_record(archive_sha256="a", protocol_sha256="p", seed=0, k=1, drawn=drawn, problems=[],
                                accelerator="", placements=1, not_judged=["episode 3 (flexgen): not judged: x"])
    assert rec["result"] == "partial" and rec["placements"] == "archived"
    assert rx.reexecution_record(archive_sha256="a", protocol_sha256="p", seed=0, k=1, drawn=drawn, problems=["p"],
                                 accelerator="", not_judged=["x"])["result"] == "disagree"


def test_an_unfit_error_without_its_reason_is_still_one_unjudged_line():
    """Bug caught: `unjudged` split the re-run's error on its first colon and took the second
    part, so an error reading just "PlacementDoesNotFit" (a record edited, or written by another
    worker) raised IndexError out of the audit instead of giving its one line."""
    archived = record(condition="flexgen", offload={"policy": {"w_gpu_percent": 40}})
    bare = {"condition": "flexgen", "status": "failed", "error": "PlacementDoesNotFit"}
    assert rx.unjudged(3, archived, bare) == \
        "episode 3 (flexgen): not judged: its archived placement does not fit this device"
