"""`expert-forecast`'s runtime: the next MoE layer's experts prefetched on a side stream, the rest of
the demand fetched (engine/moe/cache.py, capacity 0)."""

from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.moe.cache import expert_forecast

RUNTIME = LoaderRuntime(policy=expert_forecast)
