"""The protocol's GPU allowance, imposed on PyTorch's allocator with the CUDA context charged."""

import torch

from packbench.engine.sampler import process_used_bytes


def impose(device: torch.device, allowance_bytes: int, handle) -> int:
    """Cap the allocator at allowance minus what this process holds outside it; return that.

    `set_per_process_memory_fraction` caps PyTorch's allocator only. The rest of the process's
    device memory (the CUDA context, cuBLAS workspaces, lazily loaded kernels: about 0.6 GiB on
    the H200) is measured through NVML as used minus reserved, and charged. It grows as new
    kernels load, so callers re-impose after each episode: the cap only ever tightens.
    """
    torch.zeros(1, device=device)  # make sure the context exists
    context = 0
    if handle is not None:
        context = max(0, process_used_bytes(handle)[0] - torch.cuda.memory_reserved(device))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (allowance_bytes - context) / total)), device)
    return context


def lift(device: torch.device) -> None:
    """Let the allocator use the whole device until the next `impose` (a `resident` condition
    with `allowance: unbounded`, the speed reference where the model does not fit)."""
    torch.cuda.set_per_process_memory_fraction(1.0, device)
