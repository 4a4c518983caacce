"""Raw archive v1: round trips, sealing, partial archives, the layout, the write scheme (a valid
zip after every append and every crash) and structured problems. Tampering and hostile archives:
test_archive_hostile.py; the sample archive and the zip rewrites: archive_samples.py.

Every test uses real zip files under tmp_path and runs in milliseconds.
"""

import errno
import hashlib
import io
import os
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest

from archive_samples import (
    EPISODES, LOGITS, MANIFEST, MEMBERS, NOTES, PLAN, append_entry, data_offset, edit_manifest, lines, problems_of,
    rewrite, sealed_screen, verify, write_screen,
)
from packbench.core.archive import (
    MANIFEST_NAME,
    PLAN_NAME,
    PROBLEM_KINDS,
    PROTOCOL_NAME,
    VERDICTS_NAME,
    WORKER_NAME,
    ArchiveReader,
    ArchiveWriter,
    EpisodeMembers,
    Problem,
    episode_member,
    episode_members,
    file_sha256,
    logits_member,
    trace_member,
)
from packbench.core.canonical import canonical_json, sha256_hex
from packbench.core.errors import ArchiveError, PackbenchError


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    return sealed_screen(tmp_path)


# ----------------------------------------------------------------------------- round trip


def test_round_trip_json_arrays_bytes(tmp_path: Path):
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    arrays = {
        "f32.npy": np.array([[1.5, -0.0, np.inf], [np.nan, 3e-38, -7.25]], dtype=np.float32),
        "f16.npy": np.array([0.1, -65504.0, 6e-8, np.nan], dtype=np.float16),
        "i64.npy": np.array([-(2**63), 0, 2**63 - 1], dtype=np.int64),
        "fortran.npy": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "empty.npy": np.zeros((0, 5), dtype=np.float32),
    }
    obj = {"b": [1, 2.5, "é"], "a": None, "nested": {"z": True}}
    w.add_json("x/obj.json", obj)
    for name, arr in arrays.items():
        w.add_array(name, arr)
    w.add_bytes("raw.bin", b"\x00\xffabc")
    w.add_bytes("empty.bin", b"")
    w.seal({"screen_id": 1})

    with ArchiveReader(path) as r:
        assert r.complete and r.verify() == []
        assert r.read_json("x/obj.json") == obj
        assert r.read_bytes("x/obj.json") == canonical_json(obj)
        for name, arr in arrays.items():
            got = r.read_array(name)
            assert got.dtype == arr.dtype and got.shape == arr.shape
            assert got.tobytes() == np.ascontiguousarray(arr).tobytes()  # bit-exact, NaN included
        assert r.read_bytes("raw.bin") == b"\x00\xffabc"
        assert r.read_bytes("empty.bin") == b""
        assert r.names[-1] == MANIFEST_NAME
        assert set(r.names) == set(w.members) | {MANIFEST_NAME}
        assert r.manifest["format_version"] == 1 and r.manifest["screen_id"] == 1


def test_seal_hash_manifest_and_compression(sealed: Path, tmp_path: Path):
    other = tmp_path / "again.zip"
    w = write_screen(other, seal=False)
    digest = w.seal(MANIFEST)
    assert digest == file_sha256(other) == w.sha256
    assert digest == file_sha256(sealed)  # same records, byte-identical archive
    with ArchiveReader(other) as r:
        assert r.names == MEMBERS
        assert r.manifest == {**MANIFEST, "format_version": 1, "members": w.members}
        assert r.read_bytes(MANIFEST_NAME) == canonical_json(r.manifest)
    for name, entry in w.members.items():
        assert set(entry) == {"sha256", "size"}
    assert w.members["notes.bin"] == {"sha256": sha256_hex(NOTES), "size": len(NOTES)}
    with zipfile.ZipFile(other) as zf:
        for info in zf.infolist():
            want = zipfile.ZIP_STORED if info.filename.endswith(".npy") else zipfile.ZIP_DEFLATED
            assert info.compress_type == want, info.filename


def test_seal_rejects_conflicting_keys_and_second_seal(tmp_path: Path):
    w = write_screen(tmp_path / "a.zip", seal=False)
    with pytest.raises(ArchiveError, match="members"):
        w.seal({"members": {}})
    with pytest.raises(ArchiveError, match="format_version"):
        w.seal({"format_version": 2})
    w.seal({**MANIFEST, "format_version": 1})
    with pytest.raises(ArchiveError, match="already sealed"):
        w.seal(MANIFEST)
    with pytest.raises(ArchiveError, match="already sealed"):
        w.add_json("late.json", {})
    assert verify(tmp_path / "a.zip") == []


# ----------------------------------------------------------------------------- writer refusals


def test_duplicate_name_refused(tmp_path: Path):
    w = ArchiveWriter(tmp_path / "a.zip")
    w.add_json("episodes/00000.json", {"a": 1})
    with pytest.raises(ArchiveError, match="episodes/00000.json is already in archive"):
        w.add_bytes("episodes/00000.json", b"x")
    with pytest.raises(ArchiveError, match="reserved"):
        w.add_json(MANIFEST_NAME, {})
    with zipfile.ZipFile(tmp_path / "a.zip") as zf:
        assert zf.namelist() == ["episodes/00000.json"]


@pytest.mark.parametrize(
    "name", ["../evil", "a/../../b", "/etc/x", "a\\b", "C:/x", "a//b", "dir/", "./a", "sp ace", "", "ü.json"]
)
def test_bad_member_names_refused(tmp_path: Path, name: str):
    w = ArchiveWriter(tmp_path / "a.zip")
    with pytest.raises(ArchiveError, match="relative POSIX path"):
        w.add_bytes(name, b"x")
    assert w.members == {}


def test_overwrite_refused(sealed: Path, tmp_path: Path):
    before = file_sha256(sealed)
    with pytest.raises(ArchiveError, match="never overwritten") as exc:
        ArchiveWriter(sealed)
    assert str(sealed) in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, PackbenchError)
    assert file_sha256(sealed) == before
    stray = tmp_path / "not-an-archive.txt"
    stray.write_text("keep me")
    with pytest.raises(ArchiveError, match="never overwritten"):
        ArchiveWriter(stray)
    assert stray.read_text() == "keep me"


def test_writer_refuses_object_arrays_nan_and_wrong_types(tmp_path: Path):
    w = ArchiveWriter(tmp_path / "a.zip")
    with pytest.raises(ArchiveError, match="object dtype"):
        w.add_array("o.npy", np.array([{"a": 1}], dtype=object))
    with pytest.raises(ArchiveError, match="ndarray"):
        w.add_array("l.npy", [1, 2])
    with pytest.raises(ArchiveError, match="canonical JSON"):
        w.add_json("n.json", {"x": float("nan")})
    with pytest.raises(ArchiveError, match="bytes"):
        w.add_bytes("s.bin", "text")
    with pytest.raises(ArchiveError, match="format_version"):
        ArchiveWriter(tmp_path / "b.zip", format_version=2)
    assert w.members == {}
    assert verify(tmp_path / "a.zip") == ["archive incomplete: no manifest.json (interrupted screen?)"]


