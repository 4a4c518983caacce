"""The audit's paths that exact, batch-1 screens never take: approximate screens (fidelity
figures recomputed from the teacher-forced logits, `forced/` members, the database's fidelity
columns), batch screens (one token check per sequence), and the bounds an audit keeps on what a
hostile record carries. Each test names the bug it catches; the archives are synthetic
(bench/audit.py), a few milliseconds each."""

import json
import math

import numpy as np
import pytest

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter
from packbench.core.audit import (
    _DROPPED,
    EPISODE_FIELDS,
    MAX_PROBLEM_CHARS,
    MAX_PROBLEMS,
    RETAINED,
    _Audit,
    _bounded,
    _int8_row_bytes,
    _kept_tokens,
    _retained,
    _small,
    audit_archive,
)
from packbench.core.canonical import canonical_json
from packbench.core.protocol import expand, freeze
from packbench.core.protocol.schema import MAX_BATCH, MAX_CONTINUATION
from packbench.core.record import FIELDS_BY_NAME, token_count
from packbench.core.registry import INT8_SCALE_BYTES, SHAPES


def approximate_protocol() -> dict:
    """dense-stream (the exact reference) and an int8 `quantized` competitor (schema 5)."""
    raw = synthetic_protocol(prompts_n=2, repetitions=1, conditions=("dense-stream", "int8"))
    raw["schema"] = 5
    raw["conditions"][1] = {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}
    gates = raw["gates"]
    gates.pop("acquisition"), gates.pop("runtime")
    gates["faithfulness"] = None
    gates["fidelity"] = {"max_mean_kl": 0.01, "min_top1": 0.7}
    return raw


