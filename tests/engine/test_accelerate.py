"""The `accelerate` competitor on the CPU, and the worker holding one condition's device state at a
time. On the CPU accelerate has no device to offload to, so its hooks copy nothing (0 bytes, as
the ledger says); the counting itself is proved on hooks that do move tensors, with `meta`
standing in for the GPU (no bytes are really copied there: the test proves what the counter adds
up, the H200 run measures real copies)."""

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.accelerate import AcceleratedModel, count_copies, layer_of
from packbench.engine.episode import run_episode
from packbench.engine.ledger import Recorder
from packbench.engine.model import CpuFirstModel
from packbench.engine.worker import Worker

pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accelerate_is_dense_stream_bit_for_bit(tiny, dtype):
    """Exact tier: the same stock OPT arithmetic, so the same logits (decided by this test)."""
    acc = AcceleratedModel(tiny, dtype=dtype, device=torch.device("cpu"), allowance_bytes=64 << 20)
    ref = CpuFirstModel(tiny, dtype=dtype, device=torch.device("cpu"))
    ref.use("dense-stream")
    prompt = list(range(4, 20))
    a, r = run_episode(acc, prompt, continuation=6), run_episode(ref, prompt, continuation=6)
    assert np.array_equal(a.logits, r.logits) and a.tokens == r.tokens
    assert acc.stats.offloaded_modules == 0 and sum(sum(c.h2d_weight_bytes) for c in a.calls) == 0


def test_the_bytes_its_hooks_copy_are_counted_per_call_and_layer(tiny):
    from accelerate import cpu_offload

    acc = AcceleratedModel(tiny, dtype=torch.float32, device=torch.device("cpu"), allowance_bytes=64 << 20)
    model = acc._model
    # Every module offloaded, executed on `meta`: each hook's pre_forward places its weights there.
    cpu_offload(model, execution_device=torch.device("meta"))
    recorder = Recorder(2)
    hidden = acc.config.hidden_size
    wrapped = count_copies(model, recorder, row_bytes=hidden * 4)
    assert wrapped > 0
    layer = model.model.decoder.layers[1]
    recorder.begin(phase="decode", tokens=1)
    x = torch.zeros((1, 1, hidden), device="meta")
    layer.fc1(layer.final_layer_norm(x))  # two hooked modules of layer 1
    fc1 = sum(t.numel() * 4 for t in (layer.fc1.weight, layer.fc1.bias))
    norm = sum(t.numel() * 4 for t in (layer.final_layer_norm.weight, layer.final_layer_norm.bias))
    call = recorder.current
    assert call.h2d_weight_bytes == [0, fc1 + norm]
    assert call.rows_copied[1] * hidden * 4 == fc1 + norm and call.h2d_index_bytes == [0, 0]
    assert (layer_of("model.decoder.layers.7.fc1", 12), layer_of("model.decoder.final_layer_norm", 12),
            layer_of("model.decoder.embed_tokens", 12)) == (7, 11, 0)


