"""`dense-stream`'s runtime: every outgoing weight, every call, as the checkpoint holds it or
quantized to int8 rows (engine/policies/dense.py, int8.py)."""

from packbench.core.registry import check_param, param_default
from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.policies.base import LoaderPolicy
from packbench.engine.policies.dense import DenseStream
from packbench.engine.policies.int8 import Int8DenseStream

# Its weight formats: a plain table whose keys are the kind's `weights` choices.
DENSE_WEIGHTS: dict[str, type[LoaderPolicy]] = {"dtype": DenseStream, "int8": Int8DenseStream}


def dense_stream(*, weights: str = param_default("dense-stream", "weights")) -> LoaderPolicy:
    """A fresh `dense-stream` policy."""
    return DENSE_WEIGHTS[check_param("dense-stream", "weights", weights)]()


# Captured where its host copy is pinned: the copy is a graph memcpy node, on a forked stream.
RUNTIME = LoaderRuntime(policy=dense_stream, graph_safe=lambda policy: policy.host.pin)
