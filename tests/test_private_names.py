"""A leading underscore means "this module's own": no module of packbench imports another
module's private name (tests may, to reach a seam). A helper two modules share is public in
the module that defines it. Read with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import ROOT, modules

# Private names still imported across modules, each with why it is not fixed yet:
# {(module path, imported module, name): why}. Empty: keep it so (a fixed entry must leave it,
# test_the_allowlist_holds_only_live_entries).
ALLOWED: dict[tuple[str, str, str], str] = {}


def private_imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(module path, imported module, name) for every `from packbench.x import _name` (and
    `import packbench.x._mod`) in packbench/, wherever it stands; a module's own names and
    dunders are not private imports."""
    out = []
    for path in modules(root):
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "packbench":
                out += [(rel, node.module, a.name) for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                out.append((rel, "." * node.level + (node.module or ""), "(a relative import)"))
            elif isinstance(node, ast.Import):
                out += [(rel, a.name, a.name.rsplit(".", 1)[-1]) for a in node.names if a.name.split(".")[0] == "packbench"
                        and any(part.startswith("_") and not part.startswith("__") for part in a.name.split("."))]
    return out


def test_no_module_imports_another_modules_private_name():
    found = [f"{path} imports {name} from {module}" for path, module, name in private_imports()
             if (path, module, name) not in ALLOWED]
    assert found == []


def test_the_allowlist_holds_only_live_entries():
    assert set(ALLOWED) <= set(private_imports()), set(ALLOWED) - set(private_imports())


def test_the_check_sees_a_private_import(tmp_path):
    (tmp_path / "packbench" / "core").mkdir(parents=True)
    (tmp_path / "packbench" / "core" / "a.py").write_text(
        "def f():\n    from packbench.core.b import _helper, public, __version__\n")
    assert private_imports(tmp_path) == [("packbench/core/a.py", "packbench.core.b", "_helper")]
