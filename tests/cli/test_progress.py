"""cli/progress.py and `submit --wait` interrupted: piped episode lines carry times, log records
print above the bars, and an interrupted screen is cancelled unless --keep-queued."""

import io
import logging

import yaml
from typer.testing import CliRunner

from packbench.cli import main as cli_main
from packbench.cli.progress import PlainLines, _LogsAbove
from packbench.db.store import Store


def test_piped_episode_lines_start_with_the_seconds_since_their_screen_began(capsys):
    now = iter([100.0, 100.0, 102.5])
    view = PlainLines(clock=lambda: next(now))
    view("worker-1 ready on vm")
    view("screen 3 attempt 1: 8 episodes on cpu", screen=3, done=0, total=8)
    view("  episode   0 packet warmup prompt 0 ok, wall 0.410 s", screen=3, done=1, total=8)
    view("  episode   1 packet scored prompt 0 ok, wall 2.100 s", screen=3, done=2, total=8)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["worker-1 ready on vm", "[    0.0 s] screen 3 attempt 1: 8 episodes on cpu",
                     "[    0.0 s] episode   0 packet warmup prompt 0 ok, wall 0.410 s",
                     "[    2.5 s] episode   1 packet scored prompt 0 ok, wall 2.100 s"]


def test_log_records_go_through_the_bars_console_while_bars_are_live():
    from rich.console import Console

    root = logging.getLogger()
    terminal = io.StringIO()
    direct = logging.StreamHandler(terminal)
    root.addHandler(direct)
    try:
        screen = io.StringIO()
        logs = _LogsAbove(Console(file=screen, width=200))
        logging.getLogger("packbench.service.dispatcher").warning("SIGINT: giving back held screens and stopping")
        logs.close()
        assert "SIGINT: giving back held screens" in screen.getvalue() and terminal.getvalue() == ""
        logging.getLogger("packbench.service.dispatcher").warning("after the bars")
        assert "after the bars" in terminal.getvalue()  # the stream handler is back
    finally:
        root.removeHandler(direct)


def _protocol(tmp_path):
    body = {"schema": 2, "name": "tiny-screen",
            "model": {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}},
            "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
            "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_an_interrupted_wait_cancels_its_screen_unless_kept_queued(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_dispatch", interrupted)
    r = CliRunner().invoke(cli_main.app, ["submit", str(_protocol(tmp_path)), "--wait", "--db", url])
    assert r.exit_code == 130
    # Stopped before its first episode: no attempt exists, so none is promised kept.
    assert r.stderr.strip() == ("interrupted: screen 1 cancelled, so no `packbench dispatch` runs it unasked (no "
                                "attempt had started); `packbench screens retry 1` queues it again")
    r = CliRunner().invoke(cli_main.app, ["screens", "show", "1", "--db", url])
    assert "no attempts: cancelled before any ran, so no `packbench dispatch` runs it; `packbench screens retry 1` " \
           "queues it again" in r.stdout and "run it with `packbench dispatch`" not in r.stdout, r.stdout
    r = CliRunner().invoke(cli_main.app, ["submit", str(_protocol(tmp_path)), "--wait", "--keep-queued", "--db", url])
    assert r.exit_code == 130 and "screen 2 stays queued (--keep-queued)" in r.stderr
    with Store(url) as store:
        assert (store.screen(1).status, store.screen(2).status) == ("cancelled", "queued")


def test_a_sigterm_while_ray_starts_cancels_the_waited_screen_and_exits_143(tmp_path, monkeypatch):
    """Bug caught: SIGTERM in the seconds `submit --wait` spends starting Ray, before the
    dispatcher's own handler is in place, met Ray's driver handler (`sys.exit(15)`): the command
    exited 15 with no line and left its screen queued, so the next `packbench dispatch` ran it
    unasked (`packbench submit p.yaml --wait`, killed 2.5 s in: exit 15, `screens list`: queued).
    SIGINT there already cancelled it; SIGTERM now does as well, exit 143."""
    import os
    import signal
    import sys

    from packbench.cluster.pool import RayPool

    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()

    def connect(self):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(RayPool, "connect", connect)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        r = CliRunner().invoke(cli_main.app, ["submit", str(_protocol(tmp_path)), "--wait", "--db", url,
                                              "--archive-dir", str(tmp_path / "archives")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert r.exit_code == 143, (r.exit_code, r.stderr)
    assert r.stderr.strip().startswith("interrupted: screen 1 cancelled, so no `packbench dispatch` runs it unasked")
    with Store(url) as store:
        assert store.screen(1).status == "cancelled"
