"""Sweeps (service/sweep.py): queued all at once or not at all, every refusal before anything is
stored, and a bounded number of points."""

from __future__ import annotations

import re
import sqlite3

import pytest

import packbench.db.labels
from packbench.core.errors import ProtocolError
from packbench.service.sweep import MAX_POINTS, parse_axes, points, submit_sweep, with_value
from tests.service.screens import interrupt_on_call, protocol_file


def rows(tmp_path) -> dict[str, int]:
    """Rows of the tables a submit writes, read around the Store (conftest.py's database file)."""
    with sqlite3.connect(tmp_path / "packbench.db") as db:
        return {t: db.execute(f"select count(*) from {t}").fetchone()[0]
                for t in ("protocols", "screens", "screen_tags")}


def test_a_sweep_is_queued_in_one_transaction(store, tmp_path, monkeypatch):
    """An interrupt part-way (recording the third point) queues no point. The bug caught: one
    transaction per point and another for its sweep label, which left the points before the
    interrupt queued, the last of them without its sweep id."""
    calls, real = interrupt_on_call(monkeypatch, packbench.db.labels, "set_sweep", 3)
    path = protocol_file(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        submit_sweep(store, path, parse_axes(["continuation_tokens=2,3,4,5"]), name="sw", tags={"k": "v"})
    assert len(calls) == 3 and rows(tmp_path) == {"protocols": 0, "screens": 0, "screen_tags": 0}
    monkeypatch.setattr(packbench.db.labels, "set_sweep", real)
    sweep_id, queued = submit_sweep(store, path, parse_axes(["continuation_tokens=2,3"]), name="sw", tags={"k": "v"},
                                    priority=5)
    screens = store.find_screens(sweep_id=sweep_id)
    assert sorted(s.id for s in screens) == [i for i, _ in queued] and len(screens) == 2
    assert {s.name for s in screens} == {"sw"} and {s.priority for s in screens} == {5}
    assert [s.point for s in sorted(screens, key=lambda s: s.id)] == [{"continuation_tokens": 2},
                                                                       {"continuation_tokens": 3}]
    assert store.screen_tags([queued[0][0]]) == {queued[0][0]: {"k": "v"}}


def test_a_date_value_is_refused_before_anything_is_queued(store, tmp_path):
    """`--sweep name=2001-01-01` (YAML reads a date) queued its first screen, then exited 70 on
    `Object of type date is not JSON serializable` when recording the point. The bugs caught: a
    value no JSON holds got past parse_axes, and a swept `name` was accepted though each point's
    name replaces it."""
    for spec, words in (("dtype=float32,2001-01-01", "--sweep dtype: datetime.date(2001, 1, 1) is a YAML date"),
                        ("seed=!!binary aGk=", "is a YAML bytes"),
                        ("name=a,b", "--sweep name: each point is named for its values")):
        with pytest.raises(ProtocolError, match=re.escape(words)):
            submit_sweep(store, protocol_file(tmp_path), parse_axes([spec]))
    assert rows(tmp_path) == {"protocols": 0, "screens": 0, "screen_tags": 0}


def test_the_points_are_bounded_before_any_is_frozen():
    """The bug caught: no bound on the product, so three --sweep options of 100 values each set
    out to freeze and queue a million protocols (1,024 took 8 s to plan)."""
    values = ",".join(str(v) for v in range(1, 101))
    assert len(parse_axes([f"prefix_tokens={values}", "dtype=float32,float16,bfloat16"])[0].values) == 100
    with pytest.raises(ProtocolError, match=rf"^--sweep: 100 x 100 x 100 = 1000000 points, more than {MAX_POINTS}; "):
        parse_axes([f"prefix_tokens={values}", f"continuation_tokens={values}", f"repetitions={values}"])


def test_a_field_under_a_mapping_the_file_leaves_out_can_be_swept(tmp_path):
    """docs/api.md's own example, `conditions.1.params.gather=host,device`, was refused on a
    protocol whose packet condition gives no params (the quickstart's): 'the protocol has no
    conditions.1.params'. And `conditions.01` was a second axis over conditions.1."""
    got = points(protocol_file(tmp_path), parse_axes(["conditions.1.params.gather=host,device"]))
    assert [p.frozen.body["conditions"][1]["params"] for p in got] == [{"gather": "host"}, {"gather": "device"}]
    assert with_value({"a": {"b": None}}, "a.b.c", 1) == {"a": {"b": {"c": 1}}}
    with pytest.raises(ProtocolError, match="the protocol has no conditions.01"):
        with_value({"conditions": [{}, {}]}, "conditions.01.params.gather", "host")


@pytest.mark.parametrize("how", ["exit", "keyboard"])
@pytest.mark.parametrize("keep", [False, True])
def test_an_interrupted_sweep_wait_gives_back_the_points_not_run(store, tmp_path, capsys, how, keep):
    """`submit --sweep ... --wait` stopped by SIGINT/SIGTERM at its second of four points: the
    running point and the two not reached are cancelled, or with --keep-queued all stay queued,
    and the exit is the stop's. The bug caught: --keep-queued was never passed on, and the points
    not yet run stayed queued for any later `packbench dispatch` to run unasked, whatever the flag."""
    import typer

    from packbench.cli.sweep import submit_sweep as cli_submit_sweep
    from packbench.core.settings import Settings

    ran, keeps = [], []

    def run(store, settings, *, json_out, only_screen, workers, keep_queued):
        ran.append(only_screen)
        keeps.append(keep_queued)
        if len(ran) == 2:
            if how == "keyboard":
                raise KeyboardInterrupt
            from packbench.cli.main import interrupted_screen  # what _dispatch says when stopped
            interrupted_screen(store, only_screen, keep_queued=keep_queued)
            raise typer.Exit(143)

    with pytest.raises(typer.Exit) as stop:
        cli_submit_sweep(store, Settings(archive_dir=tmp_path / "archives"), protocol_file(tmp_path),
                         ["continuation_tokens=2,3,4,5"], wait=True, json_out=False, run=run, keep_queued=keep)
    assert stop.value.exit_code == (130 if how == "keyboard" else 143)
    screens = sorted(store.find_screens(sweep_id=store.find_screens()[0].sweep_id), key=lambda s: s.id)
    assert len(ran) == 2 and keeps == [keep, keep]
    statuses = [s.status for s in screens]
    assert statuses == (["queued"] * 4 if keep else ["queued", "cancelled", "cancelled", "cancelled"])
    err = capsys.readouterr().err
    rest = f"{screens[2].id}, {screens[3].id}"
    assert (f"screens {rest} not run, stay queued (--keep-queued)" in err if keep
            else f"screens {rest} not run, cancelled" in err)
