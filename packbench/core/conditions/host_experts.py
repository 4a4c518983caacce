"""`host-experts`: Fiddler-style expert offload, packbench's implementation (a competitor, tier
approximate, MoE models only). Attention, norms, routers, embeddings and lm_head run on the
device; every routed expert is computed on the host CPU, where its weights live: each MoE layer's
hidden states and routing go device-to-host, the experts' summed outputs come back. No expert
weight crosses the link, but for `hot` > 0 the hot set's, once per episode (Fiddler's GPU-resident
popular experts, chosen from the episode's own prefill routing). Host arithmetic is not the GPU's bit for bit, so the tier is approximate
and the fidelity gate judges it against dense-stream. Its runtime is engine/conditions/host_experts.py
over engine/moe/host_experts.py; docs/experiments/competitors.md says what it leaves out of Fiddler.
"""

from typing import Any, Mapping

from packbench.core.conditions.base import MODE_PARAM, CallInputs, Competitor, ConditionKind, IntParam

LIBRARY = "torch"  # the experts run through torch's own CPU kernels, as Fiddler's did
CAPTURE_REFUSAL = "its expert arithmetic runs on the host CPU between the device's kernels on every call"


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """The experts' outputs coming back, one hidden-sized row a token a layer (no weight moves but a
    hot set's, once, at the prefill); what goes down (hidden states and routing) is device-to-host,
    outside this estimate."""
    return float(call.tokens * call.row_bytes * call.shape.layers)


KIND = ConditionKind(
    name="host-experts",
    summary="Fiddler-style (packbench's implementation): every expert computed on the host CPU where its "
            "weights live; hidden states down, expert outputs up",
    # `hot`: experts per MoE layer held on the device (the ones the episode's prefill routed the most
    # tokens to), computed there; 0: every expert on the host.
    params={"hot": IntParam(minimum=0, default=0), "mode": MODE_PARAM},
    h2d_bytes=h2d_bytes,
    tier="approximate",
    since=8,  # the newest schema when it landed: its name was sayable in none before
    competitor=Competitor(library=lambda params: LIBRARY, fastest_mode=lambda params: "eager",
                          capture_refusal=lambda params: CAPTURE_REFUSAL),
    families=("moe",),
)
