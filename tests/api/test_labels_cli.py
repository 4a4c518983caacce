"""Names, tags and notes on the command line: `submit --name/--tag/--note`, `screens tag`, and
the `--tag` filters of `results` and `screens list` (in-process: typer's runner for the output,
the console entry point `cli.main.main()` for the one-line refusals it prints)."""

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.db.store import Store
from screens import QUICKSTART, ingest_archive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Store(url) as store:
        store.upgrade()
        for n in range(3):
            ingest_archive(store, QUICKSTART, key=str(n))
    return url


def run(*args: str) -> str:
    r = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_screens_tag_then_filter_listings_and_results(url):
    assert "screen 1: name base; tags team=infra" in run("screens", "tag", "1", "--name", "base", "--tag",
                                                         "team=infra", "--db", url)
    run("screens", "tag", "2", "--tag", "team=research", "--tag", "box=ci", "--note", "a rerun", "--db", url)
    listed = json.loads(run("screens", "list", "--tag", "team=infra", "--json", "--db", url))
    assert [(s["id"], s["name"], s["tags"]) for s in listed] == [(1, "base", {"team": "infra"})]
    both = json.loads(run("screens", "list", "--tag", "team=*", "--json", "--db", url))
    assert [s["id"] for s in both] == [2, 1]
    assert [s["id"] for s in json.loads(run("screens", "list", "--name", "base", "--json", "--db", url))] == [1]
    rows = json.loads(run("results", "--tag", "team=research", "--format", "json", "--db", url))
    assert {r["screen_id"] for r in rows} == {2} and len(rows) == 8
    limited = CliRunner().invoke(app, ["results", "--tag", "team=*", "--limit", "3", "--format", "json", "--db", url])
    assert len(json.loads(limited.stdout)) == 3
    shown = json.loads(run("screens", "tag", "2", "--untag", "box", "--json", "--db", url))
    assert shown == {"screen_id": 2, "name": None, "note": "a rerun", "tags": {"team": "research"}}


def test_an_unlabelled_listing_reads_as_before(url):
    listed = json.loads(run("screens", "list", "--json", "--db", url))
    assert all(set(s) == {"id", "protocol", "protocol_sha256", "status", "created_at", "attempts", "latest_status",
                          "passed", "failed", "submitter"} for s in listed)


def test_submit_labels_what_it_queues(tmp_path, tiny):
    url = f"sqlite:///{tmp_path / 'q.db'}"
    Store(url).upgrade()
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    run("submit", str(tmp_path / "p.yaml"), "--name", "nightly", "--tag", "ci=yes", "--note", "from cron",
        "--replicas", "2", "--db", url)
    with Store(url) as store:
        rows = store.find_screens(tags={"ci": "yes"})
        assert [(s.name, s.note) for s in rows] == [("nightly", "from cron")] * 2


@pytest.mark.parametrize("args, words", [
    (("screens", "tag", "1", "--tag", "noequals"), "--tag 'noequals' is not KEY=VALUE"),
    (("screens", "tag", "1", "--tag", "bad key=x"), "tag key 'bad key'"),
    (("screens", "tag", "1"), "nothing to label"),
    (("screens", "tag", "9", "--tag", "a=b"), "no screen with id 9"),
    (("screens", "list", "--tag", "a=b", "--tag", "a=c"), "--tag a is given twice"),
    (("screens", "tag", "1", "--name", "a\rb"), "must be one line"),
    (("screens", "tag", "1", "--name", "a\u2028b"), "must be one line"),
    (("screens", "tag", "1", "--tag", "k=v\rw"), "its value must be one line"),
])
def test_bad_labels_are_one_line(url, args, words, packbench_cli):
    r = packbench_cli(*args, "--db", url)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_screens_tag_echoes_a_name_as_one_line(url):
    """A carriage return or a right-to-left override in a name was echoed raw by `screens tag`: the
    terminal overwrote or reordered the line (the listings escape them; the echo did not)."""
    out = run("screens", "tag", "1", "--name", "evil\u202e<x>", "--tag", "k=v\u202e", "--db", url)
    assert out == "screen 1: name evil\\u202e<x>; tags k=v\\u202e\n"


def test_untag_of_a_key_the_screen_lacks_says_so(url):
    """`--untag tema` (a typo of `team`) drops nothing: the line says which keys were not there,
    and names only those (a bug listing every --untag key, or none, fails)."""
    run("screens", "tag", "1", "--tag", "team=infra", "--tag", "box=ci", "--db", url)
    out = run("screens", "tag", "1", "--untag", "tema", "--untag", "box", "--db", url)
    assert out.strip() == "screen 1: name -; tags team=infra; no tag tema to drop"
    assert run("screens", "tag", "1", "--untag", "team", "--db", url).strip() == "screen 1: name -; tags none"


def test_screens_list_json_and_csv_keep_tags_that_hold_commas_and_equals(url):
    """Bug: `screens list --json/--csv` wrote tags as the text "k=v,k2=v2", which cannot be split
    back when a value holds "," or "=" (both allowed): {a: "1,b=c", d: "e"} and {a: "1", b: "c,d=e"}
    both read "a=1,b=c,d=e". JSON now gives the mapping, CSV its JSON text; the table still
    shows k=v pairs."""
    import csv
    import io

    run("screens", "tag", "1", "--tag", "a=1,b=c", "--tag", "d=e", "--db", url)
    run("screens", "tag", "2", "--tag", "a=1", "--tag", "b=c,d=e", "--db", url)
    want = {1: {"a": "1,b=c", "d": "e"}, 2: {"a": "1", "b": "c,d=e"}, 3: None}
    listed = json.loads(run("screens", "list", "--json", "--db", url))
    assert {s["id"]: s["tags"] for s in listed} == want
    rows = list(csv.DictReader(io.StringIO(run("screens", "list", "--format", "csv", "--db", url))))
    assert {int(r["id"]): json.loads(r["tags"]) if r["tags"] else None for r in rows} == want
    table = run("screens", "list", "--db", url)
    assert "a=1,b=c,d=e" in table and "team" not in table
