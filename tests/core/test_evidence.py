"""Issue 10: the hostile classes the auditor used to accept or mishandle, one test per rule.

Archives come from bench.audit's synthetic screen (physically consistent records) and are
forged the way a suspicious reviewer would: by hand with the writer's own zip helpers, by
zipfile, or re-sealed consistently (manifest recomputed) so only the new checks can object.
"""

import hashlib
import io
import json
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

import packbench.core.archive as archive
import packbench.core.archive.zipformat as zipformat
from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import (
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    ArchiveReader,
    ArchiveWriter,
    file_sha256,
)
from packbench.core.audit import audit_archive
from packbench.core.canonical import canonical_json
from packbench.core.errors import ArchiveError, ProtocolError
from packbench.core.gates import bootstrap_ratio
from packbench.core.protocol import freeze
from packbench.core.protocol.schema import MAX_BOOTSTRAP_DRAWS
from packbench.core.provenance import (
    Signer,
    checkpoint_digest,
    check_signature,
    generate_key,
    load_public_key,
    signature_path,
)


@pytest.fixture(scope="module")
def screen(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("ev") / "screen.zip"
    out = write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2))
    return {**out, "path": path}


def members(path: Path) -> dict[str, bytes]:
    with ArchiveReader(path) as r:
        return {n: r.read_bytes(n) for n in r.names}


def reseal(src: Path, dst: Path, *, edit=None, replace=None, add=None) -> Path:
    """A consistent forgery: members edited (a function of the parsed JSON) or replaced (bytes),
    the manifest recomputed by the writer itself: the file is in the exact layout."""
    data = members(src)
    w = ArchiveWriter(dst)
    for name, raw in data.items():
        if name == MANIFEST_NAME:
            continue
        if edit and name in edit:
            obj = json.loads(raw)
            edit[name](obj)
            raw = canonical_json(obj)
        raw = (replace or {}).get(name, raw)
        w.add_bytes(name, raw)
    for name, raw in (add or {}).items():
        w.add_bytes(name, raw)
    old = json.loads(data[MANIFEST_NAME])
    w.seal({k: v for k, v in old.items() if k not in ("members", "format_version")})
    return dst


def problems(path: Path, **kw) -> list[str]:
    return audit_archive(path, **kw).problems


# ----------------------------------------------------------------------------- 1. bounds


def test_the_clean_screen_agrees(screen):
    report = audit_archive(screen["path"])
    assert report.agrees, report.problems


def test_a_huge_non_zip_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(archive.MAX_ARCHIVE_BYTES + 1)  # sparse: costs nothing on disk
    hashed = []
    monkeypatch.setattr("packbench.core.audit.file_sha256", lambda p: hashed.append(p) or "0" * 64)
    report = audit_archive(path)
    assert hashed == [] and report.unreadable and not report.agrees
    assert report.record["archive_sha256"] is None
    # One line: the size, the bound and the `--max-mib` that reads it (never "SHA-256 None differs").
    assert report.problems == [f"the archive is {archive.MAX_ARCHIVE_BYTES + 1} bytes (1024.0 MiB), over the audit "
                               f"bound of {archive.MAX_ARCHIVE_BYTES} bytes (1024 MiB), so it was not read; only for an "
                               f"archive you trust, audit it with `packbench audit archive FILE --max-mib 1073`"]  # the file + 48 MiB of JSON


def test_a_forged_member_count_is_refused_before_zipfile_parses(tmp_path):
    path = tmp_path / "count.zip"
    with open(path, "wb") as f:  # a count past the bound, through the zip64 records
        f.write(zipformat.end_records(archive.MAX_MEMBERS + 1, 0, 0))
    with pytest.raises(ArchiveError, match="over the bounds"):
        ArchiveReader(path)


def test_a_small_file_declaring_a_huge_array_allocates_nothing(screen, tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1000, 262144)})
    forged = reseal(screen["path"], tmp_path / "huge-array.zip",
                    replace={"logits/00001.npy": header.getvalue() + b"\0" * 64})
    found = problems(forged)
    assert any("logits/00001.npy" in p and "declares shape (1000, 262144)" in p for p in found), found


