"""`packbench model stats --robustness`: fake quantization and the statistics against values
computed by hand, and the measurement on a tiny model."""

import math

import numpy as np
import pytest
import torch

from packbench.engine.robustness import (NF4_CODE, VARIANTS, absmax_symmetric, decoder_linears, mean_interval,
                                         measure, minmax_asymmetric, nearest_code, nf4_blocks, real_opt,
                                         sample_continuations, summarise, token_figures)


def test_absmax_is_per_row_and_symmetric():
    """2 bits: levels -1, 0, 1 times each row's own absmax (a per-tensor scale would give row 2 zeros)."""
    w = torch.tensor([[1.0, -0.4, 0.6], [0.5, 0.2, -0.3]])
    assert absmax_symmetric(w, bits=2).tolist() == [[1.0, 0.0, 1.0], [0.5, 0.0, -0.5]]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    step = x.abs().amax(1, keepdim=True) / 127
    assert ((absmax_symmetric(x, bits=8) - x).abs() <= step / 2 + 1e-7).all()


def test_minmax_has_an_integer_zero_point_and_groups():
    # row 2: low -1, high 2, scale 1, zero 1: 0.4 -> 0, 1.6 -> 2
    w = torch.tensor([[0.0, 3.0, 1.4, 2.6], [-1.0, 2.0, 0.4, 1.6]])
    assert minmax_asymmetric(w, bits=2).tolist() == [[0.0, 3.0, 1.0, 3.0], [-1.0, 2.0, 0.0, 2.0]]
    # groups of 2 keep the small group's resolution (per row, 0.3 rounds to 0)
    w = torch.tensor([[0.0, 0.3, 0.0, 3.0]])
    assert minmax_asymmetric(w, bits=2).tolist() == [[0.0, 0.0, 0.0, 3.0]]
    assert torch.allclose(minmax_asymmetric(w, bits=2, group=2), w)
    # a row shorter than the group is one group (the tiny shape's 64-wide rows at group 128)
    assert torch.equal(minmax_asymmetric(w, bits=2, group=128), minmax_asymmetric(w, bits=2))


def test_int3_variants_round_to_eight_levels_per_row_or_per_group():
    """int3: 2^3 - 1 = 7 steps between a row's (or a group's) range ends, which include 0."""
    # row 1: low 0, high 7, step 1: 3.4 -> 3, 5.6 -> 6; row 2: low -2, high 5, step 1, zero 2: 0.4 -> 0, -0.6 -> -1
    w = torch.tensor([[0.0, 7.0, 3.4, 5.6], [-2.0, 5.0, 0.4, -0.6]])
    assert VARIANTS["int3-channel"].quantize(w).tolist() == [[0.0, 7.0, 3.0, 6.0], [-2.0, 5.0, 0.0, -1.0]]
    # two groups of 128: the first spans 0..0.7 (step 0.1), the second 0..7 (step 1)
    w = torch.zeros(1, 256)
    w[0, 1], w[0, 2], w[0, 129], w[0, 130] = 0.7, 0.34, 7.0, 3.4
    grouped = VARIANTS["int3-g128"].quantize(w)
    assert grouped[0, [1, 2, 129, 130]].tolist() == pytest.approx([0.7, 0.3, 7.0, 3.0])
    # one step of 1 for the whole row: the small group's entries round to 1 and 0
    assert VARIANTS["int3-channel"].quantize(w)[0, [1, 2, 129, 130]].tolist() == [1.0, 0.0, 7.0, 3.0]
    assert grouped[0, [0] + list(range(3, 129)) + list(range(131, 256))].abs().max() == 0.0


def test_nf4_maps_each_block_to_the_nearest_code_value():
    w = torch.tensor([[1.0, 0.5], [-2.0, 0.1]])
    # block 1: absmax 1, 0.5 is nearer 0.4407 than 0.5626; block 2: absmax 2, 0.05 is nearer 0.0796 than 0
    expected = [[1.0, NF4_CODE[12]], [-2.0, 2 * NF4_CODE[8]]]
    assert torch.allclose(nf4_blocks(w, block=2), torch.tensor(expected))


