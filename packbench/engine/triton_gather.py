"""Triton kernels behind `engine.gather.gather_active_rows` and `complete_forecast` on CUDA
(imported only there).

Each program owns BLOCK_R consecutive neurons: it tests them for activity over every token of
the call, adds how many are active to counts[layer] (one atomic), and, if any is, copies their
outgoing rows from `src` (mapped host memory: inactive rows are never read) into the matching
workspace columns, BLOCK_H elements at a time. The copy is a bitwise move, so exactness does
not depend on the kernel's tiling. early-forecast's completion tests activity the same way and
copies only the active rows its forecast missed (`_active_rows` and `_copy_rows` are shared).

Column split (the gathers, not the forecast's completion): with `split` the grid has a second
axis of one program per column tile, and program (r, c) copies column tile c of its neurons' active
rows; every program of a neuron block tests their activity (h is on the device: cheap for the
few tokens of a decode call), the first one counts them. At decode a block of 64 neurons holds
about 2 active rows (3.3 % density), so one program reading a row 128 columns at a time makes 20
PCIe round trips in a row; split, they are in flight at once. The forecast's completion is not
split: its programs read and then rewrite `prev`, which another share would race with.
"""

import triton
import triton.language as tl


@triton.jit
def _active_rows(h_ptr, n_tokens, rows64, in_range, ffn, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """The program's neurons that are non-zero in any token of h (tokens, ffn)."""
    hits = tl.zeros([BLOCK_R], dtype=tl.int32)
    for t0 in range(0, n_tokens, BLOCK_T):
        t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        x = tl.load(h_ptr + t[:, None] * ffn + rows64[None, :],
                    mask=(t[:, None] < n_tokens) & in_range[None, :], other=0)
        hits += tl.sum((x != 0).to(tl.int32), axis=0)
    return (hits > 0) & in_range


@triton.jit
def _copy_rows(src_ptr, ws_ptr, rows64, which, ffn, hidden, first, step, BLOCK_H: tl.constexpr):
    """Rows `which` of src (ffn, hidden) into the same columns of the workspace (hidden, ffn):
    the column tiles starting at `first`, every `step` columns (all of them: 0, BLOCK_H)."""
    for h0 in range(first, hidden, step):
        cols = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        m = which[:, None] & (cols[None, :] < hidden)
        tile = tl.load(src_ptr + rows64[:, None] * hidden + cols[None, :], mask=m)
        tl.store(ws_ptr + cols[None, :] * ffn + rows64[:, None], tile, mask=m)


@triton.jit(do_not_specialize=["layer"])  # one compiled variant serves every layer
def _gather_active_rows(h_ptr, n_tokens, src_ptr, ws_ptr, count_ptr, layer, ffn, hidden,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < ffn
    rows64 = rows.to(tl.int64)
    active = _active_rows(h_ptr, n_tokens, rows64, in_range, ffn, BLOCK_R, BLOCK_T)
    n_active = tl.sum(active.to(tl.int32), axis=0)
    if n_active > 0:
        split = tl.program_id(1)  # which share of the columns (module docstring: column split)
        if split == 0:
            tl.atomic_add(count_ptr + layer, n_active)
        _copy_rows(src_ptr, ws_ptr, rows64, active, ffn, hidden, split * BLOCK_H, tl.num_programs(1) * BLOCK_H,
                   BLOCK_H)


@triton.jit(do_not_specialize=["layer"])
def _gather_active_int8_rows(h_ptr, n_tokens, rows_ptr, scales_ptr, ws_ptr, count_ptr, layer, ffn, hidden,
                             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """`_gather_active_rows` over int8 rows: each active row's int8 values and float32 scale are
    read from mapped host memory and written as dtype(float32(q) * scale), the arithmetic of
    engine/policies/int8.py `dequantize_into` (one float32 product, rounded once to the
    workspace's dtype, to nearest even), so a row lands with the bits the dense int8 path gives."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < ffn
    rows64 = rows.to(tl.int64)
    active = _active_rows(h_ptr, n_tokens, rows64, in_range, ffn, BLOCK_R, BLOCK_T)
    n_active = tl.sum(active.to(tl.int32), axis=0)
    if n_active > 0:
        split = tl.program_id(1)
        if split == 0:
            tl.atomic_add(count_ptr + layer, n_active)
        scale = tl.load(scales_ptr + rows64, mask=active, other=0.0)
        for h0 in range(split * BLOCK_H, hidden, tl.num_programs(1) * BLOCK_H):
            cols = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            m = active[:, None] & (cols[None, :] < hidden)
            q = tl.load(rows_ptr + rows64[:, None] * hidden + cols[None, :], mask=m, other=0)
            value = q.to(tl.float32) * scale[:, None]
            tl.store(ws_ptr + cols[None, :] * ffn + rows64[:, None], value.to(ws_ptr.dtype.element_ty), mask=m)


def gather_active_int8_rows_cuda(h, rows, scales, workspace, counts, layer, *, block_r, block_h, block_t,
                                 num_warps=4, split=False) -> None:
    n_tokens, ffn = h.shape
    hidden = rows.shape[1]
    if (rows.shape != (ffn, hidden) or scales.shape != (ffn,) or workspace.shape != (hidden, ffn)
            or not workspace.is_contiguous()):
        raise ValueError(f"shapes do not match: h {tuple(h.shape)}, rows {tuple(rows.shape)}, "
                         f"scales {tuple(scales.shape)}, workspace {tuple(workspace.shape)}")
    grid = (triton.cdiv(ffn, block_r), triton.cdiv(hidden, block_h) if split else 1)
    _gather_active_int8_rows[grid](h, n_tokens, rows, scales, workspace, counts, layer, ffn, hidden,
                                   BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_T=block_t, num_warps=num_warps)


def gather_active_rows_cuda(h, src, workspace, counts, layer, *, block_r, block_h, block_t, num_warps=4,
                            split=False) -> None:
    n_tokens, ffn = h.shape
    hidden = src.shape[1]
    if src.shape != (ffn, hidden) or workspace.shape != (hidden, ffn) or not workspace.is_contiguous():
        raise ValueError(f"shapes do not match: h {tuple(h.shape)}, src {tuple(src.shape)}, "
                         f"workspace {tuple(workspace.shape)}")
    grid = (triton.cdiv(ffn, block_r), triton.cdiv(hidden, block_h) if split else 1)
    _gather_active_rows[grid](h, n_tokens, src, workspace, counts, layer, ffn, hidden,
                              BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_T=block_t, num_warps=num_warps)


@triton.jit(do_not_specialize=["layer", "use_prev"])
def _complete_forecast(h_ptr, n_tokens, prev_ptr, use_prev, src_ptr, ws_ptr, count_ptr, layer, layers, ffn, hidden,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """After fc1: copy the active rows the forecast (prev, this layer's last active set) missed,
    count active / missed / wasted rows into counts[0|2|3, layer], and make the active set the
    next call's forecast. use_prev 0 (a prefill) treats the forecast as empty."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < ffn
    rows64 = rows.to(tl.int64)
    active = _active_rows(h_ptr, n_tokens, rows64, in_range, ffn, BLOCK_R, BLOCK_T)
    prev_at = prev_ptr + layer * ffn + rows64
    predicted = (tl.load(prev_at, mask=in_range, other=0) != 0) & in_range & (use_prev != 0)
    missed = active & ~predicted
    n_active = tl.sum(active.to(tl.int32), axis=0)
    n_missed = tl.sum(missed.to(tl.int32), axis=0)
    n_wasted = tl.sum((predicted & ~active).to(tl.int32), axis=0)
    if n_active > 0:
        tl.atomic_add(count_ptr + layer, n_active)
    if n_missed > 0:
        tl.atomic_add(count_ptr + 2 * layers + layer, n_missed)
    if n_wasted > 0:
        tl.atomic_add(count_ptr + 3 * layers + layer, n_wasted)
    tl.store(prev_at, active.to(tl.int8), mask=in_range)
    if n_missed > 0:
        _copy_rows(src_ptr, ws_ptr, rows64, missed, ffn, hidden, 0, BLOCK_H, BLOCK_H)


def complete_forecast_cuda(h, prev, use_prev, src, workspace, counts, layer, *, block_r, block_h, block_t,
                           num_warps=4) -> None:
    n_tokens, ffn = h.shape
    layers, hidden = prev.shape[0], src.shape[1]
    if (src.shape != (ffn, hidden) or workspace.shape != (hidden, ffn) or not workspace.is_contiguous()
            or prev.shape != (layers, ffn) or counts.shape != (4, layers) or not counts.is_contiguous()):
        raise ValueError(f"shapes do not match: h {tuple(h.shape)}, prev {tuple(prev.shape)}, src {tuple(src.shape)}, "
                         f"workspace {tuple(workspace.shape)}, counts {tuple(counts.shape)}")
    grid = (triton.cdiv(ffn, block_r),)
    _complete_forecast[grid](h, n_tokens, prev, int(use_prev), src, workspace, counts, layer, layers, ffn, hidden,
                             BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_T=block_t, num_warps=num_warps)
