"""docs/protocol.md's fields table names the schemas this packbench reads and the newest.

Bug caught: the `schema` row said "1 to 10 | `10`, the newest" after schema 11 (profile opt4)
became the newest and what a file without `schema:` means; the "Schema versions" table and the
code (SCHEMAS, SCHEMA_VERSION) said 11."""

from __future__ import annotations

import re
from pathlib import Path

from packbench.core.protocol import SCHEMA_VERSION, SCHEMAS

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_the_schema_row_names_the_newest_schema():
    (row,) = [line for line in DOC.read_text().splitlines() if line.startswith("| `schema` |")]
    assert f"| {SCHEMAS[0]} to {SCHEMAS[-1]} | `{SCHEMA_VERSION}`, the newest |" in row, row


def test_the_moe_shape_paragraph_names_every_policy_an_moe_model_takes():
    """Bug caught: the paragraph on an MoE shape's conditions said "only the expert policies
    (resident, dense-stream, packet, phase-switched)" while the code (core/moe.py MOE_POLICIES) also
    takes expert-cache, expert-forecast, accelerate and host-experts."""
    from packbench.core.moe import MOE_POLICIES

    text = " ".join(DOC.read_text().split())
    start = text.index("only the policies with an MoE form")
    listed = text[start:text.index(")", text.index("MOE_POLICIES", start) + len("MOE_POLICIES`:"))]
    assert sorted(set(re.findall(r"`([a-z-]+)`", listed)) - {"MOE_POLICIES"}) == sorted(MOE_POLICIES)