def test_writer_stops_when_the_file_changes_behind_it(tmp_path: Path):
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    w.add_json("plan.json", PLAN)
    append_entry(path, "intruder.json", b"{}")
    with pytest.raises(ArchiveError, match="no longer holds exactly the members"):
        w.add_json("episodes/00000.json", EPISODES[0])
    with pytest.raises(ArchiveError, match="unusable after a failed write"):
        w.seal(MANIFEST)
    damaged = tmp_path / "b.zip"
    w2 = ArchiveWriter(damaged)
    w2.add_json("plan.json", PLAN)
    raw = damaged.read_bytes()[:-10]  # torn tail: no end-of-central-directory record
    damaged.write_bytes(raw)
    with pytest.raises(ArchiveError, match="could not append member episodes/00000.json"):
        w2.add_json("episodes/00000.json", EPISODES[0])
    assert damaged.read_bytes() == raw  # no second zip appended to a damaged file


# ----------------------------------------------------------------------------- partial archive


def test_partial_archive_is_readable_and_incomplete(tmp_path: Path):
    path = tmp_path / "partial.zip"
    write_screen(path, seal=False)  # the screen "crashed" before sealing
    with ArchiveReader(path) as r:
        assert r.complete is False and r.manifest is None
        assert r.names == MEMBERS[:-1]
        assert r.read_json("episodes/00001.json") == EPISODES[1]
        np.testing.assert_array_equal(r.read_array("logits/00000.npy"), LOGITS[0])
        assert lines(r) == ["archive incomplete: no manifest.json (interrupted screen?)"]


def test_empty_unsealed_archive(tmp_path: Path):
    path = tmp_path / "empty.zip"
    ArchiveWriter(path)
    assert path.is_file()
    with ArchiveReader(path) as r:
        assert r.names == [] and not r.complete
        assert lines(r) == ["archive incomplete: no manifest.json (interrupted screen?)"]


def test_missing_file_and_not_a_zip(tmp_path: Path):
    with pytest.raises(ArchiveError, match="no archive at .*nope.zip"):
        ArchiveReader(tmp_path / "nope.zip")
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"this is not a zip file at all" * 10)
    with pytest.raises(ArchiveError, match="not a readable zip"):
        ArchiveReader(junk)


# ----------------------------------------------------------------------------- layout


def test_the_layout_is_owned_here():
    """Historical archives hold these names: they never change."""
    assert (PROTOCOL_NAME, PLAN_NAME, WORKER_NAME, VERDICTS_NAME, MANIFEST_NAME) == (
        "protocol.json", "plan.json", "worker.json", "verdicts.json", "manifest.json")
    assert episode_member(7) == "episodes/00007.json"
    assert logits_member(7) == "logits/00007.npy"
    assert trace_member(12345) == "traces/12345.npy"
    assert episode_members(3) == EpisodeMembers(3, "episodes/00003.json", "logits/00003.npy", "traces/00003.npy",
                                                "forced/00003.npy",  # teacher-forced logits: approximate episodes only
                                                "active/00003.trace")  # active sets: a protocol's trace: true


def test_add_episode_writes_its_members_in_order_and_skips_none(tmp_path: Path):
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    trace = np.array([[0.0, 10.0], [0.5, 30.0]])
    assert w.add_episode({"plan_index": 0, "status": "ok"}, LOGITS[0], trace) == episode_members(0)
    w.add_episode({"plan_index": 1, "status": "failed"}, None, None)
    w.add_episode({"plan_index": 2, "status": "ok"}, LOGITS[1])
    with ArchiveReader(path) as r:
        # The record last (bug: it went first, so a write cut off at the trace left a record whose
        # episode looked whole to `db reconcile`; tests/db/test_db_reconcile.py has the fault).
        assert r.names == ["logits/00000.npy", "traces/00000.npy", "episodes/00000.json",
                           "episodes/00001.json", "logits/00002.npy", "episodes/00002.json"]
        assert r.read_json("episodes/00001.json") == {"plan_index": 1, "status": "failed"}
        np.testing.assert_array_equal(r.read_array("traces/00000.npy"), trace)
        assert [e.index for e in r.episodes()] == [0, 1, 2]


def test_a_refused_episode_writes_nothing(tmp_path: Path):
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    w.add_episode({"plan_index": 0}, LOGITS[0])
    before = path.read_bytes()
    for record, logits, trace, why in [
        ({"plan_index": 1}, LOGITS[0], np.array([{"x": 1}], dtype=object), "object dtype"),
        ({"plan_index": 1, "x": float("nan")}, LOGITS[0], None, "canonical JSON"),
        ({"plan_index": 1}, [1.0, 2.0], None, "ndarray"),
        ({"plan_index": 0}, None, None, "already in archive"),
        ({"plan_index": True}, None, None, "plan_index"),
        ({"plan_index": -1}, None, None, "plan_index"),
        ({"condition": "packet"}, None, None, "plan_index"),
    ]:
        with pytest.raises(ArchiveError, match=why):
            w.add_episode(record, logits, trace)
    assert path.read_bytes() == before and list(w.members) == ["logits/00000.npy", "episodes/00000.json"]
    w.add_episode({"plan_index": 1}, LOGITS[1])  # refusals leave the writer usable
    assert list(w.members)[-1] == "episodes/00001.json"  # the record last


def test_episodes_lists_the_records_held_in_index_order(tmp_path: Path):
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    for i in (3, 0, 1):
        w.add_episode({"plan_index": i}, LOGITS[0])
    w.add_bytes("episodes/000002.json", b"{}")  # not a name the layout builds
    w.add_bytes("episodes/x.json", b"{}")
    w.add_bytes("logits/00009.npy", b"")  # logits without a record: no episode
    with ArchiveReader(path) as r:
        assert r.episodes() == [episode_members(0), episode_members(1), episode_members(3)]


# ----------------------------------------------------------------------------- write scheme


def _zip_of_one_member(payload: bytes) -> tuple[bytes, int]:
    """zipfile's bytes of one stored member `sig.bin` holding `payload`, and its central directory's offset."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("sig.bin", payload)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        return buf.getvalue(), zf.start_dir


def zipfile_reference(path: Path, ref: Path) -> None:
    """The same members written by Python's zipfile in one go (what the old writer produced)."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(ref, "w") as dst:
        for info in src.infolist():
            new = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            new.create_system = 3
            new.external_attr = (stat.S_IFREG | 0o644) << 16
            dst.writestr(new, src.read(info), compress_type=info.compress_type)


def test_a_sealed_archive_is_byte_for_byte_what_zipfile_writes(sealed: Path, tmp_path: Path):
    ref = tmp_path / "ref.zip"
    zipfile_reference(sealed, ref)
    assert sealed.read_bytes() == ref.read_bytes()
    # Members large enough that the central directory moves several times before the seal.
    rng = np.random.default_rng(0)
    big = tmp_path / "big.zip"
    w = ArchiveWriter(big)
    for i in range(24):
        w.add_array(logits_member(i), rng.standard_normal(30_000 + 1000 * i).astype(np.float32))
        w.add_json(episode_member(i), {"i": i, "pad": "x" * (i * 50)})
    digest = w.seal(MANIFEST)
    zipfile_reference(big, ref2 := tmp_path / "ref2.zip")
    assert big.read_bytes() == ref2.read_bytes()
    assert digest == file_sha256(big)  # the running hash is the file's


