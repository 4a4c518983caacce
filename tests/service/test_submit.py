"""Submitting screens (service/submit.py): `--replicas` bounded, and queued all at once or not at
all, labels included."""

from __future__ import annotations

import pytest

import packbench.db.labels
from packbench.core.errors import PackbenchError
from packbench.service.submit import MAX_REPLICAS, submit
from tests.service.screens import interrupt_on_call, protocol_file


def test_replicas_are_bounded_before_anything_is_stored(store, tmp_path):
    """The bug caught: an unbounded count, with which `submit q.yaml --replicas 100000000` queued
    47,473 screens in the 60 s it ran."""
    for count in (MAX_REPLICAS + 1, 100_000_000, 0):
        with pytest.raises(PackbenchError, match=rf"^--replicas {count}: give 1 to {MAX_REPLICAS} screens per submit"):
            submit(store, protocol_file(tmp_path), replicas=count)
    assert store.list_screens() == []


def test_replicas_are_queued_in_one_transaction_labels_included(store, tmp_path, monkeypatch):
    """An interrupt part-way (here: labelling the third replica) queues none of them. The bug
    caught: one transaction per replica, which left every replica before the interrupt queued."""
    calls, real = interrupt_on_call(monkeypatch, packbench.db.labels, "label", 3)
    with pytest.raises(KeyboardInterrupt):
        submit(store, protocol_file(tmp_path), replicas=5, name="batch", tags={"k": "v"})
    assert len(calls) == 3 and store.list_screens() == [] and store.queued_screens() == []
    monkeypatch.setattr(packbench.db.labels, "label", real)
    ids = submit(store, protocol_file(tmp_path), replicas=5, name="batch", spread=True)
    screens = store.queued_screens()
    assert [s.id for s in screens] == ids and len(ids) == 5
    assert len({s.replica_group for s in screens}) == 1 and screens[0].replica_group
    assert {s.name for s in screens} == {"batch"}


def test_a_checkpoint_without_weight_files_is_refused_before_a_screen_is_queued(store, tmp_path):
    """The bug caught: submit read config.json alone, so an OPT directory holding only
    pytorch_model.bin (or a sharded checkpoint lacking a shard) was queued and its screen failed
    on the worker, its archive written for nothing."""
    import json

    import yaml

    from packbench.engine.synth import synth_checkpoint

    model = synth_checkpoint(tmp_path / "m", shape="tiny", dtype="float32", sparsity=0.94, seed=0)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    path = protocol_file(tmp_path)
    body = yaml.safe_load(path.read_text())
    body["model"] = {"path": str(model)}
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(PackbenchError, match="lacks 1 of the 2 shards model.safetensors.index.json lists "
                                             "\\(first: 'model-00002-of-00002.safetensors'\\); copy the whole"):
        submit(store, path)
    assert store.list_screens() == []
