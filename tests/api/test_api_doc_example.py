"""docs/api.md's notebook runs as written, in a folder like the one `make demo` leaves."""

import os
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_notebook_in_docs_api_runs_as_written(results_dir, monkeypatch, capsys):
    blocks = python_blocks(DOC.read_text())
    assert blocks, "docs/api.md has no python example"
    monkeypatch.chdir(results_dir)
    monkeypatch.delenv("PACKBENCH_DB_URL", raising=False)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102  (the documentation's own code)
    printed = capsys.readouterr().out
    assert "dense-stream" in printed and "packet" in printed
    assert namespace["archive"].problems == ()


def test_the_notebook_labels_the_quickstart_when_a_newer_screen_is_another_protocol(results_dir, monkeypatch,
                                                                                    capsys):
    """After the README's steps the newest screen is int8-fidelity's: the notebook labelled it
    "baseline", then failed its assertion on the conditions. It picks the newest quickstart."""
    from packbench.db.store import Store
    from screens import DATA, ingest_archive

    with Store(f"sqlite:///{results_dir / 'packbench.db'}") as store:
        ingest_archive(store, DATA / "gates-v2.zip")  # screen 2, newer, of another protocol
    monkeypatch.chdir(results_dir)
    monkeypatch.delenv("PACKBENCH_DB_URL", raising=False)
    namespace: dict = {}
    for block in python_blocks(DOC.read_text()):
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102  (the documentation's own code)
    assert namespace["screen"].id == 1
    with Store(f"sqlite:///{results_dir / 'packbench.db'}") as store:
        assert (store.screen(1).name, store.screen(2).name) == ("baseline", None)
