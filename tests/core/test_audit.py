"""The auditor on real archives of a synthetic screen: agreement, repeat digests, recomputation
catching consistent forgeries (manifest re-sealed), partial archives, database comparisons and
hostile input."""

import io
import json
import os
import shutil
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter
from packbench.core.audit import audit_archive
from packbench.core.canonical import canonical_json
from packbench.core.errors import ArchiveError


@pytest.fixture(scope="module")
def screen(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("screen") / "screen.zip"
    out = write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2))
    return {**out, "path": path}


def members(path: Path) -> dict[str, bytes]:
    with ArchiveReader(path) as r:
        return {n: r.read_bytes(n) for n in r.names}


def reseal(src: Path, dst: Path, *, replace=None, drop=(), seal=True, manifest=None) -> Path:
    """A consistent forgery: members replaced (bytes, or a function of the parsed JSON), and a
    manifest re-computed over them, so verify() finds nothing and only recomputation can."""
    data = members(src)
    w = ArchiveWriter(dst)
    for name, raw in data.items():
        if name == MANIFEST_NAME or name in drop:
            continue
        new = (replace or {}).get(name, raw)
        if callable(new):
            obj = json.loads(raw)
            new(obj)  # edits in place
            new = canonical_json(obj)
        w.add_bytes(name, new)
    if seal:
        old = json.loads(data[MANIFEST_NAME])
        w.seal({k: v for k, v in old.items() if k not in ("members", "format_version")} | (manifest or {}))
    return dst


