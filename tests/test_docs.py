"""docs/architecture.md stays true to the code.

Every `path/file.py` it names (in a code span or in the diagram) exists; every `name()` and
`Class.member` it names is defined by the code, looked up with `ast`; a name written right after
a path (the diagram's `core/plan.py  plan_screen()`, a table row's `core/registry.py`
(`tier_of`)) is defined in that very file. The check is generic: it reads whatever the document
names, so a moved function fails here until the document follows it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def resolve(path: str) -> Path:
    """A path the document names: a module path reads from the package (`core/gates.py` is
    packbench/core/gates.py, as docs/architecture.md says at its top), anything else from the
    repository root (`tests/...`, `bench/...`)."""
    in_package = ROOT / "packbench" / path
    return in_package if in_package.is_file() else ROOT / path
SKIP_DIRS = {".venv", ".git", "node_modules", "build", "dist", "archives", ".packbench"}

PATH = r"(?:[A-Za-z_][\w.-]*/)+[A-Za-z_]\w*\.py"
_PATH_RE = re.compile(rf"(?<![\w/.]){PATH}\b")
_DOTTED_RE = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*)\b(?!\.|/)")
_CALL_RE = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\(")
_CAMEL_RE = re.compile(r"(?<![\w.])([A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*)\b(?!\.py)")
_SNAKE_RE = re.compile(r"(?<![\w.\-/])([a-z]\w*_\w*)\b(?![.(/\w-])")
_IDENT_RE = re.compile(r"^[A-Za-z_]\w*$")
_SPAN_RE = re.compile(r"`([^`\n]+)`")


@dataclass
class Defs:
    """What one Python file defines: module-level names and each class's members."""
    names: set[str] = field(default_factory=set)
    members: dict[str, set[str]] = field(default_factory=dict)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _body_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(n for t in node.targets for n in _targets(t))
        elif isinstance(node, ast.AnnAssign):
            names.update(_targets(node.target))
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under `if TYPE_CHECKING:` or try
            names |= _body_names(node.body)
    return names


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes a class's methods assign on `self` (instance state named in the doc)."""
    out: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
    return out


