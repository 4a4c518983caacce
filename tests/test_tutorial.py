"""The commands the docs tell a newcomer to type run as written.

The shell blocks (```sh / ```bash) of docs/tutorial.md, and of the README's "Using it" section
after the Makefile's `demo` recipe, run in a temporary copy of `protocols/` with a temporary
database and archive folder (the defaults, relative to that copy). Every command must exit 0,
and a few print lines that are cheap to check (a PASS, an audit that agrees). `packbench` is
this checkout's code: `.venv/bin/activate` in the copy puts a `packbench` on PATH that runs
`python -m packbench` with this interpreter and this checkout first on PYTHONPATH.

The Makefile's `demo` recipe, the first thing a newcomer runs, starts packbench's embedded Ray
as theirs would. The commands after it (the README's "Using it", the tutorial) join the
session's local Ray cluster (tests/conftest.py `ray_address`, `PACKBENCH_RAY_ADDRESS`, the
README's setting): each of their nine Ray commands would otherwise start and stop an embedded
Ray of its own, about 3.5 s each on the 2-core CI machine, and what they print does not depend
on it.

docs/protocol.md's example protocol, saved under `protocols/`, validates and plans as copied.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from local_ray import clean_environment  # tests/local_ray.py

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(sh|bash)\s*$")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


@dataclass(frozen=True)
class Command:
    text: str
    line: int


def shell_blocks(markdown: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every ```sh / ```bash fenced block."""
    blocks, current, start = [], None, 0
    for n, line in enumerate(markdown.splitlines(), 1):
        if current is None and FENCE.match(line):
            current, start = [], n + 1
        elif current is not None and line.startswith("```"):
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _strip_comment(line: str) -> str:
    """A trailing `  # comment` (the docs' style) or a whole-line comment goes; `#` in a word stays."""
    if line.lstrip().startswith("#"):
        return ""
    return re.split(r"\s+#\s", line, maxsplit=1)[0].rstrip()


def commands(block: list[str], first_line: int) -> list[Command]:
    """The block's commands: one per line, with backslash continuations and heredocs kept whole."""
    out: list[Command] = []
    i = 0
    while i < len(block):
        line, start = _strip_comment(block[i]), first_line + i
        i += 1
        if not line:
            continue
        parts = [line]
        while parts[-1].endswith("\\") and i < len(block):
            parts.append(_strip_comment(block[i]))
            i += 1
        m = HEREDOC.search(parts[-1])
        if m:  # a heredoc's body is data, comments and all
            while i < len(block):
                parts.append(block[i])
                i += 1
                if block[i - 1].strip() == m.group(2):
                    break
        out.append(Command("\n".join(parts), start))
    return out


def section(markdown: str, heading: str) -> str:
    """The text under `## heading` up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(heading)}\s*$", markdown, flags=re.M)
    assert m, f"no section '## {heading}'"
    rest = markdown[m.end():]
    nxt = re.search(r"^## ", rest, flags=re.M)
    return rest[:nxt.start()] if nxt else rest


def demo_recipe(makefile: str) -> list[Command]:
    """The Makefile's `demo:` recipe, as the commands a user would type."""
    m = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert m, "the Makefile has no demo recipe"
    out = []
    for line in m.group(1).splitlines():
        cmd = line.strip().replace("$(BIN)/", "").replace("$(DEMO_DIR)", ".packbench")
        out.append(Command(cmd, 0))
    return out


