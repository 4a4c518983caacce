"""CUDA twins of test_quantized.py: every `quantized` method on the GPU, on the calibrated
opt-125m shape (int4's kernels want dimensions of whole groups of 128). A method whose library
or kernel is missing must refuse in one line naming the extra; one that runs must be resident,
charged and close to the reference. Run with `pytest -m gpu` on a GPU machine."""

import importlib.util

import numpy as np
import pytest
import torch

from packbench.core.fidelity import of_episode
from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.core.registry import QUANT_METHODS
from packbench.engine.quantized import QuantizationUnavailable
from packbench.engine.synth import synth_checkpoint
from packbench.engine.worker import Worker

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("opt") / "opt-125m", shape="opt-125m", dtype="float16", seed=0,
                            profile="opt")


@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_every_method_runs_or_refuses_in_one_line(calibrated, method):
    if importlib.util.find_spec(QUANT_METHODS[method]) is None:
        pytest.skip(f"{QUANT_METHODS[method]} is not installed")
    raw = {"name": "q", "model": {"path": str(calibrated)}, "dtype": "float16",
           "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 64, "continuation_tokens": 8,
           "conditions": [{"policy": "dense-stream"}, {"name": "low", "policy": "quantized", "params": {"method": method}}],
           "reference": "dense-stream", "warmups": 0, "repetitions": 2, "allowance_mib": 4800,
           "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.0}}}
    body = freeze(raw).body
    worker = Worker(device="cuda")
    try:
        try:
            start = worker.load(body, str(calibrated))
        except QuantizationUnavailable as e:
            assert "\n" not in str(e) and "packbench[lowbit]" in str(e)
            pytest.skip(f"refused as it should be: {e}")
        stats = start["quantized"][method]
        assert stats["quantize_s"] > 0 and 0 < stats["device_bytes"] < start["param_bytes"]
        assert stats["device_peak_bytes"] >= stats["device_bytes"]
        ids = prompts(body, vocab=start["vocab"])
        records = [worker.run(e, ids[e["prompt"]]) for e in plan(body)]
        assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
        by = {r["plan_index"]: r for r in records}
        low = [r for r in records if r["condition"] == "low"]
        assert all(r["forced_from"] is not None and r["h2d_weight_bytes"] == 0 for r in low)
        assert all(r["memory"]["peak_allocated_bytes"] > 0 for r in low)
        if QUANT_METHODS[method] == "torchao":  # shelved between its episodes, captured again on return
            assert low[1]["quantization"]["state"] == "shelved"
            graphs = [r["engine"]["decode_graph"] for r in low]
            assert graphs[0].startswith("compiled (torch.compile) and captured"), graphs
            assert graphs[1].endswith("made again after 1 moves to the host"), graphs
            # the same prompt, the same compiled kernels: the return changes no logit
            assert np.array_equal(np.asarray(low[0]["logits"]), np.asarray(low[1]["logits"]))
            assert np.array_equal(np.asarray(low[0]["forced_logits"]), np.asarray(low[1]["forced_logits"]))
        fid = [of_episode(r, by, reference="dense-stream") for r in low]
        print(method, stats, [f.as_dict() for f in fid])
        # low-bit, so not bit-identical; on the calibrated profile still close to the reference
        assert all(0 < f.max_abs_logit and np.isfinite(f.mean_kl) and f.mean_kl < 1.0 for f in fid)
    finally:
        if worker.gpu_lock:
            worker.gpu_lock.release()
        worker.sampler.close()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("method", ["int8-weight-only", "int4-weight-only", "nf4"])
def test_a_compiled_model_decodes_close_to_eager_and_returns_from_the_host(calibrated, method):
    """Mode compile (graph is refused on this stack: core.registry.STACK_REFUSALS): the step is
    compiled and captured once, replayed across episodes on the reset cache, close to eager; after
    a move to the host and back (another condition took the device) it is captured again under
    the same compiled code and gives the same logits. nf4 and int4 launch their kernels on shapes
    alone, as torchao's int8 does."""
    if importlib.util.find_spec(QUANT_METHODS[method]) is None:
        pytest.skip(f"{QUANT_METHODS[method]} is not installed")
    from packbench.engine.episode import run_episode
    from packbench.engine.quantized import QuantizedModel

    held = torch.cuda.memory_allocated()  # what earlier tests of this process still hold
    q = QuantizedModel(calibrated, method=method, dtype=torch.float16, device=torch.device("cuda", 0))
    try:
        prompt = list(range(4, 68))
        eager = run_episode(q, prompt, continuation=8, mode="eager")
        runs = [run_episode(q, prompt, continuation=8, mode="compile") for _ in range(2)]
        for r in runs:
            assert r.decode_graph.startswith("compiled"), r.decode_graph
            assert np.abs(r.logits - eager.logits).max() < 0.5
        assert np.array_equal(runs[0].logits, runs[1].logits)
        print(method, runs[1].decode_graph, [round(c.wall_s * 1e3, 2) for c in runs[1].calls],
              "eager", [round(c.wall_s * 1e3, 2) for c in eager.calls])
        assert q.can_shelve  # kept on the host, not rebuilt and compiled again inside an episode
        q.shelve()
        assert torch.cuda.memory_allocated() - held < q.stats.device_bytes // 2
        assert q.unshelve() > 0
        again = run_episode(q, prompt, continuation=8, mode="compile")
        assert np.array_equal(again.logits, runs[0].logits)
        assert "made again after 1 moves" in again.decode_graph, again.decode_graph
    finally:
        del q
        torch.cuda.empty_cache()


def test_int8_compiled_decodes_a_batch_close_to_eager(calibrated):
    """A batch's decode step is compiled and captured on a static cache of B rows, as one
    sequence's is: each sequence close to its eager decode, replayed the same across episodes."""
    pytest.importorskip("torchao")
    from packbench.engine.episode import run_episode
    from packbench.engine.quantized import QuantizedModel

    q = QuantizedModel(calibrated, method="int8-weight-only", dtype=torch.float16, device=torch.device("cuda", 0))
    try:
        batch = [list(range(4, 68)), list(range(100, 164)), list(range(200, 264))]
        eager = run_episode(q, batch, continuation=8, mode="eager")
        runs = [run_episode(q, batch, continuation=8, mode="compile") for _ in range(2)]
        for r in runs:
            assert r.decode_graph.startswith("compiled"), r.decode_graph
            assert r.logits.shape == eager.logits.shape and np.abs(r.logits - eager.logits).max() < 0.5
        assert np.array_equal(runs[0].logits, runs[1].logits)
        print("int8 compile batch 3", runs[1].decode_graph, [round(c.wall_s * 1e3, 2) for c in runs[1].calls])
    finally:
        del q
        torch.cuda.empty_cache()