def test_a_json_member_over_its_bound_is_refused(screen, tmp_path):
    big = {"pad": "x" * (MAX_JSON_BYTES + 10)}
    forged = reseal(screen["path"], tmp_path / "big.zip", replace={"plan.json": canonical_json(big)})
    found = problems(forged)
    assert any("unreadable member plan.json" in p and "over the bound" in p for p in found), found


@pytest.mark.parametrize("error, line", [
    (MemoryError(), "out of memory while auditing: the archive needs more memory than this machine gave the audit "
                    "(docs/archive.md, Bounds)"),
    (RecursionError(), "the archive nests its records too deeply to audit"),
    (ValueError("x" * 300 + "\nsecond line"),
     f"cannot audit: ValueError while recomputing ({'x' * 200}); the archive is hostile or damaged"),
    (KeyError("k"), "cannot audit: KeyError while recomputing ('k'); the archive is hostile or damaged"),
    (RuntimeError(), "cannot audit: RuntimeError while recomputing (); the archive is hostile or damaged"),
])
def test_an_audit_that_fails_midway_is_one_line_and_a_failed_audit(screen, monkeypatch, error, line):
    """Out of memory, records nested too deep, and any error no check foresaw: one line naming
    what happened (the error's type and the first 200 characters of its first line), never a
    traceback, never agreement. Catches each line's wording and the error's type or text lost."""
    def boom(self, reader, **kw):
        raise error

    monkeypatch.setattr("packbench.core.audit._Audit.run", boom)
    report = audit_archive(screen["path"])
    assert not report.agrees
    assert report.problems == [line]


def test_the_bootstrap_draws_in_blocks_bit_for_bit():
    rng = np.random.default_rng(3)
    num, den = list(rng.uniform(1, 2, 7)), list(rng.uniform(1, 2, 7))
    got = bootstrap_ratio(num, den, confidence=0.9, resamples=400_000, seed=5)  # several blocks
    raw = np.random.PCG64(5).random_raw(size=(400_000, 7))
    idx = (raw % np.uint64(7)).astype(np.intp)
    ratios = np.sort(np.cumsum(np.asarray(num)[idx], axis=1)[:, -1] / np.cumsum(np.asarray(den)[idx], axis=1)[:, -1])
    assert got == (float(ratios[20_000]), float(ratios[379_999]))


def test_the_schema_bounds_the_bootstrap_work():
    raw = synthetic_protocol(prompts_n=1000, repetitions=20)
    raw["gates"]["runtime"] = {"control": "dense-stream", "max_ratio": 0.8, "resamples": 100_000}
    with pytest.raises(ProtocolError, match=f"more than {MAX_BOOTSTRAP_DRAWS}"):
        freeze(raw)
    raw["gates"]["runtime"]["resamples"] = 10**12
    with pytest.raises(ProtocolError, match="resamples`: 1000000000000 is not an integer in"):
        freeze(raw)


# ----------------------------------------------------------------------------- 2. exact layout


def _with_bytes(src: Path, dst: Path, mutate) -> Path:
    raw = bytearray(src.read_bytes())
    dst.write_bytes(bytes(mutate(raw)))
    return dst


def test_a_zip_comment_is_a_layout_problem(screen, tmp_path):
    path = tmp_path / "comment.zip"
    path.write_bytes(screen["path"].read_bytes())
    with zipfile.ZipFile(path, "a") as zf:
        zf.comment = b"not covered by the manifest"
    assert "layout: the end of central directory record holds a zip comment of 27 bytes" in problems(path)


def test_bytes_before_after_or_between_members_are_named(screen, tmp_path):
    before = _with_bytes(screen["path"], tmp_path / "before.zip", lambda raw: b"HIDDEN" + raw)
    found = problems(before)
    assert any(p.startswith("layout: ") for p in found) and not audit_archive(before).agrees, found
    after = _with_bytes(screen["path"], tmp_path / "after.zip", lambda raw: raw + b"HIDDEN")
    assert not audit_archive(after).agrees
    # Between: rebuild the sealed archive by hand with 5 bytes after the first member.
    src = screen["path"].read_bytes()
    with zipfile.ZipFile(screen["path"]) as zf:
        infos = zf.infolist()
    cut = infos[1].header_offset
    shifted = bytearray(src[:cut] + b"HIDDN" + src[cut:])
    forged = tmp_path / "between.zip"
    with zipfile.ZipFile(io.BytesIO(bytes(shifted))) as zf:  # zipfile still reads it...
        assert zf.namelist()[0] == "protocol.json"
    forged.write_bytes(bytes(shifted))
    assert not audit_archive(forged).agrees  # ...packbench does not