@pytest.fixture(scope="module")
def approx(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("approx") / "approx.zip"
    return {**write_synthetic_screen(path, approximate_protocol()), "path": path}


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("batch") / "batch.zip"
    raw = {**synthetic_protocol(prompts_n=3, repetitions=1), "schema": 6, "batch": 2}
    return {**write_synthetic_screen(path, raw), "path": path}


def members(path) -> dict[str, bytes]:
    with ArchiveReader(path) as r:
        return {n: r.read_bytes(n) for n in r.names}


def forged(src, dst, *, edit=None, replace=None, extra=None, drop=()):
    """A consistent forgery (the manifest recomputed): JSON members edited in place by
    `edit[name]`, raw members replaced or added, members dropped; only recomputation can tell."""
    data = members(src)
    w = ArchiveWriter(dst)
    for name, raw in {**data, **(extra or {})}.items():
        if name == MANIFEST_NAME or name in drop:
            continue
        if name in (edit or {}):
            obj = json.loads(raw)
            edit[name](obj)
            raw = canonical_json(obj)
        w.add_bytes(name, (replace or {}).get(name, raw))
    w.seal({k: v for k, v in json.loads(data[MANIFEST_NAME]).items() if k not in ("members", "format_version")})
    return dst


def npy(arr) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def db_episodes(screen) -> list[dict]:
    rows = []
    for e in screen["episodes"]:
        row = {"plan_index": e["plan_index"]}
        for column, path in EPISODE_FIELDS.items():
            value = e
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if FIELDS_BY_NAME[column].stored_as == "length":
                value = token_count(value)  # n_tokens
            if value is not None:
                row[column] = value
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- approximate screens


def test_an_approximate_screen_agrees_and_its_fidelity_verdict_is_recomputed(approx):
    # Bugs: the forced/ member counted a stray of the plan's layout, forced logits not read (or
    # read as the free run's), fidelity figures dropped from the retained record: each changes
    # the recomputed fidelity verdict or adds a problem, and an unchanged archive must agree.
    report = audit_archive(approx["path"], expected_sha256=approx["sha256"])
    assert report.agrees, report.problems
    assert report.record["verdicts"] == [{k: v[k] for k in report.record["verdicts"][0]} for v in approx["verdicts"]]
    fid = [v for v in report.record["verdicts"] if v["gate"] == "fidelity"]
    assert len(fid) == 1 and fid[0]["passed"] is True and fid[0]["value"] > 0  # a real figure, not a default
    with ArchiveReader(approx["path"]) as r:
        assert {n for n in r.names if n.startswith("forced/")} == {"forced/00001.npy", "forced/00003.npy",
                                                                  "forced/00005.npy"}


def test_a_forged_fidelity_figure_is_named_with_both_figures(approx, tmp_path):
    # Bug: the recorded figures not compared with the ones recomputed from the logits (or compared
    # only when they differ by much): one ulp of mean_kl must be named, with both figures.
    rec = next(e for e in approx["episodes"] if e["plan_index"] == 3)
    fid = dict(sorted(rec["fidelity"].items()))  # as the archive's canonical JSON holds it
    fid["mean_kl"] = math.nextafter(fid["mean_kl"], 1.0)
    report = audit_archive(forged(approx["path"], tmp_path / "f.zip",
                                  edit={"episodes/00003.json": lambda r: r.update(fidelity=fid)}))
    assert report.problems == [f"episodes/00003.json: fidelity {fid!r} != {rec['fidelity']!r} recomputed from the logits"]


def test_forged_teacher_forced_logits_change_the_recomputed_figures(approx, tmp_path):
    # Bug: the fidelity check reads the record's figures, not the forced/ member: logits forced
    # onto the reference exactly (KL 0) no longer back the recorded figures.
    with ArchiveReader(approx["path"]) as r:
        ref = r.read_array("logits/00000.npy")
    report = audit_archive(forged(approx["path"], tmp_path / "l.zip", replace={"forced/00001.npy": npy(ref)}))
    (line,) = [p for p in report.problems if "fidelity" in p]
    assert line.startswith("episodes/00001.json: fidelity {") and "'mean_kl': 0.0," in line.split(" != ")[1]


def test_figures_that_cannot_be_recomputed_must_be_stated_as_none(approx, tmp_path):
    # Bug: a ValueError from of_episode (here: forced_from names no reference episode) crashes
    # the audit or is taken as agreement: the recorded figures are then compared with None.
    rec = next(e for e in approx["episodes"] if e["plan_index"] == 3)
    report = audit_archive(forged(approx["path"], tmp_path / "n.zip",
                                  edit={"episodes/00003.json": lambda r: r.update(forced_from=4)}))
    stated = dict(sorted(rec["fidelity"].items()))  # as the archive's canonical JSON holds it
    assert f"episodes/00003.json: fidelity {stated!r} != None recomputed from the logits" in report.problems
    assert not any(p.startswith("cannot audit") for p in report.problems)


def test_a_records_tier_must_be_its_conditions(approx, tmp_path):
    # Bugs: the stated tier not checked, checked against the wrong condition, or a stated
    # fidelity accepted on an exact episode.
    report = audit_archive(forged(approx["path"], tmp_path / "t.zip", edit={
        "episodes/00002.json": lambda r: r.update(tier="approximate"),
        "episodes/00004.json": lambda r: r.update(fidelity={"mean_kl": 0.0})}))
    assert "episodes/00002.json: tier 'approximate' is not its condition's (exact)" in report.problems
    assert ("episodes/00004.json: fidelity figures on an episode that is not a finished approximate one"
            in report.problems)
    report = audit_archive(forged(approx["path"], tmp_path / "e.zip", edit={
        "episodes/00003.json": lambda r: r.update(tier="exact")}))
    assert "episodes/00003.json: tier 'exact' is not its condition's (approximate)" in report.problems


def test_a_failed_approximate_episode_with_figures_is_named(approx, tmp_path):
    # Bug: fidelity checked on any approximate episode, finished or not (a failed one has no
    # logits to recompute from, and must state none).
    def fail(r):
        r.update(status="failed", error="RuntimeError: boom")
    report = audit_archive(forged(approx["path"], tmp_path / "x.zip", edit={"episodes/00005.json": fail},
                                  drop=("logits/00005.npy", "traces/00005.npy")))
    assert ("episodes/00005.json: fidelity figures on an episode that is not a finished approximate one"
            in report.problems)


def test_forced_logits_of_an_exact_episode_are_named(approx, tmp_path):
    # Bugs: a forced/ member accepted beside an exact episode, or not counted a stray of the layout.
    with ArchiveReader(approx["path"]) as r:
        forced = r.read_bytes("forced/00001.npy")
    report = audit_archive(forged(approx["path"], tmp_path / "x.zip", extra={"forced/00002.npy": forced}))
    assert report.problems == ["member 'forced/00002.npy' is not part of the archive of this plan",
                               "forced/00002.npy: teacher-forced logits of an episode that is not approximate"]


def test_the_database_fidelity_columns_are_compared(approx):
    # Bug: the fidelity_* columns (read through the retained `fidelity` mapping) never compared.
    rows = db_episodes(approx)
    assert audit_archive(approx["path"], db_episodes=rows).agrees
    fid_columns = [c for c in EPISODE_FIELDS if c.startswith("fidelity_")]
    row = next(r for r in rows if r["plan_index"] == 3)
    assert set(fid_columns) - {"fidelity_divergence_step"} <= set(row)  # divergence_step None: not stored
    for column in set(fid_columns) & set(row):
        changed = [dict(r) for r in rows]
        mine = next(r for r in changed if r["plan_index"] == 3)
        old = mine[column]
        mine[column] = math.nextafter(old, math.inf)
        assert audit_archive(approx["path"], db_episodes=changed).problems == [
            f"database episode 3 {column} {mine[column]!r} != archive {old!r}"]


# ----------------------------------------------------------------------------- batch screens


def test_a_batch_screen_agrees(batch):
    # Bugs: a batch's tokens kept as one flat list, its calls' shape judged as batch 1's, its
    # logits read 2-D: each is a problem or a different verdict on a screen that is right.
    report = audit_archive(batch["path"], expected_sha256=batch["sha256"])
    assert report.agrees, report.problems
    assert report.record["verdicts"] == [{k: v[k] for k in report.record["verdicts"][0]} for v in batch["verdicts"]]


def test_a_batch_sequences_tokens_are_checked_one_by_one(batch, tmp_path):
    # Bug: only the first sequence checked, or sequences named wrongly.
    def flip(r):
        r["tokens"][1][2] = (r["tokens"][1][2] + 1) % 64
    report = audit_archive(forged(batch["path"], tmp_path / "s.zip", edit={"episodes/00002.json": flip}))
    assert "episodes/00002.json sequence 1: tokens are not the argmax of the stored logits" in report.problems
    assert not any("sequence 0" in p for p in report.problems)


@pytest.mark.parametrize("edit, line", [
    (lambda r: r.update(tokens=r["tokens"][:1]), "episodes/00002.json: tokens are not 2 lists, one per sequence of the batch"),
    (lambda r: r.update(tokens="none"), "episodes/00002.json: tokens are not 2 lists, one per sequence of the batch"),
])
def test_a_batch_record_without_one_token_list_per_sequence_is_named(batch, tmp_path, edit, line):
    report = audit_archive(forged(batch["path"], tmp_path / "t.zip", edit={"episodes/00002.json": edit}))
    assert line in report.problems


def test_a_batch_logits_of_the_wrong_batch_are_named(batch, tmp_path):
    # Bug: a batch's logits not checked to hold one (calls, vocab) slab per sequence.
    with ArchiveReader(batch["path"]) as r:
        logits = r.read_array("logits/00002.npy")
    three = np.concatenate([logits, logits[:1]])
    report = audit_archive(forged(batch["path"], tmp_path / "l.zip", replace={"logits/00002.npy": npy(three)}))
    assert "episodes/00002.json: logits are not 2 sequences' (batch, calls, vocab)" in report.problems
    # one sequence's 2-D logits: the reader refuses them, and the record is named, not a crash
    report = audit_archive(forged(batch["path"], tmp_path / "m.zip", replace={"logits/00002.npy": npy(logits[0])}))
    assert "episodes/00002.json: logits are not 2 sequences' (batch, calls, vocab)" in report.problems
    assert not any(p.startswith("cannot audit") for p in report.problems)


def test_a_batch_call_shape_names_the_batch(batch, tmp_path):
    # Bug: the call shape of a batch judged as batch 1's (prefill of `prefix` tokens, decode of
    # 1), or its line not saying that tokens count every sequence's.
    def one(r):
        r["calls"][1]["tokens"] = 1
    report = audit_archive(forged(batch["path"], tmp_path / "c.zip", edit={"episodes/00002.json": one}))
    assert ("episodes/00002.json: calls are not one 8-token prefill then 3 one-token decode calls of a batch of 2 "
            "(tokens count every sequence's)") in report.problems


def test_a_batch_reads_back_every_sequences_logits(batch, tmp_path):
    """Bug: a batch call's `logits_d2h_bytes` judged as one sequence's (vocab x 4) or not at
    all: the engine reads back batch x vocab x 4 (engine/episode.py), and a record stating one
    sequence's, with its total to match, audited AGREE."""
    def one_sequence(r):
        for call in r["calls"]:
            call["logits_d2h_bytes"] = 64 * 4
        r["logits_d2h_bytes"] = 64 * 4 * len(r["calls"])
    with ArchiveReader(batch["path"]) as r:
        assert {c["logits_d2h_bytes"] for c in json.loads(r.read_bytes("episodes/00002.json"))["calls"]} == {2 * 64 * 4}
    report = audit_archive(forged(batch["path"], tmp_path / "r.zip", edit={"episodes/00002.json": one_sequence}))
    assert report.problems == ["episodes/00002.json: call 0 logits_d2h_bytes 256 is not the 512 of its stored "
                               "logits (2 x 64 vocab x 4 bytes) (4 calls differ)"]


# ----------------------------------------------------------------------------- bounds on hostile records


def test_small_keeps_scalars_and_strings_up_to_1024_characters():
    # Bugs: the 1,024-character bound moved by one, a bool or None dropped, a list or a str
    # subclass kept (a hostile record's payload held in audit memory).
    for v in (None, True, 0, 1.5, "", "x" * 1024):
        assert _small(v) == v and type(_small(v)) is type(v)
    for v in ("x" * 1025, [1], {"a": 1}, (1,)):
        assert _small(v) == _DROPPED


def test_kept_tokens_are_bounded_per_sequence_and_per_batch():
    # Bugs: MAX_CONTINUATION + 1 or MAX_BATCH + 1 moved by one, a batch kept flat, ids not scrubbed.
    n = MAX_CONTINUATION + 1
    assert _kept_tokens(list(range(n + 5))) == list(range(n))
    assert _kept_tokens(list(range(n))) == list(range(n))
    assert _kept_tokens([1, "x" * 2000]) == [1, _DROPPED]
    seqs = [list(range(n + 2))] * (MAX_BATCH + 3)
    kept = _kept_tokens(seqs)
    assert len(kept) == MAX_BATCH + 1 and all(s == list(range(n)) for s in kept)
    assert _kept_tokens([[1, 2], [3, "x" * 2000]]) == [[1, 2], [3, _DROPPED]]
    assert _kept_tokens([]) == [] and _kept_tokens(None) is None and _kept_tokens("x" * 2000) == _DROPPED
    assert _kept_tokens([[1], 2]) == [_DROPPED, 2]  # not every element a list: a flat list of scalars


def test_retained_keeps_what_the_gates_and_database_read_and_bounds_the_rest():
    # Bugs: a RETAINED field dropped (the gates or the database comparison then read None), the
    # 64 memory or phase keys or 16 fidelity keys moved, a phase other than prefill/decode kept,
    # non-mapping phases/fidelity kept whole.
    rec = {k: f"v-{k}" for k in RETAINED if k != "tokens"} | {"tokens": [1, 2], "calls": [{"big": 1}], "other": 1}
    keys = {f"k{i:03d}": i for i in range(70)}
    rec |= {"memory": dict(keys), "phases": {"prefill": dict(keys), "decode": 3, "extra": {"a": 1}},
            "fidelity": dict(keys)}
    out = _retained(rec)
    assert set(out) == set(RETAINED) | {"memory", "phases", "fidelity"}
    assert all(out[k] == f"v-{k}" for k in RETAINED if k != "tokens") and out["tokens"] == [1, 2]
    assert out["memory"] == {f"k{i:03d}": i for i in range(64)}
    assert out["phases"] == {"prefill": {f"k{i:03d}": i for i in range(64)}, "decode": 3}
    assert out["fidelity"] == {f"k{i:03d}": i for i in range(16)}
    assert _retained({"phases": ["x"] * 3, "fidelity": ["y"], "memory": 5}) == {"phases": _DROPPED,
                                                                                 "fidelity": _DROPPED}
    assert _retained({"phases": None, "fidelity": None}) == {"phases": None, "fidelity": None}
    assert _retained({}) == {}


def test_problems_are_bounded_in_number_and_length():
    # Bugs: MAX_PROBLEMS or MAX_PROBLEM_CHARS moved by one, the rest not named.
    line = "x" * MAX_PROBLEM_CHARS
    assert _bounded([line]) == [line]
    assert _bounded([line + "yz"]) == [f"{line}... (2 more characters)"]
    assert _bounded(["p"] * MAX_PROBLEMS) == ["p"] * MAX_PROBLEMS
    assert _bounded(["p"] * (MAX_PROBLEMS + 3)) == ["p"] * MAX_PROBLEMS + ["... and 3 more problems"]


def test_an_incomplete_archive_names_its_first_ten_gaps(tmp_path):
    # Bug: the gaps named moved off ten, or the count of episodes recorded wrong.
    audit = _Audit(tmp_path / "a.zip", None)
    audit.note_incomplete([0, 1, 15], 20)
    assert audit.problems == [
        "archive incomplete and not a prefix of the plan: episodes [2, 3, 4, 5, 6, 7, 8, 9, 10, 11] are missing "
        "before later ones",
        "archive incomplete: 3 of 20 planned episodes recorded; verdicts from a partial screen are not the screen's"]
    assert audit.incomplete_notes == 1
    audit = _Audit(tmp_path / "a.zip", None)
    audit.note_incomplete([0, 1], 3)
    assert audit.problems == ["archive incomplete: 2 of 3 planned episodes recorded; verdicts from a partial "
                              "screen are not the screen's"]


def test_int8_row_bytes_are_the_hidden_values_and_a_scale():
    # Bug: an int8 row's size taken as the dtype's, or the scale left out.
    proto = expand(freeze(synthetic_protocol()).body)
    assert _int8_row_bytes(proto) == SHAPES["opt-2.7b"]["hidden"] + INT8_SCALE_BYTES
    raw = synthetic_protocol()
    raw["model"] = {"path": "models/x"}  # a checkpoint of unknown shape: no row size
    assert _int8_row_bytes(expand(freeze(raw).body)) is None


# ----------------------------------------------------------------------------- provenance


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    from packbench.core.provenance import Signer, generate_key

    key, _, _ = generate_key(tmp_path_factory.mktemp("key") / "key")
    return Signer.load(key)


def signed(src, dst, signer):
    """A copy of archive `src` at `dst`, signed as the dispatcher signs it."""
    import shutil

    from packbench.core.archive import file_sha256
    from packbench.core.canonical import sha256_hex

    shutil.copyfile(src, dst)
    with ArchiveReader(dst) as r:
        manifest = r.read_bytes(MANIFEST_NAME)
    signer.sign_archive(dst, file_sha256(dst), sha256_hex(manifest))
    return dst


def test_a_signed_archive_agrees_only_under_a_trusted_key(approx, tmp_path, signer):
    # Bugs: the manifest digest not passed (every signature "bad"), the status or key id not
    # recorded, an untrusted or missing signature still agreeing, `signature` ignored.
    path = signed(approx["path"], tmp_path / "s.zip", signer)
    report = audit_archive(path, trust=[signer.public_raw])
    assert report.agrees, report.problems
    assert report.record["signature"] == {"status": "valid", "key_id": signer.key_id}
    other = audit_archive(path, trust=[bytes(32)])
    assert other.record["signature"] == {"status": "unknown-signer", "key_id": signer.key_id}
    assert other.problems == [f"signature: valid, but by key {signer.key_id}, which is not trusted here"]
    assert "signature" not in audit_archive(path).record  # no trust given: provenance not checked
    moved = tmp_path / "elsewhere.sig"
    (tmp_path / "s.zip.sig").rename(moved)
    unsigned = audit_archive(path, trust=[signer.public_raw])
    assert unsigned.record["signature"] == {"status": "unsigned", "key_id": None} and not unsigned.agrees
    assert audit_archive(path, trust=[signer.public_raw], signature=moved).agrees


def test_a_signature_of_an_unreadable_or_unsealed_archive_never_holds(tmp_path, signer, monkeypatch):
    # Bugs: an unreadable file or one over the size bound given a signature status other than
    # bad-signature, or an unsealed archive's (absent or malformed) manifest digest checked as if it
    # were there.
    import packbench.core.archive.reader as archive_reader

    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"not a zip")
    report = audit_archive(junk, trust=[signer.public_raw])
    assert report.unreadable and report.record["signature"] == {"status": "bad-signature", "key_id": None}
    assert report.problems[-1] == "signature: the archive is unreadable, so no signature can hold for it"
    assert "signature" not in audit_archive(junk).record
    with monkeypatch.context() as m:
        m.setattr(archive_reader, "MAX_ARCHIVE_BYTES", 4)
        report = audit_archive(junk, trust=[signer.public_raw])
    assert report.unreadable and report.record["signature"] == {"status": "bad-signature", "key_id": None}
    assert report.problems[-1] == "signature: the archive is over the size bound, so no signature can hold for it"
    path = tmp_path / "open.zip"
    write_synthetic_screen(path, synthetic_protocol(prompts_n=1), seal=False)
    sig = signer.envelope("0" * 64, "0" * 64)
    (tmp_path / "open.zip.sig").write_bytes(canonical_json(sig))
    report = audit_archive(path, trust=[signer.public_raw])
    assert report.record["signature"]["status"] == "bad-signature"
    assert "signature: the archive has no readable manifest to check it against" in report.problems
    # a manifest.json that is no readable manifest: a signature over its bytes holds no more
    import zipfile

    from packbench.core.archive import file_sha256
    from packbench.core.canonical import sha256_hex

    malformed = tmp_path / "malformed.zip"
    with zipfile.ZipFile(malformed, "w") as zf:
        zf.writestr(MANIFEST_NAME, b'{"format_version": 99}')
    signer.sign_archive(malformed, file_sha256(malformed), sha256_hex(b'{"format_version": 99}'))
    report = audit_archive(malformed, trust=[signer.public_raw])
    assert report.record["signature"]["status"] == "bad-signature"
    assert report.problems[-1] == "signature: the archive has no readable manifest to check it against"


