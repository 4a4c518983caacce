"""bench.batch on the CPU (the twin of the H200 sweep, bench/batch_device.sh): each batch's line
carries the bytes a call moved and packet's bit check, so a run cut short still has them."""

import re

import pytest

from bench import batch


def test_each_batch_line_says_bytes_and_that_packet_is_dense_streams_bits(tmp_path, capsys):
    batch.main(["--shape", "tiny", "--dtype", "float32", "--batches", "1,2", "--prefix", "8", "--continuation", "3",
                "--rounds", "1", "--mode", "graph", "--competitor-modes", "eager", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = {int(m.group(1)): m for m in re.finditer(
        r"batch +(\d+): .* packet \(([\d,]+) of ([\d,]+) bytes a call, bit-identical: (\w+)\)", out)}
    assert sorted(lines) == [1, 2], out
    for m in lines.values():
        assert m.group(4) == "yes"
        assert 0 < int(m.group(2).replace(",", "")) < int(m.group(3).replace(",", ""))
    # batch 2 moves the union of two sequences' rows
    assert int(lines[1].group(2).replace(",", "")) <= int(lines[2].group(2).replace(",", ""))
    rows = [r for r in out.splitlines() if re.match(r"\| [12] \|", r)]
    assert len(rows) == 2 and all("| yes |" in r for r in rows), out


def test_a_competitor_that_cannot_be_built_is_not_measured_rather_than_never_faster(tmp_path, capsys, monkeypatch):
    import packbench.engine.quantized

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'torchao'")

    monkeypatch.setattr(packbench.engine.quantized, "QuantizedModel", missing)
    batch.main(["--shape", "tiny", "--dtype", "float32", "--batches", "1", "--prefix", "8", "--continuation", "2",
                "--rounds", "1", "--mode", "eager", "--competitor-modes", "compile", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "int8 model not built: ModuleNotFoundError: No module named 'torchao'" in out
    assert "packets against int8 compile: not measured (ModuleNotFoundError: No module named 'torchao')" in out
    assert "stop paying against int8" not in out
    assert re.search(r"packets stop paying against dense-stream: (from batch 1|not within batches 1)$", out, re.M), out


@pytest.mark.parametrize("args, fragment", [
    (["--batches", "1", "--competitor-batches", "4"], "--competitor-batches 4: not among --batches 1"),
    (["--batches", "99999999999999999999"], "batch sizes are 1 to 65536"),
    (["--prefix", "0"], "--prefix and --continuation are at least 1 and together at most tiny's 256 positions"),
    (["--prefix", "250", "--continuation", "16"], "together at most tiny's 256 positions"),
    (["--competitor-modes", "fast"], "--competitor-modes: 'fast': each is one of eager, graph, compile"),
    (["--rounds", "0"], "--rounds and --allowance-mib are at least 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, fragment, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        batch.main(["--shape", "tiny", "--dtype", "float32", "--dir", str(tmp_path), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "tiny-float32-opt").exists()  # refused before anything was made
