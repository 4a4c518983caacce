"""`row-retention`'s runtime: a GPU LRU cache of rows, misses gathered on the host (engine/policies/host_gather.py)."""

from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.policies.host_gather import RowRetention

RUNTIME = LoaderRuntime(policy=RowRetention)