def test_max_mib_is_mebibytes_and_a_huge_non_zip_is_not_hashed(tmp_path, monkeypatch):
    # Bugs: max_mib's MiB taken as another unit (<< 21, >> 20) or capped by the default bound
    # (min for max), the size check of a file that is no zip off by one (a huge one hashed whole), the
    # screen id a command gives (`target`) not the one the line names.
    import packbench.core.archive.reader as archive_reader
    from packbench.core.archive import file_sha256

    monkeypatch.setattr(archive_reader, "MAX_ARCHIVE_BYTES", 1000)
    monkeypatch.setattr(ArchiveReader.__init__, "__kwdefaults__",
                        {**ArchiveReader.__init__.__kwdefaults__, "max_total_bytes": 1000})
    big = tmp_path / "big.zip"
    w = ArchiveWriter(big)
    w.add_bytes("blob.npy", np.random.default_rng(0).bytes(3 << 19))  # 1.5 MiB, stored
    w.seal({})
    size = big.stat().st_size
    # --max-mib 1 admits 1 MiB, not the file: one line with the size, the bound and a --max-mib that
    # admits the file and its JSON members' 48 MiB (core/archive/bounds.py)
    assert audit_archive(big, max_mib=1).problems == [
        f"the archive is {size} bytes ({size / (1 << 20):.1f} MiB), over the audit bound of {1 << 20} bytes (1 MiB), "
        f"so it was not read; only for an archive you trust, audit it with `packbench audit archive FILE --max-mib 50`"]
    assert audit_archive(big, max_mib=1, target="3").problems[0].endswith("`packbench audit 3 --max-mib 50`")
    report = audit_archive(big, max_mib=2)  # file and members within 2 MiB: opened and checked
    assert not report.unreadable and not any(" over the bound " in p or "too large" in p for p in report.problems)
    for size, hashed in ((1000, True), (1001, False)):
        junk = tmp_path / f"junk{size}.zip"
        junk.write_bytes(b"x" * size)
        report = audit_archive(junk)
        assert report.unreadable and report.record["archive_sha256"] == (file_sha256(junk) if hashed else None)
    report = audit_archive(tmp_path / "junk1000.zip", expected_sha256="0" * 64)
    assert report.problems[0] == f"archive SHA-256 {file_sha256(tmp_path / 'junk1000.zip')} differs from the database's {'0' * 64}"
    # a file within its bound whose members declare more than theirs: the same command, never the
    # record's scrubbed path ("packbench audit archive the archive")
    monkeypatch.setattr(archive_reader, "MAX_ARCHIVE_BYTES", 1 << 20)
    members_over = tmp_path / "members.zip"
    w = ArchiveWriter(members_over)
    w.add_bytes("blob.npy", bytes(3000))
    w.seal({})
    for target, named in ((None, "archive FILE"), ("3", "3")):
        (line,) = audit_archive(members_over, target=target).problems
        assert line.startswith("archive too large: the archive declares members of ") and \
            line.endswith(f"over the audit bound of 1000 bytes, so it was not read; only for an archive you trust, "
                          f"audit it with `packbench audit {named} --max-mib 1`"), line


