"""`sparse-extents`'s runtime: fixed-size row blocks gathered on the host (engine/policies/host_gather.py)."""

from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.policies.host_gather import SparseExtents

RUNTIME = LoaderRuntime(policy=SparseExtents)
