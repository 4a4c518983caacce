"""The `zero-inference` competitor (DeepSpeed ZeRO-3 parameter offload) on the CPU.

DeepSpeed is an sdist built against the installed torch (`pip install --no-build-isolation`), so it
is not in the `test` extra (an isolated build would fetch a second, CUDA torch): `make test` installs the
`[offload]` extra with --no-build-isolation and runs these tests (the `deepspeed` marker, which a
bare `pytest` deselects) in a pytest process of their own: `pytest -m deepspeed
tests/engine/test_zero_inference.py`. The submit refusal
(tests/service) runs everywhere. On the CPU DeepSpeed's gather finds each partition on the
execution device already (nothing crosses a link: 0 bytes in the ledger); the counting itself is
proved with `meta` standing in for the GPU, as for accelerate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.episode import run_episode
from packbench.engine.ledger import Recorder
from packbench.engine.model import CpuFirstModel
from packbench.engine.worker import Worker

pytestmark = pytest.mark.deepspeed
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def zi():
    from packbench.engine.zero_inference import ZeroInferenceModel

    return lambda path, dtype: ZeroInferenceModel(path, dtype=dtype, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_inference_is_dense_stream_bit_for_bit_on_the_cpu(tiny, zi, dtype):
    """Tier exact is earned: stock OPT arithmetic behind DeepSpeed's gathers gives dense-stream's
    logits (a gather that reordered or rounded a partition would fail here)."""
    z = zi(tiny, dtype)
    ref = CpuFirstModel(tiny, dtype=dtype, device=torch.device("cpu"))
    ref.use("dense-stream")
    prompt = list(range(4, 20))
    a, r = run_episode(z, prompt, continuation=6), run_episode(ref, prompt, continuation=6)
    assert np.array_equal(a.logits, r.logits) and a.tokens == r.tokens
    # Every call gathered the offloaded partitions (hooks ran); none crossed a link on the CPU.
    assert z.gathered_bytes >= 7 * (z.stats.offloaded_bytes // 2) > 0
    assert sum(sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in a.calls) == 0
    zo = z.stats.ds_config["zero_optimization"]
    assert zo["stage"] == 3 and zo["offload_param"]["device"] == "cpu"
    assert zo["stage3_param_persistence_threshold"] == z.config.hidden_size


def test_every_partition_a_gather_copies_is_counted_in_its_layers_ledger(tiny, zi, monkeypatch):
    """With `meta` as the execution device every gathered host partition counts as moved: the
    ledger of one call must hold exactly each layer's non-persistent partitions (a gather that was
    not wrapped, a prefetch missed, or a parameter charged to the wrong layer fails it)."""
    from packbench.engine.zero_inference import count_gathers

    z = zi(tiny, torch.float32)
    hidden, layers = z.config.hidden_size, z.config.num_hidden_layers
    recorder, tally = Recorder(layers), [0]
    owners = z.owners
    count_gathers(z._engine.optimizer.get_param_coordinator(), owners, recorder, device=torch.device("meta"),
                  row_bytes=hidden * 4, tally=tally)
    # The oracle: DeepSpeed's one copy site at world size 1 (`_no_gather_coalesced`, which makes each
    # parameter's `ds_tensor.to(device)` handle), tallied per layer independently of the wrapper.
    import deepspeed.runtime.zero.partition_parameters as pp

    copied = [0] * layers
    real = pp._no_gather_coalesced

    def no_gather(params):
        params = list(params)
        for p in params:
            copied[owners[id(p)]] += p.ds_tensor.numel() * p.ds_tensor.element_size()
        return real(params)

    monkeypatch.setattr(pp, "_no_gather_coalesced", no_gather)
    matrices = [0] * layers  # what every call must bring: the offloaded matrices, each at least once
    for p in {id(p): p for p in z._model.parameters()}.values():
        if not p.ds_persist:
            matrices[owners[id(p)]] += p.ds_tensor.numel() * 4
    ledgers = []
    # A prefill (DeepSpeed records its module trace), a call that re-gathers the persistent vectors once
    # more after the trace is complete, then steady decode-sized calls.
    for ids in ([[5, 6, 7, 8]], [[9]], [[10]], [[11]]):
        copied[:] = [0] * layers
        recorder.begin(phase="prefill", tokens=len(ids[0]))
        before = tally[0]
        with torch.inference_mode():
            z._model(input_ids=torch.tensor(ids))
        call = recorder.current
        got = [w + i for w, i in zip(call.h2d_weight_bytes, call.h2d_index_bytes)]
        assert got == copied and tally[0] - before == sum(got)
        assert all(g >= m > 0 for g, m in zip(got, matrices))
        ledgers.append(got)
    assert ledgers[2] == ledgers[3] != ledgers[0]  # steady state: the same partitions every decode call
    assert all(r * hidden * 4 == w for r, w in zip(call.rows_copied, call.h2d_weight_bytes))


def test_a_deepspeed_bound_to_another_accelerator_is_refused_in_one_line(tiny, zi):
    """DeepSpeed picks its accelerator once per process: a CUDA worker whose process imported it
    for the CPU must refuse before any episode, naming the variable that fixes it."""
    from packbench.engine.zero_inference import ZeroInferenceUnavailable, library

    zi(tiny, torch.float32)  # imported for the CPU
    with pytest.raises(ZeroInferenceUnavailable, match="DS_ACCELERATOR=cuda") as e:
        library(torch.device("cuda"))
    assert "\n" not in str(e.value)


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def test_deepspeed_leaves_no_rendezvous_in_the_process_environment(tiny, zi):
    """The one-rank group DeepSpeed needs rendezvouses over an explicit address: the process
    environment keeps no MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE of it. Written there, they
    reached every process started afterwards (a Ray head, its workers), whose own group then
    rendezvoused on a port this process still held: the Ray screen test below failed after the
    in-process tests above."""
    before = {k: os.environ.get(k) for k in RENDEZVOUS}
    model = zi(tiny, torch.float32)
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 1 and model.gathered_bytes == 0
    assert {k: os.environ.get(k) for k in RENDEZVOUS} == before


def _body(model: Path) -> dict:
    raw = {"name": "z", "model": {"path": str(model)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 6,
           "conditions": [{"policy": "dense-stream"}, {"policy": "zero-inference"}, {"policy": "packet"}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    return freeze(raw).body


def test_the_worker_runs_zero_inference_beside_loaders_and_records_its_configuration(tiny):
    """Through the plugin table: the worker builds it, parks the CPU-first model, drops it for a
    loader, and every record carries DeepSpeed's configuration and the exact logits."""
    body = _body(tiny)
    assert body["schema"] == 7 and body["conditions"][1]["params"]["mode"] == "eager"
    worker = Worker(device="cpu")
    start = worker.load(body, str(tiny))
    ids = prompts(body, vocab=start["vocab"])
    records = [worker.run(entry, ids[entry["prompt"]]) for entry in plan(body)]
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    zero = [r for r in records if r["condition"] == "zero-inference"]
    assert zero and all(r["tier"] == "exact" and r["offload"]["ds_config"]["zero_optimization"]["stage"] == 3
                        and r["offload"]["library_version"] for r in zero)
    by = {(r["condition"], r["prompt"], r["role"]): r["logits"] for r in records}
    for (cond, prompt, role), logits in by.items():
        if cond == "zero-inference":
            assert np.array_equal(logits, by[("dense-stream", prompt, role)])