# ----------------------------------------------------------------------------- the record itself


def test_the_record_of_an_archive_with_nothing_to_recompute(tmp_path, approx):
    # Bugs: a default of the record changed (audit_version, planned/episodes not 0, verdicts not
    # empty, complete or result not the fail-closed ones): the digest of every such audit moves,
    # and an unreadable archive could read as complete. The flags partial/rows_pending must stay
    # off when the file is unreadable, and nothing recomputed has no details (an empty mapping).
    from packbench.core.archive import file_sha256

    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"not a zip" * 20)
    report = audit_archive(junk)
    assert report.record == {"audit_version": 2, "archive_sha256": file_sha256(junk), "protocol_sha256": None,
                             "complete": False, "planned": 0, "episodes": 0, "verdicts": [],
                             "problems": report.problems, "result": "disagree"}
    assert report.unreadable and not report.partial and not report.rows_pending and not report.complete
    assert len(report.problems) == 1 and report.details == {}
    # sealed, but without a protocol: nothing planned, nothing recomputed
    path = forged(approx["path"], tmp_path / "np.zip", drop=("protocol.json",))
    report = audit_archive(path)
    assert report.problems == ["cannot recompute: no readable protocol.json"]
    assert {k: report.record[k] for k in ("protocol_sha256", "complete", "planned", "episodes", "verdicts")} == {
        "protocol_sha256": None, "complete": True, "planned": 0, "episodes": 0, "verdicts": []}
    assert not report.unreadable and not report.partial and not report.rows_pending and report.details == {}


