"""`packet {gather: mapped}` and `phase-switched {gather: mapped}` for MoE models: the routing never
leaves the device, a one-token call's experts run the stock loop's arithmetic without its host
decisions, and every call is bit-identical to dense-stream (and so to stock transformers) in
float32, float16 and bfloat16, eager and in mode graph, with the bytes it charges: k experts a
layer in a decode call, the deduplicated union in a longer one, no index, no readback but a count
a layer after a longer call. The CPU twin gathers with index_select; the CUDA path (Triton over
mapped host memory, captured per layer in mode graph) is the `gpu` test at the end."""

import pytest
import torch

from packbench.core.moe import MOE_SHAPES
from packbench.engine.episode import run_episode
from packbench.engine.moe.gather import gather_experts, single_token_experts, sorted_routes
from packbench.engine.moe.model import CpuFirstMoE
from packbench.engine.moe.policies import ExpertMappedPacket, ExpertMappedPhaseSwitched
from packbench.engine.moe.synth import synth_moe

SHAPES = ("mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny")
DTYPES = ("float32", "float16", "bfloat16")
PROMPT = list(range(7, 31))
CONTINUATION = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe-mapped")
    return {(s, d): synth_moe(root / f"{s}-{d}", shape=s, seed=4, dtype=d) for s in SHAPES for d in DTYPES}