def test_a_local_header_that_disagrees_with_the_directory_is_named(screen, tmp_path):
    with zipfile.ZipFile(screen["path"]) as zf:
        at = zf.getinfo("plan.json").header_offset

    def mutate(raw):
        raw[at + 6] ^= 0x08  # a flag bit only the local header carries
        return raw
    path = _with_bytes(screen["path"], tmp_path / "local.zip", mutate)
    assert ("layout: the local header of member plan.json disagrees with the central directory "
            "(a streaming unzipper would read something else)") in problems(path)


def test_bytes_hidden_after_a_deflate_stream_are_found(tmp_path):
    """A member whose compressed bytes hold a whole DEFLATE stream then junk: zipfile ignores the
    junk; the exact reader names it."""
    data = canonical_json({"a": 1})
    packer = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
    payload = packer.compress(data) + packer.flush() + b"JUNK"
    name = b"plan.json"
    header = zipformat.local_header(name, method=8, crc=zlib.crc32(data), csize=len(payload), size=len(data),
                                  zip64=False)
    entry = zipformat.central_entry(name, method=8, crc=zlib.crc32(data), csize=len(payload), size=len(data),
                                  offset=0, version=20)
    raw = header + payload + entry + zipformat.end_records(1, len(header) + len(payload), len(entry))
    path = tmp_path / "junk.zip"
    path.write_bytes(raw)
    with zipfile.ZipFile(path) as zf:
        assert zf.read("plan.json") == data  # what another reader accepts
    with ArchiveReader(path) as r:
        found = [p.message for p in r.verify()]
    assert any("4 bytes after the end of its DEFLATE stream" in p for p in found), found


def test_the_sealed_writer_output_has_no_layout_problem(screen):
    with ArchiveReader(screen["path"]) as r:
        assert [p for p in r.verify() if p.kind == "layout"] == []


# ----------------------------------------------------------------------------- 3. formats


@pytest.mark.parametrize("text", [
    b'{"entries": [], "prompts": []}',  # padded
    b'{"prompts":[],"entries":[]}',  # unsorted
    b'{"entries":[],"entries":[],"prompts":[]}',  # duplicate key: another parser may keep the other
])
def test_non_canonical_json_is_refused(screen, tmp_path, text):
    forged = reseal(screen["path"], tmp_path / "json.zip", replace={"plan.json": text})
    found = problems(forged)
    assert any(p.startswith("cannot read plan.json") for p in found), found


def test_logits_in_another_dtype_or_byte_order_are_refused(screen, tmp_path):
    for dtype in (">f4", "<f8", "<f2"):
        with ArchiveReader(screen["path"]) as r:
            arr = r.read_array("logits/00000.npy").astype(dtype)
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        forged = reseal(screen["path"], tmp_path / f"dtype-{dtype[1:]}.zip", replace={"logits/00000.npy": buf.getvalue()})
        found = problems(forged)
        assert any("logits/00000.npy" in p and "the format says C-order <f4" in p for p in found), (dtype, found)


# ----------------------------------------------------------------------------- 4. invariants


@pytest.mark.parametrize("edit, expected", [
    ({"worker.json": lambda w: w["environment"].update(host="elsewhere")}, "the manifest's environment differs"),
    ({"worker.json": lambda w: w["start"].update(param_bytes=w["start"]["param_bytes"] + 2)},
     "param_bytes"),
    ({"episodes/00002.json": lambda e: e.update(wall_s=e["call_s"] / 2)}, "is below the"),
    ({"episodes/00003.json": lambda e: e["calls"][1]["h2d_weight_bytes"].__setitem__(
        0, e["calls"][1]["h2d_weight_bytes"][0] + 2)}, "impossible copy"),
    ({"verdicts.json": lambda vs: vs[0].update(detail="all fine, trust me")}, "differs in detail"),
])
def test_records_are_cross_checked(screen, tmp_path, edit, expected):
    forged = reseal(screen["path"], tmp_path / "x.zip", edit=edit)
    found = problems(forged)
    assert any(expected in p for p in found), found


