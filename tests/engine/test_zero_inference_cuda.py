"""CUDA twin of test_zero_inference.py's allowance tests (the H200's out-of-memory): ZeRO-Inference
built CPU-first under an allowance smaller than the model decodes within it, its logits dense-stream's.
DeepSpeed binds its accelerator at first import, so this file runs in a pytest process of its own:

    pytest -m "deepspeed and gpu" tests/engine/test_zero_inference_cuda.py
"""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]


def test_zero_inference_decodes_within_an_allowance_below_the_model(checkpoint_125m):
    """Partitioned before deepspeed.initialize and sized from the allowance, the model never holds
    more on the device than the allowance, although the allowance is below the model's own bytes
    (initialize moving the unpartitioned model onto the device, the H200's failure, fails here)."""
    from packbench.engine.checkpoint import build_weights
    from packbench.engine.opt_weights import stock_model
    from packbench.engine.zero_inference import ZeroInferenceModel, budget

    from packbench.engine.sampler import device_uuid, nvml_handle, process_used_bytes

    cuda = torch.device("cuda")
    handle = nvml_handle(device_uuid(0))

    def outside() -> int:  # the process's device memory outside PyTorch's allocator (context, NCCL)
        torch.cuda.synchronize(cuda)
        return process_used_bytes(handle)[0] - torch.cuda.memory_reserved(cuda)

    ref = CpuFirstModel(checkpoint_125m, dtype=torch.float16, device=cuda)
    ref.use("dense-stream")
    prompt = list(range(4, 20))
    r = run_episode(ref, prompt, continuation=6)
    again = run_episode(ref, prompt, continuation=6)
    assert np.array_equal(r.logits, again.logits)  # the reference reproduces itself first
    del ref, again
    torch.cuda.empty_cache()
    before_outside = outside()
    w = build_weights(checkpoint_125m, dtype=torch.float16)
    model_bytes = sum(p.numel() * 2 for p in {id(p): p for p in stock_model(w, vars(w.config)).parameters()}.values())
    # what the process holds already (cuBLAS's workspace, from the reference's runs) counts, as the worker's `held`
    probe = budget(stock_model(w, vars(w.config)), w.config, dtype=torch.float16, allowance=0, context=0,
                   held=torch.cuda.memory_allocated(cuda), capacity=22, batch=1, cuda=True)
    allowance = probe.needed + (32 << 20)
    assert allowance < model_bytes  # the test means something only below the model's size
    del w
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    z = ZeroInferenceModel(checkpoint_125m, dtype=torch.float16, device=cuda, allowance_bytes=allowance, capacity=22)
    out = run_episode(z, prompt, continuation=6)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(cuda) - base
    assert 0 < peak <= allowance, (peak, allowance, z.stats.budget)
    assert sum(sum(c.h2d_weight_bytes) for c in out.calls) > 0  # the weights did cross the link
    assert np.array_equal(out.logits, r.logits) and out.tokens == r.tokens
    # Released, it leaves the device as it found it: nothing allocated, and no memory outside PyTorch's
    # allocator that every later condition's cap would lose (nccl's communicator took ~480 MiB on the H200)
    z.release()
    del z, out
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(cuda) <= base
    assert outside() - before_outside < 128 << 20, (outside() - before_outside) >> 20
