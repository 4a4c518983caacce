"""The device-side gathers of `packet {gather: device}` (`engine.policies.device_gather.DevicePacket`) and
`early-forecast {gather: device}` (`engine.policies.device_gather.DeviceForecast`): the compute device finds a
layer's active neurons and pulls their outgoing rows from host memory itself, with no host
synchronisation.

`gather_active_rows(h, src, workspace, counts, layer)`:
- h: (tokens, ffn) fc2 input of one call; a neuron is active if it is non-zero in any token.
- src: (ffn, hidden) outgoing rows of the layer; on CUDA a mapped view of pinned host memory
  (`engine.mapped.cuda_view`), so the GPU reads only the active rows, over PCIe.
- workspace: (hidden, ffn) dense device weight; column j is overwritten for every active j and
  left as it was otherwise (inactive columns meet exact zeros in h).
- counts: (layers,) int32 on the device; counts[layer] += number of active neurons.

On CUDA one Triton kernel does all of it: activity test, copy, count. Nothing waits for the
count, so the host keeps launching the next layers while the GPU pulls rows; the ledger reads
every layer's count once, after the call's logits have come back (`Recorder.defer`). The
previous version (`nonzero` + `index_select` + `index_copy_`) synchronised once per layer for
nonzero's output size. Elsewhere (CPU) the same contract is met by plain torch ops, the
reference the kernel is tested against.

`complete_forecast(h, prev, use_prev, src, workspace, counts, layer)`, early-forecast's second
half (its first is `gather_active_rows` with the forecast as `h`):
- prev: (layers, ffn) int8 on the device, each layer's active set in its last call: this
  call's forecast, whose rows are already in the workspace. Overwritten with this call's set.
- copies the active rows the forecast missed (every row when use_prev is False: a prefill);
- counts: (4, layers) int32; adds the active rows to counts[0, layer], the rows copied here to
  counts[2, layer], the forecast rows that were not active (wasted) to counts[3, layer]
  (counts[1] is the forecast's own copy).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Tile of the CUDA kernel: BLOCK_R neurons per program, their rows read BLOCK_H elements at a
# time by NUM_WARPS warps, activity tested BLOCK_T tokens at a time. Chosen on the H200 by decode
# time in bench.engine (`+tile=` variants alternated; docs/benchmarks.md, "The device gather's tile") after
# `python -m bench.mapped_gather --grid` narrowed the candidates: 64 neurons per program against
# the earlier 16 made decode 16 % faster at opt-13b, 10 % at opt-6.7b, and kept opt-2.7b's.
BLOCK_R, BLOCK_H, NUM_WARPS, BLOCK_T = 64, 128, 8, 8
TILE_OVERRIDE: tuple[int, int, int] | None = None  # (BLOCK_R, BLOCK_H, NUM_WARPS): a bench's variant
# Calls of at most SPLIT_TOKENS tokens (decode) split each neuron block's columns over programs
# (engine/triton_gather.py, "Column split"); longer calls (prefill: a dense union) do not.
SPLIT_TOKENS = 64
SPLIT_OVERRIDE: int | None = None  # a bench's variant of SPLIT_TOKENS


# A captured decode step multiplies fc2 in FC2_CHUNKS chunks of output rows, each as soon as its
# columns of the active rows have landed, on a second stream while the next chunk crosses PCIe
# (`gather_fc2`). Chosen on the H200 by `python -m bench.fc2_pipeline` and bench.engine
# (docs/benchmarks.md, "fc2 under the gather").
FC2_CHUNKS = 4
FC2_CHUNKS_OVERRIDE: int | None = None  # a bench's variant (1: fc2 after the whole gather)


def split_columns(h: torch.Tensor) -> bool:
    """Whether this call splits each neuron block's columns over programs (one program per column
    tile): a call of at most SPLIT_TOKENS tokens (SPLIT_OVERRIDE, a bench's variant, first)."""
    limit = SPLIT_TOKENS if SPLIT_OVERRIDE is None else SPLIT_OVERRIDE
    return 0 < h.numel() // h.shape[-1] <= limit


def gather_active_rows_reference(h: torch.Tensor, src: torch.Tensor, workspace: torch.Tensor,
                                 counts: torch.Tensor, layer: int) -> None:
    """Plain torch (any device). On CUDA, nonzero synchronises for its output size."""
    active = (h != 0).any(dim=0).nonzero().squeeze(1)
    workspace.index_copy_(1, active, src.index_select(0, active).t())
    counts[layer] += active.numel()


def complete_forecast_reference(h: torch.Tensor, prev: torch.Tensor, use_prev: bool, src: torch.Tensor,
                                workspace: torch.Tensor, counts: torch.Tensor, layer: int) -> None:
    """Plain torch (any device)."""
    active = (h != 0).any(dim=0)
    predicted = prev[layer] != 0 if use_prev else torch.zeros_like(active)
    missed = (active & ~predicted).nonzero().squeeze(1)
    workspace.index_copy_(1, missed, src.index_select(0, missed).t())
    counts[0, layer] += active.sum()
    counts[2, layer] += missed.numel()
    counts[3, layer] += (predicted & ~active).sum()
    prev[layer] = active


def tile() -> dict:
    block_r, block_h, num_warps = TILE_OVERRIDE or (BLOCK_R, BLOCK_H, NUM_WARPS)
    return dict(block_r=block_r, block_h=block_h, block_t=BLOCK_T, num_warps=num_warps)


def complete_forecast(h: torch.Tensor, prev: torch.Tensor, use_prev: bool, src: torch.Tensor,
                      workspace: torch.Tensor, counts: torch.Tensor, layer: int) -> None:
    if h.device.type != "cuda":
        complete_forecast_reference(h, prev, use_prev, src, workspace, counts, layer)
        return
    from engine.triton_gather import complete_forecast_cuda

    complete_forecast_cuda(h.reshape(-1, h.shape[-1]).contiguous(), prev, use_prev, src, workspace, counts, layer,
                           **tile())


def gather_active_rows(h: torch.Tensor, src: torch.Tensor, workspace: torch.Tensor,
                       counts: torch.Tensor, layer: int) -> None:
    if h.device.type != "cuda":
        gather_active_rows_reference(h, src, workspace, counts, layer)
        return
    from engine.triton_gather import gather_active_rows_cuda  # Triton ships with CUDA builds of torch

    gather_active_rows_cuda(h.reshape(-1, h.shape[-1]).contiguous(), src, workspace, counts, layer, **tile(),
                            split=split_columns(h))


def fc2_chunks(hidden: int, chunks: int, block: int) -> list[tuple[int, int]]:
    """`chunks` ranges of fc2's output rows covering 0..hidden, each a whole number of the
    gather's column tiles where it can be (the last takes the rest)."""
    tiles = max(1, hidden // block)
    chunks = max(1, min(chunks, tiles))
    edges = [round(i * tiles / chunks) * block for i in range(chunks)] + [hidden]
    return list(zip(edges[:-1], edges[1:]))


def gather_fc2(h: torch.Tensor, src: torch.Tensor, workspace: torch.Tensor, counts: torch.Tensor, layer: int,
               bias: torch.Tensor | None, branch: "torch.cuda.Stream") -> torch.Tensor | None:
    """The layer's gather and fc2 (F.linear(h, workspace, bias)) with fc2 under the gather, or
    None where this does not apply (not CUDA, a call that does not split its columns, one chunk).

    fc2's output rows [c0, c1) read only workspace rows [c0, c1), i.e. columns c0..c1 of the
    active rows. So the gather runs chunk by chunk on the current stream, and once a chunk has
    landed its rows of fc2 run on `branch` while the next chunk crosses PCIe: the copy is
    PCIe-bound, the matmul HBM-bound. Each chunk is F.linear over a contiguous row slice of the
    workspace, which cuBLAS answers with the bits of the whole product's rows (checked per shape
    and dtype by `python -m bench.fc2_pipeline` and tests/engine/test_gather_cuda.py); an exactness
    check against dense-stream still guards every condition. Meant for a captured step (the
    branch is engine/graph.py's): eagerly, tensors made on `branch` would need record_stream.
    """
    chunks = FC2_CHUNKS if FC2_CHUNKS_OVERRIDE is None else FC2_CHUNKS_OVERRIDE
    if h.device.type != "cuda" or chunks <= 1 or not split_columns(h):
        return None
    from engine.triton_gather import gather_active_rows_cuda

    x = h.reshape(-1, h.shape[-1]).contiguous()
    hidden, t = workspace.shape[0], x.shape[0]
    kernel = tile()
    main = torch.cuda.current_stream()
    out = torch.empty((t, hidden), dtype=workspace.dtype, device=workspace.device)
    parts = []
    for c0, c1 in fc2_chunks(hidden, chunks, kernel["block_h"]):
        gather_active_rows_cuda(x, src, workspace, counts, layer, **kernel, split=True, columns=(c0, c1))
        branch.wait_stream(main)  # this chunk's columns have landed
        with torch.cuda.stream(branch):
            b = None if bias is None else bias[c0:c1]
            if t == 1:  # a (1, c1 - c0) slice of out is contiguous: F.linear's own addmm writes it in place
                if b is None:
                    torch.mm(x, workspace[c0:c1].t(), out=out[:, c0:c1])
                else:
                    torch.addmm(b, x, workspace[c0:c1].t(), out=out[:, c0:c1])
            else:
                parts.append(F.linear(x, workspace[c0:c1], b))
    main.wait_stream(branch)
    out = torch.cat(parts, dim=1) if parts else out
    return out.view(*h.shape[:-1], hidden)


def gather_active_int8_rows_reference(h: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                                      workspace: torch.Tensor, counts: torch.Tensor, layer: int, *,
                                      dequantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                                      ) -> None:
    """Plain torch (any device). On CUDA, nonzero synchronises for its output size."""
    active = (h != 0).any(dim=0).nonzero().squeeze(1)
    landed = torch.empty((active.numel(), rows.shape[1]), dtype=workspace.dtype, device=workspace.device)
    dequantize(landed, rows.index_select(0, active), scales.index_select(0, active)[:, None])
    workspace.index_copy_(1, active, landed.t())
    counts[layer] += active.numel()


def gather_active_int8_rows(h: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, workspace: torch.Tensor,
                            counts: torch.Tensor, layer: int, *,
                            dequantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """`gather_active_rows` over int8 rows (`packet {gather: device, weights: int8}`):
    rows (ffn, hidden) int8 and scales (ffn,) float32, on CUDA mapped views of pinned host
    memory; the active rows are read, dequantized as `dequantize(out, q, scales)` does
    (engine/policies/int8.py) and written into their workspace columns. On CUDA one Triton
    kernel does it with no host synchronisation (so mode graph captures it); elsewhere the
    plain-torch reference, which the kernel is tested against bit for bit."""
    if h.device.type != "cuda":
        gather_active_int8_rows_reference(h, rows, scales, workspace, counts, layer, dequantize=dequantize)
        return
    from engine.triton_gather import gather_active_int8_rows_cuda

    gather_active_int8_rows_cuda(h.reshape(-1, h.shape[-1]).contiguous(), rows, scales, workspace, counts, layer,
                                 **tile(), split=split_columns(h))
