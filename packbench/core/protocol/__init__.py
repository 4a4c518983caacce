"""Protocols: a YAML screen description, validated, canonicalised and frozen by SHA-256.

The package, along its seams:

- `schema.py`: every field rule; `validate` gives the frozen form, `full_form` the full
  schema-2 dict (fields.py holds the shared field checks, prompt_files.py the prompt files);
  schemas 3 and 4 are schema 2 with newer defaults written out, so they freeze as 2 or 1;
  schema 5 adds competitor conditions and the fidelity gate, which freeze as 5; schema 6 the
  accelerate competitor, competitor modes, `weights` and `batch` (6); schema 7
  `passes: separate` (7); schema 8 profile `opt2` for a model.synth without one, schema 9
  profile `opt3` (written out, so nothing freezes as 8 or 9); schema 10 `scored_prompts` and the
  `flexgen` competitor (10); schema 11 (the newest) profile `opt4` (written out: nothing freezes as 11);
- `compat.py`: schema 1, what packbench 0.1 froze; a protocol is frozen in the LOWEST schema
  that says its meaning, so every old hash still holds;
- `spec.py`: the typed, frozen `Protocol` that `expand` returns, validated once and read by the
  plan, the gates, the worker and the auditor;
- `freeze.py`: reading a YAML file and freezing it (`load`, `freeze`, `FrozenProtocol`).

See docs/protocol.md for the fields.
"""

from packbench.core.protocol.freeze import FrozenProtocol, freeze, load
from packbench.core.protocol.prompt_files import TEXT_SEPARATOR, read_prompt_file, split_texts
from packbench.core.protocol.schema import (DTYPE_NAMES, ENGINE_MODES, GATE_NAMES, MAX_EPISODES, MAX_TOKENS, MIB, ORDERS, PHASES,
                                  PASSES, POLICY_NAMES, POLICY_PARAMS, PROMPT_SOURCES, SCHEMA_VERSION, SCHEMAS,
                                  SYNTH_SHAPES, ChoiceParam, IntParam, full_form, is_builtin_resource, validate)
from packbench.core.protocol.spec import (Comparison, Condition, FidelityBounds, Gates, ModelSpec, Placement, PromptSpec, Protocol, SynthSpec,
                                UsefulLatency, expand, prompt_count, resources_fit)

__all__ = [
    "ChoiceParam", "Comparison", "ENGINE_MODES", "Condition", "DTYPE_NAMES", "FidelityBounds", "FrozenProtocol", "GATE_NAMES", "Gates", "IntParam",
    "MAX_EPISODES", "MAX_TOKENS", "MIB", "ModelSpec", "Placement", "ORDERS", "PASSES", "PHASES", "POLICY_NAMES", "POLICY_PARAMS",
    "PROMPT_SOURCES", "PromptSpec", "Protocol", "SCHEMAS", "SCHEMA_VERSION", "SYNTH_SHAPES", "SynthSpec", "TEXT_SEPARATOR",
    "UsefulLatency", "expand", "freeze", "full_form", "is_builtin_resource", "load", "prompt_count",
    "read_prompt_file", "resources_fit", "split_texts", "validate",
]
