"""Plan order properties: roles, baseline-first, balance across positions, repetitions, purity."""

import copy
import itertools
from collections import Counter
from pathlib import Path

import pytest
import yaml

from packbench.core.plan import arrange, plan, williams
from packbench.core.protocol import freeze

QUICKSTART = Path(__file__).resolve().parents[2] / "protocols" / "quickstart.yaml"


def body(*, candidates=2, prompts=3, repetitions=1, order="alternating", baseline_first=True, warmups=1) -> dict:
    """A frozen protocol with dense-stream as reference and `candidates` other conditions."""
    policies = ["packet", "resident", "phase-switched", "early-forecast", "sparse-extents"]
    conditions = [{"name": "dense-stream", "policy": "dense-stream"}]
    conditions += [{"name": f"c{i}", "policy": policies[i]} for i in range(candidates)]
    return freeze({
        "name": "t", "model": {"path": "m"}, "dtype": "float32",
        "prompts": {"generator": {"seed": 0, "count": prompts}}, "prefix_tokens": 4, "continuation_tokens": 2,
        "conditions": conditions, "reference": "dense-stream", "warmups": warmups, "repetitions": repetitions,
        "order": order, "baseline_first": baseline_first, "allowance_mib": 100,
        "gates": {"faithfulness": {}},
    }).body


def blocks(entries: list[dict], size: int) -> list[list[str]]:
    scored = [e for e in entries if e["role"] == "scored"]
    assert len(scored) % size == 0
    out = [scored[i:i + size] for i in range(0, len(scored), size)]
    for b in out:  # a block runs every condition once on one prompt of one repetition
        assert len({(e["prompt"], e["repetition"]) for e in b}) == 1
        assert len({e["condition"] for e in b}) == size
    return [[e["condition"] for e in b] for b in out]


def position_counts(orders: list[list[str]], names: list[str]) -> dict[str, Counter]:
    return {n: Counter(o.index(n) for o in orders) for n in names}


def test_schema1_plan_is_the_packbench_01_plan():
    """Recorded from packbench 0.1 for protocols/quickstart.yaml: historical archives hold it."""
    entries = plan(freeze(yaml.safe_load(QUICKSTART.read_text())).body)
    assert [(e["index"], e["condition"], e["role"], e["prompt"]) for e in entries] == [
        (0, "dense-stream", "warmup", 0), (1, "packet", "warmup", 0),
        (2, "dense-stream", "scored", 0), (3, "packet", "scored", 0),
        (4, "dense-stream", "scored", 1), (5, "packet", "scored", 1),
        (6, "dense-stream", "scored", 2), (7, "packet", "scored", 2)]
    assert [e["repetition"] for e in entries] == [None, None, 0, 0, 0, 0, 0, 0]


def test_plan_is_pure_and_deterministic():
    b = body(candidates=3, repetitions=2, order="latin-square")
    before = copy.deepcopy(b)
    assert plan(b) == plan(b) and b == before
    assert [e["index"] for e in plan(b)] == list(range(len(plan(b))))


def test_warmups_come_first_per_condition_reference_first():
    b = body(candidates=2, prompts=2, warmups=1)
    b.update(schema=2, warmups={"dense-stream": 3, "c0": 0, "c1": 2})
    b = freeze(b).body
    warm = [(e["condition"], e["prompt"], e["repetition"]) for e in plan(b) if e["role"] == "warmup"]
    assert warm == [("dense-stream", 0, None), ("dense-stream", 1, None), ("dense-stream", 0, None),
                    ("c1", 0, None), ("c1", 1, None)]
    roles = [e["role"] for e in plan(b)]
    assert roles == sorted(roles, key=lambda r: r != "warmup")  # no warmup after a scored episode


@pytest.mark.parametrize("order", ["alternating", "abba", "latin-square"])
@pytest.mark.parametrize("reps", [1, 3])
def test_repetitions_multiply_scored_episodes(order, reps):
    b = body(candidates=2, prompts=3, repetitions=reps, order=order)
    scored = [e for e in plan(b) if e["role"] == "scored"]
    assert len(scored) == reps * 3 * 3
    assert Counter((e["condition"], e["prompt"]) for e in scored) == {
        (c, p): reps for c in ("dense-stream", "c0", "c1") for p in range(3)}
    assert [e["repetition"] for e in scored] == [r for r in range(reps) for _ in range(9)]


