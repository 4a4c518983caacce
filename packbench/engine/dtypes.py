"""Torch's side of the registry's dtype names (core/registry.py DTYPE_NAMES): name to torch dtype."""

import torch

from packbench.core.registry import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]
