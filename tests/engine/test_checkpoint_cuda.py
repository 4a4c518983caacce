"""CUDA twin of test_checkpoint.py's placed read: tensors land where they live, bytes unchanged."""

import numpy as np
import pytest
import torch

from packbench.engine.checkpoint import build_weights, read_placed, read_state_dict
from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel, is_outgoing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_placed_read_puts_outgoing_weights_in_pinned_memory(checkpoints, dtype, monkeypatch):
    torch_dtype = getattr(torch, dtype)
    stock = read_state_dict(checkpoints[dtype], dtype=torch_dtype)
    monkeypatch.setattr("packbench.engine.checkpoint.CHUNK", 4096)  # many chunks and waves on a tiny model
    placed = read_placed(checkpoints[dtype], dtype=torch_dtype, device=torch.device("cuda"), host_keys=is_outgoing)
    for key, t in stock.items():
        p = placed[key]
        assert (p.device.type == "cpu" and p.is_pinned()) if is_outgoing(key) else p.device.type == "cuda", key
        assert torch.equal(p.cpu().view(torch.uint8), t.view(torch.uint8)), key
    monkeypatch.undo()
    model = CpuFirstModel(checkpoints[dtype], dtype=torch_dtype, device=torch.device("cuda"))
    assert all(w.is_pinned() for w in model.host.original) and model.start.place_s < 5
    model.use("dense-stream")
    fast = run_episode(model, [2] + list(range(10, 40)), continuation=4)
    # the stock read: safe_open, then pin by copy and .to(device)
    monkeypatch.setattr("packbench.engine.model.build_weights", lambda d, *, dtype, device, host_keys: build_weights(d, dtype=dtype))
    slow = CpuFirstModel(checkpoints[dtype], dtype=torch_dtype, device=torch.device("cuda"))
    slow.use("dense-stream")
    assert np.array_equal(run_episode(slow, [2] + list(range(10, 40)), continuation=4).logits, fast.logits)


@pytest.mark.parametrize("pin", ["tensors", "blocks", "register", "map"])
def test_cuda_every_host_layout_is_pinned_and_exact(checkpoints, pin, monkeypatch):
    """Each host layout (engine/checkpoint.py PIN_MODES) gives the stock bytes, pinned host
    weights ("map" may fall back to "blocks" where the driver refuses), and the same logits."""
    stock = read_state_dict(checkpoints["float16"], dtype=torch.float16)
    monkeypatch.setattr("packbench.engine.checkpoint.CHUNK", 4096)
    timings = {}
    placed = read_placed(checkpoints["float16"], dtype=torch.float16, device=torch.device("cuda"),
                         host_keys=is_outgoing, pin=pin, timings=timings)
    for key, t in stock.items():
        p = placed[key]
        assert (p.device.type == "cpu" and p.is_pinned()) if is_outgoing(key) else p.device.type == "cuda", key
        assert torch.equal(p.cpu().view(torch.uint8), t.view(torch.uint8)), key
    del placed
    monkeypatch.undo()

    def logits(layout):
        monkeypatch.setattr("packbench.engine.checkpoint.PIN", layout)
        model = CpuFirstModel(checkpoints["float16"], dtype=torch.float16, device=torch.device("cuda"), mode="graph")
        model.use("dense-stream")
        return run_episode(model, [2] + list(range(10, 40)), continuation=4).logits

    assert np.array_equal(logits(pin), logits("tensors"))
