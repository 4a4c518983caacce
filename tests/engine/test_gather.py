"""engine.gather's contract, on the CPU (the reference) and on CUDA (the Triton kernel, marked gpu)."""

import pytest
import torch

from packbench.engine.gather import (complete_forecast, complete_forecast_reference, gather_active_rows,
                           gather_active_rows_reference)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def case(dtype, tokens, ffn=203, hidden=77, seed=0):
    """Activity with exact zeros, a -0.0 (inactive, as `h != 0` says) and a NaN (active)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.relu(torch.randn(tokens, ffn, generator=g) - 1.5).to(dtype)
    h[0, 5] = -0.0
    h[-1, 7] = float("nan")
    src = torch.randn(ffn, hidden, generator=g).to(dtype)
    workspace = torch.randn(hidden, ffn, generator=g).to(dtype)  # stale values from "another layer"
    return h, src, workspace


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_reference_copies_exactly_the_active_rows_and_counts_them(dtype, tokens):
    h, src, workspace = case(dtype, tokens)
    before = workspace.clone()
    counts = torch.zeros(3, dtype=torch.int32)
    gather_active_rows(h, src, workspace, counts, 2)
    active = [j for j in range(h.shape[1]) if any(bool(h[t, j] != 0) for t in range(tokens))]
    assert 7 in active and (5 in active) == bool((h[:, 5] != 0).any())
    assert counts.tolist() == [0, 0, len(active)]
    for j in range(h.shape[1]):
        expected = src[j] if j in active else before[:, j]
        assert torch.equal(workspace[:, j], expected), j


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 512])
@pytest.mark.parametrize("ffn", [10240 + 3, 64 * 3 + 1])  # several programs, each with a ragged end
@pytest.mark.parametrize("split", [0, 64])  # columns split over programs for calls of <= 64 tokens, or never
def test_cuda_kernel_equals_the_reference_bit_for_bit(dtype, tokens, ffn, split, monkeypatch):
    from packbench.engine import gather
    from packbench.engine.mapped import cuda_view

    monkeypatch.setattr(gather, "SPLIT_OVERRIDE", split)

    h, src, workspace = case(dtype, tokens, ffn=ffn, hidden=2560 + 5, seed=tokens)
    host = src.pin_memory()
    expected, counts_ref = workspace.clone().cuda(), torch.zeros(4, dtype=torch.int32, device="cuda")
    gather_active_rows_reference(h.cuda(), src.cuda(), expected, counts_ref, 1)
    got, counts = workspace.clone().cuda(), torch.zeros(4, dtype=torch.int32, device="cuda")
    gather_active_rows(h.cuda(), cuda_view(host), got, counts, 1)
    gather_active_rows(h.cuda(), cuda_view(host), got, counts, 3)  # again, into another layer's count
    assert torch.equal(got, expected)
    assert counts.tolist() == [0, counts_ref[1].item(), 0, counts_ref[1].item()] and counts_ref[1] > 0


def forecast_case(dtype, tokens, ffn=203, hidden=77, layers=3, seed=0):
    """A case, plus a forecast per layer that both hits and misses the active set."""
    h, src, workspace = case(dtype, tokens, ffn=ffn, hidden=hidden, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prev = (torch.rand(layers, ffn, generator=g) < 0.3).to(torch.int8)
    prev[1, 7] = 1  # forecast and active (7 is always active)
    return h, src, workspace, prev


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_prev", [True, False])
def test_forecast_completion_copies_what_the_forecast_missed_and_counts(dtype, use_prev):
    h, src, workspace, prev = forecast_case(dtype, 5)
    before, forecast = workspace.clone(), prev[1].clone().bool()
    counts = torch.zeros(4, 3, dtype=torch.int32)
    complete_forecast(h, prev, use_prev, src, workspace, counts, 1)
    active = (h != 0).any(dim=0)
    predicted = forecast if use_prev else torch.zeros_like(forecast)
    missed = active & ~predicted
    assert counts[:, 1].tolist() == [int(active.sum()), 0, int(missed.sum()), int((predicted & ~active).sum())]
    assert counts[:, [0, 2]].eq(0).all() and 0 < int(missed.sum()) < int(active.sum()) + (not use_prev)
    assert torch.equal(prev[1].bool(), active)  # the next call's forecast
    for j in range(h.shape[1]):
        expected = src[j] if missed[j] else before[:, j]
        assert torch.equal(workspace[:, j], expected), j


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("ffn", [10240 + 3, 64 * 3 + 1])
@pytest.mark.parametrize("use_prev", [True, False])
def test_cuda_forecast_kernels_equal_the_reference_bit_for_bit(dtype, tokens, ffn, use_prev):
    from packbench.engine.mapped import cuda_view

    h, src, workspace, prev = forecast_case(dtype, tokens, ffn=ffn, hidden=2560 + 5, seed=tokens)
    host = src.pin_memory()
    expected, counts_ref, prev_ref = workspace.clone().cuda(), torch.zeros(4, 3, dtype=torch.int32).cuda(), prev.cuda()
    got, counts, prev_got = workspace.clone().cuda(), torch.zeros(4, 3, dtype=torch.int32).cuda(), prev.cuda()
    if use_prev:  # the forecast's own copy first (counts[1]), as DeviceForecast.issue
        gather_active_rows_reference(prev_ref[1][None], src.cuda(), expected, counts_ref[1], 1)
        gather_active_rows(prev_got[1][None], cuda_view(host), got, counts[1], 1)
    complete_forecast_reference(h.cuda(), prev_ref, use_prev, src.cuda(), expected, counts_ref, 1)
    complete_forecast(h.cuda(), prev_got, use_prev, cuda_view(host), got, counts, 1)
    assert torch.equal(got, expected) and torch.equal(prev_got, prev_ref)
    assert counts.tolist() == counts_ref.tolist() and counts_ref[0, 1] > 0


def int8_case(dtype, tokens, ffn=203, hidden=77, seed=0):
    """A case whose rows are int8 with float32 scales (engine/policies/int8.py's layout)."""
    from packbench.engine.policies.int8 import quantize_rows

    h, src, workspace = case(dtype, tokens, ffn=ffn, hidden=hidden, seed=seed)
    q, scales = quantize_rows(src.float() * 3)
    return h, q, scales, workspace


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_reference_dequantizes_exactly_the_active_rows(dtype):
    from packbench.engine.gather import gather_active_int8_rows
    from packbench.engine.policies.int8 import dequantize_into

    h, q, scales, workspace = int8_case(dtype, 9)
    before = workspace.clone()
    counts = torch.zeros(2, dtype=torch.int32)
    gather_active_int8_rows(h, q, scales, workspace, counts, 1, dequantize=dequantize_into)
    dense = dequantize_into(torch.empty(q.shape, dtype=dtype), q, scales[:, None])  # every row, as dense-stream
    active = (h != 0).any(dim=0)
    assert counts.tolist() == [0, int(active.sum())]
    for j in range(h.shape[1]):
        assert torch.equal(workspace[:, j], dense[j] if active[j] else before[:, j]), j


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 512])
@pytest.mark.parametrize("ffn", [10240 + 3, 64 * 3 + 1])
@pytest.mark.parametrize("split", [0, 64])
def test_cuda_int8_kernel_equals_the_reference_bit_for_bit(dtype, tokens, ffn, split, monkeypatch):
    """The Triton int8 gather against the plain-torch reference on the device: the same bits
    (one float32 product rounded once, to nearest even) and the same counts."""
    from packbench.engine import gather
    from packbench.engine.gather import gather_active_int8_rows, gather_active_int8_rows_reference

    monkeypatch.setattr(gather, "SPLIT_OVERRIDE", split)
    from packbench.engine.mapped import cuda_view
    from packbench.engine.policies.int8 import dequantize_into

    h, q, scales, workspace = int8_case(dtype, tokens, ffn=ffn, hidden=2560 + 5, seed=tokens)
    expected, counts_ref = workspace.clone().cuda(), torch.zeros(4, dtype=torch.int32, device="cuda")
    gather_active_int8_rows_reference(h.cuda(), q.cuda(), scales.cuda(), expected, counts_ref, 1,
                                      dequantize=dequantize_into)
    got, counts = workspace.clone().cuda(), torch.zeros(4, dtype=torch.int32, device="cuda")
    for layer in (1, 3):  # again, into another layer's count
        rows = cuda_view(q.view(torch.uint8).pin_memory()).view(torch.int8)  # mapped as the policy maps its slabs
        gather_active_int8_rows(h.cuda(), rows, cuda_view(scales.pin_memory()), got, counts, layer,
                                dequantize=dequantize_into)
    assert torch.equal(got, expected)
    assert counts.tolist() == [0, counts_ref[1].item(), 0, counts_ref[1].item()] and counts_ref[1] > 0