def test_a_released_zero_inference_model_leaves_the_process_as_it_found_it(tiny, monkeypatch):
    """The worker interleaves conditions: once another takes the device, nothing of DeepSpeed's may
    stay. The bugs it catches, both found on the H200 (every episode after zero-inference's first ran
    out of memory, accelerate's failed on a device mismatch): the engine kept alive by DeepSpeed's
    module-level stack and its coordinator's lru_cache (its gathered parameters with it), and
    zero.Init's memory_efficient_linear replacing torch.nn.functional.linear for the whole process."""
    import gc
    import weakref

    import torch.nn.functional as F
    from deepspeed.runtime.zero import parameter_offload

    import packbench.engine.zero_inference as zim

    linear = F.linear
    built = []
    real = zim.ZeroInferenceModel.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        built.append((weakref.ref(self._engine), weakref.ref(self._model)))

    monkeypatch.setattr(zim.ZeroInferenceModel, "__init__", spy)
    body = _body(tiny)
    worker = Worker(device="cpu")
    start = worker.load(body, str(tiny))
    ids = prompts(body, vocab=start["vocab"])
    entries = plan(body)
    records = []
    for entry in entries:
        records.append(worker.run(entry, ids[entry["prompt"]]))
        if entry["condition"] == "zero-inference":
            assert F.linear is linear  # not DeepSpeed's zero3_linear_wrap, even while it is held
    loader = next(e for e in entries if e["condition"] == "packet")
    records.append(worker.run(loader, ids[loader["prompt"]]))  # whatever ran last, a loader takes the device
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    assert len(built) >= 1
    gc.collect()
    assert all(engine() is None and model() is None for engine, model in built), "a released engine outlived its condition"
    assert not any(m is model() for m in parameter_offload.FWD_MODULE_STACK for _, model in built)
    assert F.linear is linear
    worker.drop_model()


