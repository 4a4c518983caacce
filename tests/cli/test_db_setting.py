"""A database refusal names what the user set the URL with: `--db` when typed, the variable when only
the environment set it, both when neither did."""

import pytest

NOT_A_DB = b"not a database, just text\n" * 64


@pytest.fixture
def not_a_db(tmp_path):
    path = tmp_path / "notdb"
    path.write_bytes(NOT_A_DB)
    return f"sqlite:///{path}"


@pytest.mark.parametrize("where, expected", [
    ("command", "point --db at a packbench database"),
    ("top", "point --db at a packbench database"),
    ("env", "point PACKBENCH_DB_URL at a packbench database"),
    ("both", "point --db at a packbench database"),
])
def test_refusal_names_how_the_url_was_given(packbench_cli, monkeypatch, tmp_path, not_a_db, where, expected):
    """Bug caught: every database refusal said "point PACKBENCH_DB_URL at ..." (or "set
    PACKBENCH_DB_URL") when the user had typed `--db URL` and never set the variable."""
    monkeypatch.delenv("PACKBENCH_DB_URL", raising=False)
    args = {"command": ("results", "--db", not_a_db), "top": ("--db", not_a_db, "results"),
            "env": ("results",), "both": ("results", "--db", not_a_db)}[where]
    env = {"PACKBENCH_DB_URL": not_a_db if where == "env" else f"sqlite:///{tmp_path / 'other.db'}"} \
        if where in ("env", "both") else {}
    r = packbench_cli(*args, env=env, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert expected in r.stderr, r.stderr
    if where != "env":
        assert "PACKBENCH_DB_URL" not in r.stderr, r.stderr


def test_default_url_names_both(packbench_cli, monkeypatch, tmp_path):
    """Bug caught: with neither --db nor the variable given, a refusal named only the variable."""
    monkeypatch.delenv("PACKBENCH_DB_URL", raising=False)
    (tmp_path / "packbench.db").mkdir()  # the default URL names a directory here
    r = packbench_cli("results", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "set --db (or PACKBENCH_DB_URL)" in r.stderr, r.stderr


def test_parse_refusal_names_typed_option(packbench_cli, monkeypatch, tmp_path):
    """Bug caught: `--db mysql://x` was told to "set PACKBENCH_DB_URL"."""
    monkeypatch.delenv("PACKBENCH_DB_URL", raising=False)
    r = packbench_cli("screens", "list", "--db", "mysql://x", cwd=tmp_path)
    assert r.returncode == 2 and "set --db:" in r.stderr and "PACKBENCH_DB_URL" not in r.stderr, r.stderr


def test_connect_names_its_argument(not_a_db):
    """Bug caught: `packbench.connect(url)` told the caller to fix PACKBENCH_DB_URL, which it never read."""
    import packbench
    from packbench.core.errors import PackbenchError

    with pytest.raises(PackbenchError, match=r"point connect\(\)'s url at"):
        packbench.connect(not_a_db)


@pytest.mark.parametrize("where", ["command", "top", "env"])
def test_the_upgrade_a_refusal_names_migrates_the_refused_database(packbench_cli, monkeypatch, tmp_path, where):
    """Bug caught: a database typed as --db and not at head (or missing) was told "run `packbench
    db upgrade`", which migrates PACKBENCH_DB_URL's database (or the default) and left the
    refused one as it was; the line now names the --db to type again."""
    from packbench.db.store import Store

    old, other = tmp_path / "old.db", tmp_path / "other.db"
    with Store(f"sqlite:///{old}") as store:
        store.upgrade("0012_unhashed_audits")
    url = f"sqlite:///{old}"
    args = {"command": ("screens", "list", "--db", url), "top": ("--db", url, "screens", "list"),
            "env": ("screens", "list")}[where]
    env = {"PACKBENCH_DB_URL": url if where == "env" else f"sqlite:///{other}"}
    r = packbench_cli(*args, env=env, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    fix = "`packbench db upgrade`" if where == "env" else f"`packbench --db {url} db upgrade`"
    assert r.stderr.strip().endswith(f"run {fix}"), r.stderr
    if where != "env":
        r = packbench_cli("--db", url, "db", "current", env=env, cwd=tmp_path)
        assert r.returncode == 0 and f"run `packbench --db {url} db upgrade`" in r.stdout, r.stdout
        missing = f"sqlite:///{tmp_path / 'a b.db'}"
        r = packbench_cli("results", "--db", missing, env=env, cwd=tmp_path)
        assert r.returncode == 2 and f"run `packbench --db '{missing}' db upgrade` to create it" in r.stderr, r.stderr
        assert not (tmp_path / "a b.db").exists()
