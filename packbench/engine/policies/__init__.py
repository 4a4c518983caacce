"""Loader policies: how each layer's outgoing FFN weight reaches the device for a call.

Every policy hands `OutgoingLinear` a device weight in the ORIGINAL layout (hidden, ffn), and
the layer multiplies with the ordinary dense `F.linear`, exactly as stock OPT's fc2 does; rows a
policy did not refresh are finite and meet exact zeros, so logits are bit-identical to
streaming everything (`base`).

Modules, by family: `base` (the host weights, the `LoaderPolicy` protocol, the shared pieces,
`OutgoingLinear`), `dense` (resident, dense-stream), `host_gather` (the policies that read a
mask back and gather on the host), `device_gather` (the policies whose device gathers its own
rows), `int8` (dense-stream and packet over int8 weight-only outgoing rows). Each policy holds its buffers in one object made in `activate` and dropped in
`deactivate`. This module holds the registry `POLICIES`, whose constructors take exactly the
parameters and defaults of `core.registry.POLICY_PARAMS`, and re-exports every name.
"""

from collections.abc import Callable

from packbench.core.registry import check_param, param_default
from packbench.engine.policies.base import (BUFFERS_LAYOUT, INDEX_BYTES, INDEX_DTYPE, HostWeights, LoaderPolicy,
                                  OutgoingLinear, PolicySlot, RowPacket, build_gather_layout, stream_dense,
                                  zeroed_workspace)
from packbench.engine.policies.dense import DenseStream, DoubleBuffer, Resident, copies_ahead
from packbench.engine.policies.device_gather import (DeviceForecast, DeviceForecastBuffers, DevicePacket,
                                           DevicePhaseSwitched, Mapped)
from packbench.engine.policies.host_gather import (EarlyForecast, Extents, Forecast, HostGather, Packet, PhaseSwitched,
                                         Retention, RowRetention, SparseExtents, Staging, forecast_split, lru_plan)
from packbench.engine.policies.int8 import (Int8DenseStream, Int8DevicePacket, Int8Packet, Int8RowPacket, dequantize_into,
                                  int8_layout, int8_row_bytes, quantize_rows)


# `dense-stream`'s weight formats: a plain registry whose keys are the registry's `weights` choices.
DENSE_WEIGHTS: dict[str, type[LoaderPolicy]] = {"dtype": DenseStream, "int8": Int8DenseStream}


def dense_stream(*, weights: str = param_default("dense-stream", "weights")) -> LoaderPolicy:
    """The `dense-stream` condition: every outgoing weight, every call, as the checkpoint holds it
    or quantized to int8 rows."""
    return DENSE_WEIGHTS[check_param("dense-stream", "weights", weights)]()


# `packet`'s gathers: a plain registry whose keys are the registry's `gather` choices; the int8
# weight format has its own, with the same keys.
PACKET_GATHERS: dict[str, type[LoaderPolicy]] = {"host": Packet, "device": DevicePacket}
INT8_PACKET_GATHERS: dict[str, type[LoaderPolicy]] = {"host": Int8Packet, "device": Int8DevicePacket}
PACKET_WEIGHTS: dict[str, dict[str, type[LoaderPolicy]]] = {"dtype": PACKET_GATHERS, "int8": INT8_PACKET_GATHERS}


def packet(*, gather: str = param_default("packet", "gather"),
           weights: str = param_default("packet", "weights")) -> LoaderPolicy:
    """The `packet` condition: exact active rows, gathered on the host or by the device, as the
    checkpoint holds them or quantized to int8 rows."""
    by_gather = PACKET_WEIGHTS[check_param("packet", "weights", weights)]
    return by_gather[check_param("packet", "gather", gather)]()


# `phase-switched`'s gathers, as packet's.
PHASE_SWITCHED_GATHERS: dict[str, type[LoaderPolicy]] = {"host": PhaseSwitched, "device": DevicePhaseSwitched}


def phase_switched(*, gather: str = param_default("phase-switched", "gather")) -> LoaderPolicy:
    """The `phase-switched` condition: dense prefill, exact packets in decode, gathered on the
    host (one mask readback per layer) or by the device."""
    return PHASE_SWITCHED_GATHERS[check_param("phase-switched", "gather", gather)]()


# `early-forecast`'s gathers, as PACKET_GATHERS.
FORECAST_GATHERS: dict[str, type[LoaderPolicy]] = {"host": EarlyForecast, "device": DeviceForecast}


def early_forecast(*, gather: str = param_default("early-forecast", "gather")) -> LoaderPolicy:
    """The `early-forecast` condition: forecast rows gathered on the host or by the device."""
    return FORECAST_GATHERS[check_param("early-forecast", "gather", gather)]()


# One constructor per policy name of core.registry.POLICY_PARAMS, taking exactly its parameters
# as keyword-only arguments with its defaults (tests/engine/test_policy_registry.py checks).
POLICIES: dict[str, Callable[..., LoaderPolicy]] = {
    "resident": Resident,
    "dense-stream": dense_stream,
    "sparse-extents": SparseExtents,
    "packet": packet,
    "phase-switched": phase_switched,
    "row-retention": RowRetention,
    "early-forecast": early_forecast,
}


__all__ = [
    "BUFFERS_LAYOUT", "INDEX_BYTES", "INDEX_DTYPE", "HostWeights", "LoaderPolicy", "OutgoingLinear", "PolicySlot",
    "RowPacket", "build_gather_layout", "stream_dense", "zeroed_workspace",
    "DenseStream", "DoubleBuffer", "Resident", "copies_ahead",
    "DeviceForecast", "DeviceForecastBuffers", "DevicePacket", "DevicePhaseSwitched", "Mapped",
    "EarlyForecast", "Extents", "Forecast", "HostGather", "Packet", "PhaseSwitched", "Retention", "RowRetention",
    "SparseExtents", "Staging", "forecast_split", "lru_plan",
    "Int8DenseStream", "Int8DevicePacket", "Int8Packet", "Int8RowPacket", "dequantize_into", "int8_layout",
    "int8_row_bytes", "quantize_rows",
    "DENSE_WEIGHTS", "PACKET_GATHERS", "INT8_PACKET_GATHERS", "PACKET_WEIGHTS", "PHASE_SWITCHED_GATHERS",
    "FORECAST_GATHERS", "POLICIES", "dense_stream", "packet", "phase_switched", "early_forecast",
]
