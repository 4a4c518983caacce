"""The `flexgen` condition over the real FlexGen 0.1.8 on the CPU, CUDA stood in for.

FlexGen's OptLM has no CPU path (it makes CUDA streams, synchronises CUDA and moves decode attention
`.cuda()`), so the worker refuses it on a CPU device. These tests stand in for exactly those calls
(torch.cuda.Stream / stream / synchronize, Tensor.cuda as identity, pinned allocation off: no pinned
allocator without CUDA) and run FlexGen's own code otherwise, with its "gpu" a second CPU TorchDevice,
so every host-homed weight is really copied by `smart_copy` each step. They prove the wiring
(logits, teacher forcing, stamps, bytes at FlexGen's copy sites, the worker's records), not FlexGen's
CUDA kernels' numerics: on CUDA its decode attention runs in float16 on the device, here in float32
on the host. FlexGen is in the `[offload]` extra: the `flexgen` marker (a bare pytest deselects it;
make test runs it in a process of its own: `pytest -m flexgen tests/engine/test_flexgen_cpu.py`)."""

from __future__ import annotations

import contextlib
import importlib
import json

import numpy as np
import pytest
import torch

from packbench.core.conditions.flexgen import placement
from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel

pytestmark = pytest.mark.flexgen


class _Stream:  # a class, as transformers' annotations say `torch.cuda.Stream | None` at import
    pass


class _Disk:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def cpu_flexgen(monkeypatch, tmp_path):
    """A factory of FlexGenModels on the CPU (module docstring)."""
    importlib.import_module("flexgen.flex_opt")  # first: it fixes FlexGen's recursive imports (TorchCompressedDevice)
    from flexgen.pytorch_backend import TorchDevice
    from flexgen.utils import ExecutionEnv

    import packbench.engine.flexgen as pf

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    allocate = TorchDevice.allocate
    monkeypatch.setattr(TorchDevice, "allocate", lambda self, shape, dtype, pin_memory=None, name=None:
                        allocate(self, shape, dtype, pin_memory=False, name=name))
    monkeypatch.setattr(pf, "refusal", lambda device, dtype: None)
    env = ExecutionEnv(gpu=TorchDevice("cpu"), cpu=TorchDevice("cpu"), disk=_Disk(), mixed=None)
    monkeypatch.setattr(pf, "environment", lambda device, scratch: env)

    def make(checkpoint, *, params, batch=1, capacity=32):
        return pf.FlexGenModel(checkpoint, dtype=torch.float16, device=torch.device("cpu"), params=params,
                               allowance_bytes=1 << 30, context_bytes=0, capacity=capacity, batch=batch,
                               cache=tmp_path / "cache")
    return make


PROMPTS = [[2] + list(range(10, 25)), [2] + list(range(30, 45))]


@pytest.fixture
def dense(checkpoints):
    model = CpuFirstModel(checkpoints["float16"], dtype=torch.float16, device=torch.device("cpu"))
    model.use("dense-stream")
    return model


def test_flexgens_logits_are_dense_streams_within_float16_and_forcing_feeds_the_reference(cpu_flexgen, checkpoints,
                                                                                            dense):
    """Free: FlexGen's tokens are dense-stream's and its logits within float16 rounding (its own
    kernels). Forced on tokens no greedy run picks: every position's logits are those of
    dense-stream forced on the same tokens, so the forced token is what FlexGen fed on."""
    fg = cpu_flexgen(checkpoints["float16"], params={"w_gpu_percent": 50}, batch=2)
    ref = run_episode(dense, PROMPTS, continuation=6)
    out = run_episode(fg, PROMPTS, continuation=6)
    assert out.tokens == ref.tokens and out.logits.dtype == np.float32
    assert np.abs(out.logits - ref.logits).max() < 2e-3
    forced = [[101, 7, 300, 42, 9], [5, 250, 77, 3, 11]]
    ref_f = run_episode(dense, PROMPTS, continuation=6, forced=forced)
    out_f = run_episode(fg, PROMPTS, continuation=6, forced=forced)
    assert np.abs(out_f.logits - ref_f.logits).max() < 2e-3
    assert np.abs(out_f.logits - ref.logits).max() > 0.1  # the forced tokens changed what it saw
    assert out_f.tokens == [[int(t) for t in row.argmax(-1)] for row in out_f.logits]


