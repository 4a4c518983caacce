"""The audit against the database, field by field: every verdict field (passed, value,
threshold, interval, episodes, detail) and every audited episode column the database holds
is compared, so a database changed in any one of them, by as little as one ulp, disagrees with
the archive; and an unchanged database agrees."""

import math

import numpy as np
import pytest

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.audit import EPISODE_FIELDS, audit_archive
from packbench.core.record import FIELDS_BY_NAME, token_count


@pytest.fixture(scope="module")
def screen(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("screen") / "screen.zip"
    out = write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2))
    return {**out, "path": path}


def db_verdicts(screen) -> list[dict]:
    """Verdict rows as the database returns them: floats, an interval as a tuple, episodes, detail."""
    return [{**v, "interval": tuple(v["interval"]) if v["interval"] else None, "episodes": list(v["episodes"])}
            for v in screen["verdicts"]]


def db_episodes(screen) -> list[dict]:
    """One row per archived episode holding every audited column, read from the worker's record."""
    rows = []
    for e in screen["episodes"]:
        row = {"plan_index": e["plan_index"]}
        for column, path in EPISODE_FIELDS.items():
            value = e
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if FIELDS_BY_NAME[column].stored_as == "length":
                value = token_count(value)
            if value is not None:
                row[column] = list(value) if isinstance(value, tuple) else value
        rows.append(row)
    return rows


# energy_j included: the synthetic screen's records carry a GPU worker's reading. Left out, the
# audit of every GPU screen disagreed unseen ("database episode 0 energy_j 23.1 != archive None":
# the auditor dropped the record's energy before comparing), as the H100's first MoE check did.
EXACT_COLUMNS = [c for c in EPISODE_FIELDS if not c.startswith("fidelity_")]


def _up(x):
    return math.nextafter(x, math.inf)


# field -> an edit of one stored verdict that changes only that field (the smallest change)
EDITS = {
    "passed": lambda v: v.update(passed=not v["passed"]),
    "value": lambda v: v.update(value=_up(v["value"]) if v["value"] is not None else 0.0),
    "threshold": lambda v: v.update(threshold=_up(v["threshold"]) if v["threshold"] is not None else 0.0),
    "interval": lambda v: v.update(interval=None if v["interval"] is None else (v["interval"][0], _up(v["interval"][1]))),
    "episodes": lambda v: v.update(episodes=v["episodes"] + [max(v["episodes"], default=0) + 100]),
    "detail": lambda v: v.update(detail=v["detail"] + " "),
    "phase-as-int": lambda v: v.update(passed=int(v["passed"])),  # 1 is not True: a verdict is a bool
}


def test_an_unchanged_database_agrees(screen):
    report = audit_archive(screen["path"], expected_sha256=screen["sha256"], db_verdicts=db_verdicts(screen),
                           db_episodes=db_episodes(screen))
    assert report.agrees, report.problems
    # every audited column is compared; an exact screen has no fidelity figures
    assert set(db_episodes(screen)[0]) == {"plan_index", *EXACT_COLUMNS}


@pytest.mark.parametrize("field", list(EDITS))
def test_every_verdict_field_changed_in_the_database_disagrees(screen, field):
    verdicts = db_verdicts(screen)
    changed = [v for v in verdicts if field != "interval" or v["interval"] is not None]
    assert changed, "the screen has no verdict with that field"
    for v in changed:
        EDITS[field](v)
    report = audit_archive(screen["path"], db_verdicts=verdicts)
    assert not report.agrees
    name = "passed" if field == "phase-as-int" else field
    named = {p.split(" differs in ")[0] for p in report.problems if p.endswith("]") and f" differs in {name}:" in p}
    assert named == {f"database verdict {v['gate']}/{v['condition']}/{v['phase']}" for v in changed}
    assert len(report.problems) == len(changed)  # nothing else is blamed


@pytest.mark.parametrize("column", EXACT_COLUMNS)
def test_every_audited_episode_column_changed_in_the_database_disagrees(screen, column):
    rows = db_episodes(screen)
    row = next(r for r in rows if column in r)
    old = row[column]
    row[column] = (old + [1] if isinstance(old, list) else f"{old}x" if isinstance(old, str)
                   else _up(old) if isinstance(old, float) else old + 1)
    report = audit_archive(screen["path"], db_episodes=rows)
    assert report.problems == [f"database episode {row['plan_index']} {column} {row[column]!r} != archive {old!r}"]


# ----------------------------------------------------------------------------- the comparison's own lines


