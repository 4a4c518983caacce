"""A small raw archive and the tools that damage one, shared by tests/core/test_archive.py and
test_archive_hostile.py: its members, the writer that makes it, and zip-level rewrites that keep
CRCs valid (what a forger with zipfile would do)."""

import copy
import json
import os
import struct
import zipfile
from pathlib import Path

import numpy as np

from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter, Problem
from packbench.core.canonical import canonical_json

PROTOCOL = {"name": "quickstart", "model": "tiny", "conditions": ["dense-stream", "packet"]}
PLAN = {"episodes": [{"index": 0, "condition": "dense-stream"}, {"index": 1, "condition": "packet"}]}
EPISODES = [
    {"index": i, "condition": c, "tokens": [2, 7, 9], "ledger": [{"call": 0, "rows": 12}]}
    for i, c in enumerate(["dense-stream", "packet"])
]
LOGITS = [
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
]
VERDICTS = {"faithfulness": "pass", "resources": "fail"}
NOTES = b"free-form bytes \x00\x01\x02 " * 4
MANIFEST = {
    "protocol_sha256": "0" * 64,
    "screen_id": 7,
    "attempt": 1,
    "environment": {"host": "h", "gpu": "none", "driver": "", "torch": "", "cuda": "", "python": "3.11"},
    "source_freeze": {
        "package_version": "0.1.0",
        "git_commit": "abc",
        "git_dirty": False,
        "engine_sha256": "1" * 64,
    },
}
# Every member of the small sealed archive, in write order, manifest last.
MEMBERS = [
    "protocol.json",
    "plan.json",
    "episodes/00000.json",
    "logits/00000.npy",
    "episodes/00001.json",
    "logits/00001.npy",
    "verdicts.json",
    "notes.bin",
    MANIFEST_NAME,
]


def write_screen(path: Path, *, seal: bool = True) -> ArchiveWriter:
    w = ArchiveWriter(path)
    w.add_json("protocol.json", PROTOCOL)
    w.add_json("plan.json", PLAN)
    for i, (episode, logits) in enumerate(zip(EPISODES, LOGITS)):
        w.add_json(f"episodes/{i:05d}.json", episode)
        w.add_array(f"logits/{i:05d}.npy", logits)
    w.add_json("verdicts.json", VERDICTS)
    w.add_bytes("notes.bin", NOTES)
    if seal:
        w.seal(MANIFEST)
    return w


def sealed_screen(tmp_path: Path) -> Path:
    """The small screen, written and sealed as `screen.zip` in `tmp_path`."""
    path = tmp_path / "screen.zip"
    write_screen(path)
    return path


def verify(path: Path, **bounds) -> list[str]:
    """verify()'s messages: the lines packbench prints (and audit digests cover)."""
    return [p.message for p in problems_of(path, **bounds)]


def content(found: list) -> list:
    """Problems other than layout ones (a tamper made with zipfile also breaks the exact layout)."""
    return [p for p in found if not (p.kind == "layout" if isinstance(p, Problem) else p.startswith("layout: "))]


def problems_of(path: Path, **bounds) -> list[Problem]:
    with ArchiveReader(path, **bounds) as r:
        return r.verify()


def lines(r: ArchiveReader) -> list[str]:
    return [p.message for p in r.verify()]


def rewrite(path: Path, *, replace=None, drop=(), add=None) -> None:
    """Rebuild the zip with members replaced/dropped/added; CRCs stay valid."""
    replace, add = replace or {}, add or {}
    tmp = path.with_name(path.name + ".rewrite")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = replace.get(info.filename, None)
            if data is None:
                data = src.read(info)
            dst.writestr(copy.copy(info), data, compress_type=info.compress_type)
        for name, data in add.items():
            dst.writestr(name, data)
    os.replace(tmp, path)


def edit_manifest(path: Path, fn) -> None:
    with zipfile.ZipFile(path) as zf:
        manifest = json.loads(zf.read(MANIFEST_NAME))
    fn(manifest)
    rewrite(path, replace={MANIFEST_NAME: canonical_json(manifest)})


def append_entry(path: Path, info: zipfile.ZipInfo | str, data: bytes, compress_type=None) -> None:
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(info, data, compress_type=compress_type)


def data_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    off = info.header_offset
    assert raw[off : off + 4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", raw[off + 26 : off + 30])
    return off + 30 + name_len + extra_len


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
