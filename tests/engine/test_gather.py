"""engine.gather's contract, on the CPU (the reference) and on CUDA (the Triton kernel, marked gpu)."""

import pytest
import torch

from engine.gather import gather_active_rows, gather_active_rows_reference

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
def test_cuda_kernel_equals_the_reference_bit_for_bit(dtype, tokens, ffn):
    from engine.mapped import cuda_view

    h, src, workspace = case(dtype, tokens, ffn=ffn, hidden=2560 + 5, seed=tokens)
    host = src.pin_memory()
    expected, counts_ref = workspace.clone().cuda(), torch.zeros(4, dtype=torch.int32, device="cuda")
    gather_active_rows_reference(h.cuda(), src.cuda(), expected, counts_ref, 1)
    got, counts = workspace.clone().cuda(), torch.zeros(4, dtype=torch.int32, device="cuda")
    gather_active_rows(h.cuda(), cuda_view(host), got, counts, 1)
    gather_active_rows(h.cuda(), cuda_view(host), got, counts, 3)  # again, into another layer's count
    assert torch.equal(got, expected)
    assert counts.tolist() == [0, counts_ref[1].item(), 0, counts_ref[1].item()] and counts_ref[1] > 0
