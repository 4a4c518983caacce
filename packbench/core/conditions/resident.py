"""`resident`: every outgoing weight placed on the device once, at start (the speed reference)."""

from packbench.core.conditions.base import WEIGHTS_SCHEMA, ChoiceParam, ConditionKind, nothing_moves

KIND = ConditionKind(
    name="resident",
    summary="all weights on the GPU, placed once",
    # `allowance: unbounded` runs resident without the protocol's allowance on the device: the
    # speed reference where the model does not fit (its resources verdict still says so). Schema 6.
    params={"allowance": ChoiceParam(choices=("held", "unbounded"), default="held", since=WEIGHTS_SCHEMA)},
    h2d_bytes=nothing_moves,  # the weights were placed once at start
    families=("opt", "moe"),  # an MoE model runs it at expert granularity (engine/moe/policies.py)
    # every weight on the device, under the allowance unless told otherwise
    holds=lambda params: None if params.get("allowance") == "unbounded" else "all",
)
