"""The two halves of every condition kind agree, and the code that dispatches on kinds never
names one: a new kind (an MoE expert packet, an offload library) lands through the tables alone."""

from __future__ import annotations

import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from packbench.core.conditions import CONDITIONS
from packbench.engine.conditions import POLICIES, RUNTIMES, loader_policy
from packbench.engine.conditions.base import CompetitorRuntime, LoaderRuntime

ROOT = Path(__file__).resolve().parents[2]
# The modules that dispatch through the tables: the worker runs every kind, the estimate sizes
# every kind. Neither may name one, in code or in a string (comments may: a measurement's note).
DISPATCHERS = ("packbench/engine/worker.py", "packbench/core/estimate.py")


def named_kinds(source: str, kinds) -> list[str]:
    """`line: token` for every identifier or string token of `source` that names a kind
    (`dense-stream`, or `dense_stream` as an identifier), comments left out."""
    spellings = {k: re.compile(rf"(?<![\w-])({re.escape(k)}|{re.escape(k.replace('-', '_'))})(?![\w-])") for k in kinds}
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out += [f"{tok.start[0]}: {tok.string[:60]}" for k, rx in spellings.items() if rx.search(tok.string)]
    return out


@pytest.mark.parametrize("path", DISPATCHERS)
def test_the_worker_and_the_estimate_name_no_condition_kind(path):
    assert named_kinds((ROOT / path).read_text(), CONDITIONS) == []


def test_the_check_sees_a_name_branch_in_code_and_in_strings():
    source = 'if policy in ("quantized", "accelerate"):\n    x = packet_gather  # packet is fine here\nf"{kind}" == "dense-stream"\n'
    assert named_kinds(source, CONDITIONS) == ['1: "quantized"', '1: "accelerate"', '3: "dense-stream"']
    assert named_kinds("quantized_model = 1\n", CONDITIONS) == []  # a longer word is not the kind


def test_every_declared_kind_has_a_runtime_and_no_other():
    assert list(RUNTIMES) == list(CONDITIONS)


@pytest.mark.parametrize("name", list(CONDITIONS))
def test_a_competitor_declaration_has_a_competitor_runtime(name):
    runtime = RUNTIMES[name]
    assert isinstance(runtime, CompetitorRuntime if CONDITIONS[name].competitor is not None else LoaderRuntime), name


@pytest.mark.parametrize("name", [n for n, r in RUNTIMES.items() if isinstance(r, LoaderRuntime)])
def test_a_loader_builder_takes_exactly_the_declared_parameters(name):
    params = inspect.signature(RUNTIMES[name].policy).parameters
    assert list(params) == list(CONDITIONS[name].params), name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values()), name


def test_the_loader_view_and_a_competitor_asked_for_a_policy():
    assert list(POLICIES) == [n for n, k in CONDITIONS.items() if k.competitor is None and "opt" in k.families]
    with pytest.raises(ValueError, match="quantized is not a loader policy"):
        loader_policy("quantized", method="nf4")


def test_record_fields_of_the_runtimes_are_record_fields():
    """An episode record keeps only the fields core/record.py declares: a runtime's build figures
    land in one of them (an undeclared one would be dropped or refused by the archive)."""
    declared = (ROOT / "packbench/core/record.py").read_text()
    keys = [r.record_key for r in RUNTIMES.values() if r.record_key is not None]
    assert keys and all(f'_kept("{key}", dict)' in declared for key in keys), keys


def test_docs_list_every_kind_as_its_declaration_says():
    """docs/engine.md holds the kinds' table as core/conditions/ generates it: a kind, parameter,
    default or tier changed without the docs fails here (regenerate with kinds_table())."""
    from packbench.core.conditions import kinds_table

    assert kinds_table() in (ROOT / "docs" / "engine.md").read_text()
