"""The driver's signing hook (service/screen.py ScreenRun(signer=...)): a sealed archive gets its
detached signature, the attempt its signer and checkpoint digest, and the signed archive audits
as AGREE against the signer's public key. A fake store stands in for the database."""

from types import SimpleNamespace

import numpy as np

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.audit import audit_archive
from packbench.core.plan import prompts
from packbench.core.protocol import freeze
from packbench.core.provenance import Signer, generate_key, load_public_key, signature_path
from packbench.service.screen import ScreenRun


class FakeStore:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))


def test_a_finished_screen_is_signed(tmp_path):
    raw = synthetic_protocol(prompts_n=2, repetitions=1)
    made = write_synthetic_screen(tmp_path / "reference.zip", raw)  # records a worker would return
    key, pub, key_id = generate_key(tmp_path / "k.pem")
    store = FakeStore()
    env = {"host": "synthetic", "device": "cuda:0"}
    run = ScreenRun(store, screen=SimpleNamespace(id=1, model_dir=None), attempt=SimpleNamespace(id=7, number=1),
                    protocol=freeze(raw).body, archive_path=tmp_path / "a.zip", freeze={}, signer=Signer.load(key))
    run.begin(env)
    run.loaded({**made["start"], "model_sha256": "e" * 64}, prompts(made["body"], vocab=64))
    for e in made["episodes"]:
        peak = e["memory"]["peak_sampled_bytes"]
        trace = np.array([[0.0, float(peak - 5 * 2**20)], [0.01, float(peak)]], dtype=np.float64)
        run.record({**e, "trace": trace})
    outcome = run.finish()
    assert signature_path(tmp_path / "a.zip").is_file()
    assert ("set_attempt_evidence", (7,), {"model_sha256": "e" * 64, "signer_key_id": key_id}) in store.calls
    report = audit_archive(outcome.archive_path, trust=[load_public_key(pub)])
    assert report.record["signature"] == {"status": "valid", "key_id": key_id}
    assert report.agrees, report.problems