def test_every_append_leaves_a_valid_zip_of_every_member_so_far(tmp_path: Path):
    """A crash between two appends (here: a copy of the file) keeps every member written."""
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    rng = np.random.default_rng(1)
    written, directory_at = [], []
    for i in range(40):
        size = int(rng.integers(10, 300_000))
        name = f"m/{i:03d}.bin"
        if i % 2:
            # compressible, not trivially: random bytes in runs of 1 to 64 (zlib deflates runs
            # fast; 2-bit noise took it 7 s over the test's writes and the reader's re-deflates)
            runs = rng.integers(1, 65, size // 16 + 1)
            data = np.repeat(rng.integers(0, 255, runs.size, dtype=np.uint8), runs)[:size].tobytes()
            w.add_bytes(name, data)
        else:
            arr = rng.integers(0, 255, size, dtype=np.uint8)
            w.add_array(name, arr)
            data = ArchiveWriter._array_bytes(name, arr)
        written.append((name, data))
        snapshot = tmp_path / f"crash-{i}.zip"
        snapshot.write_bytes(path.read_bytes())
        with zipfile.ZipFile(snapshot) as zf:
            assert zf.namelist() == [n for n, _ in written]
            assert zf.testzip() is None
            directory_at.append(zf.start_dir)
        with ArchiveReader(snapshot) as r:
            assert lines(r) == ["archive incomplete: no manifest.json (interrupted screen?)"]
            assert r.read_bytes(name) == data
        snapshot.unlink()
    moves = sum(a != b for a, b in zip(directory_at, directory_at[1:]))
    assert 2 <= moves < 30  # most members land in the room; the directory moved a few times
    assert path.stat().st_size > sum(len(d) for _, d in written) // 4  # room is held...
    w.seal({})
    with ArchiveReader(path) as r:
        assert r.verify() == []
    ref = tmp_path / "ref.zip"
    zipfile_reference(path, ref)
    assert path.read_bytes() == ref.read_bytes()  # ...and closed by the seal


@pytest.mark.parametrize("case", ["in the room", "directory moves"])
def test_a_crash_inside_an_append_leaves_a_readable_zip(tmp_path: Path, monkeypatch, case: str):
    """Die after the first of an append's two writes: the file is still a zip of the earlier
    members (plus, when the directory moved first, the new entry, which verify() names)."""
    import packbench.core.archive.writer as archive

    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    w.add_bytes("first.bin", b"a" * 1000)
    calls = []
    real = archive._write_at

    def die_on_second(fd, parts, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EIO, "simulated crash")
        real(fd, parts, offset)

    monkeypatch.setattr(archive, "_write_at", die_on_second)
    data = b"b" * 1000 if case == "in the room" else np.random.default_rng(0).bytes(2 << 20)  # past the room
    with pytest.raises(ArchiveError, match="could not append member second.bin"):
        w.add_bytes("second.bin", data)
    assert len(calls) == 2
    with ArchiveReader(path) as r:
        assert r.read_bytes("first.bin") == b"a" * 1000
        if case == "in the room":
            assert r.names == ["first.bin"]
            assert lines(r) == ["archive incomplete: no manifest.json (interrupted screen?)"]
        else:
            assert r.names == ["first.bin", "second.bin"]
            assert [(p.member, p.kind) for p in r.verify()] == [
                (MANIFEST_NAME, "incomplete"), ("second.bin", "layout"), ("second.bin", "unreadable")]
    with pytest.raises(ArchiveError, match="unusable after a failed write"):
        w.add_bytes("third.bin", b"c")


def test_zip64_records_match_zipfile():
    """Past 2 GiB offsets/sizes and 65,535 entries the records are zipfile's (checked without
    writing gigabytes: both sides format the same entries)."""
    import packbench.core.archive.zipformat as archive

    class Sink:
        def __init__(self, at):
            self.at, self.data = at, bytearray()

        def write(self, b):
            self.data += b

        def tell(self):
            return self.at + len(self.data)

        def flush(self):
            pass

    def theirs(infos, cd_offset):
        zf = zipfile.ZipFile(io.BytesIO(), "w")
        zf.filelist, zf.start_dir, sink = infos, cd_offset, Sink(cd_offset)
        zf.fp = sink
        try:
            zf._write_end_record()
        finally:
            zf.fp = None  # nothing left for close() to write
        return bytes(sink.data)

    def info(name, offset, size, csize, method, zip64_local):
        zi = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        zi.create_system, zi.external_attr, zi.compress_type = 3, (stat.S_IFREG | 0o644) << 16, method
        zi.header_offset, zi.file_size, zi.compress_size, zi.CRC = offset, size, csize, 0x1234ABCD
        zi.FileHeader(zip64_local)  # sets the versions as writing the local header does
        return zi

    def ours(infos, cd_offset):
        central = b"".join(archive.central_entry(
            zi.filename.encode(), method=zi.compress_type, crc=zi.CRC, csize=zi.compress_size, size=zi.file_size,
            offset=zi.header_offset, version=zi.extract_version) for zi in infos)
        return central + archive.end_records(len(infos), cd_offset, len(central))

    big = 5 << 30
    cases = [
        [info("a.npy", 0, 100, 100, zipfile.ZIP_STORED, False),
         info("b.json", 3 << 30, 100, 40, zipfile.ZIP_DEFLATED, False)],  # offset past 2 GiB
        [info("c.npy", 0, big, big, zipfile.ZIP_STORED, True),
         info("d.npy", big + 60, 2_100_000_000, 2_100_000_000, zipfile.ZIP_STORED, True)],  # zip64 sizes
        [info(f"e/{i:05d}.json", 40 * i, 10, 12, zipfile.ZIP_DEFLATED, False) for i in range(70_000)],
    ]
    for infos in cases:
        cd_offset = infos[-1].header_offset + 40 + infos[-1].compress_size
        assert ours(infos, cd_offset) == theirs(infos, cd_offset)
    for size, zip64 in ((100, False), (big, True), (2_100_000_000, True)):
        zi = info("x.npy", 0, size, size, zipfile.ZIP_STORED, zip64)
        assert archive.local_header(b"x.npy", method=zipfile.ZIP_STORED, crc=zi.CRC, csize=size, size=size,
                                    zip64=zip64) == zi.FileHeader(zip64)


def test_the_guard_sees_a_replaced_or_rewritten_file(tmp_path: Path):
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    w.add_json("plan.json", PLAN)
    copy_ = tmp_path / "copy.zip"
    copy_.write_bytes(path.read_bytes())
    os.replace(copy_, path)  # same bytes, another file
    with pytest.raises(ArchiveError, match="no longer holds exactly the members"):
        w.add_json("episodes/00000.json", EPISODES[0])

    path2 = tmp_path / "b.zip"
    w2 = ArchiveWriter(path2)
    w2.add_json("plan.json", PLAN)
    st = path2.stat()
    raw = bytearray(path2.read_bytes())
    raw[-3] ^= 0xFF  # same size, and the mtime put back: only the tail tells
    with open(path2, "r+b") as f:
        f.write(raw)
    os.utime(path2, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ArchiveError, match="no longer holds exactly the members"):
        w2.add_json("episodes/00000.json", EPISODES[0])

    w3 = ArchiveWriter(tmp_path / "c.zip")
    w3.add_json("plan.json", PLAN)
    w3.close()
    with pytest.raises(ArchiveError, match="closed without sealing"):
        w3.add_json("episodes/00000.json", EPISODES[0])
    with ArchiveReader(tmp_path / "c.zip") as r:
        assert r.names == ["plan.json"]
    os.remove(tmp_path / "c.zip")
    w4 = ArchiveWriter(tmp_path / "d.zip")
    os.remove(tmp_path / "d.zip")
    with pytest.raises(ArchiveError, match="disappeared"):
        w4.add_json("plan.json", PLAN)


# ----------------------------------------------------------------------------- structured problems


def _problem_archives(sealed: Path, tmp_path: Path) -> dict[str, tuple[Path, str | None, dict]]:
    """kind -> (archive showing it, the member it must name, reader bounds)."""
    out = {}

    def variant(kind: str, member: str | None, mutate, **bounds) -> None:
        path = tmp_path / f"{kind}.zip"
        path.write_bytes(sealed.read_bytes())
        mutate(path)
        out[kind] = (path, member, bounds)

    variant("incomplete", MANIFEST_NAME, lambda p: rewrite(p, drop={MANIFEST_NAME}))
    variant("manifest", MANIFEST_NAME, lambda p: rewrite(p, replace={MANIFEST_NAME: b"{"}))
    variant("too-large", None, lambda p: None, max_total_bytes=100)
    with pytest.warns(UserWarning, match="Duplicate name"):
        variant("duplicate", "plan.json", lambda p: append_entry(p, "plan.json", b"{}"))
    variant("unsafe", "../evil", lambda p: append_entry(p, "../evil", b"x"))
    link = zipfile.ZipInfo("link")
    link.create_system, link.external_attr = 3, (stat.S_IFLNK | 0o777) << 16
    variant("symlink", "link", lambda p: append_entry(p, link, b"/etc/passwd"))
    variant("extra", "extra/x.json", lambda p: append_entry(p, "extra/x.json", b"{}"))
    variant("size", "plan.json", lambda p: edit_manifest(p, lambda m: m["members"]["plan.json"].update(size=1)))

    def crc(p: Path) -> None:
        with zipfile.ZipFile(p) as zf:
            info = zf.getinfo("logits/00000.npy")
        raw = bytearray(p.read_bytes())
        raw[data_offset(raw, info) + 5] ^= 0x01
        p.write_bytes(raw)

    variant("unreadable", "logits/00000.npy", crc)
    variant("altered", "episodes/00001.json",
            lambda p: rewrite(p, replace={"episodes/00001.json": canonical_json({**EPISODES[1], "index": 7})}))
    variant("missing", "logits/00001.npy", lambda p: rewrite(p, drop={"logits/00001.npy"}))

    def comment(p: Path) -> None:
        with zipfile.ZipFile(p, "a") as zf:
            zf.comment = b"hidden"
    variant("layout", None, comment)
    return out


def test_every_problem_kind_names_its_member(sealed: Path, tmp_path: Path):
    archives = _problem_archives(sealed, tmp_path)
    assert set(archives) == set(PROBLEM_KINDS)
    for kind, (path, member, bounds) in archives.items():
        found = problems_of(path, **bounds)
        assert [p for p in found if p.kind == kind and p.member == member and (member is None or member in p.message)], (
            kind, found)
        assert all(p.member is not None for p in found if p.kind not in ("too-large", "layout")), found


def test_problem_kinds_are_checked():
    with pytest.raises(ValueError, match="not one of incomplete, manifest"):
        Problem("x", "odd", "odd member x")
    assert str(Problem("x", "extra", "extra member x")) == "extra member x"


def test_plan_and_worker_json_are_built_and_parsed_in_the_layout():
    """plan.json and worker.json have one builder and one parser each (core/archive/layout.py);
    a parser returns what is stored and never trusts a hostile shape."""
    from packbench.core.archive import WORKER_PARTS, plan_entries, plan_json, plan_prompts, worker_json, worker_parts

    entries = [{"index": 0, "condition": "dense-stream", "role": "scored", "prompt": 0, "repetition": 0}]
    plan = plan_json(entries, [[2, 5, 7]])
    assert canonical_json(plan) == canonical_json({"entries": entries, "prompts": [[2, 5, 7]]})
    assert plan_entries(plan) == entries and plan_prompts(plan) == [[2, 5, 7]]
    for hostile in ([], "plan", {"entries": "none"}, {"entries": [1, {}]}, {}):
        assert plan_entries(hostile) is None
    worker = worker_json(environment={"device": "cpu"}, start={"param_bytes": 1}, model_dir=None,
                         source_freeze={"git_commit": ""})
    assert tuple(sorted(worker)) == tuple(sorted(WORKER_PARTS))
    assert worker_parts(worker) == worker
    assert worker_parts({"start": {"a": 1}, "other": 2}) == {"start": {"a": 1}}
    assert worker_parts(["not", "an", "object"]) == {}


def test_episode_index_reads_only_the_names_the_layout_writes():
    from packbench.core.archive import episode_index

    assert episode_index(episode_member(7)) == 7
    assert episode_index(episode_member(123456)) == 123456
    for other in ("episodes/7.json", "episodes/000007.json", "logits/00007.npy", "episodes/00007.json.bak"):
        assert episode_index(other) is None


def test_add_episode_stores_an_active_set_trace_as_given_and_refuses_other_types(tmp_path: Path):
    """`active=` bytes land as `active/NNNNN.trace`, stored byte for byte; anything else is refused
    by name before a byte is written. Catches the trace member dropped, the type check inverted or
    its message losing the member or the type."""
    from packbench.core.archive import active_sets_member
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    trace_file = b"PK\x05\x06" + bytes(18)  # any bytes: a trace file is a zip of its own
    w.add_episode({"plan_index": 4}, active=trace_file)
    before = path.read_bytes()
    with pytest.raises(ArchiveError) as e:
        w.add_episode({"plan_index": 5}, active=bytearray(b"x"))
    assert str(e.value) == "member active/00005.trace must be the bytes of a trace file, got bytearray"
    assert path.read_bytes() == before
    w.seal({})
    with ArchiveReader(path) as r:
        assert r.names == [active_sets_member(4), "episodes/00004.json", "manifest.json"]  # the record last
        assert r.read_bytes(active_sets_member(4)) == trace_file
        assert r.verify() == []


def test_add_episode_refusals_name_what_was_wrong(tmp_path: Path):
    """A record that is not a dict, a record that is not canonical JSON and an object-dtype array
    are refused with ArchiveError naming the member concerned. Catches the dict check dropped
    (an AttributeError instead) and the member's name lost from the message."""
    w = ArchiveWriter(tmp_path / "a.zip")
    with pytest.raises(ArchiveError, match=r"^an episode record needs an int plan_index >= 0 \(got None\)"):
        w.add_episode([("plan_index", 1)])
    with pytest.raises(ArchiveError, match=r"^member episodes/00001\.json is not canonical JSON"):
        w.add_episode({"plan_index": 1, "x": float("nan")})
    with pytest.raises(ArchiveError, match=r"^member logits/00001\.npy has object dtype object"):
        w.add_episode({"plan_index": 1}, np.array([{}], dtype=object))
    assert w.members == {}


def test_add_episode_fsyncs_once_after_its_last_member(tmp_path: Path, monkeypatch):
    """One fsync an episode, when every member of it is written (docs/archive.md: each member is
    on disk when add_episode returns). Catches the fsync skipped, or done after the record but
    before the arrays (a crash then loses members the driver thinks are durable)."""
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(sorted(w.members)), real(fd)))
    w.add_episode({"plan_index": 0}, LOGITS[0], np.zeros((2, 2)), LOGITS[0])
    # the one fsync comes inside the last member's write (the record): the three before it are listed already
    assert synced == [["forced/00000.npy", "logits/00000.npy", "traces/00000.npy"]]
    assert sorted(w.members) == ["episodes/00000.json", "forced/00000.npy", "logits/00000.npy", "traces/00000.npy"]


