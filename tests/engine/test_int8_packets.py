"""Quantized packets (`weights: int8`): int8 packets bit-identical to the int8 dense-stream in
three activation dtypes, their ledgers byte-exact (rows x (hidden int8 + 4-byte scale)), and
the quantization's own contract (CPU twins of test_int8_packets_cuda.py)."""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.conditions import POLICIES
from packbench.engine.policies.int8 import Int8DenseStream, Int8DevicePacket, Int8Packet, dequantize_into, int8_layout, quantize_rows
from packbench.engine.policies.int8 import slab_views
from packbench.core.registry import SHAPES

CONTINUATION = 5
PREFILLS = (1, 64)
INT8 = {"dense-int8": ("dense-stream", {"weights": "int8"}),
        "packet-int8": ("packet", {"gather": "host", "weights": "int8"}),
        "packet-int8+gather=device": ("packet", {"gather": "device", "weights": "int8"}),
        "dense-stream": ("dense-stream", {}),
        "packet": ("packet", {})}
DTYPES = ("float32", "float16", "bfloat16")


def prompt_of(length: int, vocab: int) -> list[int]:
    return [2] + [(7 * i + 11) % (vocab - 4) + 4 for i in range(length - 1)]


@pytest.fixture(scope="module", params=DTYPES)
def runs(request, checkpoints):
    """Every int8 variant and the fp pair, both prefill lengths, tiny in one activation dtype."""
    dtype = request.param
    model = CpuFirstModel(checkpoints[dtype], dtype=getattr(torch, dtype), device=torch.device("cpu"))
    outs = {}
    for n in PREFILLS:
        prompt = prompt_of(n, model.vocab)
        for key, (name, params) in INT8.items():
            model.use(name, **params)
            outs[key, n] = run_episode(model, prompt, continuation=CONTINUATION)
    return dtype, model, outs


def test_int8_packets_are_bit_identical_to_the_int8_dense_stream(runs):
    _, _, outs = runs
    for n in PREFILLS:
        ref = outs["dense-int8", n]
        for key in ("packet-int8", "packet-int8+gather=device"):
            assert np.array_equal(outs[key, n].logits, ref.logits), (key, n)
            assert outs[key, n].tokens == ref.tokens, (key, n)
        # the int8 weights are not the checkpoint's: the comparison can tell them apart
        assert not np.array_equal(ref.logits, outs["dense-stream", n].logits), n


def test_int8_ledgers_count_int8_rows_plus_their_scales(runs):
    dtype, model, outs = runs
    s = SHAPES["tiny"]
    row = s["hidden"] + 4  # hidden int8 values and one float32 scale
    for n in PREFILLS:
        dense = outs["dense-int8", n].calls
        assert all(c.h2d_weight_bytes == [s["ffn"] * row] * s["layers"] for c in dense)
        assert all(c.rows_copied == [s["ffn"]] * s["layers"] and sum(c.h2d_index_bytes) == 0 for c in dense)
        host, device = outs["packet-int8", n].calls, outs["packet-int8+gather=device", n].calls
        assert [c.active_rows for c in host] == [c.active_rows for c in device]
        for c in host:
            assert c.rows_copied == c.active_rows
            assert c.h2d_weight_bytes == [k * row for k in c.active_rows]
            assert c.h2d_index_bytes == [k * 8 for k in c.active_rows]
            assert c.d2h_bytes == [s["ffn"]] * s["layers"]  # the activity mask
        for c in device:
            assert c.h2d_weight_bytes == [k * row for k in c.active_rows]
            assert c.h2d_index_bytes == [0] * s["layers"] and c.d2h_bytes == [4] * s["layers"]
        # Layer 0 of the prefill sees no quantized fc2 yet: the fp packet's rows, counted apart.
        assert host[0].active_rows[0] == outs["packet", n].calls[0].active_rows[0] > 0
        # against fp's bytes per row: (hidden + 4) / (hidden x itemsize)
        fp_row = s["hidden"] * getattr(torch, dtype).itemsize
        assert sum(sum(c.h2d_weight_bytes) for c in dense) * fp_row == (
            sum(sum(c.h2d_weight_bytes) for c in outs["dense-stream", n].calls) * row)


def test_quantization_is_symmetric_absmax_per_outgoing_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 16, generator=g) * torch.arange(1, 7)[:, None]
    w[3] = 0.0
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and q.shape == (6, 16)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(scales[[0, 1, 2, 4, 5]], w[[0, 1, 2, 4, 5]].abs().amax(dim=1) / 127) and scales[3] == 1
    assert torch.equal(q[3], torch.zeros(16, dtype=torch.int8))
    assert float((q.float() * scales[:, None] - w).abs().max()) <= float(scales.max()) / 2 + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packet_dequantizes_to_the_columns_of_the_dense_matrix(dtype):
    """The elementwise contract exactness rests on, alone: gathered rows vs the whole matrix."""
    g = torch.Generator().manual_seed(1)
    q, scales = quantize_rows(torch.randn(40, 24, generator=g))
    dense = dequantize_into(torch.zeros(24, 40, dtype=getattr(torch, dtype)), q.t(), scales[None, :])
    rows = torch.tensor([0, 3, 17, 39])
    packet = dequantize_into(torch.empty(4, 24, dtype=getattr(torch, dtype)), q[rows], scales[rows][:, None])
    assert torch.equal(packet.t(), dense[:, rows])
    assert torch.equal(dense, (q.t().float() * scales[None, :]).to(getattr(torch, dtype)))


def test_the_int8_host_layout_is_one_slab_per_layer_and_charged(tiny):
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    hidden, ffn = model.host.shape
    before = model.host.host_bytes
    slabs = int8_layout(model.host)
    assert [s.numel() for s in slabs] == [ffn * (4 + hidden)] * model.host.layers
    assert model.host.host_bytes == before + model.host.layers * ffn * (4 + hidden)
    scales, rows = slab_views(slabs[1], ffn, hidden)
    q, s = quantize_rows(model.host.original[1].t())
    assert torch.equal(rows, q) and torch.equal(scales, s)
    assert int8_layout(model.host) is slabs  # made once


# tiny float32: hidden 64, ffn 256, 2 layers
WORKSPACE, SLAB = 64 * 256 * 4, 256 * (4 + 64)
CHARGED = {
    ("dense-stream", (("weights", "int8"),)): (Int8DenseStream, 2 * SLAB + WORKSPACE),
    ("packet", (("gather", "host"), ("weights", "int8"))): (Int8Packet, WORKSPACE + 256 * (8 + 4 + 64)),
    ("packet", (("gather", "device"), ("weights", "int8"))): (Int8DevicePacket, WORKSPACE + 2 * 4),
}


def test_int8_buffers_exist_from_activate_to_deactivate_and_are_charged(tiny):
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    for (name, params), (cls, device_bytes) in CHARGED.items():
        policy = POLICIES[name](**dict(params))
        assert type(policy) is cls and policy.name == name and policy.weights == "int8"
        assert policy.device_bytes() == 0
        policy.activate(model.host, model.device, model.recorder)
        assert (policy.device_bytes(), policy.pinned_bytes()) == (device_bytes, 0), name
        policy.deactivate()
        assert policy.device_bytes() == 0 and getattr(policy, "buffers", None) is None, name


@pytest.mark.parametrize("name, params", [("packet", {"weights": "int4"}), ("dense-stream", {"weights": "fp8"}),
                                          ("packet", {"weights": "int8", "gather": "gpu"})])
def test_unknown_weight_formats_are_refused_naming_the_choices(name, params):
    with pytest.raises(ValueError, match="must be one of"):
        POLICIES[name](**params)