def test_an_impossible_copy_is_caught_even_when_the_totals_are_consistent(screen, tmp_path):
    def forge(e):
        e["calls"][1]["h2d_weight_bytes"][0] += 2
        e["h2d_weight_bytes"] += 2
        e["phases"]["decode"]["h2d_bytes"] += 2
    forged = reseal(screen["path"], tmp_path / "copy.zip", edit={"episodes/00003.json": forge})
    found = problems(forged)
    assert [p for p in found if "impossible copy" in p] and not [p for p in found if "from the call ledger" in p], found


def test_a_stray_member_and_a_missing_trace_are_problems(screen, tmp_path):
    data = members(screen["path"])
    w = ArchiveWriter(tmp_path / "stray.zip")
    for name, raw in data.items():
        if name not in (MANIFEST_NAME, "traces/00001.npy"):
            w.add_bytes(name, raw)
    w.add_bytes("episodes/99999.json", b"{}")
    w.seal({k: v for k, v in json.loads(data[MANIFEST_NAME]).items() if k not in ("members", "format_version")})
    found = problems(tmp_path / "stray.zip")
    assert "member 'episodes/99999.json' is not part of the archive of this plan" in found
    assert "episodes/00001.json: the run sampled memory but traces/00001.npy is missing" in found


# ----------------------------------------------------------------------------- 7. fail closed


def test_a_partial_archive_never_prints_a_pass(tmp_path):
    path = tmp_path / "partial.zip"
    write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2), seal=False)
    report = audit_archive(path)
    assert not report.agrees and report.record["verdicts"]
    assert not any(v["passed"] for v in report.record["verdicts"])


# ----------------------------------------------------------------------------- 5. signatures


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("keys")
    a, a_pub, a_id = generate_key(d / "a.pem")
    b, b_pub, _ = generate_key(d / "b.pem")
    return {"a": Signer.load(a), "a_pub": load_public_key(a_pub), "b": Signer.load(b),
            "b_pub": load_public_key(b_pub), "a_id": a_id}


def signed_copy(screen, tmp_path: Path, signer: Signer, name: str = "signed.zip") -> Path:
    path = tmp_path / name
    path.write_bytes(screen["path"].read_bytes())
    with ArchiveReader(path) as r:
        manifest_sha = __import__("hashlib").sha256(r.read_bytes(MANIFEST_NAME)).hexdigest()
    signer.sign_archive(path, file_sha256(path), manifest_sha)
    return path


def test_a_valid_signature_by_a_trusted_key_agrees(screen, tmp_path, keys):
    path = signed_copy(screen, tmp_path, keys["a"])
    report = audit_archive(path, trust=[keys["a_pub"]])
    assert report.agrees, report.problems
    assert report.record["signature"] == {"status": "valid", "key_id": keys["a_id"]}
    # Without --trust nothing is claimed about provenance, and the record is the old one.
    assert "signature" not in audit_archive(path).record


def test_unsigned_unknown_and_bad_signatures_never_agree(screen, tmp_path, keys):
    assert audit_archive(screen["path"], trust=[keys["a_pub"]]).record["signature"]["status"] == "unsigned"
    by_b = signed_copy(screen, tmp_path, keys["b"], "by-b.zip")
    report = audit_archive(by_b, trust=[keys["a_pub"]])
    assert not report.agrees and report.record["signature"]["status"] == "unknown-signer"
    # A signature whose bytes were changed.
    signed = signed_copy(screen, tmp_path, keys["a"], "flipped.zip")
    env = json.loads(signature_path(signed).read_bytes())
    env["signature"] = ("0" if env["signature"][0] != "0" else "1") + env["signature"][1:]
    signature_path(signed).write_bytes(canonical_json(env))
    report = audit_archive(signed, trust=[keys["a_pub"]])
    assert not report.agrees and report.record["signature"]["status"] == "bad-signature"


def test_a_changed_archive_breaks_its_signature(screen, tmp_path, keys):
    path = signed_copy(screen, tmp_path, keys["a"], "changed.zip")
    forged = reseal(path, tmp_path / "changed2.zip",
                    edit={"episodes/00002.json": lambda e: e.update(wall_s=e["wall_s"] + 1.0)})
    os.replace(signature_path(path), signature_path(forged))
    report = audit_archive(forged, trust=[keys["a_pub"]])
    assert report.record["signature"]["status"] == "bad-signature"
    assert "signature: by key" in report.problems[-1]


