"""Bad input: one line naming the cause and the fix, exit code 2, no traceback, nothing lost.

The commands run in this process through the console entry point (tests/conftest.py
`packbench_cli`): an uncaught exception fails the test with its traceback."""

import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(packbench_cli):
    """`packbench ARGS` in `cwd` against the SQLite database file `db`."""
    return lambda *args, cwd, db: packbench_cli(*args, env={"PACKBENCH_DB_URL": f"sqlite:///{db}"}, cwd=cwd)


def assert_one_line_error(r, *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture()
def upgraded(tmp_path, cli) -> Path:
    db = tmp_path / "packbench.db"
    r = cli("db", "upgrade", cwd=tmp_path, db=db)
    assert r.returncode == 0, r.stderr
    return db


def write_protocol(tmp_path: Path, tiny: Path, **changes) -> Path:
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    body.update(changes)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_missing_model_dir(tmp_path, upgraded, cli):
    p = write_protocol(tmp_path, tmp_path / "no-such-model")
    r = cli("submit", str(p), cwd=tmp_path, db=upgraded)
    assert_one_line_error(r, "does not exist", "packbench model synth")


def test_unknown_protocol_field(tmp_path, upgraded, tiny, cli):
    r = cli("submit", str(write_protocol(tmp_path, tiny, colour="blue")), cwd=tmp_path, db=upgraded)
    assert_one_line_error(r, "`colour`", "unknown field")


def test_malformed_protocol(tmp_path, upgraded, cli):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [oops\n")
    assert_one_line_error(cli("submit", str(p), cwd=tmp_path, db=upgraded), "not valid YAML")


def test_database_not_at_head_names_the_command(tmp_path, tiny, cli):
    empty = tmp_path / "empty.db"
    r = cli("submit", str(write_protocol(tmp_path, tiny)), cwd=tmp_path, db=empty)
    assert_one_line_error(r, "packbench db upgrade")
    assert_one_line_error(cli("results", cwd=tmp_path, db=empty), "packbench db upgrade")


def test_bad_input_loses_nothing_already_stored(tmp_path, upgraded, tiny, cli):
    good = write_protocol(tmp_path, tiny)
    assert cli("submit", str(good), cwd=tmp_path, db=upgraded).returncode == 0  # queued, not run
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [oops\n")
    assert cli("submit", str(bad), cwd=tmp_path, db=upgraded).returncode == 2
    r = cli("results", "--screen", "latest", "--json", cwd=tmp_path, db=upgraded)
    assert r.returncode == 0 and '"status": "queued"' in r.stdout


def test_an_archive_file_given_to_audit_as_a_screen_names_the_flag(tmp_path, upgraded, cli):
    """`report` takes an archive file where a screen id goes; `audit` takes it with --archive."""
    (tmp_path / "junk.zip").write_bytes(os.urandom(3000))
    assert_one_line_error(cli("audit", "junk.zip", cwd=tmp_path, db=upgraded), "'junk.zip' is not a screen id",
                          "--archive junk.zip")


def test_unknown_shape_for_synth(tmp_path, upgraded, cli):
    r = cli("model", "synth", "--shape", "opt-9b", "--out", str(tmp_path / "m"), cwd=tmp_path, db=upgraded)
    assert_one_line_error(r, "unknown --shape 'opt-9b'", "opt-125m")


def test_text_prompts_on_a_checkpoint_without_a_tokenizer(tmp_path, upgraded, tiny):
    """Not "prompt 0 has 0 tokens": one line naming the missing tokenizer files and the fix."""
    from typer.testing import CliRunner

    from packbench.cli.main import app
    from packbench.core.errors import CheckpointError
    from packbench.db.store import Store

    (tmp_path / "texts.txt").write_text("the cat sat on the mat\n---\nthe dog sat on the cat\n")
    p = write_protocol(tmp_path, tiny, prompts={"text_file": "texts.txt"})
    result = CliRunner().invoke(app, ["submit", str(p), "--db", f"sqlite:///{upgraded}"])
    assert isinstance(result.exception, CheckpointError), result.output
    message = str(result.exception)
    assert "\n" not in message and "0 tokens" not in message
    for fragment in (str(tiny), "has no tokenizer files", "tokenizer.json", "vocab.json + merges.txt",
                     "prompts.token_file"):
        assert fragment in message, message
    with Store(f"sqlite:///{upgraded}") as store:
        assert store.list_screens() == []  # refused before anything was queued


def test_debug_adds_the_traceback_and_keeps_the_line_and_the_code(tmp_path, upgraded, cli):
    plain = cli("audit", "--archive", str(tmp_path / "nope.zip"), cwd=tmp_path, db=upgraded)
    assert_one_line_error(plain, "no archive at", "check the path")
    debug = cli("--debug", "audit", "--archive", str(tmp_path / "nope.zip"), cwd=tmp_path, db=upgraded)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()


@pytest.mark.parametrize("args, fragment", [
    (("results", "--foo"), "No such option: --foo"),
    (("submit",), "Missing argument 'protocol'"),
    (("results", "--limit", "x"), "Invalid value for '--limit'"),
])
def test_usage_errors_are_one_line_with_exit_2(tmp_path, args, fragment, cli):
    r = cli(*args, cwd=tmp_path, db=tmp_path / "packbench.db")
    assert_one_line_error(r, fragment, f"see `packbench {args[0]} --help`")


def test_a_competitor_whose_library_is_missing_is_refused_before_anything_is_queued(tmp_path, upgraded, tiny,
                                                                                   monkeypatch, packbench_cli):
    """In-process, with bitsandbytes made to look absent (whether or not it is installed)."""
    import importlib.util

    from packbench.db.store import Store

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    p = write_protocol(tmp_path, tiny, schema=5, conditions=[
        {"policy": "dense-stream"}, {"name": "nf4", "policy": "quantized", "params": {"method": "nf4"}}],
        gates={"faithfulness": None, "fidelity": {"max_mean_kl": 0.05}})
    r = packbench_cli("submit", str(p), env={"PACKBENCH_DB_URL": f"sqlite:///{upgraded}"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r
    for fragment in ("`conditions[1].params.method`", "nf4 (condition nf4) requires bitsandbytes",
                     "pip install 'packbench[lowbit]'"):
        assert fragment in lines[0], lines
    with Store(f"sqlite:///{upgraded}") as store:
        assert store.list_screens() == []


def test_a_fidelity_gate_on_an_exact_condition_is_refused(tmp_path, upgraded, tiny, cli):
    p = write_protocol(tmp_path, tiny, schema=5, gates={"fidelity": [{"condition": "packet", "min_top1": 0.9}]})
    assert_one_line_error(cli("submit", str(p), cwd=tmp_path, db=upgraded), "`gates.fidelity[0].condition`",
                          "'packet' is exact")