def test_gather_experts_copies_selected_slots_and_leaves_the_rest():
    src = torch.arange(5 * 3 * 2, dtype=torch.float32).reshape(5, 3, 2)
    dst = torch.full((4, 3, 2), -1.0)
    gather_experts(torch.tensor([4, -1, 0, 2]), src, dst)
    # Would catch a gather that writes a skipped slot (-1) or reads the wrong expert.
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[2], src[0]) and torch.equal(dst[3], src[2])
    assert (dst[1] == -1).all()
    gather_experts(torch.tensor([1, 3, 3, 0]), src, dst)
    assert torch.equal(dst, src[[1, 3, 3, 0]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token_experts_is_the_stock_loop_bit_for_bit(checkpoints, dtype):
    """The stock eager loop (experts resident) against the sync-free one on the same token, for
    routing weights of the router's own dtype (would catch a 0-d weight changing type promotion,
    or an order other than ascending expert ids)."""
    model = CpuFirstMoE(checkpoints[("qwen3-moe-tiny", dtype)], dtype=getattr(torch, dtype),
                        device=torch.device("cpu"))
    module = model.experts_modules[0]
    gu, dn = model.host.gate_up[0], model.host.down[0]
    stock = type(module).forward
    module.gate_up_proj, module.down_proj = gu, dn
    g = torch.Generator().manual_seed(0)
    for trial in range(8):
        x = torch.randn(1, gu.shape[2], generator=g).to(gu.dtype)
        idx = torch.randperm(gu.shape[0], generator=g)[:4][None, :]
        w = torch.softmax(torch.randn(1, 4, generator=g), dim=-1).to(gu.dtype if trial % 2 else torch.float32)
        want = stock(module, x, idx, w)
        ids, weights = sorted_routes(idx, w)
        got = single_token_experts(x, weights, gu[ids], dn[ids], module.act_fn, torch.zeros(1, dtype=torch.long))
        assert got.dtype == want.dtype and torch.equal(got, want), (dtype, trial)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_mapped_gathers_are_dense_stream_bit_for_bit_with_their_bytes(checkpoints, shape, dtype, mode):
    model = CpuFirstMoE(checkpoints[(shape, dtype)], dtype=getattr(torch, dtype), device=torch.device("cpu"),
                        mode=mode)
    s = MOE_SHAPES[shape]
    layers, experts, k = s["layers"], s["experts"], s["k"]
    expert_bytes = model.host.expert_bytes
    outs, routes = {}, {}
    for label, name, params in (("dense-stream", "dense-stream", {}), ("packet-host", "packet", {"gather": "host"}),
                                ("mapped", "packet", {"gather": "mapped"}),
                                ("phase-mapped", "phase-switched", {"gather": "mapped"})):
        model.use(name, **params)
        outs[label] = run_episode(model, PROMPT, continuation=CONTINUATION)
        routes[label] = list(model.routes)
    assert type(model.slot.policy) is ExpertMappedPhaseSwitched
    ref = outs["dense-stream"]
    for label, out in outs.items():
        assert (out.logits == ref.logits).all(), f"{label} differs from dense-stream ({shape} {dtype} {mode})"
        assert out.tokens == ref.tokens
    union = [[len(r) for r in call] for call in routes["packet-host"]]  # the host gather's routed sets
    mapped = outs["mapped"].calls
    # Prefill (24 tokens): the deduplicated union, counted on the device and read after the call.
    assert mapped[0].rows_copied == union[0] and mapped[0].active_rows == union[0]
    assert mapped[0].h2d_weight_bytes == [m * expert_bytes for m in union[0]]
    assert mapped[0].d2h_bytes == [4] * layers
    for call, want in zip(mapped[1:], union[1:]):  # decode: the token's k distinct experts, nothing read back
        assert want == [k] * layers
        assert call.rows_copied == [k] * layers and call.h2d_weight_bytes == [k * expert_bytes] * layers
        assert call.h2d_index_bytes == [0] * layers and call.d2h_bytes == [0] * layers
    assert routes["mapped"] == []  # the routing never came to the host
    phase = outs["phase-mapped"].calls
    assert phase[0].rows_copied == [experts] * layers  # dense prefill
    assert all(c.rows_copied == [k] * layers for c in phase[1:])
    if mode == "graph":  # the CPU twin: nothing captured, and the record says why
        assert model.graphs.graphs == {}


def test_the_one_token_slots_are_the_workspaces_first_experts(checkpoints):
    """After a prefill (the union into the workspace) and decode calls (k slots), the slots hold no
    memory of their own and the policy's device bytes are the workspace and its counts. Bug caught:
    separate slots, k experts more on the device (672 MiB at Mixtral-8x7B's shape), and the mapped
    packet out of memory under 4608 MiB on an H100 where the device-gather packet ran."""
    from packbench.core.moe import MoeShape, policy_need_bytes

    path = checkpoints[("mixtral-tiny", "float32")]
    model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    model.use("packet", gather="mapped")
    out = run_episode(model, PROMPT, continuation=CONTINUATION)
    assert (out.logits == ref.logits).all()
    policy = model.slot.policy
    ws, slots = policy.workspace, policy.slots
    k = MOE_SHAPES["mixtral-tiny"]["k"]
    assert slots.gate_up.shape[0] == k and slots.gate_up.data_ptr() == ws.gate_up.data_ptr()
    assert slots.down.data_ptr() == ws.down.data_ptr()
    assert policy.device_bytes() == ws.nbytes + policy.counts.numel() * policy.counts.element_size()
    shape = MoeShape.of("mixtral-tiny")
    assert policy_need_bytes(shape, "float32", "packet", "mapped") == policy_need_bytes(shape, "float32", "packet",
                                                                                          "device")


def test_the_mapped_policy_reads_only_the_routed_experts(checkpoints):
    """Scrambling an expert the decode token did not route leaves the logits; scrambling the
    mapped source of one it routed changes them (the gather reads host memory, not a stale copy)."""
    model = CpuFirstMoE(checkpoints[("olmoe-tiny", "float32")], dtype=torch.float32, device=torch.device("cpu"))
    model.use("packet", gather="host")
    base = run_episode(model, PROMPT[:3], continuation=2)
    routed = model.routes[1][0]
    unused = next(e for e in range(model.host.experts) if e not in routed)
    model.use("packet", gather="mapped")
    assert (run_episode(model, PROMPT[:3], continuation=2).logits == base.logits).all()
    model.host.gate_up[0][unused].normal_()
    assert (run_episode(model, PROMPT[:3], continuation=2).logits[1] == base.logits[1]).all()
    model.host.gate_up[0][routed[0]].normal_()
    assert not (run_episode(model, PROMPT[:3], continuation=2).logits[1] == base.logits[1]).all()


def test_the_condition_runtime_builds_the_mapped_expert_policies():
    from packbench.engine.conditions import RUNTIMES

    assert type(RUNTIMES["packet"].policy(gather="mapped")) is ExpertMappedPacket
    assert type(RUNTIMES["phase-switched"].policy(gather="mapped")) is ExpertMappedPhaseSwitched
    assert RUNTIMES["packet"].graph_safe(RUNTIMES["packet"].policy(gather="mapped"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_mapped_gather_eager_and_captured_is_dense_stream_bit_for_bit(checkpoints, shape, dtype):
    """On CUDA: the Triton gather over mapped host memory, eager and captured per layer in mode
    graph, against dense-stream in each mode (eager attention, stock shapes) and across modes."""
    logits = {}
    for mode in ("eager", "graph"):
        model = CpuFirstMoE(checkpoints[(shape, dtype)], dtype=getattr(torch, dtype), device=torch.device("cuda"),
                            mode=mode)
        for label, name, params in (("dense-stream", "dense-stream", {}), ("mapped", "packet", {"gather": "mapped"}),
                                    ("phase-mapped", "phase-switched", {"gather": "mapped"})):
            model.use(name, **params)
            for rep in range(2):  # the second episode of a graph replays from its first decode call
                out = run_episode(model, PROMPT, continuation=CONTINUATION)
                logits[(mode, label, rep)] = out.logits
                if mode == "graph" and label != "dense-stream":
                    assert out.decode_graph.startswith("experts captured"), out.decode_graph
                    assert len(model.graphs.graphs) == MOE_SHAPES[shape]["layers"]
                if label == "mapped":
                    k = MOE_SHAPES[shape]["k"]
                    assert all(c.rows_copied == [k] * MOE_SHAPES[shape]["layers"] for c in out.calls[1:])
        del model
        torch.cuda.empty_cache()
    ref = logits[("eager", "dense-stream", 0)]
    for key, value in logits.items():
        assert (value == ref).all(), key
