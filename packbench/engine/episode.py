"""One episode: a prompt under the active policy, greedy prefill + decode calls, fully recorded."""

import time
from dataclasses import dataclass

import numpy as np
import torch

from packbench.engine.ledger import CallLedger
from packbench.engine.model import CpuFirstModel


@dataclass
class EpisodeOutput:
    # Batch 1: generated token ids, one per call, and (calls, vocab) float32 logits, the
    # last-position logits of every call (exact upcast). Batch B: per sequence, in batch order,
    # B lists of token ids and (B, calls, vocab) logits.
    tokens: list[int] | list[list[int]]
    logits: np.ndarray
    calls: list[CallLedger]
    wall_s: float  # first call start to last logit on the host
    kv_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    first_logit_at: float  # time.perf_counter() when the first logit reached the host
    mode: str = "eager"  # engine/graph.py MODES
    decode_graph: str | None = None  # mode graph: "captured (x ms, y of them instantiating)" or why decode ran eagerly
    batch: int = 1  # sequences decoded together


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_batch(prompt: list) -> bool:
    """Whether `prompt` is a batch (a list of token-id lists) rather than one prompt's ids."""
    return bool(prompt) and isinstance(prompt[0], (list, tuple))


def run_episode(model: CpuFirstModel, prompt: list[int] | list[list[int]], *, continuation: int,
                mode: str | None = None, forced: list[int] | list[list[int]] | None = None) -> EpisodeOutput:
    """Greedy generation of `continuation` tokens: one prefill call, then continuation-1 decode calls.

    Every call's logits are read back (charged as recording) and argmax'd on the host, so the
    token fed to the next call is exactly the one the archive shows. `mode` (default: the
    model's) picks the execution mode (engine/graph.py). `model` may be any model with a
    CpuFirstModel's device, recorder, mode, new_cache and forward (engine/quantized.py's).

    `prompt` is one prompt's token ids, or a batch: a list of B prompts of equal length (a
    protocol's prompts are all cut to prefix_tokens), decoded together, each call feeding (B, T)
    ids; the loader's packet is then the union of the batch's active rows. The ledger's `tokens`
    counts every token a call feeds (B x T).

    `forced` (teacher forcing, for fidelity): decode call i is fed `forced[i - 1]` (the
    reference's greedy tokens; for a batch, one such list per sequence) instead of this run's own
    argmax; `tokens` still holds the argmax of every call, so position i of both runs saw the
    same prefix.
    """
    batched = is_batch(prompt)
    prompts = [list(p) for p in prompt] if batched else [list(prompt)]
    forced_rows = None if forced is None else ([list(f) for f in forced] if batched else [list(forced)])
    _check(prompts, continuation, forced_rows)
    out = _generate(model, prompts, continuation=continuation, mode=mode or model.mode, forced=forced_rows)
    if not batched:  # batch 1 keeps the shapes every archive before batches holds
        out.tokens, out.logits = out.tokens[0], out.logits[0]
    return out


def _check(prompts: list[list[int]], continuation: int, forced: list[list[int]] | None) -> None:
    if continuation < 1:
        raise ValueError("continuation must be >= 1")
    if len({len(p) for p in prompts}) != 1:
        raise ValueError(f"a batch's prompts must have one length, got {sorted({len(p) for p in prompts})}")
    if forced is not None:
        if len(forced) != len(prompts):
            raise ValueError(f"teacher forcing needs one token list per sequence, got {len(forced)} "
                             f"for {len(prompts)}")
        short = min(len(f) for f in forced)
        if short < continuation - 1:
            raise ValueError(f"teacher forcing needs {continuation - 1} tokens, got {short}")


def _generate(model: CpuFirstModel, prompts: list[list[int]], *, continuation: int, mode: str,
              forced: list[list[int]] | None) -> EpisodeOutput:
    """The episode loop over a (B, T) batch; tokens (B lists) and logits (B, calls, vocab). A model
    that runs whole episodes (`episode`: engine/flexgen.py, whose library owns the generate loop)
    runs this one itself and records its calls at its own sites."""
    whole = getattr(model, "episode", None)
    if whole is not None:
        return whole(prompts, continuation=continuation, mode=mode, forced=forced)
    device = model.device
    recorder = model.recorder
    recorder.calls = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batch = len(prompts)
    cache = model.new_cache(len(prompts[0]) + continuation, mode=mode, batch=batch)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    rows: list[np.ndarray] = []  # per call, (B, vocab)
    _sync(device)
    t_start = time.perf_counter()
    for call in range(continuation):
        recorder.begin(phase="prefill" if call == 0 else "decode", tokens=ids.numel())
        t0 = time.perf_counter()
        logits = model.forward(ids, cache).float().cpu()  # the .cpu() synchronises the call
        t1 = time.perf_counter()
        recorder.end(wall_s=t1 - t0, logits_d2h_bytes=logits.numel() * 4)
        if call == 0:
            first_logit_at = t1
        row = logits.numpy().reshape(batch, -1)  # (vocab,) from a model answering batch 1 alone
        fed = []
        for s in range(batch):
            token = int(row[s].argmax())
            tokens[s].append(token)
            fed.append(token if forced is None or call == continuation - 1 else int(forced[s][call]))
        rows.append(row)
        ids = torch.tensor([[t] for t in fed], dtype=torch.long, device=device)
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
        logits=np.stack(rows, axis=1),  # (B, calls, vocab)
        calls=list(recorder.calls),
        wall_s=wall,
        kv_bytes=kv_bytes,
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if cuda else 0,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else 0,
        first_logit_at=first_logit_at,
        mode=mode,
        decode_graph=decode_graph,
        batch=batch,
    )
