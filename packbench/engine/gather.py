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

# Tile of the CUDA kernel: BLOCK_R neurons per program, their rows read BLOCK_H elements at a
# time by NUM_WARPS warps, activity tested BLOCK_T tokens at a time. Chosen on the H200 by decode
# time in bench.engine (`+tile=` variants alternated; docs/experiments/gather.md, "The device
# gather's tile") after
# `python -m bench.mapped_gather --grid` narrowed the candidates: 64 neurons per program against
# the earlier 16 made decode 16 % faster at opt-13b, 10 % at opt-6.7b, and kept opt-2.7b's.
BLOCK_R, BLOCK_H, NUM_WARPS, BLOCK_T = 64, 128, 8, 8
TILE_OVERRIDE: tuple[int, int, int] | None = None  # (BLOCK_R, BLOCK_H, NUM_WARPS): a bench's variant
# Calls of at most SPLIT_TOKENS tokens (decode) split each neuron block's columns over programs
# (engine/triton_gather.py, "Column split"); longer calls (prefill: a dense union) do not.
SPLIT_TOKENS = 64
SPLIT_OVERRIDE: int | None = None  # a bench's variant of SPLIT_TOKENS


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
    from packbench.engine.triton_gather import complete_forecast_cuda

    complete_forecast_cuda(h.reshape(-1, h.shape[-1]).contiguous(), prev, use_prev, src, workspace, counts, layer,
                           **tile())


def gather_active_rows(h: torch.Tensor, src: torch.Tensor, workspace: torch.Tensor,
                       counts: torch.Tensor, layer: int) -> None:
    if h.device.type != "cuda":
        gather_active_rows_reference(h, src, workspace, counts, layer)
        return
    from packbench.engine.triton_gather import gather_active_rows_cuda  # Triton ships with CUDA builds of torch

    gather_active_rows_cuda(h.reshape(-1, h.shape[-1]).contiguous(), src, workspace, counts, layer, **tile(),
                            split=split_columns(h))


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
    from packbench.engine.triton_gather import gather_active_int8_rows_cuda

    gather_active_int8_rows_cuda(h.reshape(-1, h.shape[-1]).contiguous(), rows, scales, workspace, counts, layer,
                                 **tile(), split=split_columns(h))