def test_the_checkpoint_a_protocol_pins_must_be_the_one_measured(tmp_path):
    # Bugs: the pinned digest not compared (a screen of another checkpoint agrees), compared
    # when the protocol pins none, or a start record that is no mapping crashing the check;
    # a checkpoint of unknown shape given a row size.
    raw = synthetic_protocol()
    raw["model"] = {"path": "models/x", "sha256": "a" * 64}
    pinned = expand(freeze(raw).body)
    cases = [({"model_sha256": "a" * 64}, []),
             ({"model_sha256": "b" * 64},
              [f"worker.json: the checkpoint measured has digest {'b' * 64!r}, the protocol pins {'a' * 64}"]),
             (None, [f"worker.json: the checkpoint measured has digest None, the protocol pins {'a' * 64}"]),
             ({"model_sha256": 5}, ["worker.json: the checkpoint measured has digest 5, the protocol pins " + "a" * 64,
                                    "worker.json: model_sha256 5 is not 64 lowercase hex digits"])]
    for start, lines in cases:
        audit = _Audit(tmp_path / "a.zip", None)
        audit.complete = True  # a sealed archive: one without a start record measured nothing it may
        assert audit.check_start(start, pinned) is None  # no synthetic shape: no row size
        assert audit.problems == lines
    unpinned = expand(freeze(synthetic_protocol()).body)
    audit = _Audit(tmp_path / "a.zip", None)
    assert audit.check_start({"model_sha256": "b" * 64}, unpinned) == opt_row_bytes()
    assert audit.check_start(["not", "a", "start"], unpinned) is None and audit.problems == []


def opt_row_bytes() -> int:
    from packbench.core.metrics import opt_bytes

    return opt_bytes(**SHAPES["opt-2.7b"], dtype="float16")["row_bytes"]


# ----------------------------------------------------------------------------- one episode's checks


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("exact") / "exact.zip"
    return {**write_synthetic_screen(path, synthetic_protocol()), "path": path}


def int8_protocol():
    raw = synthetic_protocol()
    raw.pop("schema")
    raw["conditions"] = [{"name": "dense-stream", "policy": "dense-stream"},
                         {"name": "dense-int8", "policy": "dense-stream", "params": {"weights": "int8"}},
                         {"name": "packet", "policy": "packet", "params": {"weights": "int8"}}]
    return expand(freeze(raw).body)


def test_int8_rows_are_judged_by_their_own_row_size(exact):
    # Bugs: an int8 condition's rows judged by the dtype's row size (its condition not looked
    # up, its weights not read), the known row size not passed (the first row would fix any
    # size), or the size a first row fixed not kept for the next episode.
    from packbench.core.audit import _episode_problems

    proto = int8_protocol()
    dtype_row, int8_row = opt_row_bytes(), SHAPES["opt-2.7b"]["hidden"] + INT8_SCALE_BYTES
    packet = next(e for e in exact["episodes"] if e["condition"] == "packet")

    def moved(row, condition):
        calls = [dict(c, h2d_weight_bytes=[r * row for r in c["rows_copied"]]) for c in packet["calls"]]
        return {**packet, "condition": condition, "calls": calls}

    def copies(rec, row_bytes):
        return [p for p in _episode_problems("e", rec, rec["logits"], proto, row_bytes) if "impossible copy" in p]

    assert copies(moved(int8_row, "packet"), [dtype_row, int8_row]) == []
    assert copies(moved(int8_row, "dense-int8"), [dtype_row, int8_row]) == []
    assert len(copies(moved(dtype_row, "packet"), [dtype_row, int8_row])) == 3  # at most three named
    assert copies(moved(dtype_row, "dense-stream"), [dtype_row, int8_row]) == []
    wrong = copies(moved(dtype_row + 2, "dense-stream"), [dtype_row, int8_row])  # consistent, but not the model's
    assert wrong[0].startswith("e: impossible copy: call 0 layer 0 moved ") and wrong[0].endswith(f" of {dtype_row} B")
    fixed = [None, None]  # a checkpoint of unknown shape: the first row seen fixes the size, per slot
    assert copies(moved(6, "dense-stream"), fixed) == [] and fixed == [6, None]
    assert copies(moved(10, "packet"), fixed) == [] and fixed == [6, 10]
    assert len(copies(moved(8, "dense-stream"), fixed)) == 3


def test_one_episodes_ledger_shape_and_passes_lines(exact):
    # Bugs: a malformed ledger's first three problems not the ones named (or more named),
    # the separate-passes check run as passes together, a batch-1 call shape worded as a batch's.
    from packbench.core.audit import _episode_problems

    proto = expand(freeze(synthetic_protocol()).body)
    rec = next(e for e in exact["episodes"] if e["condition"] == "packet")
    row = [opt_row_bytes(), None]
    junk = {**rec, "calls": [{"x": 1}] * 2}
    assert _episode_problems("e", junk, rec["logits"], proto, row) == [
        "e: malformed call ledger: call 0 phase None is not prefill or decode; call 0 tokens None is not an integer "
        ">= 1; call 0 layers None is not an integer >= 1"]
    calls = [dict(c) for c in rec["calls"]]
    calls[1]["tokens"] = 2
    problems = _episode_problems("e", {**rec, "calls": calls}, rec["logits"], proto, row)
    assert "e: calls are not one 8-token prefill then 3 one-token decode calls" in problems
    raw = synthetic_protocol()
    raw.update(schema=7, passes="separate")
    separate = expand(freeze(raw).body)
    assert ("e: separate passes but no recording pass figures (passes is missing or not a mapping)"
            in _episode_problems("e", rec, rec["logits"], separate, row))
    assert _episode_problems("e", rec, rec["logits"], proto, row) == []


def test_an_expert_sections_figures_are_replayed_beside_the_ledgers_lines(exact):
    # Bugs: an episode's `experts` section (an expert cache or forecast) not replayed from its
    # routing (its key misspelt, the section not passed), or its lines replacing those before them.
    from packbench.core.audit import _episode_problems
    from packbench.core.expert_cache import episode_figures

    proto = expand(freeze(synthetic_protocol()).body)
    rec = next(e for e in exact["episodes"] if e["condition"] == "packet")
    row = [opt_row_bytes(), None]
    layers, calls = len(rec["calls"][0]["active_rows"]), len(rec["calls"])
    routes = [[None] * layers for _ in range(calls)]  # every layer without experts: nothing routed
    figures = episode_figures(routes, [c["phase"] for c in rec["calls"]], capacity=1, rule="lru")
    experts = {"routes": routes, "counted": [[None] * layers for _ in range(calls)], "capacity": 1, "rule": "lru",
               **figures}
    assert _episode_problems("e", {**rec, "experts": experts}, rec["logits"], proto, row) == []
    forged = {**rec, "experts": {**experts, "hits": 3}, "h2d_weight_bytes": rec["h2d_weight_bytes"] + 1}
    assert _episode_problems("e", forged, rec["logits"], proto, row) == [
        f"e: stored h2d_weight_bytes {rec['h2d_weight_bytes'] + 1} != {rec['h2d_weight_bytes']} recomputed from "
        f"the call ledger",
        "e: experts hits 3 is not the replay of its routing's 0"]


