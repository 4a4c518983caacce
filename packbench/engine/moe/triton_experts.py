"""The Triton kernel behind `engine/moe/gather.py` on CUDA (imported only there).

Program (j, c) copies chunk c of expert `sel[j]`'s slice of a fused expert tensor from `src`
(mapped pinned host memory, or device memory) into slot j of `dst`, BLOCK elements at a time;
`sel[j] < 0` leaves slot j as it is. An expert's slice is contiguous, so every program reads one
contiguous run: the SM loads of contiguous host memory that reach about the copy engine's rate
(docs/experiments/gather.md). The copy is a bitwise move, so exactness does not depend on the
tiling.
"""

import triton
import triton.language as tl


@triton.jit
def _gather_experts(sel_ptr, src_ptr, dst_ptr, n_elems, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    e = tl.load(sel_ptr + j).to(tl.int64)
    if e >= 0:
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < n_elems
        x = tl.load(src_ptr + e * n_elems + offs, mask=m)
        tl.store(dst_ptr + j.to(tl.int64) * n_elems + offs, x, mask=m)


def gather_experts_cuda(sel, src, dst, *, block: int, num_warps: int) -> None:
    slots, n_elems = dst.shape[0], dst[0].numel()
    if sel.shape != (slots,) or src[0].numel() != n_elems or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"shapes do not match: sel {tuple(sel.shape)}, src {tuple(src.shape)}, dst {tuple(dst.shape)}")
    _gather_experts[(slots, triton.cdiv(n_elems, block))](sel, src, dst, n_elems, BLOCK=block, num_warps=num_warps)
