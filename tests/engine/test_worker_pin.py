"""Issue 10: what was measured is pinned. The worker records the checkpoint's content digest in
its start record and refuses a protocol that pins another digest before any episode runs (a cold
load hashes while it reads; the model it read is dropped)."""

import shutil

import pytest

from packbench.core.errors import CheckpointError
from packbench.core.protocol import freeze
from packbench.core.provenance import checkpoint_digest
from packbench.engine.worker import Worker


def body(path, **model):
    return freeze({"name": "pin", "model": {"path": str(path), **model}, "dtype": "float32",
                   "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 4,
                   "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}],
                   "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
                   "gates": {"faithfulness": {}}}).body


def test_the_start_record_carries_the_digest_and_a_pin_is_enforced(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    digest = checkpoint_digest(ckpt)
    worker = Worker(device="cpu")
    start = worker.load(body(ckpt, sha256=digest), str(ckpt))
    assert start["model_sha256"] == digest
    # Overwrite the weights (same names, new bytes): the pin refuses before loading them.
    weights = sorted(ckpt.glob("*.safetensors"))[0]
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))
    refusing = Worker(device="cpu")
    with pytest.raises(CheckpointError, match="the protocol pins"):
        refusing.load(body(ckpt, sha256=digest), str(ckpt))
    assert refusing.model is None  # nothing read under the refused pin stays loaded
    # Unpinned, the changed checkpoint runs, and its start record says what was measured.
    assert Worker(device="cpu").load(body(ckpt), str(ckpt))["model_sha256"] == checkpoint_digest(ckpt) != digest


def test_a_load_that_fails_reports_its_own_error_not_the_digest_thread(tiny, tmp_path):
    """The digest runs beside the read: a checkpoint the reader refuses fails with the reader's
    error, and the worker loads a good checkpoint afterwards."""
    ckpt = tmp_path / "broken"
    shutil.copytree(tiny, ckpt)
    weights = sorted(ckpt.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:64])  # truncated: the header promises more
    worker = Worker(device="cpu")
    with pytest.raises(Exception) as failed:
        worker.load(body(ckpt), str(ckpt))
    assert "digest" not in str(failed.value) and worker.model is None
    assert worker.load(body(tiny), str(tiny))["model_sha256"] == checkpoint_digest(tiny)


def test_model_digest_prints_what_a_protocol_pins(tiny):
    from typer.testing import CliRunner

    from packbench.cli.main import app
    from packbench.core.provenance import checkpoint_digest

    out = CliRunner().invoke(app, ["model", "digest", str(tiny)])
    assert out.exit_code == 0 and out.stdout.strip() == checkpoint_digest(tiny)
    assert len(out.stdout.strip()) == 64


def test_hidden_folders_of_a_clone_or_download_do_not_move_the_digest(tiny, tmp_path):
    """Bug caught: the digest hashed every file, so `.git/` of a clone and `.cache/huggingface/` of
    `huggingface-cli download --local-dir` (download metadata with timestamps) gave the same
    weights fetched twice two digests, and a protocol pinning one refused the other. A visible
    file still moves it, at any depth, and a generated checkpoint's digest is the one archived."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    digest = checkpoint_digest(ckpt)
    (ckpt / ".git" / "objects").mkdir(parents=True)
    (ckpt / ".git" / "objects" / "ab").write_bytes(b"a clone's object")
    (ckpt / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (ckpt / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("etag\n1796479675.1\n")
    (ckpt / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / ".hidden").write_text("x")
    assert checkpoint_digest(ckpt) == digest
    (ckpt / "sub" / "notes.txt").write_text("x")  # a visible file below the top is the checkpoint's
    assert checkpoint_digest(ckpt) != digest
    assert Worker(device="cpu").load(body(ckpt), str(ckpt))["model_sha256"] == checkpoint_digest(ckpt)