@pytest.mark.ray
def test_submit_wait_runs_and_audits_a_zero_inference_screen(tmp_path, tiny, packbench_cli, ray_address):
    """Archive and audit: `submit --wait` then `audit` agree, and faithfulness passes at tolerance 0."""
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body.pop("schema")
    body.update(name="zero-inference-screen", continuation_tokens=6, model={"path": str(tiny)},
                conditions=[{"policy": "dense-stream"}, {"policy": "zero-inference"}],
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
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    summary = json.loads(out.stdout)
    verdicts = {(v["gate"], v["condition"]): v["passed"] for v in summary["verdicts"]}
    assert verdicts[("faithfulness", "zero-inference")] is True, summary["verdicts"]
    audit = cli("audit", str(summary["screen_id"]))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]


def _peak_gathered(model, calls) -> int:
    """The most parameter elements DeepSpeed held gathered (available or in flight, persistent ones
    aside) at any module boundary of the last of `calls` (token-id lists, one cache)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list({id(p): p for p in model._model.parameters()}.values())
    peak = [0]

    def hook(*_):
        peak[0] = max(peak[0], sum(p.ds_numel for p in params
                                   if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist))

    handles = [h for m in model._model.modules() for h in (m.register_forward_pre_hook(hook), m.register_forward_hook(hook))]
    cache = model.new_cache()
    for ids in calls:
        peak[0] = 0
        model.forward(torch.tensor([ids]), cache)
    for h in handles:
        h.remove()
    return peak[0]


def test_a_decode_call_gathers_no_more_than_the_allowance_leaves(tiny):
    """The configuration derived from the allowance bounds what a decode call holds gathered: its
    peak is within the budget (allowance less KV cache, activations and persistent parameters).
    DeepSpeedExamples' settings (live parameters and prefetch at 2 x hidden^2, reuse distance 1e9)
    go over the same budget: the tied embedding stays gathered through the call while the next
    layers are prefetched. And the model is partitioned before deepspeed.initialize: handed an
    unpartitioned module, initialize moved the whole model onto the device first (module.to), the
    out-of-memory of every episode on the H200. Logits stay dense-stream's bit for bit."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from packbench.engine.opt_weights import stock_model
    from packbench.engine.checkpoint import build_weights
    from packbench.engine.zero_inference import ZeroInferenceModel, budget

    cpu = torch.device("cpu")
    weights = build_weights(tiny, dtype=torch.float32)
    hidden = weights.config.hidden_size
    probe = budget(stock_model(weights, vars(weights.config)), weights.config, dtype=torch.float32, allowance=0,
                   context=0, held=0, capacity=22, batch=1, cuda=False)
    # room for one prefetch bucket of DeepSpeed's own size beyond the second largest module the limit reserves
    allowance = probe.needed + (probe.largest_module + 2 * hidden * hidden) * 4
    partitioned = []
    real = DeepSpeedEngine._configure_distributed_model

    def spy(self, model):
        partitioned.append(all(hasattr(p, "ds_id") for p in model.parameters()))
        return real(self, model)

    DeepSpeedEngine._configure_distributed_model = spy
    try:
        z = ZeroInferenceModel(tiny, dtype=torch.float32, device=cpu, allowance_bytes=allowance, capacity=22)
    finally:
        DeepSpeedEngine._configure_distributed_model = real
    assert partitioned == [True]
    calls = [list(range(4, 20)), [5], [6]]
    b = z.budget
    assert b.largest_module == weights.config.vocab_size * hidden  # OPT's tied token embedding
    assert 0 < _peak_gathered(z, calls) * 4 <= b.gather_bytes
    zo = z.stats.ds_config["zero_optimization"]
    assert zo["stage3_max_reuse_distance"] == 0 and zo["stage3_max_live_parameters"] == b.max_live
    assert z.stats.budget["gather_bytes"] == b.gather_bytes
    today = ZeroInferenceModel(tiny, dtype=torch.float32, device=cpu)  # DeepSpeedExamples' settings, no allowance
    # the bound above can fail: the example's setting gathers more than an allowance of the minimum
    # plus one of its own prefetch buckets leaves
    assert _peak_gathered(today, calls) * 4 > (b.largest_module + 2 * hidden * hidden) * 4
    ref = CpuFirstModel(tiny, dtype=torch.float32, device=cpu)
    ref.use("dense-stream")
    a, r = run_episode(z, calls[0], continuation=6), run_episode(ref, calls[0], continuation=6)
    assert np.array_equal(a.logits, r.logits) and a.tokens == r.tokens