def exact_zip(path: Path, items: dict[str, bytes]) -> Path:
    """Members written by zipfile in the writer's exact layout (fixed date, mode, method), in order:
    what a forger who knows the format writes by hand."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, raw in items.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = (stat.S_IFREG | 0o644) << 16
            zf.writestr(info, raw, compress_type=zipfile.ZIP_STORED if name.endswith('.npy') else zipfile.ZIP_DEFLATED)
    return path


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def db_rows(screen: dict) -> tuple[list[dict], list[dict]]:
    """Verdicts and episodes as the database hands them back (floats, interval tuples, flat columns)."""
    verdicts = [{"gate": v["gate"], "condition": v["condition"], "phase": v["phase"], "passed": v["passed"],
                 "value": v["value"], "threshold": v["threshold"],
                 "interval": tuple(v["interval"]) if v["interval"] else None} for v in screen["verdicts"]]
    episodes = [{"plan_index": e["plan_index"], "condition": e["condition"], "role": e["role"], "prompt": e["prompt"],
                 "status": e["status"], "error": None, "tokens": list(e["tokens"]), "n_tokens": len(e["tokens"]),
                 "wall_s": e["wall_s"], "call_s": e["call_s"], "h2d_weight_bytes": e["h2d_weight_bytes"],
                 "h2d_index_bytes": e["h2d_index_bytes"], "d2h_bytes": e["d2h_bytes"],
                 "prefill_h2d_bytes": e["phases"]["prefill"]["h2d_bytes"],
                 "decode_h2d_bytes": e["phases"]["decode"]["h2d_bytes"],
                 "prefill_call_s": e["phases"]["prefill"]["call_s"], "decode_call_s": e["phases"]["decode"]["call_s"],
                 "peak_allocated_bytes": e["memory"]["peak_allocated_bytes"],
                 "peak_sampled_bytes": e["memory"]["peak_sampled_bytes"]} for e in screen["episodes"]]
    return verdicts, episodes


# ----------------------------------------------------------------------------- agreement


def test_audit_agrees_and_recomputes_every_verdict(screen):
    report = audit_archive(screen["path"], expected_sha256=screen["sha256"])
    assert report.agrees and report.complete and report.problems == []
    rec = report.record
    assert rec["episodes"] == rec["planned"] == len(screen["entries"]) == 10
    assert rec["archive_sha256"] == screen["sha256"]
    assert rec["verdicts"] == [{k: v[k] for k in rec["verdicts"][0]} for v in screen["verdicts"]]
    gates = {v["gate"] for v in rec["verdicts"]}
    assert gates == {"faithfulness", "resources", "capacity", "acquisition", "runtime", "useful_latency"}
    assert all(v["passed"] for v in rec["verdicts"])


def test_repeat_audits_give_one_digest_wherever_the_archive_lies(screen, tmp_path):
    a = audit_archive(screen["path"])
    copy = tmp_path / "elsewhere" / "renamed.zip"
    copy.parent.mkdir()
    shutil.copy(screen["path"], copy)
    b = audit_archive(copy)
    assert a.digest == b.digest == audit_archive(screen["path"]).digest
    assert a.record == b.record
    assert str(tmp_path) not in json.dumps(b.record)


def test_database_rows_agree(screen):
    verdicts, episodes = db_rows(screen)
    report = audit_archive(screen["path"], expected_sha256=screen["sha256"], db_verdicts=verdicts,
                           db_episodes=episodes)
    assert report.agrees, report.problems


def test_database_disagreements_are_named(screen):
    verdicts, episodes = db_rows(screen)
    verdicts[0]["passed"] = not verdicts[0]["passed"]
    lost = verdicts.pop()
    episodes[3]["tokens"] = [0] * len(episodes[3]["tokens"])
    episodes[4]["decode_h2d_bytes"] += 1
    extra = dict(episodes[0], plan_index=99)
    report = audit_archive(screen["path"], expected_sha256="0" * 64, db_verdicts=verdicts,
                           db_episodes=episodes[1:] + [extra])
    p = report.problems
    assert not report.agrees
    assert f"archive SHA-256 {screen['sha256']} differs from the database's {'0' * 64}" in p
    assert any(s.startswith(f"database verdict {verdicts[0]['gate']}/{verdicts[0]['condition']}/") and
               "differs in passed" in s for s in p)
    assert f"database lacks verdict {lost['gate']}/{lost['condition']}/{lost['phase']}" in p
    assert "database lacks episode 0" in p and "database has episode 99 that the archive lacks" in p
    assert any(s.startswith("database episode 3 tokens") for s in p)
    assert any(s.startswith("database episode 4 decode_h2d_bytes") for s in p)


# ----------------------------------------------------------------------------- consistent forgeries


def _bump_total(rec):
    rec["h2d_weight_bytes"] += 4


def _bump_phase(rec):
    rec["phases"]["prefill"]["h2d_bytes"] -= 1


def _tokens(rec):
    rec["tokens"][0] = (rec["tokens"][0] + 1) % 64


def _drop_call(rec):
    rec["calls"].pop()


def _junk_ledger(rec):
    rec["calls"][0]["rows_copied"] = "many"


def _flip_verdict(vs):
    vs[0]["passed"] = not vs[0]["passed"]


def _verdict_episodes(vs):
    vs[0]["episodes"] = vs[0]["episodes"][:-1]


def _swap_plan(plan):
    plan["entries"][2]["condition"], plan["entries"][3]["condition"] = (plan["entries"][3]["condition"],
                                                                        plan["entries"][2]["condition"])


def _plan_prompts(plan):
    plan["prompts"][1][3] = (plan["prompts"][1][3] + 1) % 64


def _not_cpu_first(worker):
    worker["start"]["cpu_first"] = False


def _loosen(body):
    body["gates"]["acquisition"][0]["max_ratio"] = 0.01


_REFUSED = "cannot recompute: protocol.json is not a valid frozen protocol: protocol field "


# Each expectation is the start of a problem line as `packbench audit` prints it.
@pytest.mark.parametrize("member, forge, expected", [
    ("episodes/00003.json", _bump_total, "episodes/00003.json: stored h2d_weight_bytes"),
    ("episodes/00003.json", _bump_phase, "episodes/00003.json: stored phases.prefill.h2d_bytes"),
    ("episodes/00004.json", _tokens, "episodes/00004.json: tokens are not the argmax of the stored logits"),
    ("episodes/00005.json", _drop_call, "episodes/00005.json: calls are not one 8-token prefill then 3"),
    ("episodes/00005.json", _junk_ledger, "episodes/00005.json: malformed call ledger: call 0 rows_copied"),
    ("episodes/00006.json", lambda r: r.update(prompt=1 - r["prompt"]), "episodes/00006.json does not match plan entry 6"),
    ("episodes/00006.json", lambda r: r.update(status="maybe"),
     "episodes/00006.json: status 'maybe' is neither ok nor failed"),
    ("verdicts.json", _flip_verdict, "archive verdict acquisition/packet/all differs in passed"),
    ("verdicts.json", _verdict_episodes, "archive verdict acquisition/packet/all differs in episodes"),
    ("verdicts.json", lambda vs: vs.pop(), "archive lacks verdict useful_latency/packet/all"),
    ("plan.json", _swap_plan, "plan.json is not the plan of protocol.json (first difference at entry 2"),
    ("plan.json", _plan_prompts, "plan.json prompts are not the protocol's prompts"),
    ("plan.json", lambda p: p.update(prompts=[[1]]), "plan.json prompts are not 2 prompts of 8 token ids"),
    ("worker.json", _not_cpu_first, "archive verdict capacity/dense-stream/all differs in passed"),
    ("protocol.json", _loosen, "manifest protocol_sha256 does not match protocol.json"),
    ("protocol.json", lambda b: b.pop("recording"),
     "protocol.json is not in frozen form (it does not re-validate to itself)"),
    ("protocol.json", lambda b: b.update(order="spiral"), "cannot recompute: protocol.json is not a valid frozen protocol"),
    ("protocol.json", lambda b: b.update(repetitions=10**12),
     f"{_REFUSED}`repetitions`: 1000000000000 is not an integer in [1, 100000]"),  # refused before planning
    ("protocol.json", lambda b: b.update(repetitions=50_000), f"{_REFUSED}`repetitions`: the plan would hold"),
])
def test_recomputation_catches_what_hashes_cannot(screen, tmp_path, member, forge, expected):
    forged = reseal(screen["path"], tmp_path / "forged.zip", replace={member: forge})
    with ArchiveReader(forged) as r:
        assert r.verify() == []  # every member matches the re-sealed manifest
    report = audit_archive(forged)
    assert not report.agrees
    assert any(p.startswith(expected) for p in report.problems), report.problems


def test_forged_logits_change_the_recomputed_verdict(screen, tmp_path):
    with ArchiveReader(screen["path"]) as r:
        logits = r.read_array("logits/00003.npy")
    logits = logits.copy()
    i = int(np.argmin(logits[0]))
    logits[0, i] = np.nextafter(logits[0, i], np.float32(-np.inf))  # one ulp, argmax unchanged
    forged = reseal(screen["path"], tmp_path / "forged.zip", replace={"logits/00003.npy": _npy(logits)})
    report = audit_archive(forged)
    assert any(p.startswith("archive verdict faithfulness/packet/all differs in passed, value") for p in report.problems)
    v = next(v for v in report.record["verdicts"] if v["gate"] == "faithfulness" and v["condition"] == "packet")
    assert not v["passed"] and v["value"] > 0


def readbacks(value):
    """A consistent forgery of every call's `logits_d2h_bytes` (`value(call index)`): the stored
    total is the forged ledger's, so only the logits' shape can tell."""
    def forge(rec):
        for k, call in enumerate(rec["calls"]):
            call["logits_d2h_bytes"] = value(k)
        rec["logits_d2h_bytes"] = sum(c["logits_d2h_bytes"] for c in rec["calls"])
    return forge


@pytest.mark.parametrize("value, line", [
    (lambda k: 0, "call 0 logits_d2h_bytes 0 is not the 256 of its stored logits (1 x 64 vocab x 4 bytes) "
                  "(4 calls differ)"),
    (lambda k: 256 if k else 10**9, "call 0 logits_d2h_bytes 1000000000 is not the 256 of its stored logits "
                                    "(1 x 64 vocab x 4 bytes)"),
    (lambda k: 512 if k == 3 else 256, "call 3 logits_d2h_bytes 512 is not the 256 of its stored logits "
                                       "(1 x 64 vocab x 4 bytes)"),
])
def test_logits_readback_bytes_are_those_of_the_stored_logits(screen, tmp_path, value, line):
    """Bug: no call's `logits_d2h_bytes` was checked, so an archive stating any readback (0, a
    billion, one call's doubled) with a ledger total to match audited AGREE."""
    name = "episodes/00003.json"
    forged = reseal(screen["path"], tmp_path / "forged.zip", replace={name: readbacks(value)})
    assert audit_archive(forged).problems == [f"{name}: {line}"]


