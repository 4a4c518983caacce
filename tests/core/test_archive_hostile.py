"""Raw archive v1 against damage: tampered members and manifests, and hostile archives (unsafe
names, symlinks, zip bombs, pickles, lying headers, random damage). The reader reports each as a
structured problem naming its member and never crashes or runs code.

Every test uses real zip files under tmp_path and runs in milliseconds (the zip-bomb test
compresses 50 MB of zeros, about 0.1 s).
"""

import copy
import io
import os
import pickle
import random
import stat
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from archive_samples import (
    EPISODES, LOGITS, MEMBERS, PLAN, append_entry, content, data_offset, edit_manifest, lines, problems_of, rewrite,
    sealed_screen,
    tree, verify,
)
from packbench.core.archive import MANIFEST_NAME, PROBLEM_KINDS, ArchiveReader, ArchiveWriter, Problem
from packbench.core.canonical import canonical_json
from packbench.core.errors import ArchiveError


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    return sealed_screen(tmp_path)


# ----------------------------------------------------------------------------- tampering


def test_tamper_replaced_content_same_size(sealed: Path):
    forged = io.BytesIO()
    np.save(forged, LOGITS[1] + 1, allow_pickle=False)
    rewrite(sealed, replace={"logits/00001.npy": forged.getvalue()})
    assert verify(sealed) == ["altered member logits/00001.npy (sha256 mismatch)"]


def test_tamper_replaced_content_other_size(sealed: Path):
    episode = {**EPISODES[0], "tokens": [2, 7, 8]}  # same length
    longer = {**EPISODES[0], "tokens": [2, 7, 9, 11]}
    rewrite(sealed, replace={"episodes/00000.json": canonical_json(episode)})
    assert verify(sealed) == ["altered member episodes/00000.json (sha256 mismatch)"]
    rewrite(sealed, replace={"episodes/00000.json": canonical_json(longer)})
    (problem,) = verify(sealed)
    assert problem.startswith("size mismatch for member episodes/00000.json: manifest says ")


@pytest.mark.parametrize("name", MEMBERS)
def test_tamper_flipped_byte_names_the_member(sealed: Path, name: str):
    with zipfile.ZipFile(sealed) as zf:
        info = zf.getinfo(name)
    raw = bytearray(sealed.read_bytes())
    start = data_offset(raw, info)
    assert info.compress_size > 0
    raw[start + info.compress_size // 2] ^= 0xFF
    sealed.write_bytes(raw)

    with ArchiveReader(sealed) as r:
        problems = r.verify()
        assert problems, name
        assert any(p.member == name and name in p.message for p in problems), problems
        assert all("\n" not in p.message for p in problems)
        if name == MANIFEST_NAME:
            assert not r.complete  # the manifest itself cannot be trusted
        else:
            assert r.complete
            with pytest.raises(ArchiveError, match=name):
                r.read_bytes(name)


def test_tamper_extra_member(sealed: Path):
    append_entry(sealed, "extra/x.json", b"{}")
    assert content(verify(sealed)) == ["extra member extra/x.json"]
    assert "layout: manifest.json is not the last member (the writer seals last)" in verify(sealed)


def test_tamper_member_removed(sealed: Path):
    rewrite(sealed, drop={"logits/00000.npy"})
    assert verify(sealed) == ["missing member logits/00000.npy"]


def test_tamper_duplicate_member(sealed: Path):
    with pytest.warns(UserWarning, match="Duplicate name"):
        append_entry(sealed, "plan.json", b"{}")
    with ArchiveReader(sealed) as r:
        assert content(r.verify()) == [Problem("plan.json", "duplicate", "duplicate member plan.json")]
        with pytest.raises(ArchiveError, match="plan.json appears 2 times"):
            r.read_bytes("plan.json")


def test_unparseable_and_malformed_manifest(sealed: Path):
    rewrite(sealed, replace={MANIFEST_NAME: b'{"format_version": 1, "members": '})
    with ArchiveReader(sealed) as r:
        assert not r.complete and r.manifest is None
        (problem,) = r.verify()
        assert problem.message.startswith("unparseable member manifest.json")
        assert (problem.member, problem.kind) == (MANIFEST_NAME, "manifest")
    rewrite(sealed, replace={MANIFEST_NAME: b"[" * 100_000 + b"]" * 100_000})
    (problem,) = verify(sealed)
    assert problem.startswith("unparseable member manifest.json")
    edit_manifest_bytes = canonical_json({"format_version": 2, "members": {}})
    rewrite(sealed, replace={MANIFEST_NAME: edit_manifest_bytes})
    (problem,) = verify(sealed)
    assert problem.startswith("malformed member manifest.json: format_version is 2")


# ----------------------------------------------------------------------------- hostile archives


@pytest.mark.parametrize("name", ["../evil", "/etc/x", "a/../../evil2", "a\\..\\evil3", "C:/evil4"])
def test_hostile_unsafe_names(sealed: Path, tmp_path: Path, name: str):
    targets = [tmp_path.parent / "evil", Path("/etc/x"), tmp_path.parent / "evil2"]
    existed = {t: t.exists() for t in targets}
    append_entry(sealed, name, b"pwned")
    before = tree(tmp_path)
    with ArchiveReader(sealed) as r:
        assert name in r.names
        problems = r.verify()
        assert [p for p in problems if p.message.startswith(f"unsafe member name {name} ")
                and (p.member, p.kind) == (name, "unsafe")], problems
        with pytest.raises(ArchiveError, match="unsafe member name"):
            r.read_bytes(name)
    assert tree(tmp_path) == before  # nothing extracted
    assert {t: t.exists() for t in targets} == existed


def test_hostile_unsafe_name_listed_in_manifest(sealed: Path):
    edit_manifest(
        sealed, lambda m: m["members"].update({"../evil": {"sha256": "0" * 64, "size": 1}})
    )
    (problem,) = verify(sealed)
    assert problem.startswith("unsafe member name ../evil (listed in manifest.json")


def test_hostile_symlink_entry(sealed: Path, tmp_path: Path):
    info = zipfile.ZipInfo("link")
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    append_entry(sealed, info, b"/etc/passwd")
    before = tree(tmp_path)
    with ArchiveReader(sealed) as r:
        assert content(r.verify()) == [Problem("link", "symlink", "symlink member link")]
        with pytest.raises(ArchiveError, match="symlink member link"):
            r.read_bytes("link")
    assert tree(tmp_path) == before


def test_hostile_inflating_member(sealed: Path):
    zeros = bytes(50 << 20)
    append_entry(sealed, "bomb.bin", zeros, compress_type=zipfile.ZIP_DEFLATED)
    assert sealed.stat().st_size < 1 << 20  # small on disk, 50 MB when inflated
    with ArchiveReader(sealed, max_member_bytes=1 << 20, max_json_total_bytes=1 << 30) as r:
        with pytest.raises(ArchiveError, match="bomb.bin .*over the bound"):
            r.read_bytes("bomb.bin")
        assert r.bytes_read == 0
        problems = r.verify()
    assert Problem("bomb.bin", "extra", "extra member bomb.bin") in problems  # extra: not read at all
    with ArchiveReader(sealed) as r:  # by default the 50 MB it declares pass the non-array total bound
        assert [p.kind for p in r.verify()] == ["too-large"]


def test_hostile_inflating_member_with_lying_header(tmp_path: Path):
    """The zip entry claims 1000 bytes but inflates to 50 MB: refused after at most the bound."""
    path = tmp_path / "bomb.zip"
    w = ArchiveWriter(path)
    w.add_bytes("bomb.bin", bytes(50 << 20))
    w.seal({})
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("bomb.bin")
        cd = zf.start_dir  # first central directory entry: bomb.bin
    lie = struct.pack("<L", 1000)
    raw[info.header_offset + 22 : info.header_offset + 26] = lie  # local header size
    assert raw[cd : cd + 4] == b"PK\x01\x02"
    assert raw[cd + 46 : cd + 54] == b"bomb.bin"
    raw[cd + 24 : cd + 28] = lie  # central directory size
    path.write_bytes(raw)
    with ArchiveReader(path, max_member_bytes=1 << 20) as r:
        with pytest.raises(ArchiveError, match="bomb.bin"):
            r.read_bytes("bomb.bin")
        assert r.bytes_read == 0
        (problem,) = r.verify()
    assert problem.message.startswith("size mismatch for member bomb.bin: manifest says 52428800, archive holds 1000")
    assert (problem.member, problem.kind) == ("bomb.bin", "size")


def test_hostile_total_bound(sealed: Path):
    with ArchiveReader(sealed, max_total_bytes=100) as r:
        r.read_bytes("protocol.json")
        with pytest.raises(ArchiveError, match="total bound"):
            r.read_bytes("logits/00000.npy")
        assert r.verify()[-1].message.startswith("archive too large")
        assert (r.verify()[-1].member, r.verify()[-1].kind) == (None, "too-large")


def test_hostile_pickled_object_array_runs_no_code(tmp_path: Path):
    marker = tmp_path / "pickle-ran"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|O", "fortran_order": False, "shape": (1,)}
    )
    payload = header.getvalue() + pickle.dumps([Evil()])
    path = tmp_path / "p.zip"
    w = ArchiveWriter(path)
    w.add_bytes("logits/00000.npy", payload)
    w.add_bytes("logits/00001.npy", np.lib.format.magic(1, 0) + b"garbage")
    w.seal({})
    with ArchiveReader(path) as r:
        assert r.verify() == []  # hashes match what was written...
        with pytest.raises(ArchiveError, match=r"logits/00000.npy .*pickled object array"):
            r.read_array("logits/00000.npy")  # ...but it is never unpickled
        with pytest.raises(ArchiveError, match="logits/00001.npy"):
            r.read_array("logits/00001.npy")
        with pytest.raises(ArchiveError, match="not valid JSON"):
            r.read_json("logits/00001.npy")
    assert not marker.exists()


