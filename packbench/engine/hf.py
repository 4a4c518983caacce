"""What differs between the transformers releases packbench runs on (5.17 on the GPU machine, 5.25
where the CPU tests run)."""

from __future__ import annotations

import inspect


def cache_keyword(model) -> str:
    """The keyword `model.forward` takes its KV cache by: transformers 5.2x renamed
    `past_key_values` to `cache` (5.25 warns on the old name, which goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
