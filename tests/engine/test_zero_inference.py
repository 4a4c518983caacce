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


def test_the_memory_probe_reports_the_gathered_peak_per_variant(tiny):
    """bench/zero_memory_probe.py, the CPU twin of the H200 probe: each variant in its own process,
    one JSON line each, the variant's configuration as run, and a gathered peak that is positive
    and at most the model's parameters (catches a probe that counts nothing, or counts a parameter
    twice: the tied embedding is one parameter)."""
    r = subprocess.run([sys.executable, "-m", "bench.zero_memory_probe", str(tiny), "--variants", "default,small",
                        "--prefix", "8", "--decode", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["variant"] for row in rows] == ["default", "small"]
    assert "stage3_max_reuse_distance" not in rows[0]["config"]
    assert rows[1]["config"]["stage3_max_reuse_distance"] == 0 and rows[1]["config"]["stage3_prefetch_bucket_size"] == 0
    for row in rows:
        assert "error" not in row, row
        for phase in ("prefill", "decode"):
            assert 0 < row[phase]["gathered"] <= row["parameters"], row
            assert row[phase]["gathered_at"].startswith("enter ")