def test_writer_refusals_name_the_member_and_the_type_given(tmp_path: Path):
    """Each refusal of the writer says what it got and what to do. Catches the type or the
    member dropped from the line, and the manifest's SHA-256 (what a signer signs) not kept."""
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    with pytest.raises(ArchiveError) as e:
        w.add_bytes("x.bin", "text")
    assert str(e.value) == "member x.bin must be bytes, got str; use add_json or add_array for structured data"
    with pytest.raises(ArchiveError) as e:
        w.add_array("l.npy", [1, 2])
    assert str(e.value) == "member l.npy must be a numpy ndarray, got list; convert it with np.asarray first"
    with pytest.raises(ArchiveError) as e:
        w.add_json("n.json", {"x": float("nan")})
    assert str(e.value).startswith("member n.json is not canonical JSON (") and \
        str(e.value).endswith("); pass plain data without NaN/Infinity")
    with pytest.raises(ArchiveError) as e:
        w.seal([])
    assert str(e.value) == f"the manifest of {path} must be a dict, got list"
    with pytest.raises(ArchiveError) as e:
        w.seal({"x": float("inf")})
    assert str(e.value).startswith(f"the manifest for {path} is not canonical JSON (") and \
        str(e.value).endswith("); pass plain data without NaN/Infinity")
    w.seal({"screen_id": 1})
    with zipfile.ZipFile(path) as zf:
        assert w.manifest_sha256 == hashlib.sha256(zf.read("manifest.json")).hexdigest()