# ----------------------------------------------------------------------------- partial archives


def partial(src: Path, dst: Path, keep) -> Path:
    """An interrupted screen: the members `keep` selects, in write order, no manifest."""
    data = members(src)
    w = ArchiveWriter(dst)
    for name, raw in data.items():
        if name != MANIFEST_NAME and keep(name):
            w.add_bytes(name, raw)
    return dst


def test_unsealed_archive_is_audited_and_reported_incomplete(screen, tmp_path):
    path = tmp_path / "unsealed.zip"
    write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2), seal=False)
    report = audit_archive(path, db_verdicts=[])
    assert not report.agrees and not report.complete
    assert report.problems == ["archive incomplete: no manifest.json (interrupted screen?)",
                               ("archive incomplete: 10 of 10 planned episodes recorded; "
                                "verdicts from a partial screen are not the screen's")]


def test_interrupted_screen_keeps_what_it_recorded(screen, tmp_path):
    def keep(name):
        early = name < "episodes/00004" or name in ("logits/00000.npy", "logits/00001.npy", "logits/00002.npy")
        return not name.startswith(("episodes/", "logits/", "verdicts")) or early

    path = partial(screen["path"], tmp_path / "partial.zip", keep)  # episode 3's logits never written
    _, episodes = db_rows(screen)
    report = audit_archive(path, db_verdicts=[], db_episodes=episodes[:3])
    assert not report.complete and report.record["episodes"] == 3 and report.record["planned"] == 10
    assert report.problems == ["archive incomplete: no manifest.json (interrupted screen?)",
                               ("archive incomplete: 3 of 10 planned episodes recorded; "
                                "verdicts from a partial screen are not the screen's")]
    assert report.record["verdicts"] and not any(v["passed"] for v in report.record["verdicts"]
                                                 if v["gate"] in ("acquisition", "runtime"))  # fail closed
    assert audit_archive(path, db_verdicts=[], db_episodes=episodes[:3]).digest == report.digest