def test_nf4_picks_what_the_distance_argmin_picks_bit_for_bit():
    """nf4 finds each entry's code from the two around it (`nearest_code`): the same bits as the
    argmin over all sixteen distances, ties to the lower code and NaN to code[0] included, so a
    checkpoint's nf4 figures stay what they were (a block holding inf or NaN included)."""
    code = torch.tensor(NF4_CODE)
    mid = (code[1:] + code[:-1]) / 2
    edges = torch.cat([code, -code, mid, mid.nextafter(torch.tensor(2.0)), mid.nextafter(torch.tensor(-2.0)),
                       torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("nan")])])
    y = torch.cat([edges, torch.empty(10_000).uniform_(-1, 1, generator=torch.Generator().manual_seed(0))])
    argmin = code[(y.unsqueeze(-1) - code).abs().argmin(-1)]
    assert torch.equal(nearest_code(y, code).view(torch.int32), argmin.view(torch.int32))
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    w[3, 5], w[5, 0], w[7] = float("nan"), float("inf"), 0.0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = w.to(dtype).float().reshape(-1, 64)
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        expected = (code[((x / scale).unsqueeze(-1) - code).abs().argmin(-1)] * scale).to(dtype)
        got = nf4_blocks(w.to(dtype), block=64).reshape(-1, 64)
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0)) and torch.equal(got.isnan(), expected.isnan())


def test_token_figures_by_hand():
    ref = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(3.0)]])  # p = (3/4, 1/4), (1/4, 3/4)
    out = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])  # q = (1/4, 3/4) twice
    f = token_figures(ref, out, torch.tensor([0, 1]))
    assert f["dce"] == pytest.approx([math.log(3.0), 0.0], abs=1e-6)  # -ln(1/4) + ln(3/4); unchanged
    assert f["kl"] == pytest.approx([0.75 * math.log(3.0) + 0.25 * math.log(1 / 3), 0.0], abs=1e-6)
    assert f["agree"].tolist() == [False, True]


def test_the_interval_treats_sequences_as_the_units():
    # tokens 1, 3 | 5: pooled mean 3; residual sums -2, +2; se = sqrt(8 * 2) / 3; t(1 df) = 12.706
    mean, low, high = mean_interval([np.array([1.0, 3.0]), np.array([5.0])])
    assert mean == 3.0 and high - mean == pytest.approx(12.706 * 4 / 3) and mean - low == pytest.approx(12.706 * 4 / 3)
    # identical sequence means: no spread, however noisy the tokens
    assert mean_interval([np.array([0.0, 4.0]), np.array([2.0, 2.0])])[1:] == (2.0, 2.0)
    assert all(math.isnan(x) for x in mean_interval([np.array([1.0, 2.0])])[1:])


def test_summarise_by_hand():
    seqs = [{"dce": np.array([0.1, 0.3]), "kl": np.array([0.0, 1.0]), "agree": np.array([True, False])},
            {"dce": np.array([0.2]), "kl": np.array([0.5]), "agree": np.array([True])}]
    s = summarise(seqs)
    assert s["dce"] == pytest.approx(0.2) and s["mean_kl"] == pytest.approx(0.5) and s["top1"] == pytest.approx(2 / 3)
    assert s["p99_kl"] == pytest.approx(np.percentile([0.0, 1.0, 0.5], 99)) and s["tokens"] == 3 and s["sequences"] == 2


def test_real_opt_figures_name_their_sources():
    figures = real_opt("opt-2.7b")
    assert figures["int4-channel"]["ln_ratio"] == pytest.approx(0.305, abs=0.001)
    assert figures["int4-g128"]["ln_ratio"] == 0.043 and "AffineQuant" in figures["int4-g128"]["source"]
    assert real_opt("tiny") == {}
    # 3-bit RTN, beyond the calibrated targets: GPTQ's per-channel and AWQ's group-128 tables
    assert figures["int3-channel"]["ln_ratio"] == pytest.approx(math.log(1.6e4 / 12.47))
    assert "Table 3" in figures["int3-channel"]["source"] and "GPTQ" in figures["int3-channel"]["source"]
    assert figures["int3-g128"]["ln_ratio"] == pytest.approx(math.log(298.00 / 12.47))
    assert "AWQ" in figures["int3-g128"]["source"] and "int3-g128" not in real_opt("opt-125m")



