"""Every command that prints a result takes --json and then prints one JSON document on stdout
(JSON Lines for `audit` and `dispatch`, one object per audit or screen); settings and their
environment variables in one table; `--db` before the command; the `audit` subcommands and the
one-command forms they keep; `protocol plan`'s time from measured rates."""

import json
import platform
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.cli.audit_cmd import route_legacy
from packbench.cli.main import app
from packbench.core.protocol import load
from packbench.core.settings import ENVIRONMENT, Settings
from packbench.db.store import Store

ROOT = Path(__file__).resolve().parents[2]
GATES = ROOT / "tests" / "data" / "gates-v2.yaml"


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def document(*args: str, env: dict | None = None, code: int = 0):
    """The one JSON document a command printed on stdout (CliRunner keeps stderr apart)."""
    r = invoke(*args, env=env)
    assert r.exit_code == code, (r.exit_code, r.stdout, r.stderr)
    return json.loads(r.stdout)


def earlier_screen(url: str, *, archive: str = "a.zip", gpu_name: str = "cpu", host: str | None = None) -> None:
    """One finished screen of synth:tiny float32 on this host's CPU: dense-stream 0.2 s and 0.4 s
    per 4 generated tokens (median 0.075 s/token), packet 0.1 s (0.025 s/token)."""
    body = json.dumps({"name": "earlier", "model": {"synth": {"shape": "tiny"}}, "dtype": "float32"}, sort_keys=True)
    with Store(url) as store:
        store.upgrade()
        protocol_id = store.put_protocol(sha256="ab" * 32, name="earlier", canonical_json=body)
        machine = store.put_machine(host=host or platform.node(), gpu_name=gpu_name, driver="", torch="2", cuda="")
        screen_id = store.create_screen(protocol_id=protocol_id, submitter="t")
        attempt = store.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name=gpu_name, gpu_index=0,
                                      machine_id=machine, source_freeze={}, archive_path=archive)
        episodes = [(0, "dense-stream", 0.2), (1, "packet", 0.1), (2, "dense-stream", 0.4)]
        store.put_episodes(attempt.id, [
            {"plan_index": i, "condition": c, "role": "scored", "prompt": 0, "status": "ok", "error": None,
             "tokens": [1, 2, 3, 4], "wall_s": wall, "call_s": wall / 2, "h2d_weight_bytes": 10, "h2d_index_bytes": 0,
             "d2h_bytes": 0, "energy_j": None} for i, c, wall in episodes])
        store.finish_attempt(attempt.id, status="done", archive_sha256="e" * 64)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("json")
    url = f"sqlite:///{d / 'packbench.db'}"
    archive = d / "screen.zip"
    write_synthetic_screen(archive, synthetic_protocol(prompts_n=1, repetitions=1))
    earlier_screen(url, archive=str(archive))
    return {"dir": d, "url": url, "archive": archive}


def test_query_commands_print_one_document(world):
    db = ("--db", world["url"])
    assert document("screens", "list", *db, "--json")[0]["id"] == 1
    assert document("screens", "show", "1", *db, "--json")["screen"]["id"] == 1
    assert isinstance(document("status", *db, "--json"), dict)
    assert len(document("results", "--condition", "packet", *db, "--json")) == 1
    assert document("results", "--screen", "1", *db, "--json")["screen_id"] == 1
    assert document("compare", "1", "1", *db, "--json")["a"]["screen_id"] == 1


def test_db_and_keys_commands_print_one_document(world, tmp_path):
    db = ("--db", world["url"])
    assert document("db", "upgrade", *db, "--json")["revision"] == document("db", "current", *db, "--json")["head"]
    assert document("db", "current", *db, "--json")["at_head"] is True
    assert all(isinstance(line, str) for line in document("db", "history", *db, "--json")["revisions"])
    made = document("keys", "init", "--key", str(tmp_path / "k.pem"), "--name", "lab", *db, "--json")
    assert made["registered"] is True and Path(made["public_key"]).is_file()
    assert made["key_id"] in [k["key_id"] for k in document("keys", "list", *db, "--json")["keys"]]
    other = document("keys", "init", "--key", str(tmp_path / "o.pem"), "--no-db", "--json")
    assert other["registered"] is False
    trusted = document("keys", "register", other["public_key"], "--name", "other lab", *db, "--json")
    assert trusted == {"key_id": other["key_id"], "name": "other lab", "local": False}


