"""Torch's side of the registry: dtype names to torch dtypes. Shapes are pure data in
core/registry.py, re-exported here for the engine's callers."""

import torch

from packbench.core.registry import DTYPE_NAMES, SHAPES

__all__ = ["DTYPES", "SHAPES", "dtype_of"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]