def test_group_128_figures_are_the_cited_tables_rtn_row_at_every_shape_it_prints():
    """The int4 group-128 figures against the figure they cite (bytedance/AffineQuant fig/weight-only-opt.png,
    Table 1, w4a16g128 RTN over FP16: 27.65 -> 30.47, 14.63 -> 15.29, 12.47 -> 13.02, 10.86 -> 11.15,
    10.12 -> 10.30). Catches a figure the source prints that REAL_OPT left out: opt-125m's 0.097 was read as
    "-" (docs/workloads.md), so `model stats --robustness` on an opt-125m checkpoint, the CPU's calibration
    shape, printed no real group-128 figure beside the measured one. opt-125m's is held out (no profile's
    target) and says so."""
    table = {"opt-125m": (27.65, 30.47), "opt-1.3b": (14.63, 15.29), "opt-2.7b": (12.47, 13.02),
             "opt-6.7b": (10.86, 11.15), "opt-13b": (10.12, 10.30)}
    for shape, (fp16, rtn) in table.items():
        f = real_opt(shape)["int4-g128"]
        assert f["ln_ratio"] == pytest.approx(math.log(rtn / fp16), abs=5e-4), shape  # 3 decimals as the docs give them
        assert "AffineQuant" in f["source"] and "weight-only-opt.png" in f["source"], shape
    assert real_opt("opt-125m")["int4-g128"]["reads"] == "27.65 -> 30.47 (held out)"
    assert "held out" not in real_opt("opt-2.7b")["int4-g128"]["reads"]
    assert real_opt("opt-125m")["int4-g128"]["held_out"] is True
    assert not any(f["held_out"] for shape in table for v, f in real_opt(shape).items() if (v, shape) != ("int4-g128", "opt-125m"))
    # the table marks it, with a footnote that says what the mark means
    from packbench.cli.model_stats import render_robustness

    s = stats_of("opt-125m", "float32", dce=0.1, spread=0.1, mean_kl=0.1, p99_kl=1.0, top1=0.8)
    lines = render_robustness(s).splitlines()
    row = next(line for line in lines if line.startswith(VARIANTS["int4-g128"].label))
    assert f"*{math.log(30.47 / 27.65):.3f} [" in row
    row = next(line for line in lines if line.startswith(VARIANTS["int4-channel"].label))
    assert "*" not in row and f" {math.log(37.28 / 27.65):.3f} [" in row
    assert "* held out: no profile was tuned to this figure (docs/workloads.md)" in lines
    s["model"]["shape"] = "opt-2.7b"
    for name, v in s["variants"].items():
        v["real_opt"] = real_opt("opt-2.7b").get(name)
    assert not any(line.startswith("* held out") for line in render_robustness(s).splitlines())
    # int8: the chart the figure was read from, at a commit that holds it
    assert "@76946f35" in real_opt("opt-1.3b")["int8-channel"]["source"]
    assert "facebook-opt-1.3b_Perplexity.png" in real_opt("opt-1.3b")["int8-channel"]["source"]

@pytest.fixture(scope="module")
def tiny_model(tiny):
    from packbench.engine.checkpoint import build_model

    return build_model(tiny, dtype=torch.float32)


def test_measure_restores_the_weights_and_leaves_embeddings_alone(tiny, tiny_model):
    """A variant quantizes the decoder's Linears only, and every weight is the original afterwards
    (else the next variant would quantize quantized weights)."""
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    assert len(decoder_linears(tiny_model)) == 6 * tiny_model.config.num_hidden_layers
    seqs = sample_continuations(tiny_model, [[2, 5, 9, 11]] * 2, tokens=8, seed=0, device="cpu")
    assert [len(s) for s in seqs] == [12, 12] and seqs[0] != seqs[1]  # sampled, not greedy
    out = measure(tiny, seqs, score_from=[4, 4], model=tiny_model)
    after = tiny_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert set(out) == set(VARIANTS) >= {"int8-channel", "int4-channel", "int4-g128", "nf4-b64", "int3-channel",
                                          "int3-g128"}
    assert out["int8-channel"]["tokens"] == 16 and out["int8-channel"]["mean_kl"] < out["int4-channel"]["mean_kl"]
    assert out["int4-channel"]["mean_kl"] < out["int3-channel"]["mean_kl"]  # fewer levels, larger steps


def test_a_variant_measured_alone_has_the_figures_it_has_among_all(tiny):
    """`robustness(..., variants=...)` measures the variants asked for, each with the figures the
    full set gives it (tests/engine/test_synth.py measures only those it checks)."""
    from packbench.engine.robustness import robustness

    prompts = [[2, 5, 9, 11], [2, 7, 3, 8]]
    every = robustness(tiny, prompts, sampled=8, seed=0, text=False)
    alone = robustness(tiny, prompts, sampled=8, seed=0, text=False, variants=("nf4-b64", "int4-g128"))
    assert list(alone) == ["nf4-b64", "int4-g128"] and list(every) == list(VARIANTS)
    assert alone == {name: every[name] for name in alone}


def test_each_sampled_token_sees_its_whole_context(tiny_model):
    """Sampling through the KV cache draws what a full forward of the sequence so far would: the
    same seeded draws over the same distributions give the same tokens. Catches the cache passed
    under a name the installed transformers does not take (5.17 says `past_key_values`, 5.25
    `cache`): the keyword vanishes into **kwargs, every token is drawn without its context, and
    the model's "own" text is no longer its own (dCE on it came out below zero on the H200)."""
    prompt = [2, 5, 9, 11]
    (cached,) = sample_continuations(tiny_model, [prompt], tokens=12, seed=3, device="cpu")
    gen, seq = torch.Generator().manual_seed(3), list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            logits = tiny_model(torch.tensor([seq])).logits[0, -1].float()
            seq.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    assert cached == seq