def test_prompts_that_cannot_be_recomputed_are_named(tmp_path):
    # Bug: a protocol whose prompts cannot be drawn for the logits' vocabulary (ids from [4, 4))
    # crashes the audit or passes unnamed.
    proto = expand(freeze(synthetic_protocol()).body)
    audit = _Audit(tmp_path / "a.zip", None)
    audit.check_prompts({"prompts": [[2] * 8, [2] * 8]}, proto, vocab=4)
    (line,) = audit.problems
    assert line.startswith("cannot recompute the prompts: ") and len(line) > len("cannot recompute the prompts: ")


def test_token_problems_each_line_at_its_boundary():
    # Bugs: logits with a row too many or too few taken as covering the calls (and then blamed on
    # the tokens), a vocabulary of one refused, integer logits accepted, a bool token taken for an id.
    from packbench.core.audit import _token_problems

    logits = np.float32([[0.0, 1.0], [2.0, 0.0]])
    assert _token_problems("e", [1, 0], logits, 2) == []
    assert _token_problems("e", [0, 0], np.zeros((2, 1), np.float32), 2) == []  # a vocabulary of one
    for bad in (np.vstack([logits, logits[:1]]), logits[:1], logits.astype(np.int32), logits[None], None,
                np.zeros((2, 0), np.float32)):
        assert _token_problems("e", [1, 0], bad, 2) == ["e: logits do not cover every call"]
    assert _token_problems("e", [1], logits, 2) == ["e: tokens do not cover every call"]
    assert _token_problems("e", (1, 0), logits, 2) == ["e: tokens do not cover every call"]
    assert _token_problems("e", [True, 0], logits, 2) == ["e: tokens are not all integers"]
    assert _token_problems("e", [0, 0], logits, 2) == ["e: tokens are not the argmax of the stored logits"]


def test_one_sample_is_a_sampled_run_and_a_record_without_memory_has_no_peak(tmp_path):
    # Bugs: a sampler that took exactly one sample not counted as sampling (its missing trace
    # unnamed); a record whose memory is no mapping crashing the trace check.
    audit = _Audit(tmp_path / "a.zip", None)
    audit.check_sampled("episodes/00000.json", "traces/00000.npy", {"sampler": {"samples": 1}}, set())
    audit.check_sampled("episodes/00001.json", "traces/00001.npy", {"sampler": {"samples": 0}, "memory": 3}, set())
    audit.check_sampled("episodes/00002.json", "traces/00002.npy", {"sampler": {"samples": 1}}, {"traces/00002.npy"})
    assert audit.problems == ["episodes/00000.json: the run sampled memory but traces/00000.npy is missing"]
    audit = _Audit(tmp_path / "a.zip", None)
    audit.check_trace("traces/00000.npy", np.array([[0.0, 7.0], [1.0, 9.0]]), {"memory": 5})
    assert audit.problems == ["traces/00000.npy: peak_sampled_bytes None != 9 recomputed from the trace"]


@pytest.mark.parametrize("field, value", [("condition", "dense-stream"), ("role", "scored"), ("prompt", 1),
                                          ("prompt", 0.0)])
def test_a_record_must_match_its_plan_entrys_condition_role_and_prompt(exact, tmp_path, field, value):
    # Bug: one of the plan entry's fields left out of the comparison (the record of another
    # condition, role or prompt accepted in this entry's place); 0.0 is not the prompt 0.
    report = audit_archive(forged(exact["path"], tmp_path / "p.zip",
                                  edit={"episodes/00001.json": lambda r: r.update({field: value})}))
    assert "episodes/00001.json does not match plan entry 1" in report.problems, report.problems


def test_traces_are_read_as_float64_and_only_when_present(exact, tmp_path):
    # Bugs: a trace read without its dtype check (float32 seconds and bytes accepted), or a
    # trace looked for on an episode that kept none (a run that did not sample needs none).
    with ArchiveReader(exact["path"]) as r:
        trace = r.read_array("traces/00000.npy")
    report = audit_archive(forged(exact["path"], tmp_path / "f.zip",
                                  replace={"traces/00000.npy": npy(trace.astype(np.float32))}))
    assert any(p.startswith("cannot read traces/00000.npy") for p in report.problems), report.problems

    def unsampled(rec):
        rec["memory"]["peak_sampled_bytes"] = None
    report = audit_archive(forged(exact["path"], tmp_path / "n.zip", edit={"episodes/00002.json": unsampled},
                                  drop=("traces/00002.npy",)))
    assert not any("traces/00002.npy" in p for p in report.problems), report.problems


def test_a_failed_episode_is_not_an_unknown_status(exact, tmp_path):
    # Bug: the status check reads another field or word, so a failed episode is named as
    # "neither ok nor failed" (and an unknown status is not).
    def fail(r):
        r.update(status="failed", error="RuntimeError: boom")
    report = audit_archive(forged(exact["path"], tmp_path / "f.zip", edit={"episodes/00003.json": fail},
                                  drop=("logits/00003.npy", "traces/00003.npy")))
    assert not any("neither ok nor failed" in p for p in report.problems), report.problems
    report = audit_archive(forged(exact["path"], tmp_path / "w.zip",
                                  edit={"episodes/00003.json": lambda r: r.update(status="weird")}))
    assert "episodes/00003.json: status 'weird' is neither ok nor failed" in report.problems


def test_teacher_forced_logits_are_read_as_float32_of_the_episodes_shape(approx, tmp_path):
    # Bug: forced/ read without the dtype or shape check (float64 or 3-D teacher-forced logits
    # of a batch-1 screen accepted).
    with ArchiveReader(approx["path"]) as r:
        forced = r.read_array("forced/00003.npy")
    for k, bad in enumerate((forced.astype(np.float64), forced[None])):
        report = audit_archive(forged(approx["path"], tmp_path / f"f{k}.zip", replace={"forced/00003.npy": npy(bad)}))
        assert any(p.startswith("cannot read forced/00003.npy") for p in report.problems), report.problems


