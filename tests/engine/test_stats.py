"""`packbench model stats`: the figures against counts made by hand, and on a real model run."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.core.errors import PackbenchError
from packbench.engine.stats import PromptActivity, hot_shares, summarise, union_curve


def trace() -> PromptActivity:
    """1 layer, 4 neurons; prefill of 3 tokens, 2 decode calls."""
    prefill = np.array([[[1, 0, 0, 0],
                         [1, 1, 0, 0],
                         [0, 0, 1, 0]]], dtype=bool)
    decode = np.array([[[1, 0, 0, 1],
                        [1, 1, 0, 0]]], dtype=bool)
    return PromptActivity(prefill=prefill, decode=decode, entropy=np.array([1.0, 2.0, 3.0, 0.5, 0.5]),
                 top1=np.array([0.5, 0.25, 0.2, 0.9, 0.9]))


def test_the_union_curve_counts_first_activations():
    assert union_curve(trace().prefill).tolist() == [0.25, 0.5, 0.75]


def test_hot_shares_are_the_fewest_neurons_carrying_each_share():
    counts = np.array([6, 2, 1, 1, 0])  # 10 activations over 5 neurons
    assert hot_shares(counts, (0.5, 0.8, 0.95)) == {"0.5": 0.2, "0.8": 0.4, "0.95": 0.8}


def test_every_figure_against_counts_by_hand():
    s = summarise([trace()])
    assert s["density"]["prefill"] == 4 / 12 and s["density"]["decode"] == 4 / 8
    assert s["union"]["1"] == 0.25 and s["union"]["3"] == 0.75 and s["union"]["2"] == 0.5
    # decode: {0, 3} then {0, 1}: 1 of 2 active again; Jaccard 1 / 3
    assert s["overlap"]["decode_next"] == 0.5 and s["overlap"]["decode_jaccard"] == pytest.approx(1 / 3)
    # prefill: {0} -> {0, 1} -> {2}: (1 + 0) of (1 + 2)
    assert s["overlap"]["prefill_next"] == pytest.approx(1 / 3)
    # activations per neuron: 4, 2, 1, 1 over 8: neuron 0 alone carries 50 %
    assert s["hot"]["0.5"] == 0.25 and s["hot"]["0.8"] == 0.75
    assert s["next_token"]["entropy_nats"] == pytest.approx(7 / 5) and s["next_token"]["top1_prob"] == pytest.approx(2.75 / 5)
    w = s["workload"]
    assert w["decode_packet_over_dense"] == 0.5 and w["prefill_packet_over_dense"] == 0.75
    # demand: prefill packet 3 rows + decode 2 + 2 over 3 calls x 4 rows
    assert w["episode_packet_over_dense"] == 7 / 12
    # forecasts: prefill {0,1,2} -> decode {0,3}: 2 wasted; {0,3} -> {0,1}: 1 wasted, 1 used
    assert w["forecast_extra_over_demand"] == 3 / 7 and w["forecast_extra_over_demand_decode_only"] == 1 / 7
    assert w["forecast_wasted_over_used_decode_only"] == 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from packbench.engine.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("stats") / "tiny", shape="tiny", dtype="float32", seed=0,
                            profile="opt")


def test_measure_agrees_with_the_engines_own_ledger(tiny):
    """The masks model stats keeps are the rows a packet moves: the same counts as the episode
    runner's ledger on the same prompt."""
    import torch

    from packbench.engine.episode import run_episode
    from packbench.engine.model import CpuFirstModel
    from packbench.engine.stats import measure

    prompt = [2] + list(range(10, 41))
    (t,) = measure(tiny, [prompt], continuation=6)
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    model.use("packet")
    out = run_episode(model, prompt, continuation=6)
    assert [int(n) for n in t.prefill.any(axis=1).sum(axis=1)] == out.calls[0].active_rows
    for call in range(5):
        assert [int(n) for n in t.decode[:, call].sum(axis=1)] == out.calls[call + 1].active_rows


def test_model_stats_prints_json_and_refuses_bad_options(tiny):
    r = CliRunner().invoke(app, ["model", "stats", str(tiny), "--prefix", "32", "--count", "2", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["model"]["shape"] == "tiny" and s["model"]["recipe"]["profile"] == "opt"
    assert len(s["union"]["curve"]) == 32 and s["decode_calls"] == 15 and len(s["density"]["by_layer_decode"]) == 2
    r = CliRunner().invoke(app, ["model", "stats", str(tiny), "--prefix", "32"])
    assert r.exit_code == 0 and "union of k tokens" in r.stdout and "early-forecast extra over demand" in r.stdout
    for bad, fragment in ((["--prefix", "0"], "--prefix 0 must be in 1..2048"),
                          (["--device", "tpu"], "--device 'tpu': use cpu, cuda or cuda:N"),
                          (["--prompts", str(tiny / "config.json")], "text_file prompts need the checkpoint's tokenizer")):
        r = CliRunner().invoke(app, ["model", "stats", str(tiny), *bad])
        assert isinstance(r.exception, PackbenchError) and fragment in str(r.exception), r.output
    r = CliRunner().invoke(app, ["model", "stats", str(tiny.parent / "missing")])
    assert isinstance(r.exception, PackbenchError) and "does not exist" in str(r.exception)
