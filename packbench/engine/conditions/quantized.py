"""`quantized`'s runtime: a low-bit model resident on the device (engine/quantized.py
`QuantizedModel`), built once per method at load so a missing library or kernel fails before
any episode, held on the device alone while its episodes run and shelved on the host between
them where the method allows (QuantizedModel.can_shelve)."""

from collections.abc import Sequence

from packbench.core.protocol import Condition
from packbench.engine.conditions.base import CompetitorRuntime, Holder
from packbench.engine.quantized import QuantizationUnavailable, QuantizedModel


class QuantizedRuntime(CompetitorRuntime):
    record_key = "quantization"  # core/record.py: what building the model cost
    start_key = "quantized"  # the start record: build figures per method
    unavailable = QuantizationUnavailable

    def build(self, holder: Holder, params: dict) -> QuantizedModel:
        return QuantizedModel(holder.path, method=params["method"], dtype=holder.dtype, device=holder.device)

    def identity(self, params: dict) -> str:
        return params.get("method")

    def prepare(self, holder: Holder, conditions: Sequence[Condition]) -> dict:
        """Quantize the checkpoint once per method, one at a time with the CPU-first model parked
        (the build's peak is its own), and keep the last one built; a missing library or kernel
        raises here (QuantizationUnavailable) and the model just read is dropped."""
        figures = {}
        for method in sorted({c.params["method"] for c in conditions}):
            try:
                model, state = holder.hold(conditions[0].policy, {"method": method}, self)
            except BaseException:
                holder.drop_model()
                raise
            figures[method] = {**model.stats.as_dict(), "state": state}
            del model  # else it stays on the device while the next method builds (an OOM at 4800 MiB)
        return figures


RUNTIME = QuantizedRuntime()
