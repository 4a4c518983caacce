"""The plan: the ordered episode list of a screen, a pure function of the frozen protocol."""

import numpy as np

BOS = 2  # OPT's beginning-of-sequence id


def prompts(body: dict, *, vocab: int) -> list[list[int]]:
    """The prompt token ids, each cut to prefix_tokens.

    A generator prompt is BOS followed by ids drawn uniformly from [4, vocab) (0-3 are OPT's
    special tokens) by numpy's PCG64 with the protocol's seed: identical on every machine.
    """
    n = body["prefix_tokens"]
    spec = body["prompts"]
    if "token_ids" in spec:
        out = [list(p[:n]) for p in spec["token_ids"]]
        for p in out:
            bad = [t for t in p if t >= vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}")
        return out
    rng = np.random.Generator(np.random.PCG64(spec["generator"]["seed"]))
    return [[BOS] + rng.integers(4, vocab, size=n - 1).tolist() for _ in range(spec["generator"]["count"])]


def plan(body: dict) -> list[dict]:
    """Warmups first (reference first, then the other conditions in protocol order), then for
    each prompt the reference (baseline-first) followed by the candidates rotated by the prompt
    index, so each candidate takes each position equally often across prompts.
    """
    ref = body["reference"]
    others = [c["name"] for c in body["conditions"] if c["name"] != ref]
    n_prompts = (
        len(body["prompts"]["token_ids"]) if "token_ids" in body["prompts"] else body["prompts"]["generator"]["count"]
    )
    entries: list[tuple[str, str, int]] = []
    for cond in [ref] + others:
        entries += [(cond, "warmup", w % n_prompts) for w in range(body["warmups"])]
    for p in range(n_prompts):
        rotated = others[p % len(others):] + others[: p % len(others)] if others else []
        entries += [(cond, "scored", p) for cond in [ref] + rotated]
    return [{"index": i, "condition": c, "role": r, "prompt": p} for i, (c, r, p) in enumerate(entries)]
