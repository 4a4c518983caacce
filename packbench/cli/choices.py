"""Enum choices built from core/registry.py, so `--help` and shell completion list them.

The registry stays the one source: these enums are made from its tuples, never typed again.
"""

from enum import Enum

from packbench.core.registry import DTYPE_NAMES, POLICY_NAMES, SYNTH_SHAPES

# str mixins: typer hands the command the member, whose .value is the registry's name.
Shape = Enum("Shape", {name: name for name in SYNTH_SHAPES}, type=str)
Dtype = Enum("Dtype", {name: name for name in DTYPE_NAMES}, type=str)
Policy = Enum("Policy", {name: name for name in POLICY_NAMES}, type=str)