@pytest.mark.parametrize("order", ["alternating", "abba", "latin-square"])
def test_baseline_first_puts_the_reference_first_in_every_block(order):
    orders = blocks(plan(body(candidates=3, prompts=4, repetitions=2, order=order)), 4)
    assert all(o[0] == "dense-stream" for o in orders)


@pytest.mark.parametrize("order", ["alternating", "latin-square"])
@pytest.mark.parametrize("candidates", [1, 2, 3, 4])
def test_every_candidate_takes_every_position_equally_often(order, candidates):
    names = [f"c{i}" for i in range(candidates)]
    for n_blocks in (candidates, 2 * candidates):  # blocks = prompts x repetitions, a multiple of m
        orders = blocks(plan(body(candidates=candidates, prompts=n_blocks, order=order)), candidates + 1)
        counts = position_counts([o[1:] for o in orders], names)
        assert all(c == Counter({p: n_blocks // candidates for p in range(candidates)}) for c in counts.values())


@pytest.mark.parametrize("candidates", [2, 3, 4])
def test_abba_gives_every_candidate_the_same_mean_position(candidates):
    orders = blocks(plan(body(candidates=candidates, prompts=2, repetitions=2, order="abba")), candidates + 1)
    names = [f"c{i}" for i in range(candidates)]
    assert orders[0][1:] == names and orders[1][1:] == names[::-1]
    for pair in (orders[0:2], orders[2:4]):
        assert len({sum(o.index(n) for o in pair) for n in names}) == 1


@pytest.mark.parametrize("order", ["alternating", "latin-square"])
def test_without_baseline_first_the_reference_is_balanced_too(order):
    orders = blocks(plan(body(candidates=2, prompts=3, order=order, baseline_first=False)), 3)
    counts = position_counts(orders, ["dense-stream", "c0", "c1"])
    assert all(c == Counter({0: 1, 1: 1, 2: 1}) for c in counts.values())


@pytest.mark.parametrize("m", range(1, 8))
def test_williams_design_is_latin_and_carryover_balanced(m):
    rows = williams(m)
    assert len(rows) == (m if m % 2 == 0 else 2 * m)
    for half in (rows[:m], rows[m:] or rows[:m]):
        assert all(sorted(r) == list(range(m)) for r in half)
        assert all(sorted(col) == list(range(m)) for col in zip(*half))  # Latin: each position once
    follows = Counter(pair for r in rows for pair in itertools.pairwise(r))
    if m > 1:
        assert set(follows) == set(itertools.permutations(range(m), 2))
        assert len(set(follows.values())) == 1  # every condition follows every other equally often


def test_arrange_orders():
    names = ["a", "b", "c"]
    assert [arrange(names, b, "alternating") for b in range(3)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [arrange(names, b, "abba") for b in range(2)] == [["a", "b", "c"], ["c", "b", "a"]]
    assert arrange([], 5, "latin-square") == []
    with pytest.raises(ValueError, match="unknown order"):
        arrange(names, 0, "zigzag")


def test_prompt_ids_must_lie_inside_the_vocabulary():
    """A prompt's ids index the embedding: each must be < vocab (ids 0..vocab-1); a generator draws
    from [4, vocab). Catches the planted bug "plan: a prompt id equal to the vocabulary accepted"."""
    from packbench.core.plan import prompts

    data = copy.deepcopy(body())
    data["prompts"] = {"token_ids": [[2, 3, 4, 99]]}
    assert prompts(data, vocab=100) == [[2, 3, 4, 99]]
    with pytest.raises(ValueError, match="prompt token id 100 is outside the model's vocabulary of 100"):
        prompts({**data, "prompts": {"token_ids": [[2, 3, 4, 100]]}}, vocab=100)
    drawn = prompts(body(prompts=50), vocab=6)
    assert {t for p in drawn for t in p[1:]} == {4, 5} and {p[0] for p in drawn} == {2}
