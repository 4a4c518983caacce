"""The plan: the ordered episode list of a screen, a pure function of the frozen protocol.

Layout: every condition's declared warmups first (reference first when baseline_first), then
`repetitions` x `prompts` scored blocks. A block runs every condition once on one prompt; the
protocol's `order` arranges the conditions inside each block (see `arrange`). With
baseline_first the reference opens every block and only the other conditions are arranged.

A protocol with `batch` B > 1 keeps that plan: the episode of prompt p decodes B prompts
together, p, p+1, ..., p+B-1 modulo the prompt count (`batch_prompts`; B never exceeds the
count, so they are distinct), and its entry lists them as `prompts`. A batch-1 entry has no
`prompts` (plans made before batches read the same).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from packbench.core.errors import ProtocolError
from packbench.core.protocol import Protocol, expand, read_prompt_file

BOS = 2  # OPT's beginning-of-sequence id


# ----------------------------------------------------------------------------- prompts


def prompts(protocol: Protocol | dict, *, vocab: int, prompt_file: Path | None = None,
            tokenize: Callable[[list[str]], list[list[int]]] | None = None) -> list[list[int]]:
    """The prompt token ids, each cut to prefix_tokens.

    A generator prompt is BOS followed by ids drawn uniformly from [4, vocab) (0-3 are OPT's
    special tokens) by numpy's PCG64 with the protocol's seed: identical on every machine.
    token_file/text_file prompts are read from `prompt_file` (FrozenProtocol.prompt_file()),
    whose SHA-256 must equal the frozen one; text is encoded by `tokenize` (the checkpoint's
    tokenizer, engine.prompts.tokenizer_for).
    """
    p = expand(protocol)
    n = p.prefix_tokens
    spec = p.prompts
    if spec.source == "generator":
        rng = np.random.Generator(np.random.PCG64(spec.seed))
        return [[BOS] + rng.integers(4, vocab, size=n - 1).tolist() for _ in range(spec.count)]
    if spec.source == "token_ids":
        ids = spec.token_ids
    else:
        kind = spec.source
        field = f"prompts.{kind}"
        if prompt_file is None:
            raise ProtocolError(f"protocol field `{field}`: pass the file ({spec.path}) to read the prompts from")
        data, items = read_prompt_file(kind, Path(prompt_file), field=field)
        digest = hashlib.sha256(data).hexdigest()
        if digest != spec.sha256:
            raise ProtocolError(f"protocol field `{field}`: {prompt_file} has sha256 {digest}, the protocol froze "
                                f"{spec.sha256}; restore the file the protocol was frozen with")
        if kind == "text_file":
            if tokenize is None:
                raise ProtocolError(f"protocol field `{field}`: text prompts need the checkpoint's tokenizer")
            items = tokenize(items)
        ids = items
    out = []
    for i, p in enumerate(ids):
        if len(p) < n:
            raise ProtocolError(f"protocol field `prompts`: prompt {i} has {len(p)} tokens, "
                                f"fewer than prefix_tokens={n}; write a longer prompt")
        out.append([int(t) for t in p[:n]])
    for p in out:
        bad = [t for t in p if t >= vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}")
    return out


# ----------------------------------------------------------------------------- orders


def williams(m: int) -> list[list[int]]:
    """Rows of a Williams design for m conditions: each row is a Latin-square row, and over all
    rows every condition immediately follows every other equally often (first-order carryover
    balance). m rows for even m; for odd m the m mirrored rows follow (2m rows in all).
    """
    if m <= 0:
        return [[]]
    first, lo, hi = [0], 1, m - 1
    while len(first) < m:
        first.append(lo)
        lo += 1
        if len(first) < m:
            first.append(hi)
            hi -= 1
    rows = [[(c + r) % m for c in first] for r in range(m)]
    if m % 2:
        rows += [row[::-1] for row in rows]
    return rows


def arrange(names: list[str], block: int, order: str) -> list[str]:
    """The order of `names` in scored block `block`.

    alternating: rotated by the block number (a cyclic Latin square: each condition takes each
    position once every len(names) blocks). abba: forward in even blocks, reversed in odd ones
    (each pair of blocks gives every condition the same mean position). latin-square: the rows of
    a Williams design in turn (Latin and balanced for first-order carryover).
    """
    m = len(names)
    if m == 0:
        return []
    if order == "alternating":
        k = block % m
        return names[k:] + names[:k]
    if order == "abba":
        return list(names) if block % 2 == 0 else list(reversed(names))
    if order == "latin-square":
        rows = williams(m)
        return [names[i] for i in rows[block % len(rows)]]
    raise ValueError(f"unknown order {order!r}")


def batch_prompts(prompt: int, *, batch: int, count: int) -> list[int]:
    """The prompts an episode of prompt `prompt` decodes together: `batch` consecutive ones from
    it, wrapping round the protocol's `count` prompts."""
    return [(prompt + k) % count for k in range(batch)]


def episode_input(token_ids: list[list[int]], entry: dict) -> list[int] | list[list[int]]:
    """What a worker is given for plan entry `entry` (engine/worker.py Worker.run): the prompt's
    token ids, or for a batch entry the list of its prompts' token ids, in batch order."""
    if "prompts" in entry:
        return [token_ids[p] for p in entry["prompts"]]
    return token_ids[entry["prompt"]]


def plan(protocol: Protocol | dict) -> list[dict]:
    """Every planned episode, in run order: {index, condition, role, prompt, repetition}, plus
    `prompts` (the batch's, `batch_prompts`) when the protocol's batch is above 1.

    Warmup w of a condition uses prompt w mod prompts and has repetition None. The scored episodes
    of a repetition start at the first `scored_prompts` prompts (every prompt unless the protocol
    says fewer); scored block b = repetition * scored_prompts + prompt.
    """
    proto = expand(protocol)
    ref = proto.reference
    names = list(proto.condition_names)
    others = [n for n in names if n != ref]
    n_prompts = proto.prompt_count
    first = [ref] + others if proto.baseline_first else names
    entries: list[tuple[str, str, int, int | None]] = []
    for cond in first:
        entries += [(cond, "warmup", w % n_prompts, None) for w in range(proto.warmups[cond])]
    n_scored = proto.scored_prompts
    for rep in range(proto.repetitions):
        for p in range(n_scored):
            block = rep * n_scored + p
            if proto.baseline_first:
                seq = [ref] + arrange(others, block, proto.order)
            else:
                seq = arrange(names, block, proto.order)
            entries += [(cond, "scored", p, rep) for cond in seq]
    out = [{"index": i, "condition": c, "role": r, "prompt": p, "repetition": rep}
           for i, (c, r, p, rep) in enumerate(entries)]
    if proto.batch > 1:
        for e in out:
            e["prompts"] = batch_prompts(e["prompt"], batch=proto.batch, count=n_prompts)
    return out
