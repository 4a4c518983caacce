"""Every member kind of a real screen's archive is covered by its manifest hash: a CPU screen
through the driver (service/screen.py) with an exact loader and a low-bit competitor writes
protocol.json, plan.json, worker.json, episodes/, logits/, traces/ (the CPU's empty memory
traces), forced/ (the competitor's teacher-forced logits), verdicts.json and manifest.json. A
same-size rewrite of any one of them that keeps every zip CRC valid (what a forger with
zipfile writes) is reported as that member altered, by verify() and by the auditor; random
byte damage anywhere in the file is always some problem."""

import random
import zipfile
from pathlib import Path

import pytest

from archive_samples import rewrite
from packbench.core.archive import MANIFEST_NAME, ArchiveReader
from packbench.core.audit import audit_archive
from packbench.core.errors import ArchiveError

KINDS = ("protocol.json", "plan.json", "worker.json", "verdicts.json", "episodes/", "logits/", "traces/", "forced/")


@pytest.fixture(scope="module")
def real_archive(tmp_path_factory, tiny) -> Path:
    pytest.importorskip("torchao")  # a test extra: installed wherever the suite runs
    from packbench.core.canonical import canonical_json, sha256_hex
    from packbench.core.plan import episode_input, prompts
    from packbench.core.protocol import freeze
    from packbench.db.store import Store
    from packbench.engine.worker import Worker
    from packbench.service.screen import ScreenRun

    root = tmp_path_factory.mktemp("real-screen")
    body = freeze({"name": "members", "model": {"path": str(tiny)}, "dtype": "float32",
                   "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 6, "continuation_tokens": 2,
                   "conditions": [{"policy": "dense-stream"}, {"policy": "packet"},
                                  {"name": "int8", "policy": "quantized",
                                   "params": {"method": "int8-weight-only", "mode": "eager"}}],
                   "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
                   "gates": {"faithfulness": {}, "fidelity": {"max_mean_kl": 1.0}}}).body
    store = Store(f"sqlite:///{root / 'screen.db'}")
    store.upgrade()
    try:
        protocol_id = store.put_protocol(sha256=sha256_hex(canonical_json(body)), name=body["name"],
                                         canonical_json=canonical_json(body).decode())
        screen_id = store.create_screen(protocol_id=protocol_id, submitter="test", model_dir=str(tiny))
        archive = root / "screen.zip"
        attempt = store.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                      machine_id=None, source_freeze={}, archive_path=str(archive))
        worker = Worker(device="cpu")
        start = worker.load(body, str(tiny))
        ids = prompts(body, vocab=start.pop("vocab"))
        run = ScreenRun(store, screen=store.screen(screen_id), attempt=attempt, protocol=body, archive_path=archive,
                        freeze={})
        run.begin(worker.describe())
        for entry in run.loaded(start, ids):
            run.record(worker.run(entry, episode_input(ids, entry)))
        run.finish()
    finally:
        store.close()
    return archive


def first_of(names: list[str], kind: str) -> str:
    return next(n for n in names if n == kind or (kind.endswith("/") and n.startswith(kind)))


def test_the_real_archive_holds_every_member_kind_and_audits(real_archive):
    with ArchiveReader(real_archive) as r:
        names = list(r.names)
        assert r.verify() == []
    assert all(any(n == k or (k.endswith("/") and n.startswith(k)) for n in names) for k in KINDS + (MANIFEST_NAME,))
    report = audit_archive(real_archive)
    assert report.agrees, report.problems


@pytest.mark.parametrize("kind", KINDS)
def test_a_same_size_crc_valid_rewrite_of_each_member_kind_is_altered(real_archive, tmp_path, kind):
    forged = tmp_path / "forged.zip"
    forged.write_bytes(real_archive.read_bytes())
    with zipfile.ZipFile(forged) as zf:
        name = first_of(zf.namelist(), kind)
        data = bytearray(zf.read(name))
    data[-2] ^= 0x01  # one bit of the content, the size kept (JSON ends in `}`, an array in data)
    rewrite(forged, replace={name: bytes(data)})  # zipfile recomputes every CRC
    with zipfile.ZipFile(forged) as zf:
        assert zf.testzip() is None and zf.getinfo(name).file_size == len(data)  # the zip itself is sound
    with ArchiveReader(forged) as r:
        assert [(p.member, p.kind, p.message) for p in r.verify()] == [
            (name, "altered", f"altered member {name} (sha256 mismatch)")]
    report = audit_archive(forged)
    assert not report.agrees and f"altered member {name} (sha256 mismatch)" in report.problems


def test_random_damage_to_the_real_archive_is_always_a_problem(real_archive, tmp_path):
    """Byte damage anywhere (headers, directory, any member's data) or truncation: the reader
    refuses the file or verify() names at least one problem; never an intact verdict."""
    orig = real_archive.read_bytes()
    path = tmp_path / "damaged.zip"
    rng = random.Random(47)
    for _ in range(150):
        raw = bytearray(orig)
        for _ in range(rng.choice([1, 2])):
            at = rng.randrange(len(raw))
            raw[at] ^= rng.randrange(1, 256)  # a real change
        if rng.random() < 0.2:
            raw = raw[: rng.randrange(len(raw))]
        path.write_bytes(raw)
        try:
            r = ArchiveReader(path, max_member_bytes=1 << 22)
        except ArchiveError:
            continue
        with r:
            assert r.verify() != [], f"damaged file verified as intact (first change at byte {at})"