def test_short_writes_are_continued_and_a_write_of_nothing_is_an_error(tmp_path: Path, monkeypatch):
    """pwritev may write less than asked: the writer goes on from where it stopped, across the
    parts of one append, and the archive is byte for byte what it would be otherwise; a write
    that makes no progress is an I/O error naming the member. Catches the loop restarting at
    the wrong offset or part, and a zero-byte write spinning or passing."""
    from packbench.core.archive import writer as writer_module
    real = os.pwritev
    monkeypatch.setattr(writer_module.os, "pwritev", lambda fd, views, offset: real(fd, [views[0][:7]], offset))
    short = tmp_path / "short.zip"
    write_screen(short)
    monkeypatch.setattr(writer_module.os, "pwritev", real)
    whole = tmp_path / "whole.zip"
    write_screen(whole)
    assert short.read_bytes() == whole.read_bytes()
    w = ArchiveWriter(tmp_path / "zero.zip")
    monkeypatch.setattr(writer_module.os, "pwritev", lambda fd, views, offset: 0)
    with pytest.raises(ArchiveError) as e:
        w.add_bytes("a.bin", b"abc")
    assert str(e.value) == (f"could not append member a.bin to archive {tmp_path / 'zero.zip'} ([Errno 5] short "
                            f"write); check disk space, permissions and who else touches the file, then rerun as a new "
                            f"attempt")
    with pytest.raises(ArchiveError, match=r"is unusable after a failed write \(OSError: \[Errno 5\] short write\)"):
        w.add_bytes("b.bin", b"abc")


def test_a_writer_that_finds_its_file_changed_says_so_and_stays_unusable(tmp_path: Path):
    """Someone else appends to, truncates or removes the file: the next append refuses with
    the reason, and every later call names it. Catches a reason lost and the size-and-mtime
    guard weakened to one of the two."""
    cases = {"appended": lambda p: p.open("ab").write(b"x"),
             "truncated": lambda p: os.truncate(p, p.stat().st_size - 1),
             "removed": lambda p: p.unlink()}
    why = {"appended": "archive changed behind the writer", "truncated": "torn or truncated file",
           "removed": "file vanished"}
    for case, change in cases.items():
        path = tmp_path / f"{case}.zip"
        w = ArchiveWriter(path)
        w.add_bytes("a.bin", b"abc")
        change(path)
        with pytest.raises(ArchiveError):
            w.add_bytes("b.bin", b"abc")
        with pytest.raises(ArchiveError) as e:
            w.add_bytes("c.bin", b"abc")
        assert str(e.value).startswith(f"archive {path} is unusable after a failed write ({why[case]}); "), str(e.value)
    # same size, same end record, another mtime: still someone else's write
    path = tmp_path / "touched.zip"
    w = ArchiveWriter(path)
    w.add_bytes("a.bin", b"abc")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ArchiveError, match="no longer holds exactly the members this writer wrote"):
        w.add_bytes("b.bin", b"abc")


def test_the_room_is_a_quarter_of_the_members_at_least_1_mib_and_holds_the_directory():
    """docs/archive.md: a moved directory leaves room for about a quarter more member data, at
    least 1 MiB, and more than the directory plus its end records. Catches any of the three
    terms dropped or changed."""
    from packbench.core.archive.writer import MAX_END_RECORDS, _room
    assert _room(0, 0) == 1 << 20
    assert _room(8 << 20, 100) == 2 << 20
    assert _room((8 << 20) + 7, 0) == ((8 << 20) + 7) // 4
    assert _room(0, 3 << 20) == (3 << 20) + MAX_END_RECORDS


# ----------------------------------------------------------------------------- zip records, names, the reader's door


def _locate(data: bytes) -> tuple[int, int, int, int]:
    from packbench.core.archive.zipformat import locate_end
    return locate_end(io.BytesIO(data), len(data))


def _zipfile_bytes(comment: bytes = b"", members: int = 0) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(members):
            zf.writestr(f"m{i}.bin", b"x" * (i + 1))
        zf.comment = comment
    return buf.getvalue()


def test_locate_end_reads_what_zipfiles_end_record_says():
    """(count, directory size, directory start, bytes from the end record to the file's end),
    whatever the comment holds (zipfile itself is misled by an end record's signature in it)."""
    empty = _zipfile_bytes()
    assert len(empty) == 22 and _locate(empty) == (0, 0, 0, 22)  # the smallest zip: its end record alone
    base = _zipfile_bytes(members=3)
    with zipfile.ZipFile(io.BytesIO(base)) as zf:
        start = zf.start_dir
        assert len(zf.namelist()) == 3
    cd_size = len(base) - 22 - start
    for comment in (b"", b"c" * 10, b"PK\x05\x06", b"PK\x05\x06" + b"z" * 30, b"z" * 5 + b"PK\x05\x06" + b"q" * 17,
                    b"w" * 0xFFFF):
        data = base[:-2] + len(comment).to_bytes(2, "little") + comment
        assert _locate(data) == (3, cd_size, start, 22 + len(comment)), comment[:12]
    # End record signatures in a member's data, before the real one, are passed over too.
    data, start = _zip_of_one_member(b"PK\x05\x06" * 3 + bytes(40))
    assert _locate(data) == (1, len(data) - 22 - start, start, 22)


