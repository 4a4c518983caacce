"""`expert-cache`'s runtime: c experts a layer cached on the device, misses fetched by the device
gather, the forecast on a side stream when `forecast: on` (engine/moe/cache.py). An MoE model
takes the policy as built; the schema refuses the kind on an OPT model before anything runs."""

from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.moe.cache import expert_cache

RUNTIME = LoaderRuntime(policy=expert_cache)