def test_malformed_signature_files_are_reported(tmp_path, keys):
    sig = tmp_path / "x.zip.sig"
    for content in (b"", b"{}", b"x" * 10_000, canonical_json({"scheme": "other"})):
        sig.write_bytes(content)
        check = check_signature(sig, archive_sha256="0" * 64, manifest_sha256="0" * 64, trusted=[keys["a_pub"]])
        assert check.status == "malformed" and check.line.startswith("signature: ")


def test_an_envelope_not_in_canonical_json_is_malformed(screen, tmp_path, keys):
    """The .sig file holds one canonical JSON object (core/provenance.py): the same envelope
    re-serialised (indented, keys reordered) is not one, even though every field and the
    signature itself still check. Catches the planted bug "signature: a non-canonical envelope
    accepted"."""
    path = signed_copy(screen, tmp_path, keys["a"], "loose.zip")
    sig = signature_path(path)
    env = json.loads(sig.read_bytes())
    assert audit_archive(path, trust=[keys["a_pub"]]).record["signature"]["status"] == "valid"
    sig.write_bytes(json.dumps(dict(reversed(list(env.items()))), indent=1).encode())
    with ArchiveReader(path) as r:
        manifest_sha = hashlib.sha256(r.read_bytes(MANIFEST_NAME)).hexdigest()
    check = check_signature(sig, archive_sha256=file_sha256(path), manifest_sha256=manifest_sha,
                            trusted=[keys["a_pub"]])
    assert (check.status, check.line) == ("malformed", "signature: loose.zip.sig is not a packbench-ed25519-v1 envelope")


# ----------------------------------------------------------------------------- 6. what was measured


def test_the_checkpoint_digest_pins_every_file(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 100)
    first = checkpoint_digest(d)
    assert first == checkpoint_digest(d)
    (d / "model.safetensors").write_bytes(b"\0" * 99 + b"\1")  # same size, other weights
    assert checkpoint_digest(d) != first


