"""`resident`'s runtime: every outgoing weight copied to the device once (engine/policies/dense.py)."""

from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.policies.dense import Resident

RUNTIME = LoaderRuntime(policy=Resident, lifts_allowance=lambda params: params.get("allowance") == "unbounded",
                        graph_safe=lambda policy: True)
