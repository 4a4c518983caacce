"""`early-forecast`'s runtime: forecast rows gathered on the host or by the device
(engine/policies/host_gather.py, device_gather.py)."""

from packbench.core.registry import check_param, param_default
from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.policies.base import LoaderPolicy
from packbench.engine.policies.device_gather import DeviceForecast
from packbench.engine.policies.host_gather import EarlyForecast

FORECAST_GATHERS: dict[str, type[LoaderPolicy]] = {"host": EarlyForecast, "device": DeviceForecast}


def early_forecast(*, gather: str = param_default("early-forecast", "gather")) -> LoaderPolicy:
    """A fresh `early-forecast` policy."""
    return FORECAST_GATHERS[check_param("early-forecast", "gather", gather)]()


# DeviceForecast is captured: its side stream is joined as dense-stream's.
RUNTIME = LoaderRuntime(policy=early_forecast, graph_safe=lambda policy: policy.gather == "device")