def test_hostile_npy_header_lies_about_shape(tmp_path: Path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**15,)}
    )
    path = tmp_path / "s.zip"
    w = ArchiveWriter(path)
    w.add_bytes("logits/00000.npy", header.getvalue() + bytes(16))
    w.seal({})
    with ArchiveReader(path) as r, pytest.raises(ArchiveError, match="declares shape"):
        r.read_array("logits/00000.npy")


def test_hostile_manifest_lies_about_size(sealed: Path, monkeypatch):
    true_size = len(canonical_json(EPISODES[0]))
    edit_manifest(sealed, lambda m: m["members"]["episodes/00000.json"].update(size=10**12))
    edit_manifest(sealed, lambda m: m["members"]["plan.json"].update(size=len(canonical_json(PLAN)) + 5))
    with ArchiveReader(sealed) as r:
        read = []
        real_chunks = r._chunks
        monkeypatch.setattr(r, "_chunks", lambda info, limit, **kw: (read.append(info.filename), real_chunks(info, limit, **kw))[1])
        problems = lines(r)
    assert f"size mismatch for member episodes/00000.json: manifest says {10**12}, archive holds {true_size}" in problems
    assert f"size mismatch for member plan.json: manifest says {len(canonical_json(PLAN)) + 5}, archive holds {len(canonical_json(PLAN))}" in problems
    assert len(problems) == 2
    assert "episodes/00000.json" not in read and "plan.json" not in read  # named before reading


def test_hostile_crc_error_is_archive_error(sealed: Path):
    with zipfile.ZipFile(sealed) as zf:
        info = zf.getinfo("logits/00000.npy")
    raw = bytearray(sealed.read_bytes())
    raw[data_offset(raw, info) + info.compress_size - 1] ^= 0x01  # STORED: only the CRC can tell
    sealed.write_bytes(raw)
    with ArchiveReader(sealed) as r:
        with pytest.raises(ArchiveError, match="logits/00000.npy .*CRC"):
            r.read_array("logits/00000.npy")
        assert r.verify() == [Problem(
            "logits/00000.npy", "unreadable",
            "unreadable member logits/00000.npy: BadZipFile: Bad CRC-32 for file 'logits/00000.npy'"
        )]


def test_reader_refuses_unknown_and_unsafe_lookups(sealed: Path):
    with ArchiveReader(sealed) as r:
        with pytest.raises(ArchiveError, match="no member nope.json"):
            r.read_bytes("nope.json")
        with pytest.raises(ArchiveError, match="unsafe member name"):
            r.read_bytes("../protocol.json")


def test_random_damage_never_crashes_the_reader(sealed: Path):
    """Random byte damage anywhere (headers, central directory, data): ArchiveError or a report,
    and the report names a problem whenever the file differs from the sealed one."""
    orig = sealed.read_bytes()
    rng = random.Random(1234)
    for _ in range(300):
        raw = bytearray(orig)
        for _ in range(rng.choice([1, 3])):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if rng.random() < 0.2:
            raw = raw[: rng.randrange(len(raw))]
        sealed.write_bytes(raw)
        try:
            r = ArchiveReader(sealed, max_member_bytes=1 << 20)
        except ArchiveError:
            continue
        with r:
            problems = r.verify()
            assert problems or bytes(raw) == orig, "a damaged archive verified as intact"
            assert all(isinstance(p, Problem) and p.kind in PROBLEM_KINDS and "\n" not in p.message
                       and (p.member is not None or p.kind in ("too-large", "layout")) for p in problems)
            for name in r.names:
                try:
                    r.read_bytes(name)
                except ArchiveError:
                    pass


# ----------------------------------------------------------------------------- array headers, word for word


def _npy(arr: np.ndarray, *, version=(1, 0)) -> bytes:
    out = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(arr)
    np.lib.format.write_array_header_1_0(out, header) if version == (1, 0) else \
        np.lib.format.write_array_header_2_0(out, header)
    data = arr.tobytes(order="F" if header["fortran_order"] else "C")
    return out.getvalue() + data


def _array_archive(tmp_path: Path, members: dict[str, bytes]) -> Path:
    path = tmp_path / "arrays.zip"
    w = ArchiveWriter(path)
    for name, data in members.items():
        w.add_bytes(name, data)
    w.seal({})
    return path


def test_read_array_refusals_name_the_member_the_cause_and_the_fix(tmp_path: Path):
    """Each refusal of `read_array` is one line: the member, what is wrong with its header, and the
    fix. Catches a check dropped or inverted (dtype, Fortran order, rank, declared shape, pickle)
    and a message that loses its cause or its fix (the audit prints these lines)."""
    f4 = np.arange(6, dtype="<f4").reshape(2, 3)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (3,)})
    pickled = io.BytesIO()
    np.lib.format.write_array_header_1_0(pickled, {"descr": "|O", "fortran_order": False, "shape": (1,)})
    path = _array_archive(tmp_path, {
        "a.npy": _npy(f4.astype("<f8")),
        "b.npy": _npy(np.asfortranarray(f4)),
        "c.npy": _npy(f4),
        "d.npy": header.getvalue() + bytes(8),  # declares 12 data bytes, holds 8
        "e.npy": pickled.getvalue() + b"x" * 16,
        "f.npy": _npy(np.asfortranarray(f4).astype("<f8")),
    })
    fix_format = "the archive was not written by packbench"
    with ArchiveReader(path) as r:
        def refusal(name, **kw):
            with pytest.raises(ArchiveError) as e:
                r.read_array(name, **kw)
            return str(e.value)

        at = f"of archive {path}"
        assert refusal("a.npy", dtype="<f4") == \
            f"member a.npy {at} is a <f8 array, the format says C-order <f4 (docs/archive.md); {fix_format}"
        assert refusal("b.npy", dtype="<f4") == \
            f"member b.npy {at} is a Fortran-order <f4 array, the format says C-order <f4 (docs/archive.md); {fix_format}"
        assert refusal("f.npy", dtype="<f4") == \
            f"member f.npy {at} is a Fortran-order <f8 array, the format says C-order <f4 (docs/archive.md); {fix_format}"
        assert refusal("c.npy", ndim=3) == f"member c.npy {at} has 2 dimensions, the format says 3; the archive is damaged"
        assert refusal("d.npy") == (f"member d.npy {at} declares shape (3,) of float32 (12 bytes) but holds 8 data "
                                    f"bytes; the archive is damaged")
        assert refusal("e.npy") == (f"member e.npy {at} is a pickled object array (dtype object), refused; raw "
                                    f"archives hold numeric arrays only; the archive is hostile or damaged")
        # what the format asks for is read back as written
        np.testing.assert_array_equal(r.read_array("c.npy", dtype="<f4", ndim=2), f4)
        np.testing.assert_array_equal(r.read_array("b.npy", ndim=2), f4)  # Fortran order allowed when no dtype is asked


