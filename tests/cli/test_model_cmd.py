"""`packbench model synth` progress: layers done/total, plain lines off a terminal, a rich bar on one."""

import io
import json

from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.cli.progress import StepBar, StepLines


def test_synth_reports_layers_then_the_write(tmp_path):
    out = tmp_path / "tiny"
    result = CliRunner().invoke(app, ["model", "synth", "--out", str(out), "--shape", "tiny"])
    assert result.exit_code == 0, result.output
    # Not a terminal under the runner: plain lines, one per layer for the 2-layer tiny shape.
    assert result.stdout.splitlines() == [
        "synthesising tiny float32: 1/2 layers",
        "synthesising tiny float32: 2/2 layers; writing model.safetensors",
        f"wrote tiny float32 checkpoint (profile opt4, seed 0) to {out}",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["packbench_synth"]["profile"] == "opt4"


def test_plain_lines_stay_few_for_many_layers(capsys):
    lines = StepLines("synthesising opt-175b float16", "layers")
    for done in range(1, 97):
        lines(done, 96)
    printed = capsys.readouterr().out.splitlines()
    assert 2 <= len(printed) <= 11 and printed[-1] == "synthesising opt-175b float16: 96/96 layers"
    assert printed[0] == "synthesising opt-175b float16: 1/96 layers"


def test_the_terminal_bar_counts_layers():
    from rich.console import Console

    sink = io.StringIO()
    bar = StepBar("synthesising tiny float32", "layers", after="writing model.safetensors",
                  console=Console(file=sink, force_terminal=True, width=120))
    bar(1, 2)
    bar(2, 2)
    bar.close()
    text = sink.getvalue()
    assert "2/2" in text and "layers" in text and "writing model.safetensors" in text