def test_the_live_limit_leaves_room_for_the_modules_own_fetch_and_the_prefetchs_overshoot():
    """DeepSpeed's prefetch loop adds parameters while the live count is under the limit (the last
    one goes past it by up to one parameter) and a module fetches its own parameters whatever the
    limit says, so the limit is the gather budget less twice the largest module, never below 0.
    The bug it catches: the limit of the budget less one largest module, which ran out of memory on
    the H200 (OPT-2.7B at 4800 MiB, a decode call's prefetch asking for the embedding's 246 MiB)."""
    from packbench.engine.zero_inference import ZeroBudget

    def plan(gather_elements: int, largest: int = 1000) -> ZeroBudget:
        return ZeroBudget(allowance=gather_elements * 2 + 700, context=300, held=100, persistent=100, kv=100,
                          activations=100, largest_module=largest, element_bytes=2, threshold=8)

    assert plan(5000).gather_bytes == 10000
    assert plan(5000).max_live == 3000 and plan(2000).max_live == 0 and plan(2001).max_live == 1
    assert plan(1500).max_live == 0 and plan(1500).fits  # one module gathered, nothing prefetched
    assert plan(1000).fits and not plan(999).fits  # below one module: refused (ds_config raises)
    assert plan(1000).needed == plan(1000).allowance and plan(999).needed == plan(999).allowance + 2
    assert plan(5000).as_dict()["max_live_parameters"] == 3000


def test_an_allowance_below_deepspeeds_minimum_is_refused_naming_the_allowance_it_needs(tiny):
    """Below one module's gathered parameters beside the KV cache and activations, DeepSpeed cannot
    run: one line naming the allowance that would do, before anything is partitioned."""
    from packbench.engine.zero_inference import AllowanceTooSmall, ZeroInferenceModel

    with pytest.raises(AllowanceTooSmall, match=r"needs an allowance of at least \d+ MiB") as e:
        ZeroInferenceModel(tiny, dtype=torch.float32, device=torch.device("cpu"), allowance_bytes=1 << 10, capacity=22)
    assert "\n" not in str(e.value)