def test_npy_version_2_headers_are_read_and_other_versions_refused(tmp_path: Path):
    """Catches the version-2 branch of the header parser broken (numpy writes v2 for headers
    over 64 KiB) and an unknown version's refusal losing its words."""
    arr = np.arange(4, dtype="<f4")
    v3 = bytearray(_npy(arr))
    v3[6] = 3  # the major version byte
    path = _array_archive(tmp_path, {"v2.npy": _npy(arr, version=(2, 0)), "v3.npy": bytes(v3)})
    with ArchiveReader(path) as r:
        np.testing.assert_array_equal(r.read_array("v2.npy", dtype="<f4", ndim=1), arr)
        with pytest.raises(ArchiveError) as e:
            r.read_array("v3.npy")
    assert str(e.value) == (f"member v3.npy of archive {path} is not a .npy array (unsupported .npy version "
                            f"(3, 0)); the archive is damaged")


def test_a_header_numpy_will_not_parse_is_named_with_200_characters_of_its_cause(tmp_path: Path):
    """A header numpy refuses (here one of 64 KiB, over numpy's own header bound) is named with at
    most 200 characters of numpy's words, on one line. Catches the cause dropped or cut elsewhere."""
    body = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }"
    body = body + " " * (65535 - len(body) - 1) + "\n"
    big = np.lib.format.magic(1, 0) + struct.pack("<H", len(body)) + body.encode("latin1")
    path = _array_archive(tmp_path, {"big.npy": big + bytes(12)})
    with ArchiveReader(path) as r, pytest.raises(ArchiveError) as e:
        r.read_array("big.npy")
    message = str(e.value)
    prefix, suffix = f"member big.npy of archive {path} is not a .npy array (", "); the archive is damaged"
    assert message.startswith(prefix) and message.endswith(suffix), message
    cause = message[len(prefix):-len(suffix)]
    assert len(cause) == 200 and "\n" not in cause and cause.startswith("Header info length (65535)"), cause


def test_over_bound_line_gives_size_and_bound_in_bytes_and_mib():
    """The words `packbench audit` prints for an archive over its bound: bytes below 1 MiB, whole
    MiB when exact, one decimal otherwise. Catches the MiB threshold or the rounding changed."""
    from packbench.core.archive.bounds import over_bound_line
    cases = {
        6941: "6941 bytes",
        (1 << 20) - 1: "1048575 bytes",
        1 << 20: "1048576 bytes (1 MiB)",
        3 << 20: "3145728 bytes (3 MiB)",
        (2 << 20) + 1: "2097153 bytes (2.0 MiB)",
        10193506778: "10193506778 bytes (9721.3 MiB)",
    }
    for size, words in cases.items():
        line = over_bound_line("a.zip", size, 1 << 30)
        assert line == (f"a.zip is {words}, over the audit bound of 1073741824 bytes (1024 MiB), so it was not "
                        f"read; only for an archive you trust, audit it with `packbench audit archive a.zip "
                        f"--max-mib {max(1, -(-size // (1 << 20)))}`"), line


# ----------------------------------------------------------------------------- JSON members and the manifest's shape


def test_read_json_refusals_say_which_rule_the_member_breaks(tmp_path: Path):
    """A duplicate key, a NaN and a non-canonical form are each named by the rule they break, on
    one line of at most 200 characters of cause; a key repeated in another object is no duplicate.
    Catches the duplicate check dropped, inverted or its set shared, NaN let through, and the
    causes' words lost."""
    long_key = "k" * 300
    path = _array_archive(tmp_path, {
        "dup.json": b'{"a":1,"a":2}',
        "nested.json": b'{"a":{"a":1},"b":{"a":2}}',
        "nan.json": b'{"a":NaN}',
        "order.json": b'{"b":1,"a":2}',
        "long.json": ('{"%s":1,"%s":2}' % (long_key, long_key)).encode(),
    })
    with ArchiveReader(path) as r:
        def refusal(name):
            with pytest.raises(ArchiveError) as e:
                r.read_json(name)
            return str(e.value)

        def line(name, cause):
            return f"member {name} of archive {path} is not valid JSON ({cause}); the archive is damaged: run verify()"

        assert r.read_json("nested.json") == {"a": {"a": 1}, "b": {"a": 2}}
        assert refusal("dup.json") == line("dup.json", "duplicate key 'a' (another parser may keep the other value)")
        assert refusal("nan.json") == line("nan.json", "non-standard JSON constant NaN")
        assert refusal("order.json") == line(
            "order.json", "not canonical JSON (sorted keys, compact, UTF-8, as core.canonical writes it)")
        assert refusal("long.json") == line("long.json", f"duplicate key '{long_key}"[:200])


def test_read_json_keeps_to_the_json_member_bound(tmp_path: Path):
    """A JSON member over `max_json_bytes` is refused though the array bound would admit it, and
    the total bound admits a member that fills it exactly. Catches the JSON bound not passed to
    the read and the total budget's arithmetic off by one or in sign."""
    body = canonical_json({"a": "x" * 100})
    path = _array_archive(tmp_path, {"a.json": body, "b.bin": bytes(50)})
    with ArchiveReader(path, max_json_bytes=len(body) - 1) as r, pytest.raises(ArchiveError, match="a.json"):
        r.read_json("a.json")
    with ArchiveReader(path, max_total_bytes=len(body) + 50) as r:
        assert r.read_json("a.json") == {"a": "x" * 100}
        assert r.read_bytes("b.bin") == bytes(50)  # exactly the rest of the budget
        with pytest.raises(ArchiveError, match="total bound"):
            r.read_bytes("b.bin")


def test_manifest_shape_problems_are_named():
    """Each way a manifest can be malformed has its own words (verify prints them after
    'malformed member manifest.json: '), and every field of a member entry is checked. Catches
    a check of the entry dropped (an `and` made `or`) and the words changed."""
    from packbench.core.archive.verify import manifest_shape_problem
    good = {"sha256": "0" * 64, "size": 3}
    ok = {"format_version": 1, "members": {"a": good}}
    assert manifest_shape_problem(ok) is None
    assert manifest_shape_problem([]) == "not a JSON object"
    assert manifest_shape_problem({"format_version": 1}) == "'members' is missing or not an object"
    assert manifest_shape_problem({"format_version": 1, "members": {MANIFEST_NAME: good}}) == \
        "'members' lists manifest.json itself"
    for bad in ([], {**good, "x": 1}, {"sha256": 5, "size": 3}, {"sha256": "g" * 64, "size": 3},
                {"sha256": "0" * 63, "size": 3}, {**good, "size": "3"}, {**good, "size": True}, {**good, "size": -1}):
        assert manifest_shape_problem({"format_version": 1, "members": {"a": bad}}) == \
            "entry for 'a' is not {sha256: 64 hex digits, size: int >= 0}", bad


def test_mib_to_admit_and_an_archive_too_large_name_the_command_that_reads_it(tmp_path: Path):
    """`--max-mib` is the size in whole MiB rounded up, at least 1; an archive over the reader's
    bound is refused with the line that names it, its size, the bound and a `--max-mib` admitting
    it and the JSON members besides. Catches the rounding, the floor of 1, the admitted total and
    the line's fields changed."""
    from packbench.core.archive import MAX_JSON_TOTAL_BYTES, mib_to_admit
    from packbench.core.archive.bounds import over_bound_line
    from packbench.core.archive.reader import ArchiveTooLarge
    assert [mib_to_admit(n) for n in (0, 1, 1 << 20, (1 << 20) + 1, 5 << 20, (5 << 20) + 1)] == [1, 1, 1, 2, 5, 6]
    assert over_bound_line("a.zip", 10, 5, what="would be", target="7", admit=3 << 20) == (
        "a.zip would be 10 bytes, over the audit bound of 5 bytes, so it was not read; only for an archive you "
        "trust, audit it with `packbench audit 7 --max-mib 3`")
    path = tmp_path / "a.zip"
    path.write_bytes(bytes(3000))
    with pytest.raises(ArchiveTooLarge) as e:
        ArchiveReader(path, max_archive_bytes=2000)
    admit = mib_to_admit(3000 + MAX_JSON_TOTAL_BYTES)
    assert (e.value.path, e.value.size, e.value.bound, e.value.admit) == (path, 3000, 2000, 3000 + MAX_JSON_TOTAL_BYTES)
    assert str(e.value) == e.value.line() == (
        f"{path} is 3000 bytes, over the audit bound of 2000 bytes, so it was not read; only for an archive you "
        f"trust, audit it with `packbench audit archive {path} --max-mib {admit}`")
    assert e.value.line("12", path="elsewhere.zip") == (
        "elsewhere.zip is 3000 bytes, over the audit bound of 2000 bytes, so it was not read; only for an archive "
        f"you trust, audit it with `packbench audit 12 --max-mib {admit}`")


# ----------------------------------------------------------------------------- members of several chunks, bounds