def test_partial_archive_with_a_gap_is_named(screen, tmp_path):
    def keep(name):
        return not name.startswith(("episodes/00001", "logits/00001", "verdicts"))

    report = audit_archive(partial(screen["path"], tmp_path / "gap.zip", keep))
    assert "archive incomplete and not a prefix of the plan: episodes [1] are missing before later ones" in report.problems


def test_partial_archive_without_a_plan(screen, tmp_path):
    report = audit_archive(partial(screen["path"], tmp_path / "early.zip", lambda n: n == "protocol.json"))
    assert not report.complete and report.record["protocol_sha256"] and report.record["episodes"] == 0
    assert report.problems[0] == "archive incomplete: no manifest.json (interrupted screen?)"
    assert report.problems[-1].startswith("archive incomplete: 0 of 10 planned episodes recorded")
    empty = tmp_path / "empty.zip"
    ArchiveWriter(empty)
    assert audit_archive(empty).problems == ["archive incomplete: no manifest.json (interrupted screen?)"]


def test_a_complete_archive_missing_records_is_not_merely_incomplete(screen, tmp_path):
    forged = reseal(screen["path"], tmp_path / "f.zip", drop=("episodes/00002.json", "logits/00002.npy", "verdicts.json"))
    p = audit_archive(forged).problems
    assert "episode 2 has no readable record (episodes/00002.json)" in p and "verdicts.json is missing" in p