def test_locate_end_refuses_what_holds_no_end_record():
    for data, why in ((b"", "too short"), (b"PK\x05\x06" + bytes(17), "too short"), (bytes(22), "no zip end record"),
                      (b"PK\x05\x06" + bytes(17) + b"!", "no zip end record"),  # 1 byte after, no comment declared
                      (b"PK\x05\x06" + bytes(16) + b"\x02\x00" + b"!", "no zip end record")):  # 2 declared, 1 held
        with pytest.raises(ValueError, match=why):
            _locate(data)


def test_locate_end_follows_the_zip64_locator_to_the_zip64_record():
    from packbench.core.archive.zipformat import end_records
    # A zip64 end record at the very start of the file (offset 0 is a valid place for it).
    data = end_records(70_000, 0, 0)
    assert len(data) == 56 + 20 + 22
    assert _locate(data) == (70_000, 0, 0, len(data))
    # Count, size and start are three distinct fields, read from the zip64 record.
    body = b"d" * 300
    data = body + end_records(70_001, 120, 180)
    assert _locate(data) == (70_001, 180, 120, len(data) - 300)
    # A locator that points past the file, or at bytes that are no zip64 record, is ignored:
    # the classic record's values stand.
    tail = end_records(70_002, 120, 180)[56:]  # locator + end record, the zip64 record left out
    assert _locate(body + tail) == (0xFFFF, 180, 120, 42 - 20)
    assert _locate(b"x" * 10 + tail) == (0xFFFF, 180, 120, 42 - 20)  # it would point inside nothing


def test_end_records_switch_to_zip64_exactly_where_zipfile_does():
    from packbench.core.archive.zipformat import ZIP64_LIMIT, end_records

    def zipfile_end(count: int, cd_offset: int, cd_size: int) -> bytes:
        zf = zipfile.ZipFile(io.BytesIO(), "w")
        sink = io.BytesIO()

        class Sink:
            def write(self, b):
                sink.write(b)

            def tell(self):
                return cd_offset + cd_size + sink.tell()

            def flush(self):
                pass

        zf.filelist, zf.start_dir, zf.fp = [], cd_offset, Sink()
        zf._didModify = True
        try:
            # zipfile counts its filelist; stand in the count by a list of that length
            zf.filelist = _NoEntries(count)
            zf._write_end_record()
        finally:
            zf.fp = None
        return sink.getvalue()

    for count, cd_offset, cd_size in ((0xFFFF, 10, 20), (0x10000, 10, 20), (3, ZIP64_LIMIT, 20),
                                      (3, ZIP64_LIMIT + 1, 20), (3, 10, ZIP64_LIMIT), (3, 10, ZIP64_LIMIT + 1),
                                      (3, 0xFFFFFFFF + 5, 0xFFFFFFFF + 9)):
        ours = end_records(count, cd_offset, cd_size)
        assert ours == zipfile_end(count, cd_offset, cd_size), (count, cd_offset, cd_size)
        assert len(ours) == (22 if max(cd_offset, cd_size) <= ZIP64_LIMIT and count <= 0xFFFF else 98)


