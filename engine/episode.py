"""One episode: a prompt under the active policy, greedy prefill + decode calls, fully recorded."""

import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.ledger import CallLedger
from engine.model import CpuFirstModel


@dataclass
class EpisodeOutput:
    tokens: list[int]  # generated token ids, one per call
    logits: np.ndarray  # (calls, vocab) float32: last-position logits of every call (exact upcast)
    calls: list[CallLedger]
    wall_s: float  # first call start to last logit on the host
    kv_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    first_logit_at: float  # time.perf_counter() when the first logit reached the host
    mode: str = "eager"  # engine/graph.py MODES
    decode_graph: str | None = None  # mode graph: "captured (x ms, y of them instantiating)" or why decode ran eagerly


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_episode(model: CpuFirstModel, prompt: list[int], *, continuation: int,
                mode: str | None = None, forced: list[int] | None = None) -> EpisodeOutput:
    """Greedy generation of `continuation` tokens: one prefill call, then continuation-1 decode calls.

    Every call's logits are read back (charged as recording) and argmax'd on the host, so the
    token fed to the next call is exactly the one the archive shows. `mode` (default: the
    model's) picks the execution mode (engine/graph.py). `model` may be any model with a
    CpuFirstModel's device, recorder, mode, new_cache and forward (engine/quantized.py's).

    `forced` (teacher forcing, for fidelity): decode call i is fed `forced[i - 1]` (the
    reference's greedy tokens) instead of this run's own argmax; `tokens` still holds the argmax
    of every call, so position i of both runs saw the same prefix.
    """
    if continuation < 1:
        raise ValueError("continuation must be >= 1")
    if forced is not None and len(forced) < continuation - 1:
        raise ValueError(f"teacher forcing needs {continuation - 1} tokens, got {len(forced)}")
    device = model.device
    recorder = model.recorder
    recorder.calls = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mode = mode or model.mode
    cache = model.new_cache(len(prompt) + continuation, mode=mode)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    _sync(device)
    t_start = time.perf_counter()
    for call in range(continuation):
        recorder.begin(phase="prefill" if call == 0 else "decode", tokens=ids.shape[1])
        t0 = time.perf_counter()
        logits = model.forward(ids, cache).float().cpu()  # the .cpu() synchronises the call
        t1 = time.perf_counter()
        recorder.end(wall_s=t1 - t0, logits_d2h_bytes=logits.numel() * 4)
        if call == 0:
            first_logit_at = t1
        row = logits.numpy()
        token = int(row.argmax())
        tokens.append(token)
        rows.append(row)
        fed = token if forced is None or call == continuation - 1 else int(forced[call])
        ids = torch.tensor([[fed]], dtype=torch.long, device=device)
    wall = time.perf_counter() - t_start
    kv_bytes = sum(
        t.numel() * t.element_size()
        for layer in getattr(cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None
    )
    cuda = device.type == "cuda"
    decode_graph = None
    if mode in ("graph", "compile") and continuation > 1:  # compile: a competitor's (engine/quantized.py)
        step = cache.graph
        decode_graph = step.describe() if step is not None else f"eager: {cache.eager_reason}"
    return EpisodeOutput(
        tokens=tokens,
        logits=np.stack(rows),
        calls=list(recorder.calls),
        wall_s=wall,
        kv_bytes=kv_bytes,
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if cuda else 0,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else 0,
        first_logit_at=first_logit_at,
        mode=mode,
        decode_graph=decode_graph,
    )
