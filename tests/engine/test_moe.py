"""MoE models CPU-first: every expert policy bit-identical to dense-stream (and to stock
transformers with the experts resident) in float32, float16 and bfloat16 on a tiny shape of
each family, with exact ledgers (bytes = experts moved x expert bytes + 8 B an index)."""

import pytest
import torch

from packbench.core.moe import MOE_SHAPES
from packbench.engine.episode import run_episode
from packbench.engine.moe.model import CpuFirstMoE, MoeCheckpointError, force_eager, model_class
from packbench.engine.moe.policies import EXPERT_POLICIES
from packbench.engine.moe.synth import synth_moe

SHAPES = ("mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny")
DTYPES = ("float32", "float16", "bfloat16")
PROMPT = list(range(7, 31))  # 24 tokens: a prefill that routes to most experts, decodes to few
CONTINUATION = 5
RUNS = [(name, name, {}) for name in EXPERT_POLICIES] + [
    ("packet-device", "packet", {"gather": "device"}), ("phase-device", "phase-switched", {"gather": "device"})]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe")
    return {(s, d): synth_moe(root / f"{s}-{d}", shape=s, seed=3, dtype=d) for s in SHAPES for d in DTYPES}


def _stock_logits(path, dtype) -> torch.Tensor:
    """Stock transformers, experts resident, the eager expert loop: (calls, vocab) greedy logits."""
    from transformers import DynamicCache

    family = MOE_SHAPES[path.name.rsplit("-", 1)[0]]["family"]
    model = model_class(family).from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    force_eager(model.config)
    cache, ids, rows = DynamicCache(), torch.tensor([PROMPT]), []
    with torch.inference_mode():
        for _ in range(CONTINUATION):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
            rows.append(logits)
            ids = torch.tensor([[int(logits.argmax())]])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_policy_is_dense_stream_bit_for_bit_with_exact_ledgers(checkpoints, shape, dtype):
    path = checkpoints[(shape, dtype)]
    model = CpuFirstMoE(path, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    s = MOE_SHAPES[shape]
    expert_bytes = 3 * s["hidden"] * s["intermediate"] * getattr(torch, dtype).itemsize
    assert model.host.expert_bytes == expert_bytes
    outs = {}
    for label, name, params in RUNS:
        model.use(name, **params)
        outs[label] = run_episode(model, PROMPT, continuation=CONTINUATION)
        outs[label].routes = list(model.routes)
    ref = outs["dense-stream"]
    for name, out in outs.items():
        # Catches a loader whose expert loop takes another arithmetic path (other token counts,
        # a grouped kernel) or reads a stale expert slot.
        assert (out.logits == ref.logits).all(), f"{name} differs from dense-stream in {dtype}"
        assert out.tokens == ref.tokens
    # Against stock transformers with the experts resident: the engine changes no arithmetic.
    assert torch.equal(torch.from_numpy(ref.logits), _stock_logits(path, dtype))

    layers, experts = s["layers"], s["experts"]
    for call in ref.calls:  # dense-stream: every expert of every layer, no index, no readback
        assert call.rows_copied == [experts] * layers
        assert call.h2d_weight_bytes == [experts * expert_bytes] * layers
        assert call.h2d_index_bytes == [0] * layers and call.active_rows == [None] * layers
    for call in outs["resident"].calls:
        assert call.h2d_weight_bytes == [0] * layers
    packet = outs["packet"]
    assert len(packet.routes) == CONTINUATION
    for call, routes in zip(packet.calls, packet.routes):
        m = [len(r) for r in routes]
        assert call.active_rows == m and call.rows_copied == m
        assert call.h2d_weight_bytes == [k * expert_bytes for k in m]  # the packet's bytes, exactly
        assert call.h2d_index_bytes == [8 * k for k in m]
        assert call.d2h_bytes == [experts] * layers  # the routing mask read back
        assert all(list(r) == sorted(set(r)) for r in routes)
    assert all(len(r) <= s["k"] for r in packet.routes[1])  # a decode call routes one token's k experts
    assert packet.calls[0].rows_copied != ref.calls[0].rows_copied or experts <= s["k"] * len(PROMPT)
    for call, want in zip(outs["packet-device"].calls, packet.calls):  # the same experts, no index
        assert call.rows_copied == want.rows_copied and call.h2d_weight_bytes == want.h2d_weight_bytes
        assert call.h2d_index_bytes == [0] * layers
    assert outs["phase-device"].calls[0].rows_copied == [experts] * layers
    phase = outs["phase-switched"]
    assert phase.calls[0].rows_copied == [experts] * layers  # dense prefill
    for got, want in zip(phase.calls[1:], packet.calls[1:]):  # packets in decode, as packet's
        assert got.h2d_weight_bytes == want.h2d_weight_bytes and got.h2d_index_bytes == want.h2d_index_bytes


def test_a_packet_carries_only_the_routed_experts(checkpoints):
    """Scrambling the experts the call did not route must not change the logits, and scrambling
    one it routed must: the packet is exact and is the union, no more (catches a packet that
    silently streams everything, or misses an expert)."""
    path = checkpoints[("olmoe-tiny", "float32")]
    model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    model.use("packet")
    base = run_episode(model, PROMPT[:3], continuation=2)
    routed = model.routes[1][0]
    unused = next(e for e in range(model.host.experts) if e not in routed)
    model.host.gate_up[0][unused].normal_()
    model.use("packet")
    same = run_episode(model, PROMPT[:3], continuation=2)
    assert (same.logits[1] == base.logits[1]).all()
    model.host.gate_up[0][routed[0]].normal_()
    model.use("packet")
    moved = run_episode(model, PROMPT[:3], continuation=2)
    assert not (moved.logits[1] == base.logits[1]).all()


def test_device_bytes_charge_each_policys_workspace_and_packet(checkpoints):
    """What each MoE policy holds on the device is charged to the allowance: one layer's workspace
    for dense-stream and the packets, plus, for `packet {gather: host}` and its phase-switched
    twin, the device twin of the staging packet (every expert of a layer and its int64 id);
    resident holds every layer's experts. Catches the planted bug "moe packet host gather:
    staging not charged"."""
    model = CpuFirstMoE(checkpoints[("qwen3-moe-tiny", "float32")], dtype=torch.float32, device=torch.device("cpu"))
    host = model.host
    layer, packet = host.layer_bytes, host.experts * (8 + host.expert_bytes)
    moe_layers = sum(host.has_experts(i) for i in range(host.layers))
    for name, params, want in (("resident", {}, moe_layers * layer), ("dense-stream", {}, layer),
                               ("packet", {"gather": "host"}, layer + packet), ("packet", {"gather": "device"}, layer),
                               ("phase-switched", {"gather": "host"}, layer + packet),
                               ("phase-switched", {"gather": "device"}, layer)):
        model.use(name, **params)
        assert model.slot.policy.device_bytes() == want, (name, params)


def test_opt_only_policies_and_formats_are_refused(checkpoints):
    model = CpuFirstMoE(checkpoints[("mixtral-tiny", "float32")], dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(MoeCheckpointError, match="does not fit an MoE model"):
        model.use("row-retention", rows_per_layer=4)
    with pytest.raises(MoeCheckpointError, match="weights int8"):
        model.use("packet", weights="int8")
    with pytest.raises(MoeCheckpointError, match="mode eager or graph"):
        model.new_cache(10, mode="compile")
