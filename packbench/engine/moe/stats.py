"""Routing traces of an MoE checkpoint (`packbench model stats` on an MoE model): stock
transformers' forward over prompts, each layer's router output kept per token
(core/routing.py's trace layout); the whole model on `device` (the CPU by default)."""

from pathlib import Path

import numpy as np
import torch

from packbench.engine.moe.model import force_eager, load_stock, moe_family


def routing_traces(model_dir: Path, prompts: list[list[int]], *, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", progress=None) -> tuple[list[np.ndarray], dict]:
    """One (layers, tokens, k) int array per prompt (one prefill call each), over the layers that
    have experts, and the model's (experts, k, layers, layer_ids: those layers' indices in the
    model). The routers' own top-k, read by a hook on each router's output."""
    family = moe_family(model_dir)
    model = load_stock(model_dir, family=family, dtype=dtype)
    force_eager(model.config)
    model.eval().to(device)
    routers = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers)
               if getattr(getattr(layer, "mlp", None), "experts", None) is not None]
    seen: dict[int, torch.Tensor] = {}
    hooks = [gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2] if isinstance(out, tuple) else out))
             for i, gate in routers]
    traces = []
    try:
        with torch.inference_mode():
            for n, prompt in enumerate(prompts):
                seen.clear()
                model(input_ids=torch.tensor([prompt], device=device), use_cache=False, logits_to_keep=1)
                traces.append(np.stack([seen[i].reshape(len(prompt), -1).cpu().numpy() for i, _ in routers]))
                if progress:
                    progress(n + 1, len(prompts))
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    return traces, {"experts": int(experts), "k": int(cfg.num_experts_per_tok), "layers": len(routers),
                    "layer_ids": [i for i, _ in routers], "family": family}