@pytest.mark.parametrize("share", [0, 50, 100])
def test_every_call_counts_the_weights_flexgen_copied_from_their_host_home(cpu_flexgen, checkpoints, share):
    """Each step FlexGen copies every host-homed weight (smart_copy), the next step's first layer
    during the step before: every call's ledger holds exactly the bytes core's placement rule
    puts on the CPU (so the rule is FlexGen's own), and the model's pinned figure agrees."""
    import json

    config = json.loads((checkpoints["float16"] / "config.json").read_text())
    fg = cpu_flexgen(checkpoints["float16"], params={"w_gpu_percent": share})
    out = run_episode(fg, PROMPTS[0], continuation=4)
    host = sum(placement(config, share)[1])
    assert fg.stats.pinned_bytes == host and fg.stats.policy["w_gpu_percent"] == share
    assert [sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in out.calls] == [host] * 4
    assert (host > 0) == (share < 100)
    assert all(c.wall_s > 0 for c in out.calls) and sum(c.wall_s for c in out.calls) <= out.wall_s
    assert [c.phase for c in out.calls] == ["prefill", "decode", "decode", "decode"]


def test_the_worker_runs_flexgen_its_archive_holds_the_policy_and_the_audit_agrees(cpu_flexgen, checkpoints,
                                                                                  tmp_path):
    """Through the plugin table, as the driver archives a screen: built beside dense-stream, every
    episode ok, tier approximate, the policy FlexGen ran with (chosen from the allowance) in
    `offload.policy`, judged by the fidelity gate on teacher-forced logits; the auditor agrees."""
    from cpu_screen import archive_screen

    from packbench.core.audit import audit_archive
    from packbench.core.protocol import freeze

    ck = checkpoints["float16"]
    frozen = freeze({"name": "fg", "model": {"path": str(ck)}, "dtype": "float16",
                     "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 8, "continuation_tokens": 3,
                     "conditions": [{"policy": "dense-stream"}, {"policy": "flexgen"}], "reference": "dense-stream",
                     "warmups": 1, "allowance_mib": 256,
                     "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.5}}})
    _, episodes, verdicts = archive_screen(frozen, ck, tmp_path / "screen.zip")
    assert all(e["status"] == "ok" for e in episodes), [e.get("error") for e in episodes]
    fg = [e for e in episodes if e["condition"] == "flexgen"]
    assert fg and all(e["tier"] == "approximate" and e["offload"]["policy"]["chosen"]
                      and e["offload"]["policy"]["w_gpu_percent"] == 100 for e in fg)
    fidelity = [v for v in verdicts if v["gate"] == "fidelity"]
    assert fidelity and all(v["passed"] for v in fidelity), fidelity
    report = audit_archive(tmp_path / "screen.zip")
    assert report.agrees, report.record["problems"]


def test_the_audit_names_an_edited_flexgen_policy(cpu_flexgen, checkpoints, tmp_path):
    """A consistent forgery (manifest recomputed) of one flexgen episode's placement policy: a share
    other than the frozen one, compression on, a chosen flag where the condition froze the share.
    The bug it catches: the auditor never read `offload.policy`, so each audited AGREE."""
    import json

    from cpu_screen import archive_screen, resealed

    from packbench.core.audit import audit_archive
    from packbench.core.canonical import canonical_json
    from packbench.core.protocol import freeze

    ck = checkpoints["float16"]
    frozen = freeze({"name": "fg", "model": {"path": str(ck)}, "dtype": "float16",
                     "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8, "continuation_tokens": 3,
                     "conditions": [{"policy": "dense-stream"}, {"policy": "flexgen", "params": {"w_gpu_percent": 50}}],
                     "reference": "dense-stream", "warmups": 1, "allowance_mib": 256,
                     "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.5}}})
    path = tmp_path / "screen.zip"
    _, episodes, _ = archive_screen(frozen, ck, path)
    assert audit_archive(path).agrees
    fg = next(e for e in episodes if e["condition"] == "flexgen" and e["role"] == "scored")
    member = f"episodes/{fg['plan_index']:05d}.json"

    def policy_edited(edit):
        def apply(members):
            rec = json.loads(members[member])
            rec["offload"]["policy"].update(edit)
            members[member] = canonical_json(rec)
        return apply

    for edit, line in [({"w_gpu_percent": 60}, "offload.policy: w_gpu_percent 60 is not the protocol's 50"),
                       ({"compress_weight": True}, "offload.policy: compress_weight recorded True, expected False"),
                       ({"chosen": True}, "offload.policy: chosen True is not the protocol's False")]:
        out = tmp_path / "forged.zip"
        out.unlink(missing_ok=True)
        report = audit_archive(resealed(path, out, policy_edited(edit)))
        assert not report.agrees and any(p.startswith(f"{member}: {line}") for p in report.record["problems"]), \
            (line, report.record["problems"])


def test_an_episode_after_a_failed_generate_runs(cpu_flexgen, checkpoints):
    """FlexGen's process-wide "generate" timer is left started by a generate that raised; without a
    reset every later episode of the screen would fail FlexGen's assert (`has already been started`)."""
    fg = cpu_flexgen(checkpoints["float16"], params={"w_gpu_percent": 100})
    store = fg._lm.store_hidden

    def broken(i, j, k):
        raise RuntimeError("CUDA out of memory (stand-in)")

    fg._lm.store_hidden = broken
    with pytest.raises(RuntimeError, match="stand-in"):
        run_episode(fg, PROMPTS[0], continuation=3)
    fg._lm.store_hidden = store
    assert len(run_episode(fg, PROMPTS[0], continuation=3).calls) == 3


def _screen(ck, *, allowance_mib: int = 256):
    from packbench.core.protocol import freeze

    return freeze({"name": "fg", "model": {"path": str(ck)}, "dtype": "float16",
                   "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 8, "continuation_tokens": 3,
                   "conditions": [{"policy": "dense-stream"}, {"policy": "flexgen"}], "reference": "dense-stream",
                   "warmups": 1, "allowance_mib": allowance_mib,
                   "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.5}}})


def _measured_context(monkeypatch) -> dict:
    """The worker's measured CUDA context, which a CPU worker has none of (0): what the test sets
    in `measured["context"]` is what every build and episode of a Worker sees."""
    from packbench.engine.worker import Worker

    measured = {"context": 0}
    monkeypatch.setattr(Worker, "context", property(lambda self: measured["context"], lambda self, value: None),
                        raising=False)
    return measured


def test_a_re_execution_re_runs_the_archived_flexgen_placement_not_one_chosen_again(cpu_flexgen, checkpoints,
                                                                                   tmp_path, monkeypatch):
    """The archive chose `w_gpu_percent` under the context its worker measured; the re-execution
    worker is fresh and measures another. The bug it catches: the re-run chose its placement again
    (here every weight on the GPU), moved other bytes every call, and the exact comparison called an
    honest archive DISAGREE. The archived policy is handed to the worker and run as it is."""
    from cpu_screen import archive_screen
    from rerun import rerun_here

    from packbench.core.conditions.flexgen import choose_policy
    from packbench.engine.worker import Worker
    from packbench.service.audit import reexecute_archive

    ck = checkpoints["float16"]
    frozen = _screen(ck)
    config = json.loads((ck / "config.json").read_text())
    allowance = 256 << 20

    def needed(share):
        return choose_policy(config, {"w_gpu_percent": share}, allowance=1 << 40, context=0, held=0, batch=1,
                             prompt=11, gen=0, cuda=False).needed

    measured = _measured_context(monkeypatch)
    measured["context"] = allowance - (needed(0) + needed(100)) // 2  # the archive's worker: room for some weights
    _, episodes, _ = archive_screen(frozen, ck, tmp_path / "screen.zip")
    shares = {e["offload"]["policy"]["w_gpu_percent"] for e in episodes if e["condition"] == "flexgen"}
    assert all(e["status"] == "ok" for e in episodes) and len(shares) == 1 and 0 < shares.pop() < 100
    measured["context"] = 0  # the re-execution's fresh worker measures another context
    made = rerun_here(monkeypatch, lambda: Worker(device="cpu"))
    out = reexecute_archive(tmp_path / "screen.zip", k=4, seed=0, time_factor=1e6, model_dir=str(ck))
    assert made and out.exact_agrees and out.agrees, out.problems
    assert out.record["placements"] == "archived"


def test_an_archived_flexgen_placement_this_device_cannot_hold_is_not_judged_not_a_disagreement(
        cpu_flexgen, checkpoints, tmp_path, monkeypatch, packbench_cli):
    """The re-executing worker's context leaves no room for the archived placement (every weight on
    the GPU): its episodes are named in one line each as not judged and the re-execution is partial
    (exit 0), where choosing again would have moved other bytes and called the archive DISAGREE."""
    from cpu_screen import archive_screen
    from rerun import rerun_here

    from packbench.engine.worker import Worker

    ck = checkpoints["float16"]
    measured = _measured_context(monkeypatch)
    _, episodes, _ = archive_screen(_screen(ck), ck, tmp_path / "screen.zip")
    assert all(e["offload"]["policy"]["w_gpu_percent"] == 100 for e in episodes if e["condition"] == "flexgen")
    needed = next(e for e in episodes if e["condition"] == "flexgen")["offload"]["policy"]["needed_bytes"]
    measured["context"] = (256 << 20) - needed + 1  # one byte short of the archived placement's room
    rerun_here(monkeypatch, lambda: Worker(device="cpu"))
    r = packbench_cli("audit", "reexecute", "--archive", str(tmp_path / "screen.zip"), "--count", "4",
                      "--time-factor", "1000000", "--model-dir", str(ck))
    assert r.returncode == 0, (r.stdout, r.stderr)
    unjudged = [line for line in r.stdout.splitlines() if line.startswith("unjudged: ")]
    assert unjudged and all("(flexgen): not judged: the archived flexgen placement (w_gpu_percent 100) needs"
                            in line and "over the allowance of 256 MiB" in line for line in unjudged), r.stdout
    assert "problem:" not in r.stdout and ": PARTIAL (" in r.stdout, r.stdout