class _NoEntries(list):
    """A filelist of `n` entries whose central records are empty: zipfile's end records need
    only its length."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(())


def test_central_entries_switch_to_zip64_exactly_where_zipfile_does():
    from packbench.core.archive.zipformat import VERSION, ZIP64_LIMIT, central_entry

    def zipfile_central(size, csize, offset):
        zi = zipfile.ZipInfo("m/x.npy", date_time=(1980, 1, 1, 0, 0, 0))
        zi.create_system, zi.external_attr, zi.compress_type = 3, (stat.S_IFREG | 0o644) << 16, zipfile.ZIP_STORED
        zi.header_offset, zi.file_size, zi.compress_size, zi.CRC = offset, size, csize, 0x0BADF00D
        zi.FileHeader(max(size, csize) > 0xFFFFFFFF)  # sets the versions as writing the local header does
        zf = zipfile.ZipFile(io.BytesIO(), "w")
        sink = io.BytesIO()
        zf.filelist, zf.start_dir, zf.fp = [zi], 0, sink
        try:
            zf._write_end_record()
        finally:
            zf.fp = None
        data = sink.getvalue()
        return data[:data.index(b"PK\x05\x06") if b"PK\x06\x06" not in data else data.index(b"PK\x06\x06")]

    L = ZIP64_LIMIT
    for size, csize, offset in ((L, L, L), (L + 1, L, 0), (L, L + 1, 0), (5, 5, L + 1), (L + 1, L + 2, L + 3),
                                (0xFFFFFFFF + 1, 7, 9)):
        ours = central_entry(b"m/x.npy", method=zipfile.ZIP_STORED, crc=0x0BADF00D, csize=csize, size=size,
                             offset=offset, version=VERSION)
        assert ours == zipfile_central(size, csize, offset), (size, csize, offset)


def test_local_headers_are_zipfiles():
    from packbench.core.archive.zipformat import local_header
    for size, csize, zip64, method in ((0, 0, False, zipfile.ZIP_STORED), (1000, 321, False, zipfile.ZIP_DEFLATED),
                                       (7 << 30, 6 << 30, True, zipfile.ZIP_DEFLATED)):
        zi = zipfile.ZipInfo("a/b.json", date_time=(1980, 1, 1, 0, 0, 0))
        zi.compress_type, zi.file_size, zi.compress_size, zi.CRC = method, size, csize, 0xFEEDBEEF
        assert local_header(b"a/b.json", method=method, crc=0xFEEDBEEF, csize=csize, size=size,
                            zip64=zip64) == zi.FileHeader(zip64)


@pytest.mark.parametrize("name, why", [
    ("", "empty or not a string"), (None, "empty or not a string"), (7, "empty or not a string"),
    (b"a.json", "empty or not a string"),
    ("a\\b", "contains a backslash"), ("C:\\x", "contains a backslash"), ("/a\\b", "contains a backslash"),
    ("a\x00b", "contains a NUL byte"), ("/\x00", "contains a NUL byte"),
    ("C:x", "starts with a drive letter"), ("z:/x", "starts with a drive letter"),
    ("/etc/x", "is absolute"), ("/a b", "is absolute"), ("/", "is absolute"),
    ("sp ace", "has characters outside [A-Za-z0-9._/-]"), ("ü.json", "has characters outside [A-Za-z0-9._/-]"),
    ("1:x", "has characters outside [A-Za-z0-9._/-]"), ("ab:c", "has characters outside [A-Za-z0-9._/-]"),
    ("a/b\n", "has characters outside [A-Za-z0-9._/-]"),
    ("..", "contains a '..' segment"), ("a/../b", "contains a '..' segment"), ("../a//", "contains a '..' segment"),
    ("a//b", "has an empty or '.' segment"), ("./a", "has an empty or '.' segment"),
    ("dir/", "has an empty or '.' segment"), ("a/./..", "has an empty or '.' segment"),
])
def test_name_problem_says_which_rule_a_name_breaks(name, why):
    from packbench.core.archive import name_problem
    assert name_problem(name) == why


@pytest.mark.parametrize("name", ["a", "a.json", ".hidden", "a..b", "...", "x/.y/z", "A-Z_0.9/b-c", "episodes/00000.json"])
def test_name_problem_admits_relative_posix_names(name):
    from packbench.core.archive import name_problem
    assert name_problem(name) is None


def test_expected_method_stores_arrays_and_traces_and_deflates_json():
    from packbench.core.archive import expected_method
    assert expected_method("logits/00000.npy") == zipfile.ZIP_STORED
    assert expected_method("active/00000.trace") == zipfile.ZIP_STORED
    assert expected_method("a.json.npy") == zipfile.ZIP_STORED
    assert expected_method("episodes/00000.json") == zipfile.ZIP_DEFLATED
    assert expected_method("a.npy.json") == zipfile.ZIP_DEFLATED
    for other in ("notes.bin", "npy", "json", "a.NPY", "a.Json", "a.tracex", "a.npy/"):
        assert expected_method(other) is None, other


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_reader_refuses_at_the_door_with_the_cause_and_closes_its_file(tmp_path: Path):
    """Refusals before any member is read: each names the file, the cause and what to do, and
    leaves no file open behind it."""
    from packbench.core.archive import MAX_DIRECTORY_BYTES, MAX_MEMBERS
    from packbench.core.archive.zipformat import end_records
    path = tmp_path / "a.zip"
    before = _open_fds()

    def refusal(data: bytes) -> str:
        path.write_bytes(data)
        with pytest.raises(ArchiveError) as e:
            ArchiveReader(path)
        assert _open_fds() == before
        return str(e.value)

    assert refusal(b"short") == (f"{path} is not a readable zip archive (too short for a zip end record); "
                                 f"point at a raw archive written by packbench")
    assert refusal(bytes(100)) == (f"{path} is not a readable zip archive (no zip end record); "
                                   f"point at a raw archive written by packbench")
    over = MAX_MEMBERS + 1
    assert refusal(end_records(over, 0, 0)) == (
        f"{path} declares {over} members in a 0-byte directory, over the bounds of {MAX_MEMBERS} members and "
        f"{MAX_DIRECTORY_BYTES} bytes; it is not a raw archive packbench reads")
    big = MAX_DIRECTORY_BYTES + 1
    assert refusal(end_records(1, 0, big)) == (
        f"{path} declares 1 members in a {big}-byte directory, over the bounds of {MAX_MEMBERS} members and "
        f"{MAX_DIRECTORY_BYTES} bytes; it is not a raw archive packbench reads")
    # At the bounds the counts pass on to zipfile (which reads no entry in an empty directory).
    path.write_bytes(end_records(MAX_MEMBERS, 0, 0))
    with ArchiveReader(path) as r:
        assert r.names == [] and not r.complete
    assert refusal(end_records(1, 0, MAX_DIRECTORY_BYTES)).startswith(f"{path} is not a readable zip archive (")
    # zipfile's own refusal, in its words
    assert refusal(b"PK\x03\x04" + end_records(1, 0, 46)) == (
        f"{path} is not a readable zip archive (Bad offset for central directory); "
        f"point at a raw archive written by packbench")


def test_the_reader_refuses_a_file_over_its_size_bound_before_reading_it(tmp_path: Path):
    from packbench.core.archive import MAX_ARCHIVE_BYTES, ArchiveTooLarge
    path = tmp_path / "huge.zip"
    with open(path, "wb") as f:  # sparse: nothing written
        f.truncate(MAX_ARCHIVE_BYTES + 1)
    with pytest.raises(ArchiveTooLarge) as e:
        ArchiveReader(path)
    assert (e.value.size, e.value.bound) == (MAX_ARCHIVE_BYTES + 1, MAX_ARCHIVE_BYTES)
    with open(path, "r+b") as f:
        f.truncate(MAX_ARCHIVE_BYTES)  # at the bound: read (and found to be no zip)
    with pytest.raises(ArchiveError, match="no zip end record"):
        ArchiveReader(path)
    small = sealed_screen(tmp_path)
    size = small.stat().st_size
    with pytest.raises(ArchiveTooLarge) as e:
        ArchiveReader(small, max_archive_bytes=size - 1)
    assert (e.value.size, e.value.bound) == (size, size - 1)
    with ArchiveReader(small, max_archive_bytes=size) as r:
        assert r.complete and r.verify() == []


def test_the_reader_keeps_its_bounds_and_counts_from_nothing_read(sealed: Path):
    with ArchiveReader(sealed) as r:
        from packbench.core.archive.reader import MAX_ARRAY_BYTES, MAX_JSON_BYTES, MAX_JSON_TOTAL_BYTES, MAX_TOTAL_BYTES
        assert (r.path, r.size, r.bytes_read) == (sealed, sealed.stat().st_size, 0)
        assert (r.max_member_bytes, r.max_total_bytes, r.max_json_bytes, r.max_json_total_bytes) == (
            MAX_ARRAY_BYTES, MAX_TOTAL_BYTES, MAX_JSON_BYTES, MAX_JSON_TOTAL_BYTES)
        assert r.names == MEMBERS
    with ArchiveReader(str(sealed), max_member_bytes=100, max_json_bytes=1000, max_total_bytes=5000,
                       max_json_total_bytes=700) as r:
        assert isinstance(r.path, Path)
        assert (r.max_member_bytes, r.max_total_bytes, r.max_json_bytes, r.max_json_total_bytes) == (100, 5000, 100, 700)
    with ArchiveReader(sealed, max_member_bytes=1000, max_json_bytes=100) as r:
        assert (r.max_member_bytes, r.max_json_bytes) == (1000, 100)


def test_zip64_records_are_zipfiles_with_the_limit_scaled_down(tmp_path: Path, monkeypatch):
    """zipfile's zip64 decisions (a member of size x 1.05 over the limit, offsets, sizes and the
    directory past it) made at a limit of 4,000 bytes instead of 2 GiB, in zipfile and in the
    archive modules alike: the writer's archive is still zipfile's byte for byte, verifies
    clean and reads back. Catches the writer's or the layout check's zip64 decision dropped,
    inverted, or made on another threshold, and the zip32 guard applied to zip64 members."""
    import packbench.core.archive.verify as verify_module
    import packbench.core.archive.writer as writer_module
    import packbench.core.archive.zipformat as zipformat
    for module in (zipfile, zipformat, writer_module, verify_module):
        monkeypatch.setattr(module, "ZIP64_LIMIT", 4000)
    rng = np.random.default_rng(5)
    noise = rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    members = {
        "small.bin": b"s" * 100,  # zip32 at offset 0
        "edge.npy": rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(),  # 3,150 after x 1.05: zip32
        "over.bin": noise[:3900],  # 4,095 after x 1.05: zip64 header, sizes under the limit
        "noise.bin": noise,  # deflates to more than the limit: zip64 sizes and offset
        "late.json": canonical_json({"after": "the limit"}),  # offset past the limit
    }
    path = tmp_path / "z64.zip"
    w = ArchiveWriter(path)
    for name, data in members.items():
        if name.endswith(".json"):
            w.add_json(name, {"after": "the limit"})
        else:
            w.add_bytes(name, data)
    w.seal(MANIFEST)
    ref = tmp_path / "ref.zip"
    zipfile_reference(path, ref)
    assert path.read_bytes() == ref.read_bytes()
    assert b"PK\x06\x06" in path.read_bytes()  # the zip64 end record: the directory starts past the limit
    with ArchiveReader(path) as r:
        assert r.verify() == []
        for name, data in members.items():
            assert r.read_bytes(name) == data


def test_a_new_writer_makes_missing_directories_and_a_file_of_mode_0666_less_umask(tmp_path: Path):
    path = tmp_path / "a" / "b" / "c.zip"
    old = os.umask(0o022)
    try:
        w = ArchiveWriter(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert (w.sha256, w.manifest_sha256, w.members, w.format_version) == (None, None, {}, 1)
    assert path.read_bytes() == b"PK\x05\x06" + bytes(18)  # an empty zip from the first moment
    w.add_bytes("x.bin", b"x")
    w.seal({})
    assert verify(path) == []


def test_a_writer_under_a_file_says_that_is_no_directory(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"")
    path = tmp_path / "f" / "a.zip"
    with pytest.raises(ArchiveError) as e:
        ArchiveWriter(path)
    assert str(e.value) == (f"could not create archive {path}: {tmp_path / 'f'} is not a directory; write archives "
                            f"to a directory")


def test_a_member_that_fills_the_room_exactly_goes_into_it(tmp_path: Path):
    """The room before the directory is used up to its last byte before the directory moves.
    Catches the fit compared with < (a directory moved for nothing, 1 MiB of file each time)."""
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    w.add_bytes("a.bin", b"a")
    before = path.stat().st_size
    end = w._end
    name = "fill.npy"  # STORED: the payload is the data
    w.add_bytes(name, bytes(w._cd_at - end - 30 - len(name)))
    assert w._end == w._cd_at  # the room is full ...
    assert path.stat().st_size == before + 46 + len(name)  # ... and only the directory's new entry was added
    w.seal({})
    assert verify(path) == []


def test_a_file_that_changes_size_while_a_member_is_written_stops_the_writer(tmp_path: Path, monkeypatch):
    """Something else writing to the archive between the writer's write and its check: the
    append is refused with the sizes and the writer stays unusable. Catches the check's words
    or the writer's failed state lost."""
    import packbench.core.archive.writer as writer_module
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    real = os.fstat

    class Grown:
        def __init__(self, st):
            self.st_size, self.st_dev, self.st_ino, self.st_mtime_ns = st.st_size + 5, st.st_dev, st.st_ino, st.st_mtime_ns

    monkeypatch.setattr(writer_module.os, "fstat", lambda fd: Grown(real(fd)))
    with pytest.raises(ArchiveError) as e:
        w.add_bytes("a.bin", b"abc")
    monkeypatch.undo()
    size = path.stat().st_size
    assert str(e.value) == (f"archive {path} is {size + 5} bytes after writing member a.bin, this writer wrote "
                            f"{size}: something else writes to it; keep it for inspection and rerun the screen as a "
                            f"new attempt")
    with pytest.raises(ArchiveError) as e:
        w.add_bytes("b.bin", b"b")
    assert str(e.value) == (f"archive {path} is unusable after a failed write (archive changed behind the writer); "
                            f"keep it as an interrupted attempt and start a new one")