def test_the_checkpoint_digest_is_its_documented_formula_and_pins_each_files_name(tmp_path):
    """checkpoint_digest's contract: SHA-256 of the scheme line, then `path NUL size NUL
    sha256(bytes) LF` per file in sorted relative-path order; so two checkpoints whose files
    hold the same bytes under other names (shards swapped, a file renamed) differ. Catches the
    planted bug "provenance: checkpoint digest without file names"."""
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    files = {"config.json": b"{}", "model-1.safetensors": b"\0" * 7, "sub/z.bin": b"\1\2"}
    for name, data in files.items():
        (d / name).write_bytes(data)
    h = hashlib.sha256(b"packbench-checkpoint-v1\n")
    for name in sorted(files):
        h.update(f"{name}\0{len(files[name])}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    assert checkpoint_digest(d) == h.hexdigest()
    first = checkpoint_digest(d)
    (d / "model-1.safetensors").rename(d / "model-2.safetensors")  # same bytes, another name
    assert checkpoint_digest(d) != first


def test_a_pinned_model_is_checked_against_the_start_record(tmp_path):
    raw = synthetic_protocol()
    raw["model"] = {"path": "/models/opt", "sha256": "a" * 64}
    body = freeze(raw).body
    assert body["model"] == {"path": "/models/opt", "sha256": "a" * 64}
    path = tmp_path / "pinned.zip"
    write_synthetic_screen(path, raw)
    found = problems(path)
    assert any("the protocol pins " + "a" * 64 in p for p in found), found
    with pytest.raises(ProtocolError, match="model.sha256"):
        freeze({**raw, "model": {"synth": synthetic_protocol()["model"]["synth"], "sha256": "a" * 64}})


def test_problem_lines_and_retained_records_are_bounded():
    from packbench.core.audit import MAX_PROBLEM_CHARS, MAX_PROBLEMS, _bounded, _retained

    out = _bounded(["x" * (MAX_PROBLEM_CHARS + 5)] + ["p"] * (MAX_PROBLEMS + 3))
    assert len(out) == MAX_PROBLEMS + 1 and out[-1] == "... and 4 more problems"
    assert out[0].endswith("... (5 more characters)")
    kept = _retained({"plan_index": 1, "status": "ok", "junk": [{}] * 1000, "calls": [1] * 1000,
                      "error": "e" * 5000, "memory": {"peak_sampled_bytes": 3, "bomb": [{}] * 10},
                      "phases": {"prefill": {"call_s": 1.0}, "other": {}}, "tokens": [1, 2]})
    assert kept == {"plan_index": 1, "status": "ok", "error": "<dropped: not a small scalar>", "tokens": [1, 2],
                    "memory": {"peak_sampled_bytes": 3, "bomb": "<dropped: not a small scalar>"},
                    "phases": {"prefill": {"call_s": 1.0}}}


def test_bits_no_content_depends_on_are_covered(screen, tmp_path):
    """Flipping every bit of a DEFLATE member's last byte: where the content stays the same (the
    padding after the final block), the member hash cannot see it; the recompression check does."""
    with zipfile.ZipFile(screen["path"]) as zf:
        info = zf.getinfo("plan.json")
        content = zf.read(info)
    raw = screen["path"].read_bytes()
    last = info.header_offset + 30 + len(info.filename) + info.compress_size - 1
    unchanged = 0
    for bit in range(8):
        forged = bytearray(raw)
        forged[last] ^= 1 << bit
        path = tmp_path / f"bit{bit}.zip"
        path.write_bytes(bytes(forged))
        try:
            with zipfile.ZipFile(path) as zf:
                same = zf.read("plan.json") == content
        except (zipfile.BadZipFile, zlib.error):
            same = False
        unchanged += same
        assert not audit_archive(path).agrees, bit
    assert unchanged >= 1  # there is a padding bit, and it is caught


@pytest.mark.parametrize("edit, expected", [
    ({"episodes/00002.json": lambda e: e.update(prompt=float(e["prompt"]))}, "does not match plan entry 2"),
    ({"episodes/00002.json": lambda e: e.update(tokens=[float(t) for t in e["tokens"]])}, "tokens are not all integers"),
])
def test_json_types_are_part_of_the_format(screen, tmp_path, edit, expected):
    found = problems(reseal(screen["path"], tmp_path / "types.zip", edit=edit))
    assert any(expected in p for p in found), found


def test_a_non_finite_trace_is_one_line(tmp_path):
    from packbench.core.audit import _Audit

    audit = _Audit(tmp_path / "a.zip", "0" * 64)
    audit.check_trace("traces/00000.npy", np.array([[0.0, np.nan]]), {"memory": {"peak_sampled_bytes": 1}})
    assert audit.problems == ["traces/00000.npy: the memory trace holds non-finite values"]


def test_max_mib_raises_the_size_bounds_for_a_trusted_large_archive(screen, monkeypatch):
    monkeypatch.setattr(archive, "MAX_TOTAL_BYTES", 1000)
    monkeypatch.setattr(archive.ArchiveReader.__init__, "__kwdefaults__",
                        {**archive.ArchiveReader.__init__.__kwdefaults__, "max_total_bytes": 1000})
    assert audit_archive(screen["path"]).problems[0].startswith("archive too large")
    assert audit_archive(screen["path"], max_mib=2048).agrees


def test_a_python_without_stock_deflate_says_it_cannot_check_instead_of_calling_members_altered(
        screen, tmp_path, monkeypatch):
    """On a zlib that deflates differently (zlib-ng, say), the recompression check cannot run: the
    problem names this Python's zlib and the fix, and the audit still does not agree (fails closed)."""
    import packbench.core.archive.reader as archive

    assert archive.stock_deflate()  # this machine's zlib is stock: the check is real here
    with zipfile.ZipFile(screen["path"]) as zf:
        info = zf.getinfo("plan.json")
    raw = bytearray(screen["path"].read_bytes())
    last = info.header_offset + 30 + len(info.filename) + info.compress_size - 1
    for bit in range(8):  # the padding bit that leaves the content unchanged
        forged = bytearray(raw)
        forged[last] ^= 1 << bit
        path = tmp_path / f"bit{bit}.zip"
        path.write_bytes(bytes(forged))
        if any("bits the member hash does not cover" in p for p in problems(path)):
            break
    monkeypatch.setattr(archive, "stock_deflate", lambda: False)
    report = audit_archive(path)
    assert not report.agrees
    assert any("cannot be checked here" in p and "stock zlib" in p for p in report.problems), report.problems
