"""CUDA twins of test_accelerate.py: accelerate's offload really copies on the GPU, and its hooks'
bytes are counted; the worker parks the CPU-first model so a competitor's device memory is its
own (a compiled competitor's decode: test_quantized_cuda.py). Run with `pytest -m gpu`."""

import numpy as np
import pytest
import torch

from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.accelerate import AcceleratedModel
from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.synth import synth_checkpoint
from packbench.engine.worker import Worker

pytestmark = pytest.mark.gpu
pytest.importorskip("accelerate")
MIB = 1 << 20


@pytest.fixture(scope="module")
def opt125m(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("opt") / "opt-125m", shape="opt-125m", dtype="float16", seed=0,
                            profile="opt")


def test_accelerate_offloads_counts_its_copies_and_matches_dense_stream(opt125m):
    cuda = torch.device("cuda", 0)
    # opt-125m fp16 is ~250 MiB: 400 MiB less the KV cache and the 256 MiB margin leaves part of it on
    # the host. What earlier tests of this process still hold is subtracted from max_memory: add it.
    held = torch.cuda.memory_allocated(cuda)
    acc = AcceleratedModel(opt125m, dtype=torch.float16, device=cuda, allowance_bytes=400 * MIB + held, capacity=72)
    s = acc.stats
    # accelerate's max_memory is a placement target, not a bound: it put 200 MB on the H200 for a
    # max_memory of 148 MB (the resources gate, not this test, judges a condition's peak)
    assert s.offloaded_modules > 0 and s.offloaded_bytes > 0 and s.device_bytes > 0
    prompt = list(range(4, 68))
    out = run_episode(acc, prompt, continuation=8)
    per_call = [sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in out.calls]
    # Every offloaded module's tensors, once per call and module. A tensor two modules share is
    # copied for each offloaded one that uses it: on the H200 a call moved 127.6 MB against 50.4 MB
    # offloaded, the 77.2 MB tied embedding matrix once more (lm_head's), which offloaded_bytes,
    # counting each tensor once, leaves out
    assert per_call == [hooked_bytes(acc._model)] * 8, (per_call, s)
    assert per_call[0] >= s.offloaded_bytes
    del acc
    torch.cuda.empty_cache()
    ref = CpuFirstModel(opt125m, dtype=torch.float16, device=cuda)
    ref.use("dense-stream")
    dense = run_episode(ref, prompt, continuation=8)
    assert np.array_equal(out.logits, dense.logits) and out.tokens == dense.tokens


@pytest.mark.parametrize("shape", ["opt-125m", "mixtral-tiny"])
def test_an_allowance_with_room_for_no_layer_runs_accelerates_full_offload(opt125m, tmp_path, shape):
    """Bug caught (Mixtral-8x7B at 4608 MiB on an H100): with no room for one decoder layer beside
    the one accelerate keeps free, its device map is {"": "cpu"}; dispatch_model left the model
    on the host unhooked, and every episode failed on mixed devices (token ids on the GPU, the
    embedding on the host: "index is on cuda:0 ... wrapper_CUDA__index_select"). Now it runs as
    accelerate's full offload: nothing placed on the device, every module copied each call,
    the logits dense-stream's bit for bit."""
    from packbench.engine.moe.model import CpuFirstMoE
    from packbench.engine.moe.synth import synth_moe

    cuda = torch.device("cuda", 0)
    path = opt125m if shape == "opt-125m" else synth_moe(tmp_path / shape, shape=shape, seed=5, dtype="float16")
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(cuda)
    acc = AcceleratedModel(path, dtype=torch.float16, device=cuda, allowance_bytes=held + MIB, capacity=72)
    s = acc.stats
    buffers = sum(b.numel() * b.element_size() for b in acc._model.buffers())  # cpu_offload leaves them on the device
    assert s.max_memory_bytes == 0 and s.device_bytes == buffers and s.offloaded_modules > 0, s
    prompt = list(range(4, 36))
    out = run_episode(acc, prompt, continuation=6)
    per_call = [sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in out.calls]
    assert per_call == [hooked_bytes(acc._model)] * 6 and per_call[0] >= s.offloaded_bytes, (per_call, s)
    if shape != "opt-125m":  # whole experts: every layer's E experts a call, as rows
        assert [sum(c.rows_copied) for c in out.calls] == [acc.config.num_local_experts
                                                          * acc.config.num_hidden_layers] * 6
    del acc
    torch.cuda.empty_cache()
    ref = CpuFirstModel(path, dtype=torch.float16, device=cuda) if shape == "opt-125m" else \
        CpuFirstMoE(path, dtype=torch.float16, device=cuda)
    ref.use("dense-stream")
    dense = run_episode(ref, prompt, continuation=6)
    again = run_episode(ref, prompt, continuation=6)
    assert np.array_equal(again.logits, dense.logits)  # the reference reproduces itself
    assert np.array_equal(out.logits, dense.logits) and out.tokens == dense.tokens


