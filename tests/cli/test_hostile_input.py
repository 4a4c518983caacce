"""Hostile input: every case a one-line error naming the cause and the limit or fix, exit 2, no
traceback, nothing queued or lost; names from a protocol printed escaped.

Commands run in this process through the console entry point (`cli.main.main`), so a case
costs milliseconds, and an uncaught exception fails the test with its traceback.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    code: int
    out: str
    err: str


def pb(capsys, *args: str) -> Result:
    from cli.main import main

    argv, sys.argv = sys.argv, ["packbench", *args]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def one_line_error(r: Result, *fragments: str) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def db(tmp_path, monkeypatch) -> str:
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    monkeypatch.setenv("PACKBENCH_DB_URL", url)
    monkeypatch.chdir(tmp_path)
    from db.store import Store

    with Store(url) as store:
        store.upgrade()
    return url


def queued(url: str) -> list:
    from db.store import Store

    with Store(url) as store:
        return store.list_screens()


def quickstart(tiny: Path, **changes) -> dict:
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    body.update(changes)
    return body


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# ----------------------------------------------------------------------------- the protocol reader


@pytest.mark.parametrize("command", ["submit", "validate"])
def test_a_protocol_that_is_not_utf8_is_one_line(tmp_path, db, tiny, capsys, command):
    p = write(tmp_path / "p.yaml", b"name: q\xff\xfe\n" + yaml.safe_dump(quickstart(tiny)).encode())
    args = ["submit", str(p)] if command == "submit" else ["protocol", "validate", str(p)]
    one_line_error(pb(capsys, *args), "is not UTF-8 text", "byte 0xff at offset 7", "save it as UTF-8")
    assert queued(db) == []


def test_an_integer_of_5001_digits_names_the_digit_limit(tmp_path, db, tiny, capsys):
    text = yaml.safe_dump(quickstart(tiny, allowance_mib=4800)).replace("4800", "9" * 5001)
    r = pb(capsys, "submit", str(write(tmp_path / "p.yaml", text)))
    one_line_error(r, "5001 characters", "at most 100 digits")
    assert queued(db) == []


def test_a_list_nested_5000_deep_names_the_depth_limit(tmp_path, db, tiny, capsys):
    text = yaml.safe_dump(quickstart(tiny)) + "extra: " + "[" * 5000 + "]" * 5000 + "\n"
    r = pb(capsys, "protocol", "validate", str(write(tmp_path / "p.yaml", text)))
    one_line_error(r, "nest deeper than 32 levels, the limit")


def _alias_bomb(levels: int, width: int) -> str:
    """A flow list of anchors, each `width` aliases of the previous: width**levels values."""
    anchors, prev = ["&a0 [" + ", ".join(["x"] * width) + "]"], "a0"
    for i in range(1, levels):
        anchors.append(f"&a{i} [" + ", ".join([f"*{prev}"] * width) + "]")
        prev = f"a{i}"
    return "[" + ", ".join(anchors) + "]"


def test_an_alias_bomb_under_gates_resources_is_refused_fast_and_small(tmp_path, db, tiny, capsys):
    """9**9 values from ~1 KB: refused by the reader's expansion limit, not expanded by a message."""
    text = yaml.safe_dump(quickstart(tiny)).replace("gates:\n", f"gates:\n  resources: {_alias_bomb(9, 9)}\n")
    assert len(text) < 2000
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    r = pb(capsys, "submit", str(write(tmp_path / "p.yaml", text)))
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 100_000  # KiB: no expansion
    one_line_error(r, "expands to more than 4194304 values, the limit", "aliases")
    assert queued(db) == []


def test_an_alias_bomb_below_the_limit_is_shown_cut_not_rendered(tmp_path, db, tiny, capsys):
    """8**7 = 2M values pass the reader; the message shows 60 characters of them."""
    text = yaml.safe_dump(quickstart(tiny)).replace("gates:\n", f"gates:\n  resources: {_alias_bomb(7, 8)}\n")
    t0 = time.monotonic()
    line = one_line_error(pb(capsys, "submit", str(write(tmp_path / "p.yaml", text))),
                          "`gates.resources`: expected a mapping, got [[")
    assert time.monotonic() - t0 < 5 and len(line) < 200


def test_values_shown_in_messages_are_bounded():
    from core.protocol.fields import _show
    from core.registry import _show as registry_show

    a: list = ["x"] * 9
    for _ in range(9):
        a = [a] * 9  # 9**10 leaves, shared
    for show in (_show, registry_show):
        t0 = time.monotonic()
        assert len(show(a)) == 60 and show(a).endswith("...")
        assert "5001 digits" in show(10 ** 5000)  # repr() itself refuses past 4300 digits
        assert show("\u202e\n") == repr("\u202e\n")
        assert time.monotonic() - t0 < 0.1


def test_a_protocol_over_the_size_limit_names_it(tmp_path, db, monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(importlib.import_module("core.protocol.freeze"), "MAX_PROTOCOL_BYTES", 1 << 20)
    p = write(tmp_path / "p.yaml", "name: q\n" + "#" * (1 << 20) + "\n")
    one_line_error(pb(capsys, "protocol", "validate", str(p)), "is 1048585 bytes",
                   "a protocol file is at most 1 MiB", "prompts.token_file")


def test_a_key_with_a_newline_stays_one_line(tmp_path, db, capsys):
    p = write(tmp_path / "p.yaml", 'name: q\n"colour\\n\\u202eblue": 1\n')
    one_line_error(pb(capsys, "protocol", "validate", str(p)), "`colour\\n\\u202eblue`: unknown field")