def test_an_interrupted_screen_is_compared_with_the_database_as_far_as_it_went(exact, tmp_path):
    # Bugs: an incomplete archive's verdicts never compared with the database's rows (a partial
    # screen's forged rows pass), or archived episodes without rows not counted (the attempt
    # reads as disagreeing instead of as rows pending `db reconcile`), or rows said pending where
    # none lacks (a partial screen whose rows are all stored, a sealed one that agrees).
    data = members(exact["path"])
    w = ArchiveWriter(tmp_path / "cut.zip")
    for name, raw in data.items():
        if name != MANIFEST_NAME and not name.startswith("verdicts") and not name.endswith(("00003.json", "00003.npy")) \
                and not any(name.endswith(f"{i:05d}.{ext}") for i in range(3, 10) for ext in ("json", "npy")):
            w.add_bytes(name, raw)
    path = tmp_path / "cut.zip"
    rows = db_episodes(exact)[:2]  # episodes 0, 1 stored; 2 archived without a row
    report = audit_archive(path, db_episodes=rows)
    assert report.rows_pending and not report.partial and report.problems[-1] == "database lacks episode 2"
    forged_verdicts = [dict(v, value=123.0) for v in exact["verdicts"]]
    report = audit_archive(path, db_verdicts=forged_verdicts)
    assert any(p.startswith("database verdict ") and " differs in " in p for p in report.problems), report.problems
    report = audit_archive(path, db_verdicts=[])  # no rows yet: nothing to compare
    assert report.partial and not report.rows_pending
    report = audit_archive(path, db_episodes=db_episodes(exact)[:3])  # every archived episode has its row
    assert report.partial and not report.rows_pending
    sealed = audit_archive(exact["path"], db_episodes=db_episodes(exact))
    assert sealed.agrees and not sealed.partial and not sealed.rows_pending


def test_a_source_freeze_the_manifest_and_worker_agree_on_is_no_problem(exact, tmp_path):
    # Bug: the manifest's source_freeze read under another key (every archive whose worker
    # states a freeze then disagrees).
    import json as _json

    data = members(exact["path"])
    worker = _json.loads(data["worker.json"])
    worker["source_freeze"] = {"git_commit": "abc"}
    w = ArchiveWriter(tmp_path / "ok.zip")
    for name, raw in data.items():
        if name != MANIFEST_NAME:
            w.add_bytes(name, canonical_json(worker) if name == "worker.json" else raw)
    manifest = _json.loads(data[MANIFEST_NAME])
    w.seal({**{k: v for k, v in manifest.items() if k not in ("members", "format_version")},
            "source_freeze": {"git_commit": "abc"}})
    report = audit_archive(tmp_path / "ok.zip")
    assert report.agrees, report.problems


def test_ten_strays_are_named_without_a_rest_line(exact, tmp_path):
    # Bug: the "... and N more" line written at exactly ten strays ("and 0 more").
    strays = {f"notes/{i}.json": b"{}" for i in range(10)}
    report = audit_archive(forged(exact["path"], tmp_path / "s.zip", extra=strays))
    assert report.problems == [f"member {n!r} is not part of the archive of this plan" for n in strays]
    strays["notes/10.json"] = b"{}"  # eleven: ten named, the rest counted
    report = audit_archive(forged(exact["path"], tmp_path / "e.zip", extra=strays))
    assert report.problems[10:] == ["... and 1 more members that are not part of the archive of this plan"]


def test_a_record_of_a_condition_the_protocol_lacks_is_named_not_a_crash(exact, tmp_path):
    # Bug: the tier looked up for a condition the protocol does not have (a KeyError: the audit
    # ends in "cannot audit" instead of naming the record).
    report = audit_archive(forged(exact["path"], tmp_path / "g.zip",
                                  edit={"episodes/00001.json": lambda r: r.update(condition="ghost")}))
    assert "episodes/00001.json does not match plan entry 1" in report.problems
    assert not any(p.startswith("cannot audit") for p in report.problems), report.problems


def test_a_plan_or_worker_record_verify_names_is_not_read(exact, tmp_path):
    # Bugs: plan.json or worker.json read although verify() named it altered (an altered member
    # that still parses would be trusted); a complete archive without a plan not named.
    from tests.core.test_audit import exact_zip

    data = members(exact["path"])
    plan = data["plan.json"].replace(b'"prompts":[[2,', b'"prompts":[[3,', 1)  # still JSON, same size
    assert plan != data["plan.json"]
    report = audit_archive(exact_zip(tmp_path / "p.zip", {**data, "plan.json": plan}))
    assert "plan.json is missing or unreadable" in report.problems
    assert not any(p.startswith("plan.json prompts") for p in report.problems), report.problems
    worker = data["worker.json"].replace(b'"synthetic"', b'"synthetiK"')
    assert worker != data["worker.json"]
    report = audit_archive(exact_zip(tmp_path / "w.zip", {**data, "worker.json": worker}))
    assert "altered member worker.json (sha256 mismatch)" in report.problems
    assert "the manifest's environment differs from worker.json's" not in report.problems
    report = audit_archive(forged(exact["path"], tmp_path / "n.zip", drop=("plan.json",)))
    assert "plan.json is missing or unreadable" in report.problems


def test_a_sealed_archive_without_worker_json_does_not_agree(exact, tmp_path):
    """Bug caught: a sealed archive resealed without worker.json audited AGREE unless a capacity
    gate read the start record (the quickstart screen did): the start's byte counts, the
    environment the manifest must repeat, each episode's device parameter bytes and the checkpoint
    digest went unchecked, and nothing named the missing member the driver always writes."""
    report = audit_archive(forged(exact["path"], tmp_path / "w.zip", drop=("worker.json",)))
    assert "worker.json is missing or unreadable" in report.problems
    assert not report.agrees


def test_an_archive_over_the_bounds_is_not_recomputed(exact, monkeypatch):
    # Bug: the too-large check not stopping the audit (the work the bounds cap is done anyway).
    monkeypatch.setattr(ArchiveReader.__init__, "__kwdefaults__",
                        {**ArchiveReader.__init__.__kwdefaults__, "max_total_bytes": 1000})
    report = audit_archive(exact["path"])
    assert len(report.problems) == 1 and report.problems[0].startswith("archive too large")
    assert report.record["planned"] == 0 and report.record["protocol_sha256"] is None


@pytest.mark.parametrize("kept", [("protocol.json",), ("protocol.json", "plan.json"),
                                  ("protocol.json", "plan.json", "worker.json")])
def test_an_archive_interrupted_before_any_episode_is_partial(exact, tmp_path, kept):
    # Bugs: an unsealed archive without plan.json blamed for lacking it; prompts recomputed with
    # no vocabulary known yet (no episode has logits): either makes it more than partial.
    data = members(exact["path"])
    w = ArchiveWriter(tmp_path / "early.zip")
    for name in kept:
        w.add_bytes(name, data[name])
    report = audit_archive(tmp_path / "early.zip")
    assert report.partial, report.problems