def hooked_bytes(model) -> int:
    """The bytes accelerate's offloading hooks copy per forward call if each copies its own
    module's tensors from the host (a tensor two modules share, once per module)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook
    from accelerate.utils import named_module_tensors

    total = 0
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in (hook.hooks if isinstance(hook, SequentialHook) else [hook]):
            if isinstance(h, AlignDevicesHook) and h.offload:
                for name, _ in named_module_tensors(module, include_buffers=h.offload_buffers,
                                                    recurse=h.place_submodules, remove_non_persistent=True):
                    t = h.weights_map[name]
                    total += t.numel() * t.element_size()
    return total


def test_a_quantized_episode_holds_only_its_own_model_on_the_device(opt125m):
    pytest.importorskip("torchao")
    raw = {"name": "fit", "model": {"path": str(opt125m)}, "dtype": "float16",
           "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 64, "continuation_tokens": 8,
           "conditions": [{"policy": "dense-stream"},
                          {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only",
                                                                              "mode": "eager"}},
                          {"policy": "accelerate"}],
           "reference": "dense-stream", "warmups": 0, "repetitions": 2, "allowance_mib": 4800,
           "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.0}}}
    body = freeze(raw).body
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()  # what earlier tests of this process still hold
    worker = Worker(device="cuda")
    try:
        start = worker.load(body, str(opt125m))
        ids = prompts(body, vocab=start["vocab"])
        records = [worker.run(e, ids[e["prompt"]]) for e in plan(body)]
        assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
        for r in records:
            print(r["condition"], r["memory"]["peak_allocated_bytes"] // MIB, r["engine"].get("decode_graph"),
                  r.get("quantization") or r.get("offload"))
        int8 = [r for r in records if r["condition"] == "int8"]
        own = start["quantized"]["int8-weight-only"]["device_bytes"]
        for r in int8:
            # its model, the static KV cache and activations; not the CPU-first model's device part as well
            peak = r["memory"]["peak_allocated_bytes"] - held
            assert peak < own + start["device_param_bytes"] // 2, (r["memory"], own, held)
        acc = [r for r in records if r["condition"] == "accelerate"]
        dense = {r["prompt"]: r for r in records if r["condition"] == "dense-stream"}
        assert all(np.array_equal(r["logits"], dense[r["prompt"]]["logits"]) for r in acc)
    finally:
        worker.drop_model()
        if worker.gpu_lock:
            worker.gpu_lock.release()
        worker.sampler.close()


def test_a_cuda_worker_refuses_torchao_in_mode_graph_at_load_in_one_line(opt125m):
    """Capturing transformers' decode step over torchao int8 weights failed on the H200
    (core.registry.STACK_REFUSALS): refused before any episode, naming the mode that works."""
    pytest.importorskip("torchao")
    from packbench.engine.quantized import QuantizationUnavailable

    raw = {"name": "g", "model": {"path": str(opt125m)}, "dtype": "float16",
           "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16, "continuation_tokens": 2,
           "conditions": [{"policy": "dense-stream"},
                          {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only",
                                                                              "mode": "graph"}}],
           "reference": "dense-stream", "warmups": 0, "repetitions": 2, "allowance_mib": 4800,
           "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.0}}}
    worker = Worker(device="cuda")
    try:
        with pytest.raises(QuantizationUnavailable, match="mode graph cannot run on this CUDA stack") as e:
            worker.load(freeze(raw).body, str(opt125m))
        assert "\n" not in str(e.value) and "mode compile" in str(e.value)
    finally:
        if worker.gpu_lock:
            worker.gpu_lock.release()
        worker.sampler.close()