def test_members_over_one_chunk_read_and_verify_whole(tmp_path: Path):
    """The reader reads in 1 MiB chunks: a bytes member and an array of several chunks come back
    whole, count whole against the total bound, and verify whole; an empty array member is named.
    Catches a chunk written over the previous one, the running size or byte count reset per
    chunk, and the empty member's header check skipped."""
    blob = np.random.default_rng(3).integers(0, 255, (5 << 20) // 2, dtype=np.uint8).tobytes()
    arr = np.arange((3 << 20) // 4, dtype="<f4").reshape(-1, 4)
    path = tmp_path / "big.zip"
    w = ArchiveWriter(path)
    w.add_bytes("blob.bin", blob)
    w.add_array("arr.npy", arr)
    w.add_bytes("empty.npy", b"")
    w.seal({})
    with ArchiveReader(path) as r:
        assert r.verify() == []
        assert r.read_bytes("blob.bin") == blob
        np.testing.assert_array_equal(r.read_array("arr.npy", dtype="<f4", ndim=2), arr)
        assert r.bytes_read == len(blob) + len(ArchiveWriter._array_bytes("arr.npy", arr))
        with pytest.raises(ArchiveError) as e:
            r.read_array("empty.npy")
    assert str(e.value).startswith(f"member empty.npy of archive {path} is not a .npy array (EOF: reading magic "
                                   f"string"), str(e.value)
    # one byte changed in the second chunk of each: the hash of the whole member tells
    rewrite(path, replace={"blob.bin": blob[:(3 << 20) // 2] + b"\x00\x01"[blob[(3 << 20) // 2] == 0:][:1]
                           + blob[(3 << 20) // 2 + 1:]})
    assert content(problems_of(path)) == [Problem("blob.bin", "altered", "altered member blob.bin (sha256 mismatch)")]


def test_verify_names_a_size_mismatch_with_both_sizes(sealed: Path):
    """Catches the size problem's member, kind or either size lost from its line."""
    longer = canonical_json({**EPISODES[0], "tokens": [2, 7, 9, 11]})
    declared = len(canonical_json(EPISODES[0]))
    rewrite(sealed, replace={"episodes/00000.json": longer})
    assert problems_of(sealed) == [Problem(
        "episodes/00000.json", "size",
        f"size mismatch for member episodes/00000.json: manifest says {declared}, archive holds {len(longer)}")]


def _json_and_array(tmp_path: Path) -> Path:
    path = tmp_path / "ja.zip"
    w = ArchiveWriter(path)
    w.add_json("big.json", {"x": [i * i % 977 for i in range(1000)]})  # about 4 kB, deflates
    w.add_array("arr.npy", np.zeros(2000, dtype="<f4"))  # 8 kB
    w.seal({})
    return path


def test_verify_bounds_json_members_by_the_json_bound_and_arrays_by_the_member_bound(tmp_path: Path):
    """verify reads a JSON member under `max_json_bytes` and an array under `max_member_bytes`.
    Catches the two bounds swapped or one used for both."""
    path = _json_and_array(tmp_path)
    with zipfile.ZipFile(path) as zf:
        size, array = zf.getinfo("big.json").file_size, zf.getinfo("arr.npy").file_size
    assert array > size > zf.getinfo(MANIFEST_NAME).file_size
    found = problems_of(path, max_json_bytes=size - 1, max_member_bytes=array)
    assert found == [Problem("big.json", "unreadable",
                             f"unreadable member big.json: declares {size} bytes, over the bound of {size - 1}")]
    assert problems_of(path, max_json_bytes=size, max_member_bytes=array) == []


def test_verify_refuses_a_deflate_stream_the_writer_would_not_make(tmp_path: Path):
    """Same content, same CRC and hash, deflated at another level: bits no hash covers changed,
    which verify must name. Catches the exact-stream check turned off in verify."""
    path = _json_and_array(tmp_path)
    tmp = tmp_path / "other.zip"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            level = 1 if info.filename == "big.json" else None
            dst.writestr(copy.copy(info), src.read(info), compress_type=info.compress_type, compresslevel=level)
    with zipfile.ZipFile(path) as a, zipfile.ZipFile(tmp) as b:
        assert a.read("big.json") == b.read("big.json")
        assert a.getinfo("big.json").compress_size != b.getinfo("big.json").compress_size  # another stream
    found = [p for p in content(problems_of(tmp)) if p.member == "big.json"]
    assert found == [Problem("big.json", "unreadable", "unreadable member big.json: its DEFLATE stream is not the "
                             "one the writer's zlib (default level) makes of its content: bits the member hash does "
                             "not cover were changed")], found


def test_verify_names_the_total_and_json_bounds_with_the_command_that_reads_the_archive(sealed: Path):
    """Over the total bound: the declared total, the bound and the `packbench audit` target the
    auditor set; over the JSON total: the JSON members' declared total (arrays not counted).
    Catches the total compared with >=, the `.npy` test of the JSON total and the line's fields."""
    with zipfile.ZipFile(sealed) as zf:
        infos = zf.infolist()
    total = sum(i.file_size for i in infos)
    json_total = sum(i.file_size for i in infos if not i.filename.endswith(".npy"))
    assert problems_of(sealed, max_total_bytes=total, max_json_total_bytes=json_total) == []
    with ArchiveReader(sealed, max_total_bytes=total - 1) as r:
        r.audit_target = "42"
        (problem,) = r.verify()
    assert problem == Problem(None, "too-large", "archive too large: " + (
        f"{sealed} declares members of {total} bytes, over the audit bound of {total - 1} bytes, so it was not read; "
        f"only for an archive you trust, audit it with `packbench audit 42 --max-mib 1`"))
    (problem,) = problems_of(sealed, max_json_total_bytes=json_total - 1)
    assert problem == Problem(None, "too-large", f"archive too large: its JSON members declare {json_total} bytes in "
                              f"total, the bound is {json_total - 1} (raise max_json_total_bytes if trusted)")


# ----------------------------------------------------------------------------- members not in the writer's layout


def _zipfile_archive(tmp_path: Path, members: dict[str, tuple[bytes, int]]) -> Path:
    """Members written by zipfile with another timestamp: their local headers are not the
    writer's, so the reader takes them through zipfile (its path for foreign layouts)."""
    path = tmp_path / "z.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for name, (data, method) in members.items():
            info = zipfile.ZipInfo(name, date_time=(2001, 2, 3, 4, 5, 6))
            info.compress_type = method
            zf.writestr(info, data)
    return path


def test_a_foreign_layout_member_is_read_whole_up_to_its_bound(tmp_path: Path):
    """A member the writer did not lay out is still read whole (several chunks, deflated or
    stored) when it is within the bound, exactly at the bound included, and refused by name
    over it. Catches the zipfile path's reads cut short, its running total reset, and the
    bound compared with >=."""
    blob = np.random.default_rng(4).integers(0, 4, (5 << 20) // 2, dtype=np.uint8).tobytes()
    path = _zipfile_archive(tmp_path, {"d.bin": (blob, zipfile.ZIP_DEFLATED), "s.bin": (blob[:5000], zipfile.ZIP_STORED)})
    with ArchiveReader(path, max_member_bytes=len(blob)) as r:
        assert r._data_at == {}  # neither member is in the writer's layout
        assert r.read_bytes("d.bin") == blob
        assert r.read_bytes("s.bin") == blob[:5000]
    with ArchiveReader(path, max_member_bytes=len(blob) - 1) as r, pytest.raises(ArchiveError) as e:
        r.read_bytes("d.bin")
    assert str(e.value) == (f"member d.bin of archive {path} declares {len(blob)} bytes, over the bound of "
                            f"{len(blob) - 1}; raise max_member_bytes if the archive is trusted")


def test_unsupported_compression_and_encryption_are_refused_by_name(tmp_path: Path):
    """Catches either refusal dropped, the encryption flag tested on the wrong bit, or their
    words lost."""
    path = _zipfile_archive(tmp_path, {"b.bin": (b"x" * 100, zipfile.ZIP_BZIP2)})
    with ArchiveReader(path) as r, pytest.raises(ArchiveError) as e:
        r.read_bytes("b.bin")
    assert str(e.value) == (f"member b.bin of archive {path} uses unsupported compression method 12; raw archives "
                            f"use STORED or DEFLATED only")
    path = _zipfile_archive(tmp_path, {"e.bin": (b"x" * 100, zipfile.ZIP_STORED)})
    raw = bytearray(path.read_bytes())  # zipfile writes no encrypted member: set the flag's bit 0 by hand
    raw[6] |= 0x1  # the local header's flags
    raw[raw.index(b"PK\x01\x02") + 8] |= 0x1  # the directory entry's
    path.write_bytes(raw)
    with ArchiveReader(path) as r, pytest.raises(ArchiveError) as e:
        r.read_bytes("e.bin")
    assert str(e.value) == f"member e.bin of archive {path} is encrypted; raw archives are never encrypted"


# ----------------------------------------------------------------------------- DEFLATE streams in the writer's layout


def _one_deflated_member(path: Path, name: str, content: bytes, payload: bytes, *, size: int | None = None) -> Path:
    """An archive of one DEFLATED member whose headers are exactly the writer's for `content`
    (CRC, sizes) but whose stored bytes are `payload`: the reader takes its exact path."""
    from packbench.core.archive.zipformat import VERSION, central_entry, end_records, local_header
    size = len(content) if size is None else size
    fields = dict(method=zipfile.ZIP_DEFLATED, crc=zlib.crc32(content), csize=len(payload), size=size)
    head = local_header(name.encode(), zip64=False, **fields)
    cd = central_entry(name.encode(), offset=0, version=VERSION, **fields)
    path.write_bytes(head + payload + cd + end_records(1, len(head) + len(payload), len(cd)))
    return path


def _raw_deflate(data: bytes, *, finish: bool = True) -> bytes:
    z = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
    return z.compress(data) + z.flush(zlib.Z_FINISH if finish else zlib.Z_SYNC_FLUSH)


@pytest.mark.parametrize("case", ["junk after the stream", "junk past the first chunk", "junk over three chunks",
                                  "no final block", "not deflate"])
def test_damaged_deflate_streams_are_named_by_what_is_wrong(tmp_path: Path, case: str):
    """Bytes after the end of a member's DEFLATE stream (in its first chunk or past it), a stream
    without its final block and bytes that are no DEFLATE stream at all: each is read as
    'cannot be read (cause)' and verified as 'unreadable member NAME: cause'. Catches a check
    dropped, the count of trailing bytes wrong, and a cause or the fix lost."""
    content = b"packbench " * 300
    stream = _raw_deflate(content)
    payload, cause = {
        "junk after the stream": (stream + bytes(4), "4 bytes after the end of its DEFLATE stream"),
        "junk past the first chunk": (stream + bytes((1 << 20) + 10),
                                      f"{(1 << 20) + 10} bytes after the end of its DEFLATE stream"),
        "junk over three chunks": (stream + bytes((5 << 19) + 3),
                                   f"{(5 << 19) + 3} bytes after the end of its DEFLATE stream"),
        "no final block": (_raw_deflate(content, finish=False), "truncated DEFLATE stream"),
        "not deflate": (b"\xff" * 20, "zlib.error: Error -3 while decompressing data: invalid block type"),
    }[case]
    path = _one_deflated_member(tmp_path / "d.zip", "m.bin", content, payload)
    with ArchiveReader(path) as r:
        assert r._data_at  # the writer's layout: read straight from the file
        with pytest.raises(ArchiveError) as e:
            r.read_bytes("m.bin")
        found = [p for p in r.verify() if p.member == "m.bin"]
    assert str(e.value) == f"member m.bin of archive {path} cannot be read ({cause}); the archive is damaged: run verify()"
    assert found == [Problem("m.bin", "unreadable", f"unreadable member m.bin: {cause}")]


def test_a_member_inflating_past_the_bound_is_named_with_the_bound(tmp_path: Path):
    """The writer's layout, a size declared within the bound, more bytes inflated: refused at the
    bound with its words. Catches the bound's message or fix lost on the exact path."""
    content = bytes(5000)
    path = _one_deflated_member(tmp_path / "b.zip", "m.bin", content, _raw_deflate(content), size=100)
    with ArchiveReader(path, max_member_bytes=1000) as r, pytest.raises(ArchiveError) as e:
        r.read_bytes("m.bin")
    assert str(e.value) == (f"member m.bin of archive {path} inflates past the bound of 1000 bytes; the archive is "
                            f"hostile or damaged")


# ----------------------------------------------------------------------------- names and offsets


def _stored_zip(path: Path, members: list[tuple[bytes, bytes, int | None]], gap: int = 0) -> Path:
    """Members STORED with the writer's own records; `gap` junk bytes before the second member,
    or an explicit offset (the third field) for its directory entry."""
    from packbench.core.archive.zipformat import VERSION, central_entry, end_records, local_header
    body, cd = b"", b""
    for i, (name, data, offset) in enumerate(members):
        if i == 1:
            body += bytes(gap)
        fields = dict(method=zipfile.ZIP_STORED, crc=zlib.crc32(data), csize=len(data), size=len(data))
        at = len(body)
        body += local_header(name, zip64=False, **fields) + data
        cd += central_entry(name, offset=at if offset is None else offset, version=VERSION, **fields)
    path.write_bytes(body + cd + end_records(len(members), len(body), len(cd)))
    return path


def test_bytes_between_members_and_overlapping_members_are_layout_problems(tmp_path: Path):
    """Catches the gap and the overlap confused, their sizes or offsets wrong, and the problem
    kind or member lost (a gap belongs to no member; an overlap names the later member)."""
    a = (b"a.bin", b"x" * 50, None)
    gap = _stored_zip(tmp_path / "gap.zip", [a, (b"b.bin", b"y" * 20, None)], gap=5)
    first = 30 + 5 + 50  # a's local header (30 + 5-byte name) and data
    assert [p for p in problems_of(gap) if p.kind == "layout"][0] == Problem(
        None, "layout", f"layout: 5 bytes before member b.bin belong to no member (offset {first})")
    over = _stored_zip(tmp_path / "over.zip", [a, (b"b.bin", b"y" * 20, 10)])
    assert [p for p in problems_of(over) if p.kind == "layout"][0] == Problem(
        "b.bin", "layout", f"layout: member b.bin overlaps the member before it (offset {first})")


def test_a_name_with_a_nul_byte_or_outside_ascii_is_named_as_such(tmp_path: Path):
    """zipfile cuts a name at a NUL byte, so the name the archive holds is not the one read:
    verify and read say so; a non-ASCII name is a layout problem of that member. Catches the
    NUL check's words lost and the non-ASCII problem's member or kind changed."""
    path = _stored_zip(tmp_path / "nul.zip", [(b"a\x00b.bin", b"x", None)])
    with ArchiveReader(path) as r:
        assert [p for p in r.verify() if p.kind == "unsafe"] == [
            Problem("a", "unsafe", "unsafe member name a (contains a NUL byte)")]
        with pytest.raises(ArchiveError) as e:
            r.read_bytes("a")
    assert str(e.value) == (f"refusing unsafe member name 'a\\x00b.bin' in archive {path} (contains a NUL byte); "
                            f"the archive is hostile or damaged")
    path = tmp_path / "utf8.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("\u00e9.bin", b"x")
    assert Problem("\u00e9.bin", "layout", "layout: member \u00e9.bin has a non-ASCII name") in problems_of(path)


def test_a_duplicate_member_does_not_stop_the_check_of_those_after_it(sealed: Path):
    """Catches verify giving up at the first duplicate."""
    with zipfile.ZipFile(sealed) as zf:
        plan = zf.read("plan.json")
    with pytest.warns(UserWarning, match="Duplicate name"):  # zipfile's own, writing the forgery
        append_entry(sealed, "plan.json", plan)
    append_entry(sealed, "late.bin", b"x")
    found = content(problems_of(sealed))
    assert Problem("plan.json", "duplicate", "duplicate member plan.json") in found
    assert Problem("late.bin", "extra", "extra member late.bin") in found


# ----------------------------------------------------------------------------- the manifest itself


def test_every_problem_of_the_manifest_itself_is_named_on_manifest_json(sealed: Path, tmp_path: Path):
    """A duplicate, a symlink, an unparseable (200 characters of cause), a malformed manifest and
    one deflated at another level: each one Problem naming manifest.json with its kind, and the
    archive is not complete. Catches a check dropped, its member or kind lost, and the manifest
    read without the exact-stream check."""
    with zipfile.ZipFile(sealed) as zf:
        body = zf.read(MANIFEST_NAME)

    def manifest_problems(path: Path) -> list[Problem]:
        with ArchiveReader(path) as r:
            assert not r.complete
            return [p for p in r.verify() if p.member == MANIFEST_NAME]

    dup = tmp_path / "dup.zip"
    dup.write_bytes(sealed.read_bytes())
    with pytest.warns(UserWarning, match="Duplicate name"):
        append_entry(dup, MANIFEST_NAME, body)
    assert Problem(MANIFEST_NAME, "duplicate", "duplicate member manifest.json: cannot tell which is real") in \
        manifest_problems(dup)
    link = tmp_path / "link.zip"
    with zipfile.ZipFile(link, "w") as zf:
        info = zipfile.ZipInfo(MANIFEST_NAME)
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, b"plan.json")
    assert Problem(MANIFEST_NAME, "symlink", "symlink member manifest.json") in manifest_problems(link)
    long_key = "k" * 300
    unparseable = tmp_path / "unparseable.zip"
    with zipfile.ZipFile(unparseable, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MANIFEST_NAME, ('{"%s":1,"%s":2}' % (long_key, long_key)).encode())
    cause = f"duplicate key '{long_key}"[:200]
    assert Problem(MANIFEST_NAME, "manifest", f"unparseable member manifest.json: {cause}") in \
        manifest_problems(unparseable)
    malformed = tmp_path / "malformed.zip"
    with zipfile.ZipFile(malformed, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MANIFEST_NAME, canonical_json([]))
    assert Problem(MANIFEST_NAME, "manifest", "malformed member manifest.json: not a JSON object") in \
        manifest_problems(malformed)
    big = canonical_json({"format_version": 1, "members": {}, "pad": [i * i % 977 for i in range(1000)]})
    z = zlib.compressobj(1, zlib.DEFLATED, -15)
    level1 = z.compress(big) + z.flush()
    assert level1 != _raw_deflate(big)
    other = _one_deflated_member(tmp_path / "level1.zip", MANIFEST_NAME, big, level1)
    (problem,) = manifest_problems(other)
    assert (problem.kind, problem.message.split(": its DEFLATE stream")[0]) == (
        "unreadable", "unreadable member manifest.json"), problem


# ----------------------------------------------------------------------------- read failures on both paths, by name


def _set_sizes(path: Path, name: str, *, size: int) -> None:
    """Declare `size` uncompressed bytes for member `name` in its local header and its
    directory entry alike (the stored bytes and the CRC stay)."""
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x03\x04")
    struct.pack_into("<L", raw, at + 22, size)
    cd = raw.index(b"PK\x01\x02")
    struct.pack_into("<L", raw, cd + 24, size)
    path.write_bytes(raw)


def _read_failure(path: Path, name: str) -> tuple[str, list[Problem]]:
    with ArchiveReader(path) as r:
        with pytest.raises(ArchiveError) as e:
            r.read_bytes(name)
        return str(e.value), [p for p in r.verify() if p.member == name and p.kind != "layout"]


def _unreadable(path: Path, name: str, cause: str) -> tuple[str, list]:
    """What `_read_failure` gives for a member whose bytes cannot be read: read's error, verify's problem."""
    return (f"member {name} of archive {path} cannot be read ({cause}); the archive is damaged: run verify()",
            [Problem(name, "unreadable", f"unreadable member {name}: {cause}")])


def test_a_foreign_layout_member_that_fails_to_read_is_named_with_its_cause(tmp_path: Path):
    """Through zipfile (a member the writer did not lay out): a bad CRC, a stream that is no
    DEFLATE and a member holding fewer bytes than it declares are each refused by read with the
    cause and the fix, and named by verify as unreadable with the cause. Catches the cause's
    kind (zlib.error) or words lost, the fix lost, and the size check after the last chunk
    skipped."""
    content = b"packbench " * 50
    path = _zipfile_archive(tmp_path, {"c.bin": (content, zipfile.ZIP_STORED)})
    raw = bytearray(path.read_bytes())
    raw[raw.index(content) + 7] ^= 0x20  # one byte of the data: the CRC no longer holds
    path.write_bytes(raw)
    cause = "BadZipFile: Bad CRC-32 for file 'c.bin'"
    assert _read_failure(path, "c.bin") == _unreadable(path, "c.bin", cause)

    path = _zipfile_archive(tmp_path, {"z.bin": (content, zipfile.ZIP_DEFLATED)})
    raw = bytearray(path.read_bytes())
    start = data_offset(bytes(raw), zipfile.ZipFile(path).getinfo("z.bin"))
    raw[start] = 0xFF  # a reserved block type
    path.write_bytes(raw)
    cause = "zlib.error: Error -3 while decompressing data: invalid block type"
    assert _read_failure(path, "z.bin") == _unreadable(path, "z.bin", cause)

    path = _zipfile_archive(tmp_path, {"s.bin": (content, zipfile.ZIP_DEFLATED)})
    _set_sizes(path, "s.bin", size=len(content) + 9)  # the stream ends 9 bytes early; its CRC is right
    phrase = f"holds {len(content)} bytes but its zip entry declares {len(content) + 9}"
    assert _read_failure(path, "s.bin") == (
        f"member s.bin of archive {path} {phrase}; the archive is damaged: run verify()",
        [Problem("s.bin", "unreadable", f"unreadable member s.bin: {phrase}")])


def _stored_exact(path: Path, name: bytes, data: bytes, *, size: int, csize: int) -> Path:
    """One STORED member whose headers are the writer's for the sizes given (the reader's exact
    path), then its directory and end record."""
    from packbench.core.archive.zipformat import VERSION, central_entry, end_records, local_header
    fields = dict(method=zipfile.ZIP_STORED, crc=zlib.crc32(data), csize=csize, size=size)
    head = local_header(name, zip64=False, **fields)
    cd = central_entry(name, offset=0, version=VERSION, **fields)
    path.write_bytes(head + data + cd + end_records(1, len(head) + len(data), len(cd)))
    return path


def test_an_exact_layout_member_that_fails_to_read_is_named_with_its_cause(tmp_path: Path):
    """Read straight from the file (the writer's layout): a member holding fewer bytes than it
    declares, and one whose stored bytes run past the end of the file. Catches either check's
    words or fix lost."""
    data = b"0123456789" * 3
    path = _stored_exact(tmp_path / "short.zip", b"m.bin", data, size=len(data) + 4, csize=len(data))
    phrase = f"holds {len(data)} bytes but its zip entry declares {len(data) + 4}"
    with ArchiveReader(path) as r:
        assert r._data_at
    assert _read_failure(path, "m.bin") == (
        f"member m.bin of archive {path} {phrase}; the archive is damaged: run verify()",
        [Problem("m.bin", "unreadable", f"unreadable member m.bin: {phrase}")])
    path = _stored_exact(tmp_path / "past.zip", b"m.bin", data, size=5000, csize=5000)
    with ArchiveReader(path) as r:
        assert r._data_at
    cause = "the file ends inside the member"
    assert _read_failure(path, "m.bin") == (
        f"member m.bin of archive {path} cannot be read ({cause}); the archive is damaged: run verify()",
        [Problem("m.bin", "unreadable", f"unreadable member m.bin: {cause}")])


def test_a_member_yielding_more_than_it_declares_is_refused(tmp_path: Path):
    """A DEFLATE stream inflating to more bytes than its entry declares (under the bound): read
    refuses it as yielding more than declared, verify names what it holds. Catches the read's
    buffer overrun check dropped or its words lost."""
    content = b"abc" * 400
    path = _one_deflated_member(tmp_path / "more.zip", "m.bin", content, _raw_deflate(content), size=100)
    message, found = _read_failure(path, "m.bin")
    assert message == (f"member m.bin of archive {path} yields more than the 100 bytes it declares; the archive is "
                       f"damaged: run verify()")
    assert found == [Problem("m.bin", "unreadable",
                             f"unreadable member m.bin: holds {len(content)} bytes but its zip entry declares 100")]


def test_a_deflated_member_inflating_to_many_chunks_from_one_read_comes_back_whole(tmp_path: Path):
    """A compressible member: one read of its stored bytes inflates to several 1 MiB chunks
    (zlib keeps the input it has not used yet). Catches that input dropped."""
    blob = b"".join(b"row %07d packbench\n" % i for i in range(200_000))  # 4 MiB, a few hundred KiB deflated
    path = tmp_path / "c.zip"
    w = ArchiveWriter(path)
    w.add_bytes("rows.json.txt", blob)  # not .json: any bytes, deflated
    w.seal({})
    with ArchiveReader(path) as r:
        assert r.verify() == []
        assert r.read_bytes("rows.json.txt") == blob


def _read_error(path: Path, name: str, payload: bytes, read: str) -> tuple[Path, pytest.ExceptionInfo]:
    """A sealed archive of one member `name` holding `payload`, and the ArchiveError its reader's `read`
    method raises on it."""
    w = ArchiveWriter(path)
    w.add_bytes(name, payload)
    w.seal({})
    with ArchiveReader(path) as r, pytest.raises(ArchiveError) as e:
        getattr(r, read)(name)
    return path, e


def test_an_empty_array_member_is_named_by_the_header_check_with_numpys_words(tmp_path: Path):
    """Catches the empty member's header check fed other bytes than none."""
    path, e = _read_error(tmp_path / "e.zip", "empty.npy", b"", "read_array")
    assert str(e.value) == (f"member empty.npy of archive {path} is not a .npy array (EOF: reading magic string, "
                            f"expected 8 bytes got 0); the archive is damaged")


def test_a_deflate_stream_that_cannot_be_checked_here_says_so(tmp_path: Path, monkeypatch):
    """On a Python whose zlib does not deflate as stock zlib does, a stream other than the
    writer's is named as uncheckable here, not as altered."""
    import packbench.core.archive.reader as reader
    content = b"packbench " * 300
    z = zlib.compressobj(0, zlib.DEFLATED, -15)  # stored blocks: valid, not the writer's stream
    other = z.compress(content) + z.flush()
    assert other != _raw_deflate(content)
    path = _one_deflated_member(tmp_path / "o.zip", "m.bin", content, other)
    monkeypatch.setattr(reader, "stock_deflate", lambda: False)
    with ArchiveReader(path) as r:
        found = [p for p in r.verify() if p.member == "m.bin"]
    assert found == [Problem("m.bin", "unreadable", (
        f"unreadable member m.bin: its DEFLATE stream cannot be checked here: this Python's zlib "
        f"({zlib.ZLIB_RUNTIME_VERSION}) does not deflate as stock zlib does; audit with a Python built on stock zlib"))]


# ----------------------------------------------------------------------------- the layout's problems, each by its words


def test_a_member_stored_with_the_other_method_is_a_layout_problem_of_that_member(tmp_path: Path):
    path = _zipfile_archive(tmp_path, {"a.npy": (b"x" * 40, zipfile.ZIP_DEFLATED)})
    assert [p for p in problems_of(path) if "compression method" in p.message] == [Problem(
        "a.npy", "layout", "layout: member a.npy uses compression method 8, the writer uses 0 for it")]


def test_bytes_before_the_central_directory_of_a_sealed_archive_belong_to_no_member(tmp_path: Path):
    """Sealed (manifest.json last), junk between the last member and the directory: named with
    its size and offset. Catches the count or the kind or member lost."""
    from packbench.core.archive.zipformat import VERSION, central_entry, end_records, local_header
    data = canonical_json({"format_version": 1, "members": {}})
    fields = dict(method=zipfile.ZIP_STORED, crc=zlib.crc32(data), csize=len(data), size=len(data))
    body = local_header(MANIFEST_NAME.encode(), zip64=False, **fields) + data
    cd = central_entry(MANIFEST_NAME.encode(), offset=0, version=VERSION, **fields)
    path = tmp_path / "g.zip"
    path.write_bytes(body + bytes(7) + cd + end_records(1, len(body) + 7, len(cd)))
    layout = [p for p in problems_of(path) if p.kind == "layout"]
    assert Problem(None, "layout", f"layout: 7 bytes between the last member and the central directory belong to "
                                   f"no member (offset {len(body)})") in layout


def test_a_member_running_into_the_directory_of_an_unsealed_archive_is_a_layout_problem(tmp_path: Path):
    """Unsealed (no manifest yet): a member whose stored size reaches into the directory. Catches
    the check kept for sealed archives only, and its words or kind lost."""
    path = _stored_exact(tmp_path / "into.zip", b"m.bin", b"z" * 30, size=60, csize=60)
    layout = [p for p in problems_of(path) if p.kind == "layout"]
    assert Problem(None, "layout", "layout: the central directory is not where the members end") in layout


def test_foreign_directory_fields_and_end_records_are_named(sealed: Path):
    """A directory entry with another attribute, an end record counting entries differently on
    this disk, and a comment: each named by what holds it. Catches the words or kinds lost."""
    raw = sealed.read_bytes()
    cd = raw.index(b"PK\x01\x02")
    changed = bytearray(raw)
    changed[cd + 38] ^= 0x01  # the first entry's external attributes: zipfile reads on, CRCs hold
    sealed.write_bytes(changed)
    assert [p for p in problems_of(sealed) if p.kind == "layout"] == [Problem(
        None, "layout", "layout: the central directory holds fields, bytes or entries the writer never writes")]
    changed = bytearray(raw)
    end = raw.rindex(b"PK\x05\x06")
    struct.pack_into("<H", changed, end + 8, len(MEMBERS) - 1)  # entries on this disk; the total stays
    sealed.write_bytes(changed)
    assert [p for p in problems_of(sealed) if p.kind == "layout"] == [Problem(
        None, "layout", "layout: the end of central directory record holds bytes the writer never writes")]
    changed = bytearray(raw)
    struct.pack_into("<H", changed, end + 20, 6)
    sealed.write_bytes(bytes(changed) + b"hidden")
    assert [p for p in problems_of(sealed) if p.kind == "layout"] == [Problem(
        None, "layout", "layout: the end of central directory record holds a zip comment of 6 bytes")]


def test_a_member_zipfile_writes_as_zip64_has_the_writers_zip64_headers(tmp_path: Path):
    """The zip64 decision is zipfile's (size x 1.05 over 2^31 - 1), made from the entry's size:
    checked on the records alone (a member of that size is not written: the layout check reads
    headers only). Catches the decision dropped, inverted or moved off zipfile's threshold."""
    from packbench.core.archive.verify import layout_problems
    from packbench.core.archive.zipformat import (
        VERSION, ZIP64_LIMIT, ZIP64_VERSION, central_entry, end_records, local_header,
    )
    first_zip64 = next(n for n in range(2045222500, 2045222600) if n * 1.05 > ZIP64_LIMIT)
    for size, zip64 in ((first_zip64 - 1, False), (first_zip64, True), (2_100_000_000, True)):
        data = b"q" * 10  # what the entry says it compresses to
        info = zipfile.ZipInfo("a.bin", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type, info.CRC, info.file_size, info.compress_size = zipfile.ZIP_DEFLATED, 7, size, len(data)
        info.header_offset = 0
        fields = dict(method=zipfile.ZIP_DEFLATED, crc=7, csize=len(data), size=size)
        head = local_header(b"a.bin", zip64=zip64, **fields)
        cd = central_entry(b"a.bin", offset=0, version=ZIP64_VERSION if zip64 else VERSION, **fields)
        end = end_records(1, len(head) + len(data), len(cd))
        path = tmp_path / "z64.bin"
        path.write_bytes(head + data + cd + end)
        with open(path, "rb") as f:
            found, data_at = layout_problems(f.fileno(), path.stat().st_size, len(end), [info], b"")
        assert (found, data_at) == ([], {id(info): len(head)}), (size, zip64)


def test_a_name_that_does_not_print_is_shown_escaped(sealed: Path):
    """Catches a hostile name printed raw (a control character in a problem line) or its
    escape lost."""
    append_entry(sealed, "a\x01b", b"x")
    assert Problem("a\x01b", "unsafe", "unsafe member name 'a\\x01b' (has characters outside [A-Za-z0-9._/-])") \
        in problems_of(sealed)


def test_an_unsafe_name_listed_in_the_manifest_is_a_problem_of_that_name(sealed: Path):
    edit_manifest(sealed, lambda m: m["members"].update({"../evil": {"sha256": "0" * 64, "size": 1}}))
    assert problems_of(sealed) == [Problem(
        "../evil", "unsafe", "unsafe member name ../evil (listed in manifest.json; contains a '..' segment)")]


def test_a_duplicate_key_is_named_by_the_key_repeated(tmp_path: Path):
    path, e = _read_error(tmp_path / "d.zip", "d.json", b'{"a":1,"b":2,"b":3}', "read_json")
    assert str(e.value) == (f"member d.json of archive {path} is not valid JSON (duplicate key 'b' (another parser "
                            f"may keep the other value)); the archive is damaged: run verify()")


def test_a_manifest_of_several_chunks_is_read_whole(tmp_path: Path):
    """manifest.json over the 1 MiB read chunk. Catches its chunks joined with anything between."""
    path = tmp_path / "m.zip"
    w = ArchiveWriter(path)
    w.add_bytes("x.bin", b"x")
    notes = "".join(f"{i:08d}" for i in range(200_000))  # 1.6 MB, deflated well under one chunk
    w.seal({"notes": notes})
    with ArchiveReader(path) as r:
        assert r.complete and r.manifest["notes"] == notes
        assert r.verify() == []


def test_a_symlink_manifest_is_named_first(sealed: Path):
    """A symlink manifest.json is what verify names first, as every problem of the manifest
    itself (audit lines keep verify's order). Catches the manifest's problem dropped when it loads."""
    rewrite(sealed, drop=[MANIFEST_NAME])
    info = zipfile.ZipInfo(MANIFEST_NAME)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    append_entry(sealed, info, b"/etc/passwd")
    found = problems_of(sealed)
    assert found[0] == Problem(MANIFEST_NAME, "symlink", "symlink member manifest.json")
    assert found.count(found[0]) == 1


def test_reading_a_member_does_not_demand_the_writers_deflate_stream_verify_does(tmp_path: Path):
    """A valid DEFLATE stream other than the writer's: read gives its content (the content is
    what a reader asks for), verify names the stream (the file is not the writer's). Catches
    every read made to recompress."""
    content = b"packbench " * 300
    z = zlib.compressobj(0, zlib.DEFLATED, -15)
    path = _one_deflated_member(tmp_path / "o.zip", "m.bin", content, z.compress(content) + z.flush())
    with ArchiveReader(path) as r:
        assert r.read_bytes("m.bin") == content
        assert [p.kind for p in r.verify() if p.member == "m.bin"] == ["unreadable"]


def test_a_bomb_is_refused_before_it_inflates_in_memory(tmp_path: Path):
    """A small member inflating to 32 MiB with a bound of 1,000 bytes is refused having held
    about one bounded read of output, not the whole inflated member. Catches the inflation's
    output bound dropped."""
    import tracemalloc
    content = bytes(32 << 20)
    path = _one_deflated_member(tmp_path / "bomb.zip", "m.bin", content, _raw_deflate(content), size=100)
    with ArchiveReader(path, max_member_bytes=1000) as r:
        tracemalloc.start()
        try:
            with pytest.raises(ArchiveError, match="inflates past the bound of 1000 bytes"):
                r.read_bytes("m.bin")
            found = [p for p in r.verify() if p.member == "m.bin"]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert found == [Problem("m.bin", "unreadable", "unreadable member m.bin: inflates past the bound of 1000 bytes")]
    assert peak < 4 << 20, peak


def test_records_holding_values_no_writer_record_can_hold_are_one_layout_problem(tmp_path: Path):
    """A directory entry whose zip64 field gives a 5 GiB compressed size for a 10-byte member:
    no local header of the writer can hold it (a zip32 header, by the size). The reader opens
    the archive, names that as one layout problem with its cause, and reads the
    member through zipfile (which stops at its declared 10 bytes). Catches the problem's kind,
    words or cause lost and the members' data offsets left unset."""
    from packbench.core.archive.zipformat import VERSION, end_records, local_header
    data = b"0123456789"
    crc = zlib.crc32(data)
    head = local_header(b"m.bin", method=zipfile.ZIP_STORED, crc=crc, csize=len(data), size=len(data), zip64=False)
    extra = struct.pack("<HHQ", 1, 8, 5 << 30)
    cd = struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", VERSION, 3, VERSION, 0, 0, zipfile.ZIP_STORED, 0, 33, crc,
                     0xFFFFFFFF, len(data), 5, len(extra), 0, 0, 0, (stat.S_IFREG | 0o644) << 16, 0) + b"m.bin" + extra
    path = tmp_path / "big.zip"
    path.write_bytes(head + data + cd + end_records(1, len(head) + len(data), len(cd)))
    with ArchiveReader(path) as r:
        assert r._data_at == {}
        assert [p for p in r.verify() if p.kind == "layout"] == [Problem(
            None, "layout", "layout: the zip records hold values the writer never writes ('L' format requires "
                            "0 <= number <= 4294967295)")]
        assert r.read_bytes("m.bin") == data


# ----------------------------------------------------------------------------- what zlib and the file do rarely


class _HoldingBack:
    """zlib's raw inflater, but the output of the input it is given comes only when it is asked
    with b"" after the last input, `piece` bytes at a time (within the output bound asked for):
    what zlib does with output pending behind a bound, drawn out."""

    piece = 1000
    unconsumed_tail = b""  # every input is taken
    _zlib_inflater = staticmethod(zlib.decompressobj)  # zlib's own, while the test patches zlib.decompressobj

    def __init__(self, wbits: int) -> None:
        self._inflate = self._zlib_inflater(wbits)
        self._held = b""

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        if data:
            self._held += self._inflate.decompress(data)
            return b""
        cut = min(self.piece, max_length or self.piece)
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    @property
    def eof(self) -> bool:
        return self._inflate.eof and not self._held

    @property
    def unused_data(self) -> bytes:
        return self._inflate.unused_data


class _Stuck:
    """An inflater that takes none of its input and gives no output. zlib never does (with room
    for output it takes input or stops at the stream's end); the reader refuses it rather than
    loop forever."""

    eof = False
    unused_data = b""

    def __init__(self, wbits: int) -> None:
        self.unconsumed_tail = b""

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        self.unconsumed_tail = bytes(data)
        return b""


@pytest.mark.parametrize("case", ["zlib past 1 MiB", "held back in pieces"])
def test_output_zlib_holds_back_after_the_last_input_is_read_whole(tmp_path: Path, monkeypatch, case: str):
    """Output still pending once the whole stream is taken is read to the end: by zlib itself for
    a member 5 bytes past 1 MiB (the first inflate fills its 1 MiB bound and takes all of the
    stream), and by an inflater that gives everything only after the last input, in pieces.
    Read gives the content, verify finds nothing. Catches the output after the last input
    dropped (refused as truncated) or not handed on."""
    import packbench.core.archive.reader as reader
    if case == "zlib past 1 MiB":
        data = bytes((1 << 20) + 5)
    else:
        data = b"".join(b"row %05d packbench\n" % i for i in range(1000))
        monkeypatch.setattr(reader.zlib, "decompressobj", _HoldingBack)
    path = tmp_path / "h.zip"
    w = ArchiveWriter(path)
    w.add_bytes("m.bin", data)
    w.seal({})
    with ArchiveReader(path) as r:
        assert r._data_at  # the writer's layout: read straight from the file
        assert r.read_bytes("m.bin") == data
        assert r.verify() == []


def test_a_deflate_stream_that_makes_no_progress_is_refused_not_looped_on(tmp_path: Path, monkeypatch):
    """An inflater that takes nothing and gives nothing with input left: read refuses the member
    with the cause, verify names it unreadable with the cause, and neither loops. Catches the
    cause's words lost."""
    import packbench.core.archive.reader as reader
    content = b"packbench " * 300
    path = _one_deflated_member(tmp_path / "s.zip", "m.bin", content, _raw_deflate(content))
    monkeypatch.setattr(reader.zlib, "decompressobj", _Stuck)
    assert _read_failure(path, "m.bin") == _unreadable(path, "m.bin", "the DEFLATE stream makes no progress")


def test_a_member_the_file_fails_to_give_is_named_with_the_os_error(tmp_path: Path, monkeypatch):
    """The archive opens, then reading a member's bytes fails (an I/O error of the disk): read
    refuses the member with the error's type and words, verify names it unreadable with the
    same, one line each, no traceback. Catches the OS error's cause lost or mangled."""
    import errno
    import packbench.core.archive.reader as reader
    data = b"0123456789" * 3
    path = _stored_exact(tmp_path / "io.zip", b"m.bin", data, size=len(data), csize=len(data))

    def eio(fd: int, n: int, at: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with ArchiveReader(path) as r:
        assert r._data_at  # the writer's layout: read with os.pread
        monkeypatch.setattr(reader.os, "pread", eio)
        with pytest.raises(ArchiveError) as e:
            r.read_bytes("m.bin")
        found = [p for p in r.verify() if p.member == "m.bin" and p.kind != "layout"]
    assert (str(e.value), found) == _unreadable(path, "m.bin", "OSError: [Errno 5] Input/output error")


def test_a_long_layout_error_is_named_in_one_line_of_its_first_200_characters(tmp_path: Path, monkeypatch):
    """Checking the layout fails with a cause of several lines and over 200 characters: the
    archive still opens, its members are read through zipfile, and the layout problem holds the
    cause on one line, cut at 200 characters. Catches the cut moved or dropped."""
    import packbench.core.archive.reader as reader
    cause = "field out of range\n" + "x" * 300

    def failing(*args: object) -> None:
        raise ValueError(cause)

    data = b"0123456789"
    path = _stored_exact(tmp_path / "l.zip", b"m.bin", data, size=len(data), csize=len(data))
    monkeypatch.setattr(reader, "layout_problems", failing)
    with ArchiveReader(path) as r:
        assert r._data_at == {}
        assert r._layout == [Problem(None, "layout", "layout: the zip records hold values the writer never writes "
                                                     "(field out of range\\n" + "x" * 180 + ")")]
        assert r.read_bytes("m.bin") == data