def test_model_stats_robustness_prints_json_a_table_and_refuses_bad_options(tiny):
    import json

    from typer.testing import CliRunner

    from packbench.cli.main import app
    from packbench.core.errors import PackbenchError

    args = ["model", "stats", str(tiny), "--robustness", "--prefix", "8", "--sampled", "8", "--count", "2"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert set(s["variants"]) == set(VARIANTS)
    v = s["variants"]["int4-g128"]
    assert v["tokens"] == 16 and v["sequences"] == 2 and v["dce_low"] <= v["dce"] <= v["dce_high"] and v["real_opt"] is None
    # the session's tiny checkpoint is profile opt: its fidelity figures carry the caveat
    assert "not calibrated for robustness" in s["model"]["caveat"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "int4 group-128 RTN" in r.stdout and "not calibrated for robustness" in r.stdout
    assert "int3 per-channel RTN" in r.stdout and "int3 group-128 RTN" in r.stdout
    r = CliRunner().invoke(app, [*args[:4], "--prefix", "2040", "--sampled", "16"])
    assert isinstance(r.exception, PackbenchError) and str(r.exception) == ("--prefix 2040 + --sampled 16 - 1 = 2055 positions, but the model has 256; "
                                                                  "lower --prefix or --sampled")


def test_the_caveat_names_uncalibrated_checkpoints_only():
    from packbench.core.registry import robustness_caveat

    # listed where measured within the targets only: opt2 and opt3 at opt-125m (CPU); opt2 missed at 2.7b (H200)
    assert robustness_caveat({"shape": "opt-125m", "profile": "opt2"}) is None
    assert robustness_caveat({"shape": "opt-125m", "profile": "opt3"}) is None
    assert "profile opt2, opt-2.7b" in robustness_caveat({"shape": "opt-2.7b", "profile": "opt2"})
    assert "profile opt, opt-2.7b" in robustness_caveat({"shape": "opt-2.7b", "profile": "opt"})
    assert "uniform recipe" in robustness_caveat({"shape": "opt-2.7b", "sparsity": 0.94})
    assert "profile opt2, tiny" in robustness_caveat({"shape": "tiny", "profile": "opt2"})


def test_an_moe_checkpoints_caveat_names_its_routing_not_the_uniform_recipe():
    """A qwen3-moe-tiny screen's report and verdict table read `synthetic checkpoint (the uniform
    recipe, qwen3-moe-tiny)` under a title that says `routing olmoe`: an MoE synth has neither a
    profile nor OPT's uniform recipe."""
    from packbench.core.registry import robustness_caveat

    text = robustness_caveat({"shape": "qwen3-moe-tiny", "dtype": "float32", "seed": 0, "layers": 3, "routing": "olmoe"})
    assert "(routing olmoe, qwen3-moe-tiny)" in text and "uniform recipe" not in text


def test_the_table_prints_real_opt_beside_each_variant_with_its_source():
    """`model stats --robustness` at a shape with published figures: each variant's row ends in
    real OPT's ln ratio and a footnote number, the footnotes name the tables (3-bit rows included)."""
    from packbench.cli.model_stats import render_robustness

    real = real_opt("opt-2.7b")
    lines = render_robustness(stats_of("opt-2.7b", "float16", dce=0.5, spread=0.1, mean_kl=0.5, p99_kl=2.0,
                                       top1=0.7)).splitlines()
    row = next(line for line in lines if line.startswith(VARIANTS["int3-channel"].label))
    footnote = row.rsplit("[", 1)[1].rstrip("]")
    assert f"{math.log(1.6e4 / 12.47):.3f} [" in row
    assert f"[{footnote}] {real['int3-channel']['source']}" in lines
    row = next(line for line in lines if line.startswith(VARIANTS["int3-g128"].label))
    assert f"{math.log(298.00 / 12.47):.3f} [" in row
    assert next(line for line in lines if line.startswith(VARIANTS["nf4-b64"].label)).endswith("-")  # no figure


def stats_of(shape: str, dtype: str, *, dce: float, spread: float, mean_kl: float, p99_kl: float, top1: float) -> dict:
    """A `model stats --robustness` summary whose every variant has the same figures, with real
    OPT's published figures at `shape` beside each (what render_robustness prints)."""
    real = real_opt(shape)
    figures = {"dce": dce, "dce_low": dce - spread, "dce_high": dce + spread, "mean_kl": mean_kl, "p99_kl": p99_kl,
               "top1": top1, "tokens": 64, "sequences": 2}
    return {"model": {"dir": "m", "shape": shape, "dtype": dtype, "caveat": None}, "text": "two prompts",
            "variants": {name: {"label": v.label, **figures, "real_opt": real.get(name)} for name, v in VARIANTS.items()}}