def test_every_single_member_and_the_seal_are_fsynced_before_the_call_returns(tmp_path: Path, monkeypatch):
    """add_json, add_array, add_bytes and seal: each member is on disk when the call returns
    (docs/archive.md). Catches the fsync of a single member or of the manifest skipped."""
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(len(w.members)), real(fd)))
    w.add_json("a.json", {"a": 1})
    w.add_array("b.npy", LOGITS[0])
    w.add_bytes("c.bin", b"c")
    assert synced == [0, 1, 2]  # inside each member's write, before it is listed
    w.seal({})
    assert len(synced) == 4 and synced[3] == 3


def test_a_new_archive_that_cannot_be_written_is_removed_and_named(tmp_path: Path, monkeypatch):
    """The file is created but its first bytes cannot be made durable (a full disk): it is
    removed, and the error names the file, the cause and the fix. Catches the removal dropped
    or its words lost."""
    import packbench.core.archive.writer as writer_module
    path = tmp_path / "a.zip"

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module.os, "fsync", full)
    with pytest.raises(ArchiveError) as e:
        ArchiveWriter(path)
    monkeypatch.undo()
    assert str(e.value) == (f"could not create archive {path} ([Errno 28] No space left on device); check disk space "
                            f"and permissions")
    assert not path.exists()
    long = tmp_path / ("n" * 300 + ".zip")  # the file system refuses the name itself
    with pytest.raises(ArchiveError) as e:
        ArchiveWriter(long)
    assert str(e.value) == (f"could not create archive {long} ([Errno 36] File name too long: '{long}'); check disk "
                            f"space and permissions")


def test_an_archive_path_that_cannot_be_looked_up_stops_the_append_by_name(tmp_path: Path):
    """The archive's directory replaced by a file between two appends: the path cannot even be
    looked up. Catches the cause or the member's name lost from the error."""
    d = tmp_path / "d"
    path = d / "a.zip"
    w = ArchiveWriter(path)
    d.rename(tmp_path / "moved")
    d.write_bytes(b"")
    with pytest.raises(ArchiveError) as e:
        w.add_bytes("x.bin", b"x")
    assert str(e.value) == (f"could not append member x.bin to archive {path} ([Errno 20] Not a directory: "
                            f"'{path}'); check disk space, permissions and who else touches the file, then rerun "
                            f"as a new attempt")


def test_locate_end_finds_the_true_end_record_among_signatures_before_and_after_it():
    """Signatures in a member's data before the end record and in its comment after it; an end
    record at byte 0 of the file behind a comment holding a signature. Catches the backward
    search made forward or kept off the file's first byte."""
    from packbench.core.archive.zipformat import end_records
    base, start = _zip_of_one_member(b"PK\x05\x06" * 2 + bytes(30))
    comment = b"PK\x05\x06 not an end record"
    data = base[:-2] + len(comment).to_bytes(2, "little") + comment
    assert _locate(data) == (1, len(base) - 22 - start, start, 22 + len(comment))
    data = end_records(0, 0, 0)[:-2] + len(comment).to_bytes(2, "little") + comment
    assert _locate(data) == (0, 0, 0, len(data))


def test_locate_end_honours_a_locator_wherever_its_zip64_record_lies_in_the_file():
    """The locator just before the end record is followed to any zip64 record wholly inside the
    file, even one at the file's very end (here: the comment), and a record that would run past
    the end is ignored. Catches the bounds on the locator's position and target moved."""
    import struct as st
    end64 = st.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 70_000, 70_000, 11, 22)
    locator = st.pack("<4sLQL", b"PK\x06\x07", 0, 20 + 22, 1)  # the file's first bytes
    end = st.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 11, 22, len(end64))
    data = locator + end + end64
    assert _locate(data) == (70_000, 11, 22, len(data) - 42)
    short = b"PK\x06\x06" + bytes(26)  # a zip64 signature 30 bytes before the end: no whole record fits
    locator = st.pack("<4sLQL", b"PK\x06\x07", 0, 10 + 20 + 22 + 6, 1)  # at the signature
    end = st.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 3, 3, 11, 22, 6 + len(short))
    data = b"x" * 10 + locator + end + bytes(6) + short
    assert _locate(data) == (3, 11, 22, 22 + 6 + len(short))
