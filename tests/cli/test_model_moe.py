"""`packbench model synth --shape <MoE>` and `packbench model stats` on an MoE checkpoint: the
routing statistics beside the published figures, as JSON; bad input in one line, exit 2."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from packbench.cli.main import app


def test_synth_then_stats_json_meets_the_published_figures(tmp_path):
    out = tmp_path / "olmoe"
    made = CliRunner().invoke(app, ["model", "synth", "--out", str(out), "--shape", "olmoe-tiny", "--layers", "2"])
    assert made.exit_code == 0, made.output
    assert "routing profile olmoe, 2 of 3 layers" in made.stdout
    svg = tmp_path / "routing.svg"
    result = CliRunner().invoke(app, ["model", "stats", str(out), "--json", "--prefix", "256", "--count", "3",
                                      "--figure", str(svg)])
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout.splitlines()[-1])
    assert s["experts"] == 16 and s["k"] == 4 and len(s["layers"]) == 2
    layer = s["layers"][0]
    assert set(layer) >= {"skew", "carry80", "reuse", "temporal_lift", "union", "cache", "next_layer", "loads"}
    assert set(layer["reuse"]) == {"1", "2", "4", "8"}  # k-apart reuse
    for c in layer["cache"].values():  # the oracle bounds LRU and LFU (core/expert_cache.py)
        assert c["belady"] >= c["lru"] and c["belady"] >= c["lfu"]
    assert s["published"]["name"] == "olmoe" and "allenai/OLMoE" in s["published"]["source"]
    assert all(row["ok"] is not False for row in s["checks"]), s["checks"]
    unions = {row["target"]: row["ok"] for row in s["checks"] if row["target"].startswith("union")}
    assert unions == {"union over 32 tokens (of 64; <= independent)": True,
                      "union over 128 tokens (of 64; <= independent)": None}, unions
    assert svg.read_text().startswith("<svg") and "Belady" in svg.read_text()


def test_bad_moe_synth_input_is_one_line_exit_2(tmp_path):
    for args, cause in ((["--profile", "opt"], "not a routing profile"), (["--sparsity", "0.9"], "OPT recipes"),
                        (["--layers", "9"], "--layers 9 must be in 1..3")):
        r = subprocess.run([sys.executable, "-m", "packbench", "model", "synth", "--out", str(tmp_path / "x"),
                            "--shape", "mixtral-tiny", *args], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert cause in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr


def plan_mixtral_tiny(tmp_path, *args):
    """A mixtral-tiny checkpoint and `protocol plan` of a dense-stream/packet protocol on it."""
    import yaml

    out = tmp_path / "mx"
    assert CliRunner().invoke(app, ["model", "synth", "--out", str(out), "--shape", "mixtral-tiny"]).exit_code == 0
    body = {"name": "plan", "model": {"path": str(out)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16, "continuation_tokens": 4,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}], "reference": "dense-stream",
            "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    result = CliRunner().invoke(app, ["protocol", "plan", str(tmp_path / "p.yaml"), *args])
    assert result.exit_code == 0, result.output
    return out, result


def test_protocol_plan_on_an_moe_checkpoint_estimates_expert_bytes(tmp_path):
    """`protocol plan` on an MoE checkpoint: dense-stream moves every expert of every layer per call
    (exact); a decode packet at most k experts a layer (bounds the ledger of tests/engine/test_moe.py)."""
    _, result = plan_mixtral_tiny(tmp_path, "--json")
    rows = {r["condition"]: r for r in json.loads(result.stdout)["moe"]}
    expert = 3 * 64 * 96 * 4  # gate_up + down of one mixtral-tiny expert in float32
    assert rows["dense-stream"]["decode_bytes"] == rows["dense-stream"]["prefill_bytes"] == 3 * 8 * expert
    assert rows["packet"]["decode_bytes"] == 3 * 2 * expert and rows["packet"]["bound"] == "at most"
    assert rows["packet"]["prefill_bytes"] == 3 * 8 * expert  # 16 tokens x top 2 >= 8 experts


def test_plan_on_an_moe_checkpoint_estimates_its_archive_with_its_vocabulary(tmp_path):
    """`protocol plan` on an MoE checkpoint (its own plan path) prints the archive estimate too,
    from the checkpoint's config.json vocabulary (catches OPT's 50272 assumed)."""
    out, result = plan_mixtral_tiny(tmp_path, "--json")
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    archive = json.loads(result.stdout)["archive"]
    assert (archive["episode_logits_bytes"], archive["episodes"], archive["warning"]) == (4 * vocab * 4 + 128, 4, None)
    text = CliRunner().invoke(app, ["protocol", "plan", str(tmp_path / "p.yaml")]).stdout
    assert "\narchive: about " in text and f"{4 * vocab * 4 + 128:,} bytes each" in text


def test_routing_names_the_profile_a_protocol_calls_routing(tmp_path):
    """`model synth --routing` is `--profile` for an MoE shape (a protocol's model.synth.routing):
    the same checkpoint bytes; two different names, or --routing on an OPT shape, are refused in
    one line (would catch --routing silently ignored, the calibrated profile drawn instead)."""
    import hashlib

    def digest(d):
        return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.glob("*.safetensors")))).hexdigest()

    a, b = tmp_path / "a", tmp_path / "b"
    made = CliRunner().invoke(app, ["model", "synth", "--out", str(a), "--shape", "mixtral-tiny", "--routing", "uniform",
                                    "--json"])
    assert made.exit_code == 0 and json.loads(made.stdout)["profile"] == "uniform", made.output
    assert CliRunner().invoke(app, ["model", "synth", "--out", str(b), "--shape", "mixtral-tiny",
                                    "--profile", "uniform"]).exit_code == 0
    assert digest(a) == digest(b)
    calibrated = tmp_path / "c"
    assert CliRunner().invoke(app, ["model", "synth", "--out", str(calibrated), "--shape", "mixtral-tiny"]).exit_code == 0
    assert digest(calibrated) != digest(a)
    for args, words in [(["--shape", "mixtral-tiny", "--routing", "uniform", "--profile", "mixtral"], "give one"),
                        (["--shape", "tiny", "--routing", "uniform"], "are for MoE shapes"),
                        (["--shape", "mixtral-tiny", "--routing", "bogus"], "is not a routing profile")]:
        r = subprocess.run([sys.executable, "-m", "packbench", "model", "synth", "--out", str(tmp_path / "x"), *args],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stdout == "" and not (tmp_path / "x").exists(), args  # nothing written, nothing printed


def test_moe_stats_keep_to_the_models_positions(tmp_path):
    """Bug caught: `model stats` on an MoE checkpoint ignored config.json's max_position_embeddings
    (OPT's path cuts the default prefix to it and refuses an explicit one beyond it): a model of 32
    positions was routed 512-token prompts, and --prefix/--continuation past them were traced,
    exit 0. Now the default prefix fits, and a prefix (with --trace: plus the decode calls) beyond
    the positions is one line, exit 2."""
    out = tmp_path / "mx"
    assert CliRunner().invoke(app, ["model", "synth", "--out", str(out), "--shape", "mixtral-tiny",
                                    "--layers", "1"]).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    fits = CliRunner().invoke(app, ["model", "stats", str(out), "--json", "--count", "1"])
    assert fits.exit_code == 0, fits.output
    assert json.loads(fits.stdout.splitlines()[-1])["model"]["tokens"] == 32
    for args, cause in ((["--prefix", "33"], "--prefix 33 is more positions than the model's 32"),
                        (["--prefix", "30", "--continuation", "4", "--trace", str(tmp_path / "t.trace")],
                         "--prefix 30 + --continuation 4 - 1 = 33 positions, but the model has 32")):
        r = subprocess.run([sys.executable, "-m", "packbench", "model", "stats", str(out), "--count", "1", *args],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert cause in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "t.trace").exists()


def test_moe_stats_name_each_layer_by_its_index_in_the_model(tmp_path):
    """Bug caught: a Qwen3-MoE whose layers 0 and 2 are dense (decoder_sparse_step 2) had its MoE
    layers 1 and 3 listed as layers 0 and 1 (the table, the JSON and the figure counted traced
    routers, not the model's layers)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=6,
                            num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
                            decoder_sparse_step=2, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "q")
    result = CliRunner().invoke(app, ["model", "stats", str(tmp_path / "q"), "--json", "--prefix", "16"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout.splitlines()[-1])
    assert [r["layer"] for r in s["layers"]] == [1, 3]
    assert "next_layer" in s["layers"][0] and "next_layer" not in s["layers"][1]
    table = CliRunner().invoke(app, ["model", "stats", str(tmp_path / "q"), "--prefix", "16"])
    lines = table.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["layer"])
    assert [line.split()[0] for line in lines[head + 1:head + 3]] == ["1", "3"]


def test_moe_stats_stderr_holds_its_own_progress_alone(tmp_path):
    """`model stats` on an MoE checkpoint printed six lines of library noise above its output (the
    torchao that transformers imports, logging CUDA kernel libraries a CPU build cannot load and a
    missing Triton; torch's Enum deprecations) and numpy's "Mean of empty slice" for a reuse
    distance past an 8-token prompt. Catches any line on stderr but the command's own progress;
    with --verbose the libraries' warnings are shown."""
    import importlib.util

    out = tmp_path / "q"
    assert CliRunner().invoke(app, ["model", "synth", "--out", str(out), "--shape", "qwen3-moe-tiny",
                                    "--layers", "2"]).exit_code == 0
    r = subprocess.run([sys.executable, "-m", "packbench", "model", "stats", str(out), "--count", "1", "--prefix", "8"],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["routed prompt 1/1"], r.stderr
    assert "reuse" in r.stdout
    if importlib.util.find_spec("torchao") is not None:  # the [lowbit] extra: its warnings are there to hide
        loud = subprocess.run([sys.executable, "-m", "packbench", "--verbose", "model", "stats", str(out), "--count",
                               "1", "--prefix", "8"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2])
        assert loud.returncode == 0 and "torchao" in loud.stderr, loud.stderr


def test_stats_figure_never_replaces_a_file_that_is_no_svg(tmp_path, packbench_cli):
    """`model stats MOE --figure packbench.db` wrote the SVG over the results database (and over an
    archive given as --figure): --figure is a .svg file, checked before any prompt is routed, as
    report --out and history --html are .html files; written whole or not at all."""
    out = tmp_path / "olmoe"
    assert packbench_cli("model", "synth", "--out", str(out), "--shape", "olmoe-tiny", "--layers", "1").returncode == 0
    for name in ("packbench.db", "screen-00001-attempt-1.zip", "routing"):
        kept = tmp_path / name
        kept.write_bytes(b"SQLite format 3\x00 results")
        r = packbench_cli("model", "stats", str(out), "--prefix", "8", "--count", "1", "--figure", str(kept))
        assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stderr)
        assert r.stderr.strip().splitlines() == [f"error: --figure {kept}: write the figure to a .svg file"]
        assert kept.read_bytes() == b"SQLite format 3\x00 results"
    missing = tmp_path / "no" / "such" / "r.svg"
    r = packbench_cli("model", "stats", str(out), "--prefix", "8", "--count", "1", "--figure", str(missing))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --figure {missing}: the directory {missing.parent} does not exist; create it or choose another "
        f"--figure"], r.stderr
    svg = tmp_path / "routing.SVG"
    r = packbench_cli("model", "stats", str(out), "--prefix", "8", "--count", "1", "--figure", str(svg))
    assert r.returncode == 0, r.stderr
    assert svg.read_text().startswith("<svg") and list(tmp_path.glob(".*.tmp")) == []