def test_stored_verdicts_that_are_not_verdicts_duplicates_gaps_and_extras_are_named(screen):
    verdicts = db_verdicts(screen)
    for bad in ("not a list", verdicts[:2] + ["not a verdict"]):
        report = audit_archive(screen["path"], db_verdicts=bad)
        assert report.problems == ["database verdicts are not a list of verdicts"]
    twice, lost = verdicts[0], verdicts[-1]
    extra = {**verdicts[1], "gate": "made-up", "condition": "x", "phase": "all"}
    report = audit_archive(screen["path"], db_verdicts=verdicts[:-1] + [dict(twice), extra])
    key = f"{twice['gate']}/{twice['condition']}/{twice['phase']}"
    assert report.problems == [f"database has verdict {key} twice",
                               f"database lacks verdict {lost['gate']}/{lost['condition']}/{lost['phase']}",
                               "database has an extra verdict made-up/x/all"]
    changed = db_verdicts(screen)
    changed[0]["value"] = 123.5
    (line,) = audit_archive(screen["path"], db_verdicts=changed).problems
    assert line == f"database verdict {key} differs in value: recomputed [{verdicts[0]['value']!r}] vs stored [123.5]"


def test_a_stored_detail_in_the_old_wording_agrees_and_a_missing_one_does_not(screen):
    verdicts = db_verdicts(screen)
    acq = next(v for v in verdicts if v["gate"] == "acquisition")
    assert acq["detail"].endswith(" vs dense-stream") and " pairs " in acq["detail"]
    acq["detail"] = acq["detail"].replace(" pairs ", " prompts ")  # packbench 0.1's words
    assert audit_archive(screen["path"], db_verdicts=verdicts).agrees
    acq["detail"] = None
    (line,) = audit_archive(screen["path"], db_verdicts=verdicts).problems
    assert " differs in detail: recomputed " in line and line.endswith("vs stored [None]")


def test_stored_episode_rows_that_are_not_rows_and_extra_rows_in_order(screen):
    rows = db_episodes(screen)
    for bad in ("not a list", rows[:2] + ["not a row"]):
        assert audit_archive(screen["path"], db_episodes=bad).problems == ["database episodes are not a list of rows"]
    extra = [dict(rows[0], plan_index=99), dict(rows[0], plan_index="x"), dict(rows[0], plan_index=100)]
    assert audit_archive(screen["path"], db_episodes=rows + extra).problems == [
        "database has episode x that the archive lacks", "database has episode 100 that the archive lacks",
        "database has episode 99 that the archive lacks"]  # sorted by repr: "'x'", "100", "99"; no TypeError


def test_an_interrupted_prefix_is_partial_and_a_gap_is_not(screen, tmp_path):
    from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter

    with ArchiveReader(screen["path"]) as r:
        data = {n: r.read_bytes(n) for n in r.names}

    def cut(keep, name):
        w = ArchiveWriter(tmp_path / name)
        for member, raw in data.items():
            if member != MANIFEST_NAME and keep(member):
                w.add_bytes(member, raw)
        return audit_archive(tmp_path / name)

    def episode(member):
        return int(member.split("/")[1].split(".")[0]) if member.startswith(("episodes/", "logits/", "traces/")) \
            else None

    prefix = cut(lambda m: not m.startswith("verdicts") and (episode(m) is None or episode(m) < 3), "prefix.zip")
    assert prefix.partial and not prefix.complete and prefix.record["episodes"] == 3
    gap = cut(lambda m: not m.startswith("verdicts") and (episode(m) is None or episode(m) >= 9), "gap.zip")
    assert not gap.partial
    assert ("archive incomplete and not a prefix of the plan: episodes [0, 1, 2, 3, 4, 5, 6, 7, 8] are missing "
            "before later ones") in gap.problems
    one = cut(lambda m: not m.startswith("verdicts") and episode(m) != 1, "one.zip")
    assert "archive incomplete and not a prefix of the plan: episodes [1] are missing before later ones" in one.problems
    assert not one.partial


