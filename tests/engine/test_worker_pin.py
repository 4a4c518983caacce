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