def test_an_attempt_refused_its_pinned_checkpoint_before_worker_json_is_partial(tmp_path):
    """A worker refuses a checkpoint whose digest is not the protocol's pin before it writes
    worker.json: its archive holds protocol.json alone. The audit blamed the missing start record
    ('the checkpoint measured has digest None, the protocol pins ...'), so the failed attempt
    audited DISAGREE and every later `audit --all` exited 1; a sealed archive still must not."""
    raw = synthetic_protocol()
    raw["model"] = {"path": "/nowhere/ckpt", "sha256": "f" * 64}
    w = ArchiveWriter(tmp_path / "refused.zip")
    w.add_bytes("protocol.json", canonical_json(freeze(raw).body))
    report = audit_archive(tmp_path / "refused.zip")
    assert report.partial, report.problems
    assert not any("the protocol pins" in p for p in report.problems), report.problems
    w.seal({})
    assert any("digest None, the protocol pins" in p for p in audit_archive(tmp_path / "refused.zip").problems)


def test_a_failed_first_episode_and_a_batchs_prompts(exact, batch, tmp_path):
    # Bugs: the vocabulary taken from an episode without logits (the first one failed: a crash),
    # or never from a batch's 3-D logits (a batch screen's forged prompts then go unchecked).
    def fail(r):
        r.update(status="failed", error="RuntimeError: boom")
    report = audit_archive(forged(exact["path"], tmp_path / "f.zip", edit={"episodes/00000.json": fail},
                                  drop=("logits/00000.npy", "traces/00000.npy")))
    assert not any(p.startswith("cannot audit") for p in report.problems), report.problems

    def swap(plan):
        plan["prompts"][0][3] = (plan["prompts"][0][3] + 1) % 64
    report = audit_archive(forged(batch["path"], tmp_path / "b.zip", edit={"plan.json": swap}))
    assert "plan.json prompts are not the protocol's prompts" in report.problems, report.problems


def test_the_audits_table_says_which_way_a_fidelity_bound_compares(tmp_path):
    # Bug: the audit's record keeps no verdict detail (its digest must not move), so `packbench
    # audit`'s table printed every fidelity threshold as an upper bound: "<= 0.7" for min_top1,
    # where `results` said ">= 0.7". The recomputed details ride beside the record.
    from packbench.cli.summary import verdict_table
    from packbench.core.audit import detail_key

    raw = approximate_protocol()
    raw["gates"]["fidelity"] = {"min_top1": 0.7}
    path = tmp_path / "top1.zip"
    write_synthetic_screen(path, raw)
    report = audit_archive(path)
    assert report.agrees, report.problems
    (fid,) = [v for v in report.record["verdicts"] if v["gate"] == "fidelity"]
    assert "detail" not in fid and "(bound >= 0.7" in report.details[detail_key(fid)]
    row = next(line for line in verdict_table([{**v, "detail": report.details.get(detail_key(v))}
                                                for v in report.record["verdicts"]]).splitlines()
               if line.startswith("fidelity"))
    assert ">= 0.7" in row and "<= 0.7" not in row


def test_each_verdicts_detail_rides_under_its_own_gate_condition_and_phase(exact):
    # Bug: verdicts of one gate and condition at several phases (acquisition over all, prefill,
    # decode) kept under one key, so the table showed one phase's detail beside every phase's row.
    from packbench.core.audit import detail_key

    report = audit_archive(exact["path"])
    assert report.agrees, report.problems
    want = {f"{v['gate']}|{v['condition']}|{v['phase']}": v["detail"] for v in exact["verdicts"] if v.get("detail")}
    assert {k.split("|")[2] for k in want if k.startswith("acquisition|")} == {"all", "prefill", "decode"}
    assert report.details == want
    assert all(report.details[detail_key(v)] == v["detail"] for v in exact["verdicts"] if v.get("detail"))


def test_a_traced_screens_exact_episodes_have_their_traces_read_and_replayed(tmp_path):
    # Bugs: a traced protocol's trace members never looked for (the episode's tier misread, the
    # check run for the competitor's approximate episodes instead of the exact ones), the check
    # handed another member, record, reader or protocol than the episode's, or the trace members
    # the plan allows (an exact episode's) mistaken.
    from packbench.core.archive import episode_members
    from packbench.core.trace import Trace, TraceCall, TraceModel, trace_bytes

    raw = approximate_protocol()  # dense-stream (exact) and an int8 competitor (approximate: no trace)
    raw["trace"] = True
    screen = write_synthetic_screen(tmp_path / "t.zip", raw)
    exact_episodes = [e for e in screen["episodes"] if e["condition"] == "dense-stream"]
    missing = "{}: the protocol says trace: true, the episode's trace is missing or unreadable"
    assert audit_archive(tmp_path / "t.zip").problems == [
        missing.format(episode_members(e["plan_index"]).active) for e in exact_episodes]

    rec = exact_episodes[0]
    name = episode_members(rec["plan_index"]).active
    shape = SHAPES["opt-2.7b"]
    layers = len(rec["calls"][0]["active_rows"])

    def trace(row_bytes):  # three rows of every layer active in every call
        model = TraceModel(family="opt", unit="row", layers=layers, units=shape["ffn"], unit_bytes=row_bytes,
                           hidden=shape["hidden"], dtype="float16")
        return trace_bytes(Trace(model=model, calls=[TraceCall(0, c["phase"], c["tokens"]) for c in rec["calls"]],
                                 sets=[[np.arange(3, dtype=np.int64)] * layers for _ in rec["calls"]]))

    rest = [missing.format(episode_members(e["plan_index"]).active) for e in exact_episodes[1:]]
    # dense-stream moves every row of a layer: a trace of the model's row size replays to the record
    agreeing = forged(tmp_path / "t.zip", tmp_path / "a.zip", extra={name: trace(opt_row_bytes())})
    assert audit_archive(agreeing).problems == rest
    recorded, replayed = shape["ffn"] * opt_row_bytes(), shape["ffn"] * 2 * opt_row_bytes()
    doubled = forged(tmp_path / "t.zip", tmp_path / "d.zip", extra={name: trace(2 * opt_row_bytes())})
    assert audit_archive(doubled).problems == [
        f"{name}: call {c} layer 0 h2d_weight_bytes: recorded {recorded}, the trace's replay {replayed}"
        for c in range(len(rec["calls"]))] + rest
    # a competitor runs a model of its own: a trace member beside its episode is not of this plan
    competitor = episode_members(next(e for e in screen["episodes"] if e["condition"] == "int8")["plan_index"]).active
    stray = forged(tmp_path / "t.zip", tmp_path / "s.zip", extra={name: trace(opt_row_bytes()), competitor: b"x"})
    assert audit_archive(stray).problems == [f"member {competitor!r} is not part of the archive of this plan"] + rest