def test_the_audit_names_an_edited_configuration_tier_policy_or_ledger_of_a_zero_inference_archive(tiny, tmp_path):
    """A consistent forgery (manifest recomputed) of one zero-inference episode: its DeepSpeed
    configuration, budget, tier, policy, params or ledger edited. The bug it catches: the auditor
    never read `offload` nor the record's `policy` and `params`, so a screen whose record said ZeRO
    stage 2, no offload, or another allowance audited AGREE. The unedited archive agrees, and the
    worker's budget is the torch-free arithmetic of the tiny shape (the check a synthetic model gets)."""
    from cpu_screen import archive_screen, resealed

    from packbench.core.audit import audit_archive
    from packbench.core.canonical import canonical_json
    from packbench.core.conditions.base import RecordContext
    from packbench.core.conditions.zero_inference import record_problems
    from packbench.core.registry import shape_config

    frozen = freeze({"name": "z", "model": {"path": str(tiny)}, "dtype": "float32",
                     "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16, "continuation_tokens": 4,
                     "conditions": [{"policy": "dense-stream"}, {"policy": "zero-inference"}],
                     "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}})
    path = tmp_path / "screen.zip"
    _, episodes, _ = archive_screen(frozen, tiny, path)
    assert audit_archive(path).agrees
    zero = next(e for e in episodes if e["condition"] == "zero-inference" and e["role"] == "scored")
    ctx = RecordContext(allowance_bytes=64 << 20, dtype="float32", batch=1, capacity=20, cuda=False,
                        config=shape_config("tiny"))
    assert record_problems({"mode": "eager"}, zero, ctx) == []
    member = f"episodes/{zero['plan_index']:05d}.json"

    def forged(edit) -> list[str]:
        def apply(members):
            rec = json.loads(members[member])
            edit(rec)
            members[member] = canonical_json(rec)

        out = tmp_path / "forged.zip"
        out.unlink(missing_ok=True)
        report = audit_archive(resealed(path, out, apply))
        assert not report.agrees
        return report.record["problems"]

    def zero_opt(rec):
        return rec["offload"]["ds_config"]["zero_optimization"]

    cases = [
        (lambda r: zero_opt(r).update(stage=2), "offload.ds_config: zero_optimization.stage recorded 2, expected 3"),
        (lambda r: zero_opt(r)["offload_param"].update(device="none"),
         "offload.ds_config: zero_optimization.offload_param.device recorded none, expected cpu"),
        (lambda r: r["offload"]["budget"].update(allowance=32 << 20),
         "offload.budget: allowance 33554432 is not the protocol's 67108864"),
        (lambda r: r.pop("offload"), "offload: no DeepSpeed configuration recorded"),
        (lambda r: r.update(tier="approximate"), "tier 'approximate' is not its condition's (exact)"),
        (lambda r: r.update(policy="accelerate"), "policy 'accelerate' is not its condition's ('zero-inference')"),
        (lambda r: r.update(params={"mode": "graph"}), "params {'mode': 'graph'} is not its condition's"),
        (lambda r: r["calls"][1].update(h2d_weight_bytes=[256, 0], rows_copied=[1, 0]),
         "stored h2d_weight_bytes 0 != 256 recomputed from the call ledger"),
    ]
    for edit, line in cases:
        problems = forged(edit)
        assert any(p == f"{member}: {line}" or p.startswith(f"{member}: {line}") for p in problems), (line, problems)


@pytest.mark.parametrize("tight", [True, False])
def test_a_steady_decode_calls_ledger_is_the_hand_count_of_the_checkpoints_offloaded_tensors(tiny, tight):
    """Every byte DeepSpeed's hooks move is in the ledger, against a count made by hand from the
    checkpoint's own tensors (not DeepSpeed's bookkeeping): each tensor of more than `hidden` elements,
    once per decode call, in its decoder layer's ledger (embeddings in layer 0); the tied token
    embedding a second time where the budget frees it between the embedding and `lm_head` (an
    allowance of the minimum: reuse distance 0 and nothing prefetched), once where it stays gathered
    through the call (DeepSpeedExamples' reuse distance of 1e9 elements). With `meta` standing in for
    the device every gathered partition counts as moved. A gather left uncounted, a prefetch counted
    twice, or a tensor charged to another layer changes a layer's total."""
    from safetensors.torch import load_file

    from packbench.core.conditions.zero_inference import minimum_allowance
    from packbench.engine.zero_inference import ZeroInferenceModel, count_gathers

    config = json.loads((tiny / "config.json").read_text())
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    kw = dict(allowance_bytes=minimum_allowance(config, dtype="float32", capacity=22, batch=1), capacity=22) \
        if tight else {}
    z = ZeroInferenceModel(tiny, dtype=torch.float32, device=torch.device("cpu"), **kw)
    recorder = Recorder(layers)
    count_gathers(z._engine.optimizer.get_param_coordinator(), z.owners, recorder, device=torch.device("meta"),
                  row_bytes=h * 4, tally=[0])
    hand = [0] * layers
    for name, t in load_file(tiny / "model.safetensors").items():
        if t.numel() > h:
            hand[int(name.split("layers.")[1].split(".")[0]) if ".layers." in name else 0] += t.numel() * 4
    embedding = config["vocab_size"] * h * 4
    hand[0] += embedding if tight else 0
    assert hand[0] > embedding > 0 and hand[1] > 0
    for ids in ([[5, 6, 7, 8]], [[9]], [[10]], [[11]]):
        recorder.begin(phase="decode", tokens=len(ids[0]))
        with torch.inference_mode():
            z._model(input_ids=torch.tensor(ids))
        call = recorder.current
    assert [w + i for w, i in zip(call.h2d_weight_bytes, call.h2d_index_bytes)] == hand
    assert call.h2d_index_bytes == [0] * layers  # every tensor is whole hidden-sized rows


def test_a_re_execution_configures_deepspeed_with_the_archived_budget_not_one_sized_again(tiny, tmp_path,
                                                                                          monkeypatch):
    """The archive sized DeepSpeed's live parameters and prefetch bucket from the CUDA context its
    worker measured (stood in for here: a CPU worker measures none); the re-execution's fresh worker
    measures another. The bug it catches: the re-run sized its configuration again, ran another
    prefetch, and nothing compared the configuration, so the re-execution agreed only because the
    bytes happened to match. The archived budget is handed over and its offload section compared."""
    from cpu_screen import archive_screen
    from rerun import rerun_here

    from packbench.service.audit import reexecute_archive

    measured = {"context": 0}
    monkeypatch.setattr(Worker, "context", property(lambda self: measured["context"], lambda self, value: None),
                        raising=False)
    frozen = freeze({"name": "z", "model": {"path": str(tiny)}, "dtype": "float32",
                     "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 4,
                     "conditions": [{"policy": "dense-stream"}, {"policy": "zero-inference"}],
                     "reference": "dense-stream", "warmups": 1, "allowance_mib": 256, "gates": {"faithfulness": {}}})
    measured["context"] = 200 << 20  # the archive's worker
    _, episodes, _ = archive_screen(frozen, tiny, tmp_path / "screen.zip")
    zero = [e for e in episodes if e["condition"] == "zero-inference"]
    assert zero and all(e["status"] == "ok" and e["offload"]["budget"]["context"] == 200 << 20 for e in zero)
    measured["context"] = 0  # the re-execution's fresh worker: a live limit 200 MiB larger, sized again
    configs = []
    import packbench.engine.zero_inference as zim

    real = zim.ds_config
    monkeypatch.setattr(zim, "ds_config", lambda **k: configs.append(real(**k)) or configs[-1])
    rerun_here(monkeypatch, lambda: Worker(device="cpu"))
    out = reexecute_archive(tmp_path / "screen.zip", k=3, seed=0, time_factor=1e6, model_dir=str(tiny))
    assert out.agrees and out.record["placements"] == "archived", out.problems
    assert configs and all(c == zero[0]["offload"]["ds_config"] for c in configs)