def _body(model: Path, **changes) -> dict:
    raw = {"name": "c", "model": {"path": str(model)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 6,
           "conditions": [{"policy": "dense-stream"}, {"policy": "accelerate"},
                          {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
           "gates": {"faithfulness": {}, "fidelity": {"max_mean_kl": 1.0}}, **changes}
    return freeze(raw).body


def test_the_worker_holds_one_conditions_device_state_at_a_time(tiny, monkeypatch):
    pytest.importorskip("torchao")
    import packbench.engine.conditions.quantized as w  # the runtime that builds QuantizedModel

    body = _body(tiny)
    assert body["schema"] == 6 and body["conditions"][2]["params"]["mode"] == "compile"
    worker = Worker(device="cpu")
    seen = []
    real = w.QuantizedModel

    def built(*a, **k):  # the CPU-first model is parked and no other competitor is held meanwhile
        seen.append((worker.parked, worker.competitor))
        return real(*a, **k)

    monkeypatch.setattr(w, "QuantizedModel", built)
    start = worker.load(body, str(tiny))
    assert start["quantized"]["int8-weight-only"]["state"] == "cold" and seen == [(True, None)]
    ids = prompts(body, vocab=start["vocab"])
    records, refs = [], []
    for entry in plan(body):
        records.append(worker.run(entry, ids[entry["prompt"]]))
        held = worker.competitor[1] if worker.competitor else None
        refs.append((entry["condition"], worker.parked, None if held is None else weakref.ref(held)))
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    gc.collect()
    for i, (condition, parked, ref) in enumerate(refs):
        assert parked == (condition != "dense-stream")
        if condition == "dense-stream":
            assert ref is None  # an exact episode released the competitor
        elif condition == "accelerate" and i + 1 < len(refs) and refs[i + 1][0] != condition:
            assert ref() is None, f"the {condition} model outlived its episodes"
    # the int8 model waits on the host (QuantizedModel.shelve) while other conditions run: one object throughout
    assert len({id(ref()) for condition, _, ref in refs if condition == "int8"}) == 1
    assert [m for m in worker.shelf.values()] == [ref() for condition, _, ref in refs if condition == "int8"][-1:]
    by = {r["condition"]: r for r in records if r["role"] == "scored"}
    assert by["accelerate"]["tier"] == "exact" and by["accelerate"]["offload"]["offloaded_modules"] == 0
    assert np.array_equal(by["accelerate"]["logits"], by["dense-stream"]["logits"]) or \
        by["accelerate"]["prompt"] != by["dense-stream"]["prompt"]
    int8 = [r for r in records if r["condition"] == "int8"]
    # compile on the CPU falls back to eager decode over the static cache, and says why
    assert all(r["engine"]["mode"] == "compile" and r["engine"]["decode_graph"] == "eager: no CUDA graphs on cpu"
               for r in int8)
    assert all(r["quantization"]["quantize_s"] > 0 and r["quantization"]["state"] in ("cold", "warm", "shelved")
               for r in int8)


@pytest.mark.ray
def test_submit_wait_runs_and_audits_an_accelerate_screen(tmp_path, tiny, packbench_cli, ray_address):
    """`submit --wait` in a subprocess on the session's Ray (tests/conftest.py `ray_address`);
    the other commands in this process."""
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body.pop("schema")
    body.update(name="accelerate-screen", continuation_tokens=6, model={"path": str(tiny)},
                conditions=[{"policy": "dense-stream"}, {"policy": "accelerate"}],
                gates={"faithfulness": {"tolerance": 0.0}})
    (tmp_path / "protocol.yaml").write_text(yaml.safe_dump(body))
    settings = {"PACKBENCH_DB_URL": f"sqlite:///{tmp_path / 'packbench.db'}"}
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, **settings, PACKBENCH_RAY_ADDRESS=ray_address, RAY_AUTH_MODE="disabled", PYTHONPATH=path)

    def cli(*args):
        return packbench_cli(*args, env=settings, cwd=tmp_path)

    assert cli("db", "upgrade").returncode == 0
    out = subprocess.run([sys.executable, "-m", "packbench", "submit", "protocol.yaml", "--wait", "--json"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    verdicts = {(v["gate"], v["condition"]): v["passed"] for v in summary["verdicts"]}
    assert verdicts[("faithfulness", "accelerate")] is True, summary["verdicts"]
    audit = cli("audit", str(summary["screen_id"]))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    plan_out = cli("protocol", "plan", "protocol.yaml")
    assert plan_out.returncode == 0 and "accelerate (accelerate): mode eager; cannot be captured: accelerate's hooks" \
        in plan_out.stdout, plan_out.stdout


def device_budgets(monkeypatch) -> list[int]:
    """CUDA's calls and accelerate's placement stood in for on the CPU: returns the list that
    collects each device budget (max_memory[0]) accelerate is given."""
    import accelerate

    budgets = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(accelerate, "infer_auto_device_map",
                        lambda model, max_memory, **kw: budgets.append(max_memory[0]) or {"": "cpu"})
    monkeypatch.setattr(accelerate, "dispatch_model", lambda model, **kw: model)
    return budgets


def test_max_memory_leaves_room_for_the_whole_batchs_kv_cache(tiny, monkeypatch):
    """accelerate's max_memory reserved one sequence's KV cache whatever the protocol's batch, so at
    batch B it placed (B - 1) sequences' cache worth of weights into room the batch then needed (the
    H200's batch-32 screen: out of memory in both accelerate episodes, 4.74 GiB allocated of the 4.83
    allowed). The CUDA-only calls are stood in for so that the arithmetic runs on the CPU."""
    from packbench.engine.accelerate import KV_MARGIN, kv_bytes
    from packbench.engine.conditions.accelerate import RUNTIME

    budgets = device_budgets(monkeypatch)
    allowance, context, capacity, batch = 1024 << 20, 1 << 20, 40, 8

    class Holder:  # what the runtime reads of the worker
        path, dtype, device = tiny, torch.float32, torch.device("cuda", 0)
        placement = None

    holder = Holder()
    holder.allowance, holder.context, holder.capacity, holder.batch = allowance, context, capacity, batch
    m = RUNTIME.build(holder, {})
    kv = kv_bytes(m.config, capacity, torch.float32) * batch
    assert budgets == [allowance - context - kv - KV_MARGIN] == [m.stats.max_memory_bytes]


def test_a_re_execution_places_accelerate_by_the_archived_device_budget(tiny, monkeypatch):
    """CPU twin of a CUDA re-execution: the archive's worker measured a 300 MiB context, the fresh
    one 1 MiB. The bug it catches: `max_memory` sized again at the fresh context gave accelerate's
    device map more layers on the device, and the re-run moved other bytes than the archive. Handed
    the archived `offload`, it places by the archived budget; one the fresh worker cannot hold
    beside its own reserve is PlacementDoesNotFit (core/reexecute.py: an episode not judged)."""
    from packbench.core.errors import PlacementDoesNotFit
    from packbench.engine.conditions.accelerate import RUNTIME

    budgets = device_budgets(monkeypatch)

    class Holder:
        path, dtype, device = tiny, torch.float32, torch.device("cuda", 0)
        allowance, context, capacity, batch, placement = 1024 << 20, 300 << 20, 40, 1, None

    archived = RUNTIME.build(Holder(), {}).stats.as_dict()
    Holder.context, Holder.placement = 1 << 20, archived
    assert RUNTIME.build(Holder(), {}).stats.max_memory_bytes == archived["max_memory_bytes"] == budgets[0]
    assert budgets == [budgets[0]] * 2
    Holder.context = 301 << 20
    with pytest.raises(PlacementDoesNotFit, match="archived accelerate placement gave the device"):
        RUNTIME.build(Holder(), {})


def test_a_device_map_that_places_nothing_on_the_device_is_told_apart():
    """The rule that decides accelerate's full offload (engine/accelerate.py places_on_device):
    a map of the host (and disk) only places nothing; any device entry, index or name, places
    something. Bug caught: {"": "cpu"} dispatched unhooked, left on the host, failed its first call."""
    from packbench.engine.accelerate import places_on_device

    assert not places_on_device({"": "cpu"})
    assert not places_on_device({"model.embed_tokens": "cpu", "model.layers": "disk", "lm_head": "cpu"})
    assert places_on_device({"model.embed_tokens": 0, "model.layers": "cpu"})
    assert places_on_device({"": "cuda:0"})
