"""The sync-free expert gather of `packet {gather: mapped}` (engine/moe/policies.py
ExpertMappedPacket): the device reads the routed experts' slices itself, indexed by the router's
top-k on the device; nothing goes back to the host.

`gather_experts(sel, src, dst)`: for each slot j with `sel[j] >= 0`, `dst[j] = src[sel[j]]`
(one fused expert tensor: gate_up (E, 2 x intermediate, hidden) or down (E, hidden,
intermediate)); slots with `sel[j] < 0` keep what they hold. On CUDA `src` is a mapped view of
pinned host memory (engine/mapped.py cuda_view) and one Triton kernel copies
(engine/moe/triton_experts.py); elsewhere (the CPU twin) `index_select` / `index_copy_` do, the
reference the kernel is tested against.

`single_token_experts(...)`: stock transformers' eager expert loop for a call of one token,
without its host decisions: the loop's `nonzero` over the routed experts and its `torch.where`
per expert read the device (a synchronisation each); here the k experts are the token's top-k,
sorted on the device into the loop's ascending order, and slot j holds the j-th. Each step is
the stock loop's own arithmetic on the same shapes (a (1, hidden) row through `gate_up`, the
activation, `down`, times the (1, 1) routing weight, index-added into zeros), so the result is
bit-identical to the stock loop with the weights resident (tests/engine/test_moe_mapped.py).
"""

import torch

# Elements a program copies, and its warps (a contiguous run: wide loads in flight).
BLOCK, NUM_WARPS = 8192, 8


def gather_experts(sel: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.device.type == "cuda":
        from packbench.engine.moe.triton_experts import gather_experts_cuda

        gather_experts_cuda(sel, src, dst, block=BLOCK, num_warps=NUM_WARPS)
        return
    if bool((sel >= 0).all()):
        torch.index_select(src, 0, sel, out=dst)
        return
    slots = (sel >= 0).nonzero().reshape(-1)  # the CPU twin: no device to keep waiting
    dst.index_copy_(0, slots, src.index_select(0, sel[slots]))


def sorted_routes(top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's (k,) expert ids in ascending order (the stock loop's order) and (k,) their
    routing weights, on the device."""
    ids, pos = torch.sort(top_k_index[0])
    return ids, top_k_weights[0].index_select(0, pos)


def single_token_experts(hidden: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                         act_fn, zero_index: torch.Tensor) -> torch.Tensor:
    """(1, hidden) out of (1, hidden) in; `weights` (k,), slot j of `gate_up`/`down` the j-th expert
    in ascending id order; `zero_index` a (1,) int64 zero on the device (the stock loop's token_idx)."""
    final = torch.zeros_like(hidden)
    for j in range(gate_up.shape[0]):
        current = hidden[zero_index]
        gate, up = torch.nn.functional.linear(current, gate_up[j]).chunk(2, dim=-1)
        h = act_fn(gate) * up
        h = torch.nn.functional.linear(h, down[j])
        # (1, 1) like the stock loop's top_k_weights[token_idx, top_k_pos, None]: the same type promotion
        h = h * weights[j:j + 1, None]
        final.index_add_(0, zero_index, h.to(final.dtype))
    return final