def sandbox(tmp: Path, ray_address: str | None = None) -> dict[str, str]:
    """A copy of what the commands read, a `.venv` whose `packbench` is this checkout, and an
    environment whose database and archives are the copy's own; Ray commands join the cluster at
    `ray_address`, or start an embedded Ray when it is None."""
    shutil.copytree(ROOT / "protocols", tmp / "protocols")
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "packbench"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m packbench "$@"\n')
    exe.chmod(0o755)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\nexport PATH\n')
    env = clean_environment()
    env.update(PACKBENCH_DB_URL=f"sqlite:///{tmp / 'packbench.db'}", PACKBENCH_ARCHIVE_DIR=str(tmp / "archives"),
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    if ray_address is not None:
        env["PACKBENCH_RAY_ADDRESS"] = ray_address
    return env


def run_all(cmds: list[Command], *, cwd: Path, env: dict[str, str], where: str,
            judged: str | None = None) -> list[str]:
    """Run the commands in order in one shell (state such as `. .venv/bin/activate` carries over);
    stop at the first that fails. A command matching the regex `judged` (a `--fail-above` line,
    whose exit code is its judgement) may exit 0 or 1. Returns each command's output."""
    script = []
    for i, c in enumerate(cmds):
        ok = "0|1" if judged is not None and re.search(judged, c.text) else "0"
        script.append(f"date +%s.%N > .t0-{i}\n{{\n{c.text}\n}} > .out-{i} 2>&1 < /dev/null\necho $? > .rc-{i}\n"
                      f"date +%s.%N > .t1-{i}\ncase \"$(cat .rc-{i})\" in {ok}) ;; *) exit 1;; esac\n")
    proc = subprocess.run(["bash", "-c", "".join(script)], cwd=cwd, env=env, timeout=600)
    outputs = []
    for i, c in enumerate(cmds):
        rc_file = cwd / f".rc-{i}"
        if not rc_file.exists():
            break
        out = (cwd / f".out-{i}").read_text(errors="replace")
        rc = rc_file.read_text().strip()
        allowed = ("0", "1") if judged is not None and re.search(judged, c.text) else ("0",)
        assert rc in allowed, f"{where} line {c.line}: `{c.text}` exited {rc}:\n{out[-3000:]}"
        outputs.append(out)
        took = float((cwd / f".t1-{i}").read_text()) - float((cwd / f".t0-{i}").read_text())
        print(f"{took:6.1f} s  {c.text.splitlines()[0]}")
    assert proc.returncode == 0 and len(outputs) == len(cmds), f"{where}: the shell stopped ({proc.returncode})"
    return outputs


def _expect(cmds: list[Command], outputs: list[str], pattern: str, needle: str) -> int:
    checked = 0
    for c, out in zip(cmds, outputs):
        if re.search(pattern, c.text):
            assert needle in out, f"`{c.text}` did not print {needle!r}:\n{out[-2000:]}"
            checked += 1
    return checked


def test_extraction_keeps_heredocs_and_drops_comments():
    block = ["packbench db upgrade   # the schema", "cat > a.yaml <<'EOF'", "name: x   # kept", "EOF",
             "packbench a \\", "  --b", "# a note"]
    got = [c.text for c in commands(block, 1)]
    assert got == ["packbench db upgrade", "cat > a.yaml <<'EOF'\nname: x   # kept\nEOF", "packbench a \\\n  --b"]


@pytest.mark.ray
def test_the_tutorial_runs_as_written(tmp_path, ray_address):
    doc = (ROOT / "docs" / "tutorial.md").read_text()
    cmds = [c for start, block in shell_blocks(doc) for c in commands(block, start)]
    assert len(cmds) >= 8
    outputs = run_all(cmds, cwd=tmp_path, env=sandbox(tmp_path, ray_address), where="docs/tutorial.md")
    assert _expect(cmds, outputs, r"^packbench audit\b", "AGREE") >= 1
    assert _expect(cmds, outputs, r"^packbench submit .*--wait", "PASS") >= 2
    assert _expect(cmds, outputs, r"^packbench protocol validate", "sha256") >= 1
    assert (tmp_path / "report.html").is_file()


@pytest.mark.ray
def test_the_readme_commands_run_as_written(tmp_path, ray_address):
    readme = (ROOT / "README.md").read_text()
    demo = demo_recipe((ROOT / "Makefile").read_text())
    using = [c for start, block in shell_blocks(section(readme, "Using it")) for c in commands(block, start)]
    assert len(using) >= 15
    env = sandbox(tmp_path)
    run_all(demo, cwd=tmp_path, env=env, where="Makefile demo")  # an embedded Ray, as make demo's
    joined = {**env, "PACKBENCH_RAY_ADDRESS": ray_address}
    outputs = run_all(using, cwd=tmp_path, env=joined, where="README.md, Using it")
    assert _expect(using, outputs, r"^packbench audit latest$", "AGREE") == 1


def test_the_protocol_example_validates_and_plans_as_copied(tmp_path):
    doc = (ROOT / "docs" / "protocol.md").read_text()
    example = section(doc, "Example")
    m = re.search(r"^```yaml\n(.*?)^```", example, flags=re.M | re.S)
    assert m, "docs/protocol.md's Example has no yaml block"
    m_name = re.search(r"saved as `(protocols/[\w.-]+\.yaml)`", example, flags=re.I)
    assert m_name, "docs/protocol.md's Example says where to save it"
    env = sandbox(tmp_path)
    (tmp_path / m_name.group(1)).write_text(m.group(1))
    cmds = [Command(f"packbench protocol validate {m_name.group(1)}", 0),
            Command(f"packbench protocol plan {m_name.group(1)}", 0)]
    outputs = run_all(cmds, cwd=tmp_path, env=env, where="docs/protocol.md, Example")
    assert "phase-switched-2.7b" in outputs[0]


def test_the_tutorials_validate_output_is_what_validate_prints(tmp_path, tiny, packbench_cli):
    """The tutorial showed `read as schema 5` after the newest schema had become 7: the block it
    shows is compared with what `protocol validate` prints for its own protocol."""
    doc = (ROOT / "docs" / "tutorial.md").read_text()
    body = re.search(r"cat > protocols/first\.yaml <<'EOF'\n(.*?)\nEOF\n", doc, re.S).group(1)
    shown = re.search(r"```text\n(valid: first-protocol .*?)\n```", doc, re.S).group(1)
    (tmp_path / "protocols").mkdir()
    (tmp_path / "protocols" / "first.yaml").write_text(body + "\n")
    (tmp_path / ".packbench" / "models").mkdir(parents=True)
    (tmp_path / ".packbench" / "models" / "tiny").symlink_to(tiny)
    r = packbench_cli("protocol", "validate", "protocols/first.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == shown.strip()


def test_the_quickstart_protocol_says_what_a_file_without_schema_reads_as():
    text = (ROOT / "protocols" / "quickstart.yaml").read_text()
    assert "read at the newest schema" in text and "read as schema 3" not in text


API_SECTIONS = ("Names, tags and notes", "Sweeps", "History and regressions")
FAIL_ABOVE = r"--fail-above\b"


@pytest.mark.ray
def test_the_api_docs_shell_blocks_run_as_written(tmp_path, ray_address):
    """docs/api.md's command blocks, top to bottom, in the folder `make demo` leaves. They named
    screen 7 and sweep sw-1a2b3c4d5e, which no fresh clone has, and `results --tag` came before
    the tagged screen had run: each must now exit 0 as written (a `--fail-above` line 0 or 1,
    its judgement, which it must print) and show what its block promises."""
    doc = (ROOT / "docs" / "api.md").read_text()
    blocks = {h: [c for start, block in shell_blocks(section(doc, h)) for c in commands(block, start)]
              for h in API_SECTIONS}
    assert [len(blocks[h]) for h in API_SECTIONS] == [5, 4, 4]
    env = sandbox(tmp_path, ray_address)
    run_all(demo_recipe((ROOT / "Makefile").read_text()), cwd=tmp_path, env=env, where="Makefile demo")
    cmds = [c for h in API_SECTIONS for c in blocks[h]]
    outs = run_all(cmds, cwd=tmp_path, env=env, where="docs/api.md", judged=FAIL_ABOVE)

    def out(prefix: str) -> str:
        (hit,) = [o for c, o in zip(cmds, outs) if c.text.startswith(prefix)]
        return hit

    # Names: the tag set on `latest` (the nightly just submitted, screen 2, as the compare line
    # below assumes) shows where --tag branch=main selects, the untagged key is gone, and the
    # csv holds the nightly's packet episodes only.
    assert "screen 2: done" in out("packbench submit protocols/quickstart.yaml --wait --name nightly")
    assert "screen 2: name nightly; tags branch=main, reviewed=yes" in out("packbench screens tag latest")
    for listing in (out("packbench screens list --tag"), out("packbench screens list --name")):
        (row,) = [line for line in listing.splitlines() if line.startswith("2 ")]
        assert "nightly" in row and "branch=main,reviewed=yes" in row and "box=" not in listing
        assert not any(line.startswith("1 ") for line in listing.splitlines())
    csv_rows = [r for r in csv.DictReader(io.StringIO(out("packbench results --tag"))) if r.get("condition")]
    assert csv_rows and {(r["screen_id"], r["condition"]) for r in csv_rows} == {("2", "packet")}
    # Sweeps: two points planned, four screens queued and run, and `--sweep latest` is that sweep.
    assert out("packbench protocol plan").startswith("2 points")
    queued = out("packbench submit protocols/quickstart.yaml --sweep")
    sweep_id = re.search(r"queued sweep (sw-[0-9a-f]+): 4 screens", queued).group(1)
    assert out("packbench dispatch").count(": done; archive:") == 4
    page = (tmp_path / "sweep.html").read_text()
    assert page.lstrip().lower().startswith("<!doctype html") and sweep_id in page and "<svg" in page
    # History: the two quickstart screens (1 and 2) at this commit, with their figures; each
    # --fail-above line exits 0 or 1 and says which.
    plain = [o for c, o in zip(cmds, outs) if c.text.split("#")[0].split() == ["packbench", "history", "quickstart"]]
    assert len(plain) == 1 and "quickstart: 2 screens over 1 commits" in plain[0] and "decode_ms_per_token" in plain[0]
    assert "wrote history.html" in out("packbench history quickstart --condition")
    assert (tmp_path / "history.html").read_text().lstrip().lower().startswith("<!doctype html")
    judged = [(c, o, (tmp_path / f".rc-{i}").read_text().strip()) for i, (c, o) in enumerate(zip(cmds, outs))
              if re.search(FAIL_ABOVE, c.text)]
    assert len(judged) == 2
    for c, o, rc in judged:
        said = re.search(r"^regression: ", o, re.M) if rc == "1" else "no regression: nothing slower by more than 10%" in o
        assert said, f"`{c.text}` exited {rc} without saying so:\n{o[-2000:]}"
