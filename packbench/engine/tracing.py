"""Recording a trace (core/trace.py) of a CPU-first model's calls: per call and layer, the OPT
neurons active in any token of the call (fc2's input non-zero), or the experts an MoE layer's
router chose for any token. A `Tracer` hooks the model's outgoing layers (OPT) or experts
modules (MoE), reads the set back whatever the policy, and groups the sets by the recorder's
calls; the episode loop is unchanged. For an MoE model it also records, per call and layer, the
experts layer l's router picks from the MoE input of the layer with experts before it
(`CpuFirstMoE.forecast`, the very function `expert-forecast` prefetches by: layer l-1 where every
layer has experts), so `simulate` replays the forecast policies.

What tracing costs is not charged to the ledger (a trace is recording, like the logits): the
set's readback synchronises each layer on a GPU, so an episode traced is not timed as one that
is not. Hooks do not run inside a captured graph: tracing needs engine mode eager.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from packbench.core.trace import Trace, TraceCall, TraceModel


class Tracer:
    """Attach to a CpuFirstModel or CpuFirstMoE; `trace()` gives what it saw since attaching."""

    def __init__(self, model, *, source: dict | None = None) -> None:
        self.model, self.source = model, dict(source or {})
        self.recorder = model.recorder
        self.calls: list[TraceCall] = []
        self.sets: list[list[np.ndarray]] = []
        self.forecasts: list[list[np.ndarray]] = []  # MoE: per call and layer, what the MoE layer before it forecast for it
        self._serial = None
        self._episode = -1
        self.meta = _model_meta(model)
        if self.meta.unit == "expert":
            self._hooks = [e.register_forward_pre_hook(self._expert_hook(i), with_kwargs=True)
                           for i, e in enumerate(model.experts_modules) if e is not None]
        else:
            from packbench.engine.policies.base import OutgoingLinear

            outgoing = sorted((m for m in model.weights.modules() if isinstance(m, OutgoingLinear)),
                              key=lambda m: m.layer)
            self._hooks = [m.register_forward_pre_hook(self._row_hook(m.layer)) for m in outgoing]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _row(self) -> list[np.ndarray] | None:
        """The current call's sets (a new call opens at the recorder's next serial)."""
        rec = self.recorder
        if rec.current is None or not rec.enabled:
            return None  # outside an episode, or a timing pass (engine/passes.py): not traced
        if self._serial != rec.serial:
            self._serial = rec.serial
            if rec.phase == "prefill" or self._episode < 0:
                self._episode += 1
            self.calls.append(TraceCall(episode=self._episode, phase=rec.phase, tokens=rec.current.tokens))
            self.sets.append([np.zeros(0, dtype=np.int64) for _ in range(self.meta.layers)])
            self.forecasts.append([np.zeros(0, dtype=np.int64) for _ in range(self.meta.layers)])
        return self.sets[-1]

    def _row_hook(self, layer: int):
        def hook(module, args):
            row = self._row()
            if row is not None:
                h = args[0]
                row[layer] = (h.reshape(-1, h.shape[-1]) != 0).any(dim=0).nonzero().reshape(-1).cpu().numpy()
        return hook

    def _expert_hook(self, layer: int):
        experts = self.meta.units

        def hook(module, args, kwargs):
            row = self._row()
            if row is not None:
                top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
                hit = torch.bincount(top_k_index.reshape(-1), minlength=experts) > 0
                row[layer] = hit.nonzero().reshape(-1).cpu().numpy()
                # The next MoE layer's forecast, computed as the engine's expert-forecast computes
                # it, stored under the layer it is for.
                forecast = self.model.forecast(layer, args, kwargs)
                if forecast is not None:
                    self.forecasts[-1][self.model.forecast_target(layer)] = np.asarray(forecast, dtype=np.int64)
        return hook

    def trace(self) -> Trace:
        forecasts = [list(r) for r in self.forecasts] if self.meta.unit == "expert" else None
        return Trace(model=self.meta, calls=list(self.calls), sets=[list(r) for r in self.sets],
                     source=dict(self.source), forecasts=forecasts)


def _model_meta(model) -> TraceModel:
    """The trace header's model fields of a CpuFirstModel or CpuFirstMoE."""
    dtype = str(model.dtype).removeprefix("torch.")
    if hasattr(model, "experts_modules"):
        from packbench.core.moe import MOE_SHAPES, shape_of_config

        import json

        config = json.loads((Path(model.model_dir) / "config.json").read_text())
        s = shape_of_config(config)
        shape = next((name for name, d in MOE_SHAPES.items()
                      if d["family"] == model.family and (d["hidden"], d["intermediate"], d["experts"], d["k"])
                      == (s.hidden, s.intermediate, s.experts, s.k)), None)
        return TraceModel(family=model.family, unit="expert", layers=model.host.layers, units=model.host.experts,
                          unit_bytes=model.host.expert_bytes, hidden=s.hidden, dtype=dtype, k=s.k, shape=shape,
                          layers_without_units=tuple(i for i, e in enumerate(model.experts_modules) if e is None))
    from packbench.core.registry import SHAPES

    hidden, ffn = model.host.shape
    shape = next((name for name, d in SHAPES.items() if (d["hidden"], d["ffn"]) == (hidden, ffn)), None)
    return TraceModel(family="opt", unit="row", layers=model.host.layers, units=ffn, unit_bytes=model.host.row_bytes,
                      hidden=hidden, dtype=dtype, shape=shape)


def record_trace(model_dir: Path, prompts: list[list[int]], *, continuation: int, dtype: torch.dtype,
                 device: str = "cpu", source: dict | None = None, progress=None) -> Trace:
    """A trace of `prompts`, one episode each (prefill + continuation - 1 greedy decode calls),
    run by the CPU-first engine with every outgoing weight resident (the sets do not depend on
    the policy: every policy's logits are the same bits)."""
    from packbench.engine.episode import run_episode
    from packbench.engine.moe.model import CpuFirstMoE, moe_family

    dev = torch.device(device)
    if moe_family(model_dir) is not None:
        model = CpuFirstMoE(model_dir, dtype=dtype, device=dev)
    else:
        from packbench.engine.model import CpuFirstModel

        model = CpuFirstModel(model_dir, dtype=dtype, device=dev)
    model.use("resident")
    tracer = Tracer(model, source={"checkpoint": str(model_dir), **(source or {})})
    try:
        for n, prompt in enumerate(prompts):
            run_episode(model, prompt, continuation=continuation)
            if progress is not None:
                progress(n + 1, len(prompts))
    finally:
        tracer.close()
    return tracer.trace()
