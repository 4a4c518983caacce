"""A CUDA tensor over pinned host memory: with unified virtual addressing, a pointer from
cudaHostAlloc (PyTorch's pinned allocator) is valid on the device too, so kernels can read
host rows over PCIe without a staging copy. Exposed through __cuda_array_interface__, which
torch.as_tensor accepts without copying.
"""

import torch

_TYPESTR = {torch.float16: "<f2", torch.float32: "<f4", torch.bfloat16: "<u2",  # bf16: raw bits
            torch.uint8: "|u1"}  # the int8 slabs of engine/policies/int8.py


class _Interface:
    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


def cuda_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA view (never written through, by convention) of a pinned, contiguous host tensor (no copy).

    The caller keeps `t` alive for as long as the view is used.
    """
    if not (t.is_pinned() and t.is_contiguous()):
        raise ValueError("cuda_view needs a pinned, contiguous host tensor")
    view = torch.as_tensor(_Interface(t), device="cuda")
    return view.view(torch.bfloat16) if t.dtype == torch.bfloat16 else view
