"""One import name: `pip install .` puts `packbench` and its dist-info into site-packages and
nothing else, and the installed copy works from anywhere (not only from the repository root,
whose folders would hide a missing subpackage or a stray top-level `core`).

Catches: a layer left outside the package (a wheel with a top-level `cli/` or `core/`, which
collides with any other project's), package data lost in the move (the alembic revisions), a
console script that still points at `cli.main`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(out: Path) -> Path:
    # --no-build-isolation: the test environment already has setuptools; nothing is downloaded.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("packbench-*.whl")
    return wheel


def test_the_wheel_installs_one_import_name_and_runs_from_elsewhere(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = f"packbench-{wheel.name.split('-')[1]}.dist-info"
    assert {n.split("/")[0] for n in names} == {"packbench", dist_info}
    # the migrations travel as package data: without them `db upgrade` has nothing to run
    assert any(n.startswith("packbench/migrations/versions/") and n.endswith(".py") for n in names)
    entry = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "packbench = packbench.cli.main:main" in entry

    # Installed into a folder of its own and imported from an empty directory: the repository's
    # folders are nowhere on the path, so `import cli` must fail and `import packbench` must work.
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    code = ("import importlib.util, packbench, packbench.core.gates, packbench.db.migrate as m; "
            "assert packbench.__file__.startswith(%r), packbench.__file__; "
            "assert all(importlib.util.find_spec(n) is None for n in "
            "('cli', 'core', 'engine', 'service', 'cluster', 'db', 'migrations')); "
            "print(m.head())" % str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # a revision id: the alembic scripts were found inside the package
    version = subprocess.run([sys.executable, "-m", "packbench", "--version"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("packbench "), version.stderr
