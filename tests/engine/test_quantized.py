"""The `quantized` competitor on the CPU (torchao int8 weight-only runs there): resident, read
CPU-first from the same checkpoint, run free and teacher-forced on the reference's tokens; the
driver's fidelity figures are archived and the auditor recomputes them from the logits."""

import gc
import importlib.util
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from packbench.core.audit import audit_archive
from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.quantized import QuantizationUnavailable, QuantizedModel, storage_bytes
from packbench.engine.synth import synth_checkpoint
from packbench.engine.worker import Worker
from packbench.service.screen import ScreenRun

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    """The tiny shape under the calibrated profile: peaked next-token distributions, so fidelity
    figures mean something (random weights flip their argmax under any perturbation)."""
    return synth_checkpoint(tmp_path_factory.mktemp("opt") / "tiny", shape="tiny", dtype="float32", seed=0,
                            profile="opt")


def body(model: Path, **changes) -> dict:
    raw = {"name": "q", "model": {"path": str(model)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 8,
           "conditions": [{"policy": "dense-stream"},
                          {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
           "gates": {"faithfulness": {}, "fidelity": {"max_mean_kl": 0.01, "min_top1": 0.9}}, **changes}
    return freeze(raw).body


@pytest.fixture(scope="module")
def screen(calibrated):
    b = body(calibrated)
    worker = Worker(device="cpu")
    start = worker.load(b, str(calibrated))
    ids = prompts(b, vocab=start["vocab"])
    return b, start, ids, [worker.run(e, ids[e["prompt"]]) for e in plan(b)]


def test_int8_is_resident_quantized_and_charged(screen):
    _, start, _, records = screen
    stats = start["quantized"]["int8-weight-only"]
    assert stats["library"] == "torchao" and stats["state"] == "cold" and stats["quantize_s"] > 0
    assert stats["host_rss_peak_bytes"] > 0
    # int8 linears plus their scales, and the float32 embeddings/head: well under the float32 model
    assert 0 < stats["device_bytes"] < start["param_bytes"]
    int8 = [r for r in records if r["condition"] == "int8"]
    assert all(r["status"] == "ok" and r["tier"] == "approximate" for r in int8), [r.get("error") for r in int8]
    assert all(r["quantization"]["method"] == "int8-weight-only" for r in int8)
    assert all(r["memory"]["policy_device_bytes"] == stats["device_bytes"] for r in int8)
    assert all(r["h2d_weight_bytes"] == 0 for r in int8)  # resident: nothing moves per call
    assert {r["tier"] for r in records if r["condition"] == "dense-stream"} == {"exact"}


def test_a_shelved_model_returns_without_a_rebuild_and_computes_the_same(screen):
    """Every int8 episode follows a dense-stream one, which takes the device: the int8 model waits on
    the host (QuantizedModel.shelve) and comes back with its quantization, not rebuilt; its warmup
    and its first scored episode (prompt 0 both) give the same logits across the moves."""
    _, start, _, records = screen
    int8 = [r for r in records if r["condition"] == "int8"]
    assert {r["quantization"]["state"] for r in int8} == {"shelved"}, [r["quantization"]["state"] for r in int8]
    assert {r["quantization"]["quantize_s"] for r in int8} == {start["quantized"]["int8-weight-only"]["quantize_s"]}
    assert all(r["quantization"]["unshelve_s"] >= 0 for r in int8)  # charged, outside the episode's wall
    warm, first = [r for r in int8 if r["prompt"] == 0][:2]
    assert warm["role"] == "warmup" and np.array_equal(warm["logits"], first["logits"])


def test_a_released_competitor_leaves_no_reference_behind(calibrated, monkeypatch):
    """Building each named method at load, one at a time: when the next builds, nothing holds the
    last one (a leftover reference kept torchao's int8 model on the H200 while bitsandbytes' built,
    and the 4800 MiB screen ran out of memory at load)."""
    import gc
    import weakref

    import packbench.engine.conditions.quantized as worker_module  # the runtime that builds QuantizedModel

    alive: list[weakref.ref] = []

    class Model:  # bitsandbytes-like: cannot shelve, so it is released
        can_shelve = False

        def __init__(self, path, *, method, dtype, device):
            gc.collect()
            assert not [r for r in alive if r() is not None], "an earlier competitor is still referenced"
            alive.append(weakref.ref(self))
            self.stats = SimpleNamespace(as_dict=lambda: {"method": method})

    monkeypatch.setattr(worker_module, "QuantizedModel", Model)
    b = body(calibrated, conditions=[
        {"policy": "dense-stream"},
        {"name": "nf4", "policy": "quantized", "params": {"method": "nf4", "mode": "eager"}},
        {"name": "llm-int8", "policy": "quantized", "params": {"method": "llm-int8", "mode": "eager"}}])
    worker = Worker(device="cpu")
    start = worker.load(b, str(calibrated))
    assert sorted(start["quantized"]) == ["llm-int8", "nf4"] and len(alive) == 2


def test_each_approximate_episode_is_forced_on_its_prompts_reference(screen):
    _, _, _, records = screen
    by = {r["plan_index"]: r for r in records}
    for r in records:
        if r["condition"] != "int8":
            assert r["forced_logits"] is None
            continue
        ref = by[r["forced_from"]]
        assert ref["condition"] == "dense-stream" and ref["prompt"] == r["prompt"]
        assert r["forced_logits"].shape == r["logits"].shape == ref["logits"].shape
        # approximate: close to the reference, never bit-identical
        assert 0 < np.abs(r["forced_logits"] - ref["logits"]).max() < 2.0


def test_teacher_forcing_feeds_the_given_tokens(calibrated):
    model = CpuFirstModel(calibrated, dtype=torch.float32, device=torch.device("cpu"))
    model.use("dense-stream")
    prompt = list(range(4, 20))
    free = run_episode(model, prompt, continuation=5)
    # forced on its own tokens: the same calls, bit for bit
    again = run_episode(model, prompt, continuation=5, forced=free.tokens)
    assert np.array_equal(again.logits, free.logits) and again.tokens == free.tokens
    # forced on other tokens: the prefill is the same, the next call sees the forced token
    other = [t + 1 for t in free.tokens]
    forced = run_episode(model, prompt, continuation=5, forced=other)
    assert np.array_equal(forced.logits[0], free.logits[0]) and not np.array_equal(forced.logits[1], free.logits[1])
    step = run_episode(model, prompt + other[:1], continuation=1)
    assert np.allclose(forced.logits[1], step.logits[0], atol=1e-4)  # cached decode vs one prefill
    with pytest.raises(ValueError, match="teacher forcing needs 4 tokens"):
        run_episode(model, prompt, continuation=5, forced=other[:2])


def test_a_screen_archives_fidelity_and_the_audit_recomputes_it(screen, tmp_path, monkeypatch):
    b, start, ids, records = screen

    def record_all(path: Path):
        store = SimpleNamespace(put_episode=lambda *a: None, put_verdicts=lambda *a: None,
                                finish_attempt=lambda *a, **k: "done", set_attempt_evidence=lambda *a, **k: None)
        run = ScreenRun(store, screen=SimpleNamespace(id=1, model_dir=None), attempt=SimpleNamespace(id=1, number=1),
                        protocol=b, archive_path=path, freeze={})
        run.begin({"host": "test", "device": "cpu"})
        run.loaded(start, ids)
        for r in records:
            run.record({**r})
        return run, run.finish()

    run, outcome = record_all(tmp_path / "a.zip")
    scored = [e for e in run.episodes if e["condition"] == "int8" and e["role"] == "scored"]
    assert all(0 < e["fidelity"]["mean_kl"] < 0.01 and e["fidelity"]["top1"] >= 0.9 for e in scored)
    report = audit_archive(outcome.archive_path)
    assert report.agrees, report.problems
    verdicts = {(v["gate"], v["condition"]): v for v in report.record["verdicts"]}
    assert set(verdicts) == {("faithfulness", "dense-stream"), ("fidelity", "int8")}
    assert all(v["passed"] for v in verdicts.values())
    # The report's frontier: one point per condition, by tier, the approximate one with its fidelity.
    from packbench.core.report import frontier, read_screen

    view = frontier(read_screen(outcome.archive_path))
    points = {p["condition"]: p for p in view["points"]}
    assert view["memory"] == "held"  # a CPU run samples no GPU
    assert (points["dense-stream"]["tier"], points["int8"]["tier"]) == ("exact", "approximate")
    int8 = [e for e in run.episodes if e["condition"] == "int8" and e["role"] == "scored"]
    assert points["int8"]["memory_bytes"] == max(e["memory"]["policy_device_bytes"] + e["memory"]["kv_bytes"]
                                                 for e in int8)
    assert points["int8"]["fidelity_mean_kl_max"] == max(e["fidelity"]["mean_kl"] for e in int8)
    assert points["int8"]["fidelity_passed"] is True and points["dense-stream"]["fidelity_passed"] is None
    # A driver that wrote other figures than the logits give is caught by the auditor.
    real = ScreenRun.fidelity_of
    monkeypatch.setattr(ScreenRun, "fidelity_of",
                        lambda self, e: None if real(self, e) is None else {**real(self, e), "top1": 1.5})
    _, bad = record_all(tmp_path / "b.zip")
    report = audit_archive(bad.archive_path)
    assert not report.agrees and any("recomputed from the logits" in p for p in report.problems), report.problems


def test_a_missing_library_is_one_line_naming_the_extra(calibrated, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: its import fails
    with pytest.raises(QuantizationUnavailable) as e:
        QuantizedModel(calibrated, method="nf4", dtype=torch.float32, device=torch.device("cpu"))
    assert "requires bitsandbytes" in str(e.value) and "pip install 'packbench[lowbit]'" in str(e.value)
    assert "\n" not in str(e.value)


def test_storage_bytes_sees_through_quantized_tensors(calibrated):
    model = QuantizedModel(calibrated, method="int8-weight-only", dtype=torch.float32, device=torch.device("cpu"))
    fc1 = model.weights.model.decoder.layers[0].fc1
    # (ffn, hidden) int8 weights + per output row a float32 scale and an int8 zero point + the float32 bias
    assert storage_bytes(fc1) == 256 * 64 + 256 * 4 + 256 + 256 * 4


@pytest.mark.parametrize("method", ["int4-weight-only", "nf4", "llm-int8"])
def test_the_other_methods_run_or_refuse_in_one_line(calibrated, method):
    """Where its library is installed (the test extra installs both), a
    method either runs, close to the float model and smaller, or refuses in one line (torchao's
    int4 on the CPU: tinygemm's kernel is CUDA's)."""
    from packbench.core.registry import QUANT_METHODS

    if importlib.util.find_spec(QUANT_METHODS[method]) is None:
        pytest.skip(f"{QUANT_METHODS[method]} is not installed")
    try:
        model = QuantizedModel(calibrated, method=method, dtype=torch.float32, device=torch.device("cpu"))
    except QuantizationUnavailable as e:
        assert "\n" not in str(e) and str(e).startswith(f"quantized method {method} ")
        if method == "int4-weight-only":  # the fix names the device, not an install that cannot help
            assert "this worker's device is cpu: run the screen on a CUDA worker" in str(e)
        return
    exact = CpuFirstModel(calibrated, dtype=torch.float32, device=torch.device("cpu"))
    exact.use("dense-stream")
    prompt = list(range(4, 20))
    low, ref = run_episode(model, prompt, continuation=1), run_episode(exact, prompt, continuation=1)
    # the prefill's logits: approximate, yet the same function (on this tiny shape NF4's 64-value
    # blocks gave a correlation of 0.948, llm-int8 0.9992, int8 weight-only 0.9995)
    assert not np.array_equal(low.logits, ref.logits) and np.corrcoef(low.logits[0], ref.logits[0])[0, 1] > 0.9
    assert 0 < model.stats.device_bytes < storage_bytes(exact.weights) + exact.host.host_bytes


def test_a_failed_competitor_episode_drops_the_model_and_the_next_runs(calibrated, monkeypatch):
    """A competitor whose episode fails leaves the device (not held, not shelved), and the exact
    condition after it still runs: one failure does not fail the episodes that follow."""
    import packbench.engine.worker as worker_module

    b = body(calibrated)
    worker = Worker(device="cpu")
    start = worker.load(b, str(calibrated))
    ids = prompts(b, vocab=start["vocab"])
    real = worker_module.run_episode

    held: list[weakref.ref] = []

    def failing(model, *a, **k):
        if isinstance(model, QuantizedModel):
            held.append(weakref.ref(model))
            raise RuntimeError("CUDA out of memory (injected)")  # this frame holds the model
        return real(model, *a, **k)

    freed_with: list[bool] = []  # whether the model was gone when the worker freed the device
    free = worker._free
    monkeypatch.setattr(worker, "_free", lambda: (gc.collect(), freed_with.append(held[0]() is None), free()))
    monkeypatch.setattr(worker_module, "run_episode", failing)
    entries = plan(b)
    int8 = next(e for e in entries if e["condition"] == "int8")
    failed = worker.run(int8, ids[int8["prompt"]])
    assert failed["status"] == "failed" and "injected" in failed["error"] and "injected" in failed["traceback"]
    # no traceback frame holds the model when the device is emptied (on the H200 a failed
    # capture's frames kept a 2.7B int8 model there, and every later episode ran out of memory)
    assert freed_with and all(freed_with)
    assert worker.competitor is None and not worker.shelf
    dense = next(e for e in entries if e["condition"] == "dense-stream")
    assert worker.run(dense, ids[dense["prompt"]])["status"] == "ok"


@pytest.mark.parametrize("method", ["int8-weight-only", "nf4"])
def test_the_static_cache_call_gives_the_eager_logits(calibrated, method):
    """Modes graph and compile run the decode step on a StaticCache with the positions and the
    mask given (QuantizedModel._call; transformers derived them on the host, which no capture
    allows). On the CPU that call runs eagerly: it must compute what the eager DynamicCache does,
    call for call. The CUDA twins capture it (test_quantized_cuda.py)."""
    from packbench.core.registry import QUANT_METHODS

    if importlib.util.find_spec(QUANT_METHODS[method]) is None:
        pytest.skip(f"{QUANT_METHODS[method]} is not installed")
    model = QuantizedModel(calibrated, method=method, dtype=torch.float32, device=torch.device("cpu"))
    prompt = list(range(4, 20))
    eager = run_episode(model, prompt, continuation=6, mode="eager")
    for mode in ("graph", "compile"):
        static = run_episode(model, prompt, continuation=6, mode=mode)
        assert static.decode_graph == "eager: no CUDA graphs on cpu" and static.tokens == eager.tokens
        assert np.abs(static.logits - eager.logits).max() < 1e-4, mode
    again = run_episode(model, prompt, continuation=6, mode="graph")  # the reused cache starts clean
    assert np.array_equal(again.logits, static.logits)
    # a batch of two, on a cache of its own; its first sequence decodes what it decodes alone
    batch = [prompt, list(range(30, 46))]
    eager2 = run_episode(model, batch, continuation=6, mode="eager")
    for mode in ("graph", "compile"):
        static2 = run_episode(model, batch, continuation=6, mode=mode)
        assert static2.logits.shape == (2, 6, model.vocab) and static2.tokens == eager2.tokens
        assert np.abs(static2.logits - eager2.logits).max() < 1e-4, mode
        assert np.abs(static2.logits[0] - static.logits).max() < 1e-4
    assert list(model._static) == [(22, 2)]  # the batch of one's cache is gone: one on the device at a time


class HostReads(TorchDispatchMode):
    """Records every op that brings a tensor's value to the host (`.item()`, `bool(t)`, `nonzero`):
    inside a CUDA graph capture each one fails (cudaErrorStreamCaptureUnsupported)."""

    READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default)

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["int8-weight-only", "nf4"])
def test_the_decode_step_reads_nothing_back_to_the_host(calibrated, method):
    """What a CUDA capture needs, checked on the CPU: the static-cache decode call (the step modes
    graph and compile capture) reads no tensor value on the host. transformers' OPT forward read
    the cache length with `.item()` when not given positions and a mask: every capture failed."""
    from packbench.core.registry import QUANT_METHODS

    if importlib.util.find_spec(QUANT_METHODS[method]) is None:
        pytest.skip(f"{QUANT_METHODS[method]} is not installed")
    model = QuantizedModel(calibrated, method=method, dtype=torch.float32, device=torch.device("cpu"))
    with HostReads() as probe:
        torch.tensor([3]).item()
    assert len(probe.seen) == 1  # the probe sees a read
    for batch in (1, 2):
        kv = model.new_cache(24, mode="compile", batch=batch)
        with torch.inference_mode():
            model.forward(torch.tensor([list(range(4, 20))] * batch), kv)  # the prefill (eager, not captured)
            with HostReads() as probe:
                logits = model._call(torch.tensor([[5]] * batch), torch.tensor([16]), kv)
        assert probe.seen == [] and logits.shape[-1] == model.vocab, probe.seen


def test_a_competitor_run_eagerly_says_why_in_its_record(calibrated):
    """The archive says why a competitor's decode was not captured: its library cannot be (llm-int8,
    accelerate: core.registry.CAPTURE_REFUSALS), its condition froze mode eager (nf4 asked so), or no
    CUDA graphs on this device (int8 in mode compile, its fastest, on the CPU)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")
    b = body(calibrated, prompts={"generator": {"seed": 0, "count": 1}}, warmups=0, repetitions=2,
             gates={"faithfulness": {}, "fidelity": {"min_top1": 0.0}}, conditions=[
                 {"policy": "dense-stream"}, {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}},
                 {"name": "nf4", "policy": "quantized", "params": {"method": "nf4", "mode": "eager"}},
                 {"name": "llm-int8", "policy": "quantized", "params": {"method": "llm-int8"}},
                 {"policy": "accelerate"}])
    worker = Worker(device="cpu")
    start = worker.load(b, str(calibrated))
    ids = prompts(b, vocab=start["vocab"])
    graphs = {}
    for e in plan(b):
        r = worker.run(e, ids[e["prompt"]])
        assert r["status"] == "ok", r.get("error")
        graphs[r["condition"]] = r["engine"]["decode_graph"]
    assert graphs["int8"] == "eager: no CUDA graphs on cpu"
    assert graphs["nf4"] == "eager: the mode its condition froze"
    assert graphs["llm-int8"].startswith("eager: cannot be captured: bitsandbytes' llm-int8 splits outlier")
    assert graphs["accelerate"].startswith("eager: cannot be captured: accelerate's hooks")
    assert graphs["dense-stream"] is None  # packbench's own loader in mode eager: as before


def test_each_model_compiles_its_own_code_past_dynamos_recompile_limit():
    """torch.compile counts recompilations per code object (torch._dynamo.config.recompile_limit,
    a hard failure under fullgraph): compiling one shared method for model after model fails past
    the limit, as a long-lived worker's compiled competitors would. `own_code` gives each model a
    copy of the code, so every one compiles (backend eager: dynamo's count, without inductor)."""
    import torch._dynamo
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from packbench.engine.quantized import own_code

    class Stand:
        def __init__(self, width: int):
            self.lin = torch.nn.Linear(width, width)

        def call(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).relu()

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    try:
        for i in range(limit + 2):  # a width each: every model is a new compilation
            width = 8 * (i + 1)
            step = torch.compile(own_code(Stand(width).call), fullgraph=True, backend="eager")
            assert step(torch.ones(1, width)).shape == (1, width)
        with pytest.raises(FailOnRecompileLimitHit):  # the shared code object: what own_code avoids
            for i in range(limit + 1):
                width = 8 * (i + 1)
                torch.compile(Stand(width).call, fullgraph=True, backend="eager")(torch.ones(1, width))
    finally:
        torch._dynamo.reset()