@cache
def defs_of(path: Path) -> Defs:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    defs = Defs(names=_body_names(tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            defs.members.setdefault(node.name, set()).update(_body_names(node.body) | _self_attributes(node))
    return defs


@cache
def python_files() -> tuple[Path, ...]:
    out = []
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT)
        if not any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            out.append(p)
    return tuple(sorted(out))


def defined_in(name: str, member: str | None, files) -> bool:
    for f in files:
        d = defs_of(f)
        if member is None and (name in d.names or any(name in m for m in d.members.values())):
            return True
        if member is not None and member in d.members.get(name, ()):
            return True
    return False


@dataclass(frozen=True)
class Name:
    """One name the document uses, where it was read and the file it must be in (if any)."""
    line: int
    text: str
    name: str
    member: str | None
    home: str | None


def _inside_path(pos: int, homes: list[tuple[int, str]]) -> bool:
    return any(offset <= pos < offset + len(path) for offset, path in homes)


def _names_in(text: str, lineno: int, *, homes: list[tuple[int, str]], diagram: bool = True) -> list[Name]:
    """The names of one diagram line or code span. `homes` are the (offset, path) pairs of the
    paths on the same line: a name right after a path belongs to it. Bare snake_case words
    count as names in the diagram only (a code span's `max_restarts=0` is an option)."""
    found: list[Name] = []

    def home_at(pos: int) -> str | None:
        for offset, path in homes:
            gap = text[offset + len(path):pos]
            if gap.strip() == "" and pos > offset:
                return path
        return None

    taken: set[int] = set()
    for m in _DOTTED_RE.finditer(text):
        found.append(Name(lineno, m.group(0), m.group(1), m.group(2), home_at(m.start())))
        taken.update(range(m.start(), m.end()))
    for m in _CALL_RE.finditer(text):
        if m.start() not in taken:
            found.append(Name(lineno, m.group(0) + ")", m.group(1), None, home_at(m.start())))
            taken.update(range(m.start(), m.end()))
    for m in _CAMEL_RE.finditer(text):
        if m.start() not in taken:
            found.append(Name(lineno, m.group(1), m.group(1), None, home_at(m.start())))
            taken.add(m.start())
    # a snake_case word anywhere (`run_drawn` at the start of a continuation line)
    for m in _SNAKE_RE.finditer(text if diagram else ""):
        if m.start() not in taken and not _inside_path(m.start(), homes):
            found.append(Name(lineno, m.group(1), m.group(1), None, home_at(m.start())))
            taken.add(m.start())
    # a bare word right after a path: the diagram's `cli/main.py submit`, `db/store.py create_screen`
    for offset, path in homes:
        m = re.match(r"\s+([A-Za-z_]\w*)\b(?![(.\w/-])", text[offset + len(path):])
        if m:
            start = offset + len(path) + m.start(1)
            if start not in taken:
                found.append(Name(lineno, m.group(1), m.group(1), None, path))
    return found


def read_doc(doc: Path = DOC) -> tuple[list[tuple[int, str]], list[Name]]:
    """(paths, names) the document names in its diagrams and code spans, with line numbers."""
    paths: list[tuple[int, str]] = []
    names: list[Name] = []
    in_fence = False
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            homes = [(m.start(), m.group(0)) for m in _PATH_RE.finditer(line)]
            paths += [(lineno, p) for _, p in homes]
            names += _names_in(line, lineno, homes=homes)
            continue
        spans = _SPAN_RE.findall(line)
        row_paths = [s for s in spans if re.fullmatch(PATH, s)]
        paths += [(lineno, p) for p in row_paths]
        for span in spans:
            if re.fullmatch(PATH, span):
                continue
            if _IDENT_RE.match(span) and row_paths and ("_" in span or span[0].isupper()):
                # a bare identifier in a line or table row naming one or more files
                names.append(Name(lineno, span, span, None, "|".join(row_paths)))
                continue
            span_homes = [(m.start(), m.group(0)) for m in _PATH_RE.finditer(span)]
            paths += [(lineno, p) for _, p in span_homes]
            names += _names_in(span, lineno, homes=span_homes, diagram=False)
    return paths, names


def test_the_document_names_code():
    paths, names = read_doc()
    assert len(paths) >= 20 and len(names) >= 30, "the parser found too little: is the diagram still fenced?"


def test_every_path_exists():
    paths, _ = read_doc()
    missing = sorted({f"line {n}: {p}" for n, p in paths if not resolve(p).is_file()})
    assert missing == [], "docs/architecture.md names files that do not exist:\n" + "\n".join(missing)


def test_every_name_is_defined():
    _, names = read_doc()
    wrong = []
    for n in names:
        if n.home is not None:
            homes = [resolve(h) for h in n.home.split("|")]
            if not all(h.is_file() for h in homes):
                continue  # reported by test_every_path_exists
            if not defined_in(n.name, n.member, homes):
                wrong.append(f"line {n.line}: {n.text} is not defined in {n.home}")
        elif not defined_in(n.name, n.member, python_files()):
            wrong.append(f"line {n.line}: {n.text} is defined nowhere in the code")
    assert wrong == [], "docs/architecture.md names code that does not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("text, expected", [
    ("core/plan.py  plan_screen() -> FrozenPlan", {("plan_screen", None, "core/plan.py"), ("FrozenPlan", None, None)}),
    ("calls run_drawn (one worker)", {("run_drawn", None, None)}),
    ("cli/main.py submit", {("submit", None, "cli/main.py")}),
    ("Store.claim_screen (atomic lease)", {("Store", "claim_screen", None)}),
    ("writes plan.json + worker.json", set()),
])
def test_the_parser_reads_diagram_lines(text, expected):
    homes = [(m.start(), m.group(0)) for m in _PATH_RE.finditer(text)]
    assert {(n.name, n.member, n.home) for n in _names_in(text, 1, homes=homes)} == expected


def test_a_wrong_name_is_caught(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("```\n core/gates.py  no_such_gate()\n```\n\n| x | `core/nowhere.py` (`Nothing_here`) |\n")
    paths, names = read_doc(doc)
    assert [p for _, p in paths] == ["core/gates.py", "core/nowhere.py"]
    assert not defined_in("no_such_gate", None, [resolve("core/gates.py")])
    assert {n.text for n in names} == {"no_such_gate()", "Nothing_here"}


def test_the_readme_names_every_competitor_in_the_tier_it_has():
    """The README's tier row called `quantized` the only approximate condition after `flexgen` and
    `host-experts` joined that tier (catches a competitor added without the row following it)."""
    from packbench.core.registry import CONDITIONS

    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| tier |"))
    exact_part, approximate_part = row.split("`approximate`", 1)
    for name, kind in CONDITIONS.items():
        if kind.competitor is None:
            continue  # packbench's own loaders: "every packbench loader"
        part = exact_part if kind.tier == "exact" else approximate_part
        assert f"`{name}`" in part, (name, kind.tier)
