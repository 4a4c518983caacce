"""Batched decode (issue 26): every exact loader policy decodes a batch of prompts bit for bit as
dense-stream does at the same batch, in mode eager and mode graph (on the CPU: its eager
decoder), and a call's packet is the union of the batch's active rows."""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.conditions import POLICIES

CONTINUATION = 4
PREFIX = 12
BATCHES = (1, 2, 4)
PARAMS = {"sparse-extents": {"block_rows": 16}, "row-retention": {"rows_per_layer": 48}}
# Every exact policy and parameter variant: the gathers, and the int8 weight format (judged
# against dense-stream over the same int8 rows).
VARIANTS = {**{name: (name, PARAMS.get(name, {})) for name in POLICIES},
            "packet+gather=device": ("packet", {"gather": "device"}),
            "early-forecast+gather=device": ("early-forecast", {"gather": "device"}),
            "phase-switched+gather=device": ("phase-switched", {"gather": "device"}),
            "packet+weights=int8": ("packet", {"weights": "int8"}),
            "packet+gather=device+weights=int8": ("packet", {"gather": "device", "weights": "int8"})}
INT8_REFERENCE = ("dense-stream", {"weights": "int8"})


def prompts_of(batch: int, vocab: int) -> list[list[int]]:
    return [[2] + [(7 * i + 13 * s + 11) % (vocab - 4) + 4 for i in range(PREFIX - 1)] for s in range(batch)]


def batch_input(batch: int, vocab: int) -> list[int] | list[list[int]]:
    """Batch 1 as one prompt's ids (the shape every episode before batches took), else a batch."""
    ps = prompts_of(batch, vocab)
    return ps[0] if batch == 1 else ps


@pytest.fixture(scope="module", params=("eager", "graph"))
def runs(request, checkpoints):
    model = CpuFirstModel(checkpoints["float32"], dtype=torch.float32, device=torch.device("cpu"),
                          mode=request.param)
    outs = {}
    for batch in BATCHES:
        for key, (name, params) in {**VARIANTS, "dense-stream+weights=int8": INT8_REFERENCE}.items():
            model.use(name, **params)
            outs[key, batch] = run_episode(model, batch_input(batch, model.vocab), continuation=CONTINUATION)
    return request.param, model, outs


def test_every_exact_policy_is_bit_identical_to_dense_stream_at_each_batch(runs):
    _, model, outs = runs
    for batch in BATCHES:
        for key in VARIANTS:
            ref = outs["dense-stream+weights=int8" if "int8" in key else "dense-stream", batch]
            out = outs[key, batch]
            assert out.logits.tobytes() == ref.logits.tobytes(), (key, batch)
            assert out.tokens == ref.tokens, (key, batch)


def test_a_batch_records_every_sequence(runs):
    _, model, outs = runs
    one, four = outs["packet", 1], outs["packet", 4]
    assert one.logits.shape == (CONTINUATION, model.vocab) and len(one.tokens) == CONTINUATION
    assert four.logits.shape == (4, CONTINUATION, model.vocab) and four.batch == 4
    assert [len(t) for t in four.tokens] == [CONTINUATION] * 4
    for s in range(4):
        assert [int(t) for t in four.logits[s].argmax(axis=1)] == four.tokens[s]
    assert [c.tokens for c in four.calls] == [4 * PREFIX] + [4] * (CONTINUATION - 1)
    assert all(c.logits_d2h_bytes == 4 * model.vocab * 4 for c in four.calls)


def test_a_batch_decodes_each_sequence_as_it_decodes_alone(runs):
    """Not bit for bit (a batch's matmuls may reduce in another order): the same greedy tokens
    and logits within float32 rounding, so the batch decodes each prompt, not a mixture."""
    _, model, outs = runs
    ps = prompts_of(2, model.vocab)
    model.use("dense-stream")
    alone = run_episode(model, ps[1], continuation=CONTINUATION)
    together = outs["dense-stream", 2]
    assert np.allclose(together.logits[1], alone.logits, atol=1e-4)


def test_a_calls_packet_is_the_union_of_the_batchs_rows(runs):
    """Per call and layer, a batch moves at least the rows of its busiest sequence decoded alone
    and at most those of all its sequences alone (a union, never a sum); the active count is the
    union's, and those are the rows copied. Dense-stream moves every row at any batch."""
    _, model, outs = runs
    for key in ("packet", "packet+gather=device", "phase-switched"):
        name, params = VARIANTS[key]
        model.use(name, **params)
        alone = [run_episode(model, p, continuation=CONTINUATION).calls for p in prompts_of(4, model.vocab)]
        for batch in (2, 4):
            for call, together in enumerate(outs[key, batch].calls):
                if key == "phase-switched" and call == 0:
                    continue  # its prefill streams dense rows
                for layer in range(together.layers):
                    solo = [alone[s][call].h2d_weight_bytes[layer] for s in range(batch)]
                    assert max(solo) <= together.h2d_weight_bytes[layer] <= sum(solo), (key, batch, call, layer)
                    assert together.active_rows[layer] == together.rows_copied[layer]
        decode = [c for c in outs[key, 4].calls if c.phase == "decode"]
        assert sum(sum(c.h2d_weight_bytes) for c in decode) > sum(sum(c.h2d_weight_bytes) for c in alone[0][1:]), key
    dense = outs["dense-stream", 4].calls[1]
    assert dense.h2d_weight_bytes == outs["dense-stream", 1].calls[1].h2d_weight_bytes


def test_teacher_forcing_a_batch_feeds_each_sequence_its_own_tokens(runs):
    _, model, outs = runs
    free = outs["dense-stream", 2]
    model.use("dense-stream")
    again = run_episode(model, prompts_of(2, model.vocab), continuation=CONTINUATION, forced=free.tokens)
    assert again.logits.tobytes() == free.logits.tobytes()
    with pytest.raises(ValueError, match="one token list per sequence"):
        run_episode(model, prompts_of(2, model.vocab), continuation=CONTINUATION, forced=free.tokens[:1])
