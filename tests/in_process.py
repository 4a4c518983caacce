"""`packbench ARGS` run in this process through the console entry point (`cli.main.main`: its
exit codes and one-line errors), with `env` set and in `cwd` for that call only: milliseconds,
where a `python -m packbench` subprocess costs 1.1-1.3 s of interpreter start and imports on the
2-core CI machine. tests/conftest.py's `packbench_cli` hands it to a test; a module's fixture,
made once, calls it directly. Commands that start or join Ray belong in a subprocess (a Ray
driver would outlive the call in this process)."""

from __future__ import annotations

import io
import sys
from collections.abc import Mapping
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Ran:
    """What one `packbench` command returned and printed (the names of subprocess's result)."""
    returncode: int
    stdout: str
    stderr: str


def run_packbench(*args: str, env: Mapping[str, str] = {}, cwd: Path | None = None) -> Ran:
    from packbench.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(out), redirect_stderr(err):
        for name, value in env.items():
            patch.setenv(name, value)
        if cwd is not None:
            patch.chdir(cwd)
        patch.setattr(sys, "argv", ["packbench", *args])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Ran(code, out.getvalue(), err.getvalue())