def test_protocol_model_submit_report_ingest_print_one_document(world, tiny, tmp_path):
    assert document("protocol", "validate", str(GATES), "--json")["valid"] is True
    shown = document("protocol", "show", str(GATES), "--json")
    assert shown["body"]["name"] == shown["name"] and len(shown["sha256"]) == 64
    assert document("model", "digest", str(tiny), "--json")["sha256"] == invoke("model", "digest", str(tiny)).stdout.strip()
    synth = document("model", "synth", "--out", str(tmp_path / "m"), "--shape", "tiny", "--json")
    assert synth["profile"] == "opt4" and Path(synth["path"], "config.json").is_file()  # the newest profile
    assert document("model", "stats", str(tiny), "--prefix", "8", "--json")
    url = f"sqlite:///{tmp_path / 'q.db'}"
    assert document("db", "upgrade", "--db", url, "--json")
    assert document("submit", str(GATES), "--db", url, "--json") == {"queued": [1]}
    assert document("db", "reconcile", "--db", url, "--json")["inserted"] == 0
    written = document("report", str(world["archive"]), "--out", str(tmp_path / "r.html"), "--json")
    assert written["path"] == str(tmp_path / "r.html") and written["bytes"] == (tmp_path / "r.html").stat().st_size
    key = document("keys", "init", "--key", str(tmp_path / "k.pem"), "--no-db", "--json")["public_key"]
    refused = document("ingest", str(world["archive"]), "--trust", key, "--db", url, "--json", code=1)  # unsigned
    assert refused["ingested"] is False and refused["reasons"]


def test_audit_subcommands_and_the_forms_they_keep(world):
    one = document("audit", "archive", str(world["archive"]), "--json")
    assert one["result"] == "agree"
    assert document("audit", "--archive", str(world["archive"]), "--json") == one  # the one-command form
    # the screen's rows are not the archive's episodes: it disagrees (exit 1), and says so as JSON
    assert document("audit", "screen", "1", "--db", world["url"], "--json", code=1)["result"] == "disagree"
    assert document("audit", "1", "--db", world["url"], "--json", code=1)["result"] == "disagree"


def test_route_legacy_keeps_every_one_command_form():
    values = frozenset({"--archive", "--since", "--protocol", "--seed", "--time-factor", "--db", "--count",
                        "--reexecute", "--model-dir", "--trust", "--address", "--concurrency", "--repeat"})
    assert route_legacy(["latest"], values) == ["screen", "latest"]
    assert route_legacy([], values) == ["screen"]
    assert route_legacy(["--all", "--ray"], values) == ["screen", "--all", "--ray"]
    assert route_legacy(["--archive", "a.zip", "--trust", "k.pub"], values) == ["archive", "a.zip", "--trust", "k.pub"]
    assert route_legacy(["--archive=a.zip"], values) == ["archive", "a.zip"]
    assert route_legacy(["3", "--archive", "f.zip", "--json"], values) == ["screen", "3", "--archive", "f.zip", "--json"]
    assert route_legacy(["latest", "--reexecute", "4", "--seed", "0"], values) == \
        ["reexecute", "latest", "--count", "4", "--seed", "0"]
    assert route_legacy(["--archive", "a.zip", "--reexecute=8"], values) == ["reexecute", "--archive", "a.zip", "--count=8"]
    assert route_legacy(["--db", "sqlite:///x.db", "2"], values) == ["screen", "--db", "sqlite:///x.db", "2"]


def test_db_before_the_command_and_its_environment_variable(world, tmp_path):
    empty = f"sqlite:///{tmp_path / 'absent.db'}"
    assert document("--db", world["url"], "screens", "list", "--json")[0]["id"] == 1
    # the command line beats the environment wherever --db stands
    assert document("--db", world["url"], "screens", "list", "--json", env={"PACKBENCH_DB_URL": empty})
    assert document("screens", "list", "--json", env={"PACKBENCH_DB_URL": world["url"]})
    r = invoke("screens", "list", "--db", empty, env={"PACKBENCH_DB_URL": world["url"]})
    assert r.exit_code != 0  # a database not at head is refused: the command's own --db was used


def test_every_environment_variable_is_in_one_table_and_in_help():
    helptext = invoke("--help", env={"COLUMNS": "400"}).stdout
    readme = (ROOT / "README.md").read_text()
    for name, (option, _) in ENVIRONMENT.items():
        assert name in helptext and option in helptext
        assert f"| `{name}` | `{option}` |" in readme, name
    settings = Settings.from_environ({"PACKBENCH_WORKER_THREADS": "3", "PACKBENCH_WORKER_PIN": "1",
                                      "PACKBENCH_DB_URL": "sqlite:///x.db", "PACKBENCH_EMBEDDED_GPUS": "2"})
    assert (settings.worker_threads, settings.worker_pin, settings.db_url, settings.embedded_gpus) == \
        (3, True, "sqlite:///x.db", 2)
    r = invoke("--worker-threads", "four", "status")
    assert r.exit_code != 0 and "is not a number of threads" in str(r.exception)


def test_worker_threads_and_pinning_reach_the_actor_as_arguments(monkeypatch):
    import packbench.cluster.worker

    calls = []

    class Actor:
        @staticmethod
        def options(**options):
            return Actor

        @staticmethod
        def remote(*args, **kwargs):
            calls.append((args, kwargs))

    monkeypatch.setattr(packbench.cluster.worker, "GpuWorker", Actor)
    packbench.cluster.worker.start_worker(Settings(worker_threads=3, worker_pin=True), workers_on_host=2)
    (env,), kwargs = calls[0]
    assert kwargs == {"threads": 3, "pin": True} and env["OMP_NUM_THREADS"] == "3"
    assert not [k for k in env if k.startswith("PACKBENCH_")]