def test_no_problem_names_the_archives_path_however_it_was_reached(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.zip").write_bytes(b"not a zip at all")
    (tmp_path / "link").symlink_to(real)
    for path in (tmp_path / "link" / "a.zip", real / "a.zip"):
        report = audit_archive(path)
        assert report.problems and not any(str(tmp_path) in p or "a.zip" in p for p in report.problems), \
            report.problems


def resealed(src, dst, name, edit, drop=()):
    """A consistent forgery: one JSON member edited (members in `drop` left out), the manifest
    recomputed over the result."""
    import json

    from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter
    from packbench.core.canonical import canonical_json

    with ArchiveReader(src) as r:
        data = {n: r.read_bytes(n) for n in r.names}
    w = ArchiveWriter(dst)
    for member, raw in data.items():
        if member == MANIFEST_NAME or member in drop:
            continue
        if member == name:
            obj = json.loads(raw)
            edit(obj)
            raw = canonical_json(obj)
        w.add_bytes(member, raw)
    old = json.loads(data[MANIFEST_NAME])
    w.seal({k: v for k, v in old.items() if k not in ("members", "format_version")})
    return dst


@pytest.mark.parametrize("edit, line", [
    (lambda p: p["entries"].pop(), "plan.json is not the plan of protocol.json (first difference at entry 9; "
                                   "9 entries, the protocol plans 10)"),
    (lambda p: p["entries"][4].update(prompts=[0, 1]), "plan.json is not the plan of protocol.json (first "
                                                       "difference at entry 4; 10 entries, the protocol plans 10)"),
    (lambda p: p["prompts"][1].pop(), "plan.json prompts are not 2 prompts of 8 token ids"),
    (lambda p: p.update(prompts=None), "plan.json prompts are not 2 prompts of 8 token ids"),
])
def test_a_forged_plan_json_is_named(screen, tmp_path, edit, line):
    report = audit_archive(resealed(screen["path"], tmp_path / "forged.zip", "plan.json", edit))
    assert line in report.problems and not any(p.startswith("cannot audit") for p in report.problems), \
        report.problems


def test_token_id_prompts_are_recomputed_too(tmp_path):
    raw = synthetic_protocol(prompts_n=2, repetitions=1)
    raw["prompts"] = {"token_ids": [[2] + list(range(10, 17)), [2] + list(range(20, 27))]}
    out = write_synthetic_screen(tmp_path / "ids.zip", raw)
    assert audit_archive(tmp_path / "ids.zip").agrees

    def swap(plan):
        plan["prompts"][0][3] = plan["prompts"][0][3] + 1  # the same shape, another id
    report = audit_archive(resealed(tmp_path / "ids.zip", tmp_path / "forged.zip", "plan.json", swap))
    assert "plan.json prompts are not the protocol's prompts" in report.problems and out["sha256"]


def test_a_records_device_parameter_bytes_must_be_the_workers(screen, tmp_path):
    theirs = screen["start"]["device_param_bytes"]

    def mine(value):
        return lambda rec: rec["memory"].update(device_param_bytes=value)
    same = audit_archive(resealed(screen["path"], tmp_path / "same.zip", "episodes/00001.json", mine(theirs)))
    assert same.agrees, same.problems
    other = audit_archive(resealed(screen["path"], tmp_path / "other.zip", "episodes/00001.json", mine(theirs + 1)))
    assert other.problems == [f"episodes/00001.json: memory.device_param_bytes {theirs + 1} != worker.json's {theirs}"]


def test_a_run_that_sampled_memory_keeps_its_trace(screen, tmp_path):
    report = audit_archive(resealed(screen["path"], tmp_path / "a.zip", "episodes/00002.json", lambda rec: None,
                                    drop=("traces/00002.npy",)))
    assert "episodes/00002.json: the run sampled memory but traces/00002.npy is missing" in report.problems

    def samples_only(rec):  # no sampled peak stated, but the sampler says it took samples
        rec["memory"]["peak_sampled_bytes"] = None
        rec["sampler"] = {"samples": 3}
    report = audit_archive(resealed(screen["path"], tmp_path / "b.zip", "episodes/00002.json", samples_only,
                                    drop=("traces/00002.npy",)))
    assert "episodes/00002.json: the run sampled memory but traces/00002.npy is missing" in report.problems

    def no_samples(rec):
        rec["memory"]["peak_sampled_bytes"] = None
        rec["sampler"] = {"samples": 0}
    report = audit_archive(resealed(screen["path"], tmp_path / "c.zip", "episodes/00002.json", no_samples,
                                    drop=("traces/00002.npy",)))
    assert not any("the run sampled memory" in p for p in report.problems)


def replaced(src, dst, name, raw):
    """A consistent forgery of one member's bytes (the manifest recomputed)."""
    import json

    from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter

    with ArchiveReader(src) as r:
        data = {n: r.read_bytes(n) for n in r.names}
    w = ArchiveWriter(dst)
    for member, old in data.items():
        if member != MANIFEST_NAME:
            w.add_bytes(member, raw if member == name else old)
    w.seal({k: v for k, v in json.loads(data[MANIFEST_NAME]).items() if k not in ("members", "format_version")})
    return dst


def npy(arr) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def test_a_record_must_match_its_plan_entry_in_value_and_json_type(screen, tmp_path):
    for k, edit in enumerate((lambda r: r.update(plan_index=1.0), lambda r: r.update(plan_index=True),
                                lambda r: r.update(prompts=[0]))):
        report = audit_archive(resealed(screen["path"], tmp_path / f"p{k}.zip", "episodes/00001.json", edit))
        assert "episodes/00001.json does not match plan entry 1" in report.problems, report.problems


def test_logits_and_traces_of_the_wrong_form_are_named(screen, tmp_path):
    from packbench.core.archive import ArchiveReader

    with ArchiveReader(screen["path"]) as r:
        logits = r.read_array("logits/00001.npy")
        trace = r.read_array("traces/00000.npy")
    for k, bad in enumerate((logits.astype(np.float64), logits[None])):  # float64; a batch's 3-D in batch 1
        report = audit_archive(replaced(screen["path"], tmp_path / f"l{k}.zip", "logits/00001.npy", npy(bad)))
        assert not report.agrees and any("logits/00001.npy" in p for p in report.problems), report.problems
    wide = np.concatenate([trace, trace[:, :1]], axis=1)  # (samples, 3)
    report = audit_archive(replaced(screen["path"], tmp_path / "t.zip", "traces/00000.npy", npy(wide)))
    assert "traces/00000.npy: a memory trace is (samples, 2) [seconds, bytes]" in report.problems
    empty = np.zeros((0, 2), np.float64)
    report = audit_archive(replaced(screen["path"], tmp_path / "e.zip", "traces/00000.npy", npy(empty)))
    assert any(p.startswith("traces/00000.npy: empty trace but peak_sampled_bytes ") for p in report.problems)


def test_the_start_records_bytes_must_add_up_and_match_the_synthetic_shape(screen, tmp_path):
    start = screen["start"]
    p, d, h = start["param_bytes"], start["device_param_bytes"], start["host_outgoing_bytes"]

    def forge(name, **changes):
        return audit_archive(resealed(screen["path"], tmp_path / name, "worker.json",
                                      lambda w: w["start"].update(**changes))).problems

    problems = forge("p.zip", param_bytes=p + 1)
    assert f"worker.json: param_bytes {p + 1} != device_param_bytes {d} + host_outgoing_bytes {h}" in problems
    assert f"worker.json: param_bytes {p + 1} is not the {p} of a opt-2.7b model in float16" in problems
    problems = forge("d.zip", device_param_bytes=d + 1, host_outgoing_bytes=h - 1)  # adds up, wrong shape
    assert not any("!= device_param_bytes" in x for x in problems)
    assert f"worker.json: device_param_bytes {d + 1} is not the {d} of a opt-2.7b model in float16" in problems
    assert f"worker.json: host_outgoing_bytes {h - 1} is not the {h} of a opt-2.7b model in float16" in problems
    problems = forge("s.zip", model_sha256="ABC")
    assert "worker.json: model_sha256 'ABC' is not 64 lowercase hex digits" in problems
    assert not any("model_sha256" in x for x in forge("ok.zip", model_sha256="0" * 64))
    problems = forge("b.zip", param_bytes=True)  # a bool is no byte count: no sum is checked
    assert not any("!= device_param_bytes" in x for x in problems)


def test_records_cross_check_the_manifest_and_the_layout(screen, tmp_path):
    import json

    from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter

    with ArchiveReader(screen["path"]) as r:
        data = {n: r.read_bytes(n) for n in r.names}
    manifest = json.loads(data[MANIFEST_NAME])

    def sealed(name, *, extra=(), worker=None, **fields):
        w = ArchiveWriter(tmp_path / name)
        for member, raw in data.items():
            if member != MANIFEST_NAME:
                w.add_bytes(member, raw if member != "worker.json" or worker is None else worker)
        for member in extra:
            w.add_bytes(member, b"{}")
        w.seal({**{k: v for k, v in manifest.items() if k not in ("members", "format_version")}, **fields})
        return audit_archive(tmp_path / name).problems

    assert sealed("env.zip", environment={"host": "elsewhere"}) == ["the manifest's environment differs from worker.json's"]
    worker = json.loads(data["worker.json"])
    worker["source_freeze"] = {"git_commit": "abc"}
    from packbench.core.canonical import canonical_json

    assert sealed("freeze.zip", worker=canonical_json(worker)) == [
        "the manifest's source_freeze differs from worker.json's"]
    assert "the manifest's source_freeze is not a mapping" in sealed("notmap.zip", source_freeze=[1])
    strays = [f"episodes/{i:05d}.json" for i in range(50, 62)] + ["notes/x.json"]  # forced/: exact screens have none
    problems = sealed("strays.zip", extra=strays)
    assert problems == [f"member {n!r} is not part of the archive of this plan" for n in strays[:10]] + [
        "... and 3 more members that are not part of the archive of this plan"]


def test_every_audited_column_is_kept_for_the_database_comparison():
    """The audit keeps a record's RETAINED fields (and memory, phases, fidelity) after checking
    it and compares the database's columns with what it kept: a column whose record field is not
    kept compares the database against None. energy_j was not kept, so every GPU screen (the only
    ones with a reading) audited DISAGREE."""
    from packbench.core.audit import RETAINED
    from packbench.core.record import AUDITED

    kept = set(RETAINED) | {"memory", "phases", "fidelity"}
    assert {column for column, path in AUDITED.items() if path[0] not in kept} == set()
