"""The plain worker behind the Ray actor: failures are recorded and survived; recording can be off."""

import time
from pathlib import Path

import numpy as np
import pytest

from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.policies.dense import DenseStream
from packbench.engine.policies.device_gather import DevicePacket
from packbench.engine.policies.host_gather import Packet
from packbench.engine.worker import Worker


def body(tiny, **changes):
    raw = {"name": "w", "model": {"path": str(tiny)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8, "continuation_tokens": 3,
           "conditions": [{"policy": "dense-stream"}, {"policy": "packet", "params": {"gather": "host"}},
                          {"name": "packet-device", "policy": "packet", "params": {"gather": "device"}},
                          {"name": "broken", "policy": "sparse-extents"}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
           "gates": {"faithfulness": {}}, **changes}
    return freeze(raw).body


def run_all(tiny, **changes):
    b = body(tiny, **changes)
    worker = Worker(device="cpu")
    start = worker.load(b, str(tiny))
    ids = prompts(b, vocab=start["vocab"])
    return start, [worker.run(e, ids[e["prompt"]]) for e in plan(b)]


def test_a_failing_episode_is_recorded_and_the_next_one_runs(tiny, monkeypatch):
    from packbench.engine.policies.host_gather import SparseExtents

    def out_of_memory(self, layer, h):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(the allocator's details)")

    monkeypatch.setattr(SparseExtents, "fetch", out_of_memory)
    start, records = run_all(tiny)
    by_condition = {r["condition"]: r for r in records}
    broken = by_condition["broken"]
    assert broken["status"] == "failed" and "CUDA out of memory" in broken["error"]
    assert broken["logits"] is None and "\n" not in broken["error"]
    assert all(by_condition[c]["status"] == "ok" for c in ("dense-stream", "packet", "packet-device"))
    after = [r for r in records if r["plan_index"] > broken["plan_index"]]
    assert all(r["status"] == "ok" for r in after)
    assert start["cpu_first"] and start["param_bytes"] == start["device_param_bytes"] + start["host_outgoing_bytes"]


def test_record_fields_the_gates_read(tiny):
    _, records = run_all(tiny)
    r = next(r for r in records if r["condition"] == "packet")
    assert r["first_logit_since_entry_s"] > 0 and r["wall_s"] >= r["call_s"] > 0
    assert r["episode_s"] >= r["wall_s"]  # the worker's whole time for the entry: activation included
    assert r["phases"]["prefill"]["calls"] == 1 and r["phases"]["decode"]["calls"] == 2
    assert r["memory"]["kv_bytes"] > 0 and r["memory"]["peak_sampled_bytes"] is None  # no NVML on the CPU
    assert r["trace"].shape == (0, 2)


def test_a_new_protocols_packet_runs_the_device_gather_on_the_cpu(tiny):
    """Issue 11: a `packet` that does not say where it gathers is DevicePacket in schema 3 (a
    YAML without `schema:`), exact on the CPU (plain torch ops, engine/gather.py); in schema 2 it
    is the host gather it always was."""
    for schema, params, policy in ((None, {"gather": "device"}, DevicePacket), (2, {}, Packet)):
        changes = {"conditions": [{"policy": "dense-stream"}, {"policy": "packet"}]}
        b = body(tiny, **changes, **({} if schema is None else {"schema": schema}))
        worker = Worker(device="cpu")
        ids = prompts(b, vocab=worker.load(b, str(tiny))["vocab"])
        records = {}
        for e in plan(b):
            records.setdefault(e["condition"], []).append(worker.run(e, ids[e["prompt"]]))
            assert type(worker.model.slot.policy) is (policy if e["condition"] == "packet" else DenseStream)
        dense, packet = records["dense-stream"], records["packet"]
        assert [r["params"] for r in packet] == [params] * len(packet), schema  # the record says what ran
        for d, k in zip(dense, packet):
            assert k["status"] == "ok" and np.array_equal(d["logits"], k["logits"]) and d["tokens"] == k["tokens"]


def test_recording_off_keeps_logits_and_drops_the_ledger(tiny):
    _, on = run_all(tiny)
    _, off = run_all(tiny, recording=False)
    for a, b in zip(on, off):
        if a["status"] != "ok":
            continue
        assert np.array_equal(a["logits"], b["logits"]) and a["tokens"] == b["tokens"]
        assert b["h2d_weight_bytes"] == 0 and b["d2h_bytes"] == 0
        assert [c["wall_s"] > 0 for c in b["calls"]] == [True] * 3  # calls are still timed
    assert sum(a["h2d_weight_bytes"] for a in on if a["status"] == "ok") > 0


def test_a_worker_keeps_its_model_across_screens_of_the_same_checkpoint(tiny, checkpoints):
    """Warm reuse: same checkpoint and dtype -> the model object is kept and logits are identical;
    another dtype, another checkpoint or reuse=False -> a cold load."""
    worker = Worker(device="cpu")
    b = body(tiny, conditions=[{"policy": "dense-stream"}, {"policy": "packet"}])
    first = worker.load(b, str(tiny))
    model = worker.model
    ids = prompts(b, vocab=first["vocab"])
    cold = [worker.run(e, ids[e["prompt"]]) for e in plan(b)]
    t_before = time.perf_counter()
    second = worker.load(body(tiny, conditions=[{"policy": "dense-stream"}, {"policy": "packet"}], allowance_mib=32),
                         str(tiny))
    assert (first["model_state"], second["model_state"]) == ("cold", "warm") and worker.model is model
    assert second["allowance_bytes"] == 32 << 20 and second["read_s"] == first["read_s"]  # measured where it happened
    warm = [worker.run(e, ids[e["prompt"]]) for e in plan(b)]
    since = time.perf_counter() - t_before
    for a, w in zip(cold, warm):
        assert a["tokens"] == w["tokens"] and np.array_equal(a["logits"], w["logits"])
        assert 0 < w["first_logit_since_entry_s"] <= since  # the clock restarted at the second load
    assert worker.load(b, str(tiny), reuse=False)["model_state"] == "cold" and worker.model is not model
    other = worker.load(body(checkpoints["float16"], dtype="float16"), str(checkpoints["float16"]))
    assert other["model_state"] == "cold" and worker.model.dtype != model.dtype


def test_workers_generating_one_synthetic_spec_at_once_never_read_a_partial_checkpoint(tmp_path):
    """Two processes generate the same spec into one cache at the same moment: both end with a
    complete checkpoint in the same folder, and no temporary folder is left behind."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        from pathlib import Path
        from packbench.core.protocol import expand, freeze
        from packbench.engine.checkpoint import read_config
        from packbench.engine.worker import model_dir_for
        raw = {{"name": "s", "model": {{"synth": {{"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 3}}}},
               "dtype": "float32", "prompts": {{"generator": {{"seed": 0, "count": 1}}}}, "prefix_tokens": 8,
               "continuation_tokens": 2, "conditions": [{{"policy": "dense-stream"}}], "reference": "dense-stream",
               "warmups": 1, "allowance_mib": 64, "gates": {{"faithfulness": {{}}}}}}
        out = model_dir_for(expand(freeze(raw).body), None, cache=Path({str(tmp_path)!r}))
        read_config(out)
        print(out)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(outs) == 1
    assert [p.name for p in tmp_path.iterdir()] == [Path(outs.pop()).name]  # no .tmp-* left


def test_a_damaged_cached_checkpoint_is_generated_again_not_used(tmp_path):
    """Bug caught: a worker's cached synthetic checkpoint whose model.safetensors was cut short
    after it was placed (half-copied, a disk that lost its tail) was used again: every screen of
    the spec failed on it, told to run `packbench model synth`, which never writes the cache. Now
    the worker removes the damaged folder and generates the spec again, the same bytes (a damaged
    folder kept would hold a node's disk: checkpoints run to tens of GB)."""
    from packbench.core.protocol import expand, freeze
    from packbench.engine.checkpoint import reads_whole
    from packbench.engine.worker import model_dir_for

    raw = {"name": "s", "model": {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 5}},
           "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
           "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}], "reference": "dense-stream",
           "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    protocol = expand(freeze(raw).body)
    out = model_dir_for(protocol, None, cache=tmp_path)
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert not reads_whole(out)
    assert model_dir_for(protocol, None, cache=tmp_path) == out
    assert reads_whole(out) and (out / "model.safetensors").read_bytes() == weights
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the damaged folder removed, no .tmp-* left
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert model_dir_for(protocol, None, cache=tmp_path) == out  # whole: used as it is, not written again
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_the_environment_holds_plain_values_a_driver_without_torch_can_unpickle():
    import torch

    from packbench.engine.worker import environment

    env = environment(torch.device("cpu"))
    # torch.__version__ is a TorchVersion (a str subclass): unpickling one imports torch.
    assert {type(v) for v in env.values()} <= {str, int, float, bool, type(None)}


def test_each_episode_records_the_other_packbench_workers_busy_on_the_host(tiny, tmp_path, monkeypatch):
    """Another worker on the host (another cluster's, another GPU's) shares its cores and memory
    while it loads or runs episodes: an episode run while one is busy lists it; an idle one, or
    one gone, is not listed (the presence itself lists every live one)."""
    import os

    import packbench.engine.gpu_lock
    from packbench.engine.gpu_lock import HostPresence

    monkeypatch.setattr(packbench.engine.gpu_lock, "DEFAULT_LOCK_DIR", tmp_path)
    b = body(tiny)
    worker = Worker(device="cpu")
    assert worker.presence.others() == []
    start = worker.load(b, str(tiny))
    entry = plan(b)[0]
    prompt = prompts(b, vocab=start["vocab"])[entry["prompt"]]
    first = worker.run(entry, prompt)
    assert first["host_workers"] == []
    # What any other process took meanwhile (engine/host_load.py), from /proc on Linux.
    assert first["host_load"]["other_cpu_s"] >= 0 and first["host_load"]["cores"] == os.cpu_count()
    neighbour = HostPresence("GPU-neighbour", directory=tmp_path)
    assert worker.presence.others() == [[os.getpid(), "GPU-neighbour"]]  # alive
    assert worker.run(entry, prompt)["host_workers"] == []  # idle all along
    neighbour.busy()
    assert worker.run(entry, prompt)["host_workers"] == [[os.getpid(), "GPU-neighbour"]]
    neighbour.idle()
    assert worker.run(entry, prompt)["host_workers"] == []
    # The worker itself is busy only while it loads or runs: between episodes the neighbour's
    # view of it is idle.
    assert neighbour.others(since=time.time()) == []
    neighbour.release()


def test_a_worker_whose_lock_directory_is_unusable_runs_and_records_none(tiny, tmp_path, monkeypatch):
    import packbench.engine.gpu_lock

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(packbench.engine.gpu_lock, "DEFAULT_LOCK_DIR", blocked)
    b = body(tiny)
    worker = Worker(device="cpu")
    start = worker.load(b, str(tiny))
    entry = plan(b)[0]
    record = worker.run(entry, prompts(b, vocab=start["vocab"])[entry["prompt"]])
    assert record["status"] == "ok" and record["host_workers"] is None  # unknown, not "nobody"


def test_no_collection_runs_inside_an_episode_and_each_record_names_what_ran_before(tiny):
    """A collection inside an episode's wall was a position effect (issue 43): with the collector's
    thresholds at 1 (a collection at nearly every allocation) none may run while an episode does;
    and every record names the worker's previous episode (None for its first)."""
    import gc

    b = body(tiny)
    worker = Worker(device="cpu")
    start = worker.load(b, str(tiny))
    ids = prompts(b, vocab=start["vocab"])
    inside, seen = [False], []
    real = worker._run

    def spy(entry, prompt):
        inside[0] = True
        try:
            return real(entry, prompt)
        finally:
            inside[0] = False

    def on_gc(phase, info):
        if phase == "start" and inside[0]:
            seen.append(info["generation"])

    worker._run = spy
    thresholds = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1, 1, 1)
    try:
        records = [worker.run(e, ids[e["prompt"]]) for e in plan(b)]
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
    assert seen == []
    assert records[0]["previous"] is None
    for before, r in zip(records, records[1:]):
        assert r["previous"] == {"condition": before["condition"], "plan_index": before["plan_index"], "load": 1}


@pytest.mark.parametrize("damage", ["config.json removed", "config.json not JSON"])
def test_a_cached_moe_checkpoint_without_a_readable_config_is_generated_again(tmp_path, damage):
    """Bug caught: a cached synthetic MoE checkpoint whose config.json was removed (a removal of
    the cache folder cut short) made every screen of the spec fail with `OSError: [Errno 39]
    Directory not empty` from the rename of a fresh copy onto the old folder, leaving that copy
    behind as <folder>.tmp-PID; one whose config.json no longer read as JSON failed every screen
    told to fix "the JSON object a Hugging Face OPT checkpoint has", in a folder the user never
    wrote. Now both are damaged folders like a cut safetensors file: removed and generated again."""
    from packbench.core.protocol import expand, freeze
    from packbench.engine.worker import model_dir_for

    raw = {"name": "s", "model": {"synth": {"shape": "olmoe-tiny", "dtype": "float32", "seed": 5, "layers": 1}},
           "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
           "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}], "reference": "dense-stream",
           "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    protocol = expand(freeze(raw).body)
    out = model_dir_for(protocol, None, cache=tmp_path)
    config, weights = (out / "config.json").read_bytes(), (out / "model.safetensors").read_bytes()
    if damage == "config.json removed":
        (out / "config.json").unlink()
    else:
        (out / "config.json").write_bytes(config[: len(config) // 2])
    assert model_dir_for(protocol, None, cache=tmp_path) == out
    assert (out / "config.json").read_bytes() == config and (out / "model.safetensors").read_bytes() == weights
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the damaged folder removed, no .tmp-* left


def test_a_model_cache_that_refuses_the_write_is_one_line_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    """Bug caught: a model cache that is full (or read-only) while a worker generates a synthetic
    MoE checkpoint failed the screen with `OSError: [Errno 28] No space left on device`, naming
    neither the folder nor the fix, and left the partial copy (<folder>.tmp-PID) holding the space
    it had taken. Now the copy is removed and one CheckpointError names the cache and the fix."""
    import errno

    from packbench.core.errors import CheckpointError
    from packbench.core.protocol import expand, freeze
    from packbench.engine.moe import synth
    from packbench.engine.worker import model_dir_for

    def full(out, **spec):
        Path(out).mkdir(parents=True)
        (Path(out) / "model.safetensors").write_bytes(b"\0" * 1024)  # part of a checkpoint, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synth, "synth_moe", full)
    raw = {"name": "s", "model": {"synth": {"shape": "olmoe-tiny", "dtype": "float32", "seed": 5, "layers": 1}},
           "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
           "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}], "reference": "dense-stream",
           "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    with pytest.raises(CheckpointError, match=r"model cache .* \(No space left on device\); .*--model-cache"):
        model_dir_for(expand(freeze(raw).body), None, cache=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no partial copy left