def test_plan_time_from_measured_rates_of_an_earlier_screen(world, tmp_path):
    path = tmp_path / "p.yaml"  # gates-v2 is synth:tiny float32, as the earlier screen
    (tmp_path / "gates-v2-prompts.json").write_bytes((GATES.parent / "gates-v2-prompts.json").read_bytes())
    path.write_text(GATES.read_text())
    out = document("protocol", "plan", str(path), "--device", "cpu", "--db", world["url"], "--json")
    time = out["time"]
    assert time["kind"] == "measured" and time["measured_episodes"] == 3 and time["device"] == "cpu"
    rates = {c["condition"]: c for c in time["conditions"]}
    tokens = load(path).protocol.continuation_tokens
    assert rates["dense-stream"]["s_per_token"] == pytest.approx(0.075)  # median of 0.05 and 0.1
    assert rates["packet"]["total_s"] == pytest.approx(0.025 * tokens * rates["packet"]["episodes"])
    assert rates["extents"]["s_per_token"] is None and time["total_s"] is None  # no earlier extents episode
    text = invoke("protocol", "plan", str(path), "--device", "cpu", "--db", world["url"]).stdout
    assert "an estimate from 3 earlier episodes of synth:tiny on the CPU of" in text and "no rate known" in text
    assert "GPU transfer/episode" not in text and ">= " not in text
    # another accelerator kind: no measured rate, so the GPU-rate bound, labelled as one
    text = invoke("protocol", "plan", str(path), "--device", "NVIDIA H200", "--db", world["url"]).stdout
    assert "a GPU-rate bound" in text and "no earlier episodes of synth:tiny on NVIDIA H200" in text


def test_plan_of_a_cpu_screen_without_rates_says_none_is_known(tmp_path):
    out = invoke("protocol", "plan", str(GATES), "--device", "cpu", "--db", f"sqlite:///{tmp_path / 'none.db'}")
    assert out.exit_code == 0 and "time: no rate is known for a CPU screen" in out.stdout
    assert not (tmp_path / "none.db").exists()  # planning creates no database


def test_report_sweep_prints_one_document(tmp_path):
    """`report --sweep ID --json` ignored --json: it printed `wrote sweep-....html (N bytes)`, no
    JSON on stdout. One document names the page written, its size, the sweep and its screens."""
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    earlier_screen(url)
    with Store(url) as store:
        store.set_sweep(1, sweep_id="sw-1", point={"prefix_tokens": 16})
    page = tmp_path / "sweep.html"
    assert document("report", "--sweep", "sw-1", "--out", str(page), "--db", url, "--json") == {
        "path": str(page), "bytes": page.stat().st_size, "sweep_id": "sw-1", "screens": [1]}
    assert document("report", "--sweep", "latest", "--out", str(page), "--db", url, "--json")["sweep_id"] == "sw-1"
    text = invoke("report", "--sweep", "sw-1", "--out", str(page), "--db", url)
    assert text.exit_code == 0 and text.stdout == f"wrote {page} ({page.stat().st_size:,} bytes)\n", text.stdout


@pytest.mark.parametrize("args, env, line", [
    (["--worker-threads", "0"], {}, "error: --worker-threads '0' is not a number of threads; make it a positive integer "
     "or leave --worker-threads out (each worker then takes its share of the host's cores)"),
    ([], {"PACKBENCH_WORKER_THREADS": "four"}, "error: PACKBENCH_WORKER_THREADS='four' is not a number of threads; make "
     "it a positive integer or unset it (each worker then takes its share of the host's cores)"),
    (["--worker-pin", "2"], {"PACKBENCH_WORKER_PIN": "1"}, "error: --worker-pin '2' must be 1 (pin each GPU worker to "
     "its share of the host's cores) or 0; or leave --worker-pin out"),
    ([], {"PACKBENCH_WORKER_PIN": "yes"}, "error: PACKBENCH_WORKER_PIN='yes' must be 1 (pin each GPU worker to its "
     "share of the host's cores) or 0; or unset it"),
])
def test_a_bad_worker_setting_names_where_it_was_given(packbench_cli, tmp_path, args, env, line):
    """`--worker-threads 0` was refused as `PACKBENCH_WORKER_THREADS='0' ...; unset it`, naming a
    variable the user never set: the line names the option typed, or the variable when it was one."""
    r = packbench_cli(*args, "status", env={"PACKBENCH_DB_URL": f"sqlite:///{tmp_path / 'none.db'}", **env})
    assert (r.returncode, r.stdout, r.stderr.strip().splitlines()) == (2, "", [line])