# ----------------------------------------------------------------------------- hostile input


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_not_a_zip_is_a_problem_not_a_crash_and_names_no_path(tmp_path):
    a, b = tmp_path / "a.zip", tmp_path / "sub" / "b.zip"
    b.parent.mkdir()
    for p in (a, b):
        p.write_bytes(b"definitely not a zip" * 50)
    ra, rb = audit_archive(a), audit_archive(b)
    assert not ra.agrees and ra.problems[0].startswith("the archive is not a readable zip archive")
    assert ra.digest == rb.digest
    with pytest.raises(ArchiveError, match="no archive at"):
        audit_archive(tmp_path / "missing.zip")


def test_hostile_members_are_named_and_nothing_is_written(screen, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = tmp_path / "hostile.zip"
    shutil.copy(screen["path"], path)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    link = zipfile.ZipInfo("link")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("../evil.json", b"{}")
        zf.writestr("/abs.json", b"{}")
        zf.writestr(link, b"/etc/passwd")
        zf.writestr("bomb.bin", bytes(20 << 20), compress_type=zipfile.ZIP_DEFLATED)
    before = tree(tmp_path)
    report = audit_archive(path)
    assert not report.agrees
    p = report.problems
    assert any(s.startswith("unsafe member name ../evil.json") for s in p)
    assert any(s.startswith("unsafe member name /abs.json") for s in p)
    assert "symlink member link" in p and "extra member bomb.bin" in p
    assert tree(tmp_path) == before and not (tmp_path / "evil.json").exists()


def test_hostile_records_never_crash_the_auditor(screen, tmp_path):
    junk = {
        "episodes/00001.json": canonical_json([1, 2, 3]),
        "episodes/00002.json": canonical_json({"plan_index": "two"}),
        "episodes/00003.json": b"\xff\xfe not json",
        "worker.json": canonical_json({"start": ["not", "a", "dict"]}),
        "logits/00004.npy": b"\x93NUMPY garbage",
        "logits/00005.npy": _npy(np.zeros((4, 0), np.float32)),
        "plan.json": canonical_json({"entries": "none"}),
    }
    forged = reseal(screen["path"], tmp_path / "junk.zip", replace=junk)
    report = audit_archive(forged)
    p = report.problems
    assert not report.agrees
    assert "episodes/00001.json is not a record" in p
    assert "episodes/00002.json does not match plan entry 2" in p
    assert any(s.startswith("cannot read episodes/00003.json: member episodes/00003.json of archive the archive "
                            "is not valid JSON") for s in p)
    assert any(s.startswith("cannot read logits/00004.npy") for s in p)
    assert "plan.json has no list of entries" in p
    assert "episodes/00005.json: logits do not cover every call" in p
    assert str(tmp_path) not in json.dumps(report.record)


def test_pickled_logits_are_refused_and_never_run(screen, tmp_path):
    import pickle

    marker = tmp_path / "pickle-ran"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|O", "fortran_order": False, "shape": (1,)})
    forged = reseal(screen["path"], tmp_path / "pickle.zip",
                    replace={"logits/00003.npy": header.getvalue() + pickle.dumps([Evil()])})
    report = audit_archive(forged)
    assert any(p.startswith("cannot read logits/00003.npy") and "pickled object array" in p for p in report.problems)
    assert "episodes/00003.json: logits do not cover every call" in report.problems
    assert not marker.exists() and not report.agrees


def test_a_manifest_that_lies_about_sizes_is_named_before_reading(screen, tmp_path):
    data = members(screen["path"])
    manifest = json.loads(data[MANIFEST_NAME])
    manifest["members"]["logits/00002.npy"]["size"] = 10**12
    path = tmp_path / "lying.zip"
    exact_zip(path, {name: canonical_json(manifest) if name == MANIFEST_NAME else raw for name, raw in data.items()})
    report = audit_archive(path)
    assert any(p.startswith(f"size mismatch for member logits/00002.npy: manifest says {10**12}")
               for p in report.problems)
    # The member is not trusted: episode 2 is audited without logits.
    assert "episodes/00002.json: logits do not cover every call" in report.problems



def test_memory_trace_must_back_the_stated_sampled_peak(tmp_path):
    """A record's peak_sampled_bytes is recomputed from its traces/ member."""
    import numpy as np

    from packbench.core.audit import _Audit

    trace = np.array([[0.0, 100.0], [0.005, 300.0], [0.01, 200.0]])
    for stated, ok in ((300, True), (299, False), (None, False)):
        audit = _Audit(tmp_path / "a.zip", "0" * 64)
        audit.check_trace("traces/00000.npy", trace, {"memory": {"peak_sampled_bytes": stated}})
        assert (audit.problems == []) is ok, (stated, audit.problems)
    audit = _Audit(tmp_path / "a.zip", "0" * 64)
    audit.check_trace("traces/00000.npy", np.zeros((0, 2)), {"memory": {"peak_sampled_bytes": None}})
    assert audit.problems == []  # on the CPU nothing is sampled
    audit.check_trace("traces/00000.npy", np.zeros(3), {"memory": {}})
    assert "(samples, 2)" in audit.problems[0]


def test_a_member_named_inside_another_problem_is_still_trusted(screen, tmp_path):
    """The auditor trusts by Problem.member, not by the words of the messages: a hostile entry
    whose name spells out intact members does not make the audit drop them (it did while the
    auditor split its messages into words)."""
    path = tmp_path / "words.zip"
    shutil.copy(screen["path"], path)
    hostile = "x protocol.json plan.json episodes/00003.json logits/00003.npy verdicts.json"
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(hostile, b"{}")
    report = audit_archive(path)
    assert f"unsafe member name {hostile} (has characters outside [A-Za-z0-9._/-])" in report.problems
    # The appended entry also breaks the exact layout (manifest not last, zipfile's own header fields).
    assert all(p.startswith("layout: ") or p.startswith(f"member {hostile!r} is not part of the archive")
               for p in report.problems if not p.startswith("unsafe member name"))
    clean = audit_archive(screen["path"]).record
    assert report.record["protocol_sha256"] == clean["protocol_sha256"]
    assert report.record["episodes"] == clean["episodes"] == 10
    assert report.record["verdicts"] == clean["verdicts"]
    assert not report.agrees  # the hostile entry itself is still a problem


@pytest.mark.parametrize("member, expected", [
    ("logits/00003.npy", "episodes/00003.json: logits do not cover every call"),
    ("episodes/00004.json", "episode 4 has no readable record (episodes/00004.json)"),
    ("plan.json", "plan.json is missing or unreadable"),
    ("protocol.json", "cannot recompute: no readable protocol.json"),
])
def test_exactly_the_members_verify_names_are_distrusted(screen, tmp_path, member, expected):
    """An altered member (sha256 mismatch) is not used for recomputation; its neighbours are."""
    data = members(screen["path"])
    path = tmp_path / "altered.zip"
    exact_zip(path, {name: raw[:-1] + bytes([raw[-1] ^ 1]) if name == member else raw for name, raw in data.items()})
    report = audit_archive(path)
    assert f"altered member {member} (sha256 mismatch)" in report.problems
    assert expected in report.problems
    if member != "protocol.json":
        assert report.record["protocol_sha256"] is not None
