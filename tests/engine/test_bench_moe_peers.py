"""bench.moe_peers on the CPU (the twin of bench/moe_peers_device.sh's crossover sweep): every
batch's line per condition, cold apart from warm, the loaders bit-identical to dense-stream at
the same batch, host-experts judged by fidelity; and the crossover rule on its own."""

import re

import pytest
import torch

from bench import moe_peers
from packbench.engine.moe.synth import synth_moe


def test_the_crossover_is_the_first_batch_from_which_the_packet_stays_faster():
    # Catches a rule that takes the first batch where the packet wins once (2 here), not for good.
    ms = {1: {"packet": 3.0, "host-experts": 1.0}, 2: {"packet": 1.0, "host-experts": 2.0},
          4: {"packet": 5.0, "host-experts": 4.0}, 8: {"packet": 5.0, "host-experts": 6.0},
          16: {"packet": 6.0, "host-experts": 9.0}}
    assert moe_peers.crossover(ms) == 8
    assert moe_peers.crossover({1: {"packet": 2.0, "host-experts": 1.0}}) is None
    assert moe_peers.crossover({1: {"packet": 1.0, "host-experts": 1.0}}) == 1  # a tie pays already
    assert moe_peers.crossover({1: {"packet": 1.0}}) is None  # host-experts not measured: no claim
    # each mover on its own figures: the mapped packet's crossover is not the device gather's
    both = {1: {"packet": 3.0, "packet-mapped": 0.5, "host-experts": 1.0},
            2: {"packet": 1.0, "packet-mapped": 0.5, "host-experts": 2.0}}
    assert moe_peers.crossover(both) == 2 and moe_peers.crossover(both, "packet-mapped") == 1
    # llama.cpp's own pair: op offload on (moves the experts) against off (computes them on the host)
    lc = {1: {"llama-cpp-po": 2.0, "llama-cpp": 1.0, "packet": 0.1, "host-experts": 9.0},
          32: {"llama-cpp-po": 1.0, "llama-cpp": 3.0, "packet": 0.1, "host-experts": 9.0}}
    assert moe_peers.crossover(lc, "llama-cpp-po", "llama-cpp") == 32 and moe_peers.crossover(lc) == 1


def test_each_batch_reports_every_condition_cold_and_warm(tmp_path, capsys):
    torch.set_num_threads(1)
    path = synth_moe(tmp_path / "olmoe", shape="olmoe-tiny", seed=1, dtype="float32")
    moe_peers.main(["--model", str(path), "--dtype", "float32", "--batches", "1,2", "--prefix", "8",
                    "--continuation", "3", "--rounds", "1", "--threads", "1", "--hot", "16"])
    out = capsys.readouterr().out
    rows = re.findall(r"^ *(\d+) (\S+) +(cold|warm) .*$", out, re.M)
    names = [*moe_peers.DEFAULT, "host-hot"]
    assert sorted(set(rows)) == sorted({(b, n, s) for b in ("1", "2") for n in names for s in ("cold", "warm")}), out
    warm = {(m.group(1), m.group(2)): m.group(0) for m in re.finditer(r"^ *(\d+) (\S+) +warm .*$", out, re.M)}
    for b in ("1", "2"):
        assert warm[(b, "packet")].endswith("exact") and warm[(b, "dense-stream")].endswith("exact")
        assert warm[(b, "packet-mapped")].endswith("exact")
        # on the CPU the host's arithmetic is the device's: fidelity is perfect here
        assert "KL 0.00e+00 top1 1.000 max|d| 0 diverges never" in warm[(b, "host-experts")]
        h2d = float(warm[(b, "host-experts")].split()[6])  # MB/call: B tokens' outputs, 3 layers of 64 fp32
        assert h2d == round(int(b) * 64 * 4 * 3 / 1e6, 3)
        # every expert held on the device (olmoe-tiny has 16): dense-stream's bits, all hits, nothing moves
        assert "KL 0.00e+00 top1 1.000" in warm[(b, "host-hot")] and warm[(b, "host-hot")].endswith("hit rate 1.000")
        assert float(warm[(b, "host-hot")].split()[6]) == 0.0
    for mover in moe_peers.MOVERS:
        assert re.search(rf"^crossover: ({mover} faster from batch [12]|{mover} never faster) ", out, re.M), out


@pytest.mark.llamacpp
def test_llama_cpp_conditions_run_beside_the_packets_and_are_judged_by_fidelity(tmp_path, capsys):
    # Catches llama.cpp's conditions run through CpuFirstMoE.use (an unknown policy), a llama.cpp model
    # kept past its batch (sized for the last one), or llama.cpp judged as a loader (bit-identical).
    torch.set_num_threads(1)
    path = synth_moe(tmp_path / "qwen", shape="qwen3-moe-tiny", seed=1, dtype="float32")
    moe_peers.main(["--model", str(path), "--dtype", "float32", "--batches", "1,2", "--prefix", "8",
                    "--continuation", "3", "--rounds", "1", "--threads", "1", "--cache", str(tmp_path / "cache"),
                    "--conditions", "packet,host-experts,llama-cpp,llama-cpp-po"])
    out = capsys.readouterr().out
    warm = {(m.group(1), m.group(2)): m.group(0) for m in re.finditer(r"^ *(\d+) (\S+) +warm .*$", out, re.M)}
    for b in ("1", "2"):
        for n in ("llama-cpp", "llama-cpp-po"):
            kl = float(re.search(r"KL (\S+) top1 (\S+)", warm[(b, n)]).group(1))
            assert kl < 1e-3 and " top1 1.000 " in warm[(b, n)], warm[(b, n)]
            assert float(warm[(b, n)].split()[6]) == 0.0  # a CPU worker's llama.cpp moves nothing
        assert warm[(b, "packet")].endswith("exact")
    assert re.search(r"^crossover: llama-cpp-po (faster from batch [12]|never faster) than llama-cpp ", out, re.M), out
