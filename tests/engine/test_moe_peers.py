"""The MoE competitors on the CPU: accelerate's offload of an MoE checkpoint (tier exact: dense-stream's
logits bit for bit, every family, fp32 and bf16, its hooks' bytes counted as whole experts) and
host-experts, the Fiddler-style condition (tier approximate: judged by the fidelity gate; on the CPU
its host arithmetic is the device's, so its logits equal dense-stream's there too), with its ledger
against hand counts in each direction; each refused, in one line, on a model it does not fit; a
screen of both beside packets archived and audited AGREE."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cpu_screen import archive_screen
from packbench.core.audit import audit_archive
from packbench.core.errors import ProtocolError
from packbench.core.moe import MOE_SHAPES
from packbench.core.protocol import freeze
from packbench.engine.episode import run_episode
from packbench.engine.ledger import Recorder
from packbench.engine.moe.model import CpuFirstMoE
from packbench.engine.moe.synth import synth_moe
from packbench.service.submit import check_family

pytest.importorskip("accelerate")
from packbench.engine.accelerate import AcceleratedModel, count_copies  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny")
DTYPES = ("float32", "bfloat16")
PROMPT = list(range(7, 31))  # 24 tokens
CONTINUATION = 4
# The routing weights' element bytes as each family's router hands them to the experts: Mixtral
# keeps its float32 softmax, Qwen3-MoE and OLMoE cast it to the model's dtype (transformers 5.25).
ROUTING_BYTES = {"mixtral": lambda dtype: 4, "qwen3_moe": lambda dtype: dtype.itemsize,
                 "olmoe": lambda dtype: dtype.itemsize}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe-peers")
    return {(s, d): synth_moe(root / f"{s}-{d}", shape=s, seed=5, dtype=d) for s in SHAPES for d in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_accelerate_and_host_experts_against_dense_stream(moe_checkpoints, shape, dtype):
    """accelerate runs transformers' own modules with the eager expert loop: bit for bit (its
    tier, exact, is earned here; a grouped expert kernel or SDPA would break it). host-experts
    runs the same loop on the host: on the CPU that is the same arithmetic, so equal too; its
    ledger moves no weight, hidden states + ids + routing weights down, outputs up, per layer."""
    path, dt = moe_checkpoints[(shape, dtype)], getattr(torch, dtype)
    s = MOE_SHAPES[shape]
    model = CpuFirstMoE(path, dtype=dt, device=torch.device("cpu"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    model.use("host-experts")
    host = run_episode(model, PROMPT, continuation=CONTINUATION)
    acc_model = AcceleratedModel(path, dtype=dt, device=torch.device("cpu"), allowance_bytes=64 << 20)
    acc = run_episode(acc_model, PROMPT, continuation=CONTINUATION)
    for name, out in (("accelerate", acc), ("host-experts", host)):
        assert np.array_equal(out.logits, ref.logits) and out.tokens == ref.tokens, name
    # accelerate on the CPU offloads nothing (no device to offload to): 0 bytes, 0 hooks
    assert acc_model.stats.offloaded_modules == 0 and sum(sum(c.h2d_weight_bytes) for c in acc.calls) == 0
    assert acc_model.row_bytes == 3 * s["hidden"] * s["intermediate"] * dt.itemsize  # a row is one expert
    layers, h, k = s["layers"], s["hidden"], s["k"]
    w = ROUTING_BYTES[s["family"]](dt)
    for call in host.calls:
        t = call.tokens
        # Catches a host path that moves weights, forgets the routing, or charges the wrong direction.
        assert call.h2d_weight_bytes == [0] * layers and call.rows_copied == [0] * layers
        assert call.d2h_bytes == [t * h * dt.itemsize + t * k * 8 + t * k * w] * layers
        assert call.h2d_index_bytes == [t * h * dt.itemsize] * layers  # the outputs coming back
        assert all(1 <= a <= min(s["experts"], k * t) for a in call.active_rows)
    assert [c.tokens for c in host.calls] == [len(PROMPT)] + [1] * (CONTINUATION - 1)
    assert all(a <= k for a in host.calls[1].active_rows)  # a decode token routes to k experts


def test_host_experts_computes_with_the_host_weights(moe_checkpoints):
    """Scrambling a routed expert's host weights changes host-experts' logits: it computes with the
    host's experts, not a device copy made at some earlier call."""
    path = moe_checkpoints[("olmoe-tiny", "float32")]
    model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    model.use("host-experts")
    base = run_episode(model, PROMPT[:3], continuation=2)
    model.use("packet")
    run_episode(model, PROMPT[:3], continuation=2)
    routed = model.routes[1][0]
    model.host.gate_up[0][routed[0]].normal_()
    model.use("host-experts")
    moved = run_episode(model, PROMPT[:3], continuation=2)
    assert not np.array_equal(moved.logits[1], base.logits[1])
    assert model.slot.policy.device_bytes() == 0 and model.slot.policy.pinned_bytes() == 0


def test_accelerate_counts_an_offloaded_moe_layer_as_whole_experts(moe_checkpoints):
    """Hooks that place tensors on `meta` stand in for the GPU. Per-module hooks (cpu_offload): the
    experts module moves the fused tensors, E rows of one expert each; an attention projection is no
    whole expert and goes to h2d_index_bytes. One hook over a whole decoder layer (what dispatch_model
    attaches to an offloaded no-split layer): still E rows, the rest of the layer in index bytes
    (catches rows counted from the layer's total, which would call attention bytes experts)."""
    from accelerate import cpu_offload
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from packbench.engine.accelerate import EXPERT_TENSOR

    path = moe_checkpoints[("qwen3-moe-tiny", "float32")]
    s = MOE_SHAPES["qwen3-moe-tiny"]
    expert = 3 * s["hidden"] * s["intermediate"] * 4
    q = s["heads"] * s["head_dim"] * s["hidden"] * 4
    acc = AcceleratedModel(path, dtype=torch.float32, device=torch.device("cpu"), allowance_bytes=64 << 20)
    model = acc._model
    cpu_offload(model, execution_device=torch.device("meta"))
    recorder = Recorder(s["layers"])
    assert count_copies(model, recorder, row_bytes=acc.row_bytes, is_row=EXPERT_TENSOR.search) > 0
    layer = model.model.layers[1]
    recorder.begin(phase="decode", tokens=1)
    layer.mlp.experts._hf_hook.pre_forward(layer.mlp.experts)
    layer.self_attn.q_proj(torch.zeros((1, 1, s["hidden"]), device="meta"))
    call = recorder.current
    assert call.rows_copied == [0, s["experts"], 0] and call.h2d_weight_bytes == [0, s["experts"] * expert, 0]
    assert call.h2d_index_bytes == [0, q, 0]

    whole = AcceleratedModel(path, dtype=torch.float32, device=torch.device("cpu"), allowance_bytes=64 << 20)
    layer = whole._model.model.layers[2]
    layer_bytes = sum(t.numel() * 4 for t in layer.state_dict().values())
    add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("meta"), offload=True,
                                               place_submodules=True))
    recorder = Recorder(s["layers"])
    assert count_copies(whole._model, recorder, row_bytes=whole.row_bytes, is_row=EXPERT_TENSOR.search) == 1
    recorder.begin(phase="decode", tokens=1)
    layer._hf_hook.pre_forward(layer)
    call = recorder.current
    assert call.rows_copied == [0, 0, s["experts"]] and call.h2d_weight_bytes == [0, 0, s["experts"] * expert]
    assert call.h2d_index_bytes == [0, 0, layer_bytes - s["experts"] * expert] and layer_bytes > s["experts"] * expert


@pytest.mark.parametrize("shape", SHAPES)
def test_full_offload_runs_every_module_from_the_host_copy_bit_for_bit(moe_checkpoints, shape):
    """engine/accelerate.py full_offload (accelerate's cpu_offload, what an allowance with room for no
    layer gets), run for real with the CPU as its execution device: every module with weights is
    hooked and offloaded (its own tensors on `meta`, the host copy in the hook), and the logits are
    dense-stream's bit for bit. Bug caught: the first fix dispatched `{"": "cpu"}` with force_hooks,
    whose weights map for module "" is empty (accelerate extracts it by the prefix "."): no hook
    would have found its weights."""
    from accelerate.utils import named_module_tensors

    from packbench.engine.accelerate import EXPERT_TENSOR, full_offload, placed_bytes

    path = moe_checkpoints[(shape, "float32")]
    ref_model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    ref_model.use("dense-stream")
    ref = run_episode(ref_model, PROMPT, continuation=CONTINUATION)
    acc = AcceleratedModel(path, dtype=torch.float32, device=torch.device("cpu"), allowance_bytes=64 << 20)
    model = acc._model
    with_weights = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    full_offload(model, torch.device("cpu"))
    assert all(p.device.type == "meta" for p in model.parameters())  # every weight lives in a hook's copy
    assert all(getattr(m, "_hf_hook", None) is not None and m._hf_hook.offload for m in with_weights)
    hooked = count_copies(model, Recorder(MOE_SHAPES[shape]["layers"]), row_bytes=acc.row_bytes,
                          is_row=EXPERT_TENSOR.search)
    assert hooked >= len(with_weights) > 0  # every one counted (a module of buffers alone is hooked too)
    # What the stats call offloaded is what the hooks hold; buffers (rotary inv_freq) stay on the
    # device. Bug caught on an H100: buffers were counted offloaded, 64 B more than a call copied.
    held = {id(h.weights_map[n]): h.weights_map[n] for m in model.modules() if (h := getattr(m, "_hf_hook", None))
            for n, _ in named_module_tensors(m, include_buffers=h.offload_buffers, recurse=h.place_submodules,
                                             remove_non_persistent=True)}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffers > 0 and placed_bytes(model, {"": "cpu"}) == (buffers, sum(t.numel() * t.element_size()
                                                                              for t in held.values()))
    out = run_episode(acc, PROMPT, continuation=CONTINUATION)
    assert np.array_equal(out.logits, ref.logits) and out.tokens == ref.tokens


def _raw(path, **changes) -> dict:
    return {"name": "moe-peers", "model": {"path": str(path)}, "dtype": "bfloat16",
            "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 4,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}, {"policy": "accelerate"},
                           {"policy": "host-experts"}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
            "gates": {"faithfulness": {}, "fidelity": {"max_mean_kl": 0.001, "min_top1": 0.99}}, **changes}


def test_kinds_are_refused_on_models_they_do_not_fit(moe_checkpoints, tmp_path):
    moe = moe_checkpoints[("mixtral-tiny", "float32")]
    check_family(freeze(_raw(moe)))  # accelerate and host-experts fit an MoE checkpoint: nothing raised
    with pytest.raises(ProtocolError, match=r"conditions\[1\].policy.*'quantized' does not fit"):
        check_family(freeze(_raw(moe, conditions=[{"policy": "dense-stream"},
                                                  {"policy": "quantized", "params": {"method": "nf4"}}])))
    synth = {"synth": {"shape": "tiny", "dtype": "float32", "seed": 0}}
    with pytest.raises(ProtocolError, match=r"conditions\[1\].policy.*'host-experts' does not fit the synthetic "
                                            r"tiny shape, an OPT model"):
        freeze(_raw(moe, model=synth, dtype="float32", conditions=[{"policy": "dense-stream"},
                                                                    {"policy": "host-experts"}]))


def test_host_experts_on_an_opt_checkpoint_is_one_line_exit_2(tiny, tmp_path):
    body = _raw(tiny, dtype="float32", conditions=[{"policy": "dense-stream"}, {"policy": "host-experts"}])
    with pytest.raises(ProtocolError, match=r"'host-experts' does not fit checkpoint .*, an OPT model; use one of"):
        check_family(freeze(body))
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(body))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(f)], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "host-experts" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def screen(tmp_path_factory, moe_checkpoints):
    moe = moe_checkpoints[("qwen3-moe-tiny", "bfloat16")]
    path = tmp_path_factory.mktemp("moe-peers-screen") / "screen.zip"
    body, episodes, verdicts = archive_screen(freeze(_raw(moe)), moe, path)
    return body, episodes, verdicts, path


def test_the_screen_puts_each_in_its_tier_and_judges_it(screen):
    body, episodes, verdicts, _ = screen
    assert body["schema"] == 8  # host-experts is sayable from schema 8
    assert [c["params"] for c in body["conditions"] if c["policy"] in ("accelerate", "host-experts")] == \
        [{"mode": "eager"}, {"hot": 0, "mode": "eager"}]  # defaults written out
    assert all(e["status"] == "ok" for e in episodes), [e.get("error") for e in episodes]
    tiers = {e["condition"]: e["tier"] for e in episodes}
    assert tiers == {"dense-stream": "exact", "packet": "exact", "accelerate": "exact", "host-experts": "approximate"}
    by_gate = {(v["gate"], v["condition"]): v for v in verdicts}
    # exact conditions by the faithfulness gate, host-experts by fidelity alone
    assert by_gate[("faithfulness", "accelerate")]["passed"] and by_gate[("faithfulness", "packet")]["passed"]
    assert ("faithfulness", "host-experts") not in by_gate
    assert by_gate[("fidelity", "host-experts")]["passed"], by_gate[("fidelity", "host-experts")]
    host = [e for e in episodes if e["condition"] == "host-experts"]
    assert all(e["forced_from"] is not None and e["h2d_weight_bytes"] == 0 and e["d2h_bytes"] > 0 for e in host)


def test_the_screen_audits_agree(screen):
    *_, path = screen
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]


def test_the_screen_summary_keeps_cold_apart_and_each_direction_apart(screen, capsys):
    """bench.moe_peers_screen over the sealed archive (what bench/moe_peers_device.sh prints last):
    the warm-up episode is each condition's cold row, the scored ones its warm row; host-experts moves
    no weight and sends its hidden states down (catches a summary that mixes roles or directions)."""
    from bench import moe_peers_screen

    body, episodes, _, path = screen
    records, verdicts = moe_peers_screen.episodes(path)
    got = {(r["condition"], r["state"]): r for r in moe_peers_screen.rows(records, verdicts)}
    names = [c["name"] for c in body["conditions"]]
    assert sorted(got) == sorted((n, s) for n in names for s in ("cold", "warm"))
    assert all(got[(n, "cold")]["episodes"] == 1 and got[(n, "warm")]["episodes"] == 2 for n in names)
    host = got[("host-experts", "warm")]
    assert host["h2d_weight"] == 0 and host["verdict"] == "fidelity PASS" and host["tier"] == "approximate"
    hidden = 64 * 2  # qwen3-moe-tiny, bf16: one token's hidden state, 3 layers, each direction
    assert host["h2d_other"] == 3 * hidden and host["d2h"] == 3 * (hidden + 4 * 8 + 4 * 2)
    assert host["mean_kl"] == 0.0 and host["top1"] == 1.0
    assert got[("packet", "warm")]["verdict"] == got[("accelerate", "warm")]["verdict"] == "faithfulness PASS"
    assert got[("packet", "warm")]["d2h"] == 3 * 16  # the routing mask: one byte an expert a layer
    moe_peers_screen.main([str(path)])
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + 2 * len(names)


def test_the_plans_bytes_for_the_moe_competitors_by_hand():
    """core/moe.py call_bytes, hand-counted at the real shapes: host-experts brings one hidden-sized
    fp16 row a token a layer back (catches an estimate that charges it the packet's weights);
    accelerate at most every layer whole (Mixtral-8x7B: 8 experts of 3 x 4096 x 14336, attention
    32 + 8 heads of 128 twice, router and two norms)."""
    from packbench.core.moe import MoeShape, call_bytes

    qwen = MoeShape.of("qwen3-30b-a3b")
    assert call_bytes(qwen, "float16", "host-experts", tokens=1, phase="decode") == 48 * 2048 * 2
    assert call_bytes(qwen, "float16", "host-experts", tokens=128, phase="prefill") == 48 * 128 * 2048 * 2
    mixtral = MoeShape.of("mixtral-8x7b", layers=4)
    layer = 8 * 3 * 4096 * 14336 * 2 + (4096 * 32 * 128 * 2 + 4096 * 8 * 128 * 2) * 2 + 8 * 4096 * 2 + 2 * 4096 * 2
    assert layer == 2_902_540_288
    assert call_bytes(mixtral, "float16", "accelerate", tokens=1, phase="decode") == 4 * layer


def test_the_worker_refuses_host_experts_on_an_opt_model_before_any_episode(tiny):
    """A protocol that reached a worker without submit's check (an old queue, a hand-made body):
    the runtime's check refuses it in one line and drops the model just read."""
    from packbench.engine.conditions.host_experts import RUNTIME, HostExpertsUnavailable
    from packbench.engine.model import CpuFirstModel

    class Holder:
        model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
        path, device = tiny, torch.device("cpu")
        dropped = False

        def drop_model(self):
            self.dropped = True

    class Condition:
        name, policy, resolved_params = "host-experts", "host-experts", {"mode": "eager"}

    holder = Holder()
    with pytest.raises(HostExpertsUnavailable, match=r"is not an MoE checkpoint; drop the condition$"):
        RUNTIME.check(holder, [Condition()])
    assert holder.dropped


@pytest.mark.parametrize("shape", SHAPES)
def test_a_hot_set_on_the_device_and_the_rest_on_the_host(moe_checkpoints, shape):
    """host-experts {hot: h}: the h experts each layer's prefill routed the most tokens to move to
    the device once (charged in the prefill, as whole experts) and serve their tokens there. hot = E
    holds every expert: one loop in ascending id order, so dense-stream's logits bit for bit and a hit
    rate of 1 with no hidden state sent down (catches a hot set that still ships every token to the
    host, or that moves weights every call). A partial hot set adds two partial sums: close, not
    bit for bit (fidelity), and its hit rate is strictly between 0 and 1 here."""
    from packbench.engine.moe.host_experts import HostExperts

    path, dt = moe_checkpoints[(shape, "float32")], torch.float32
    s = MOE_SHAPES[shape]
    layers, experts, expert = s["layers"], s["experts"], 3 * s["hidden"] * s["intermediate"] * 4
    model = CpuFirstMoE(path, dtype=dt, device=torch.device("cpu"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    for hot in (experts, 2):
        model.use_policy(HostExperts(hot=hot))
        out = run_episode(model, PROMPT, continuation=CONTINUATION)
        policy = model.slot.policy
        first, rest = out.calls[0], out.calls[1:]
        assert first.rows_copied == [hot] * layers and first.h2d_weight_bytes == [hot * expert] * layers
        assert all(c.h2d_weight_bytes == [0] * layers and c.rows_copied == [0] * layers for c in rest)
        assert policy.device_bytes() == layers * (hot * expert + experts * 8)
        if hot == experts:
            assert np.array_equal(out.logits, ref.logits) and out.tokens == ref.tokens
            assert policy.hit_rate == 1.0
            assert all(c.h2d_index_bytes == [0] * layers for c in out.calls)  # nothing computed on the host
            assert all(c.d2h_bytes == [c.tokens * s["k"] * 8] * layers for c in rest)  # the ids alone
        else:
            forced = run_episode(model, PROMPT, continuation=CONTINUATION, forced=ref.tokens)
            from packbench.core.fidelity import fidelity

            f = fidelity(ref.logits, forced.logits, reference_tokens=ref.tokens, tokens=out.tokens)
            assert f.mean_kl < 1e-6 and f.top1 == 1.0, f
            assert 0 < policy.hit_rate < 1
    with pytest.raises(ValueError, match="hot must be an integer >= 0"):
        HostExperts(hot=-1)


def test_a_hot_sets_tie_goes_to_the_lower_id_and_a_split_call_charges_every_tensor_sent():
    """host-experts {hot: 1} on a stated routing, with a stand-in for the stock loop: experts 1 and
    2 tie for the most tokens, so the lower id is held (HostExperts: "ties to the lower id"); the
    prefill charges that expert and the E token counts, and its split call sends the ids, the
    hidden states and the routing weights down and the host's outputs up (module docstring).
    Catches the planted bugs "host-experts: a tie for the hot set goes to the higher id" and
    "host-experts: the routed ids sent down not charged"."""
    from types import SimpleNamespace

    from packbench.engine.moe.host_experts import HostExperts

    experts, hidden, inter, tokens, k = 4, 3, 2, 2, 2
    host = SimpleNamespace(experts=experts, expert_bytes=3 * hidden * inter * 4,
                           gate_up=[torch.ones(experts, 2 * inter, hidden)], down=[torch.ones(experts, hidden, inter)])
    recorder = Recorder(1)
    policy = HostExperts(hot=1)
    policy.activate(host, torch.device("cpu"), recorder)
    recorder.begin(phase="prefill", tokens=tokens)
    index = torch.tensor([[1, 2], [2, 1]])  # experts 1 and 2: two tokens each
    policy.compute(0, lambda gu, dn, h, i, w: torch.zeros_like(h), torch.ones(tokens, hidden), index,
                   torch.full((tokens, k), 0.5))
    recorder.end(wall_s=0.0, logits_d2h_bytes=0)
    assert policy.resident[0][3].tolist() == [False, True, False, False]
    call = recorder.calls[0]
    counts, ids, states, weights = experts * 8, tokens * k * 8, tokens * hidden * 4, tokens * k * 4
    assert (call.rows_copied, call.h2d_weight_bytes, call.active_rows) == ([1], [host.expert_bytes], [2])
    assert (call.d2h_bytes, call.h2d_index_bytes) == ([counts + ids + states + weights], [tokens * hidden * 4])


@pytest.mark.parametrize("shape", SHAPES)
def test_a_split_call_never_hands_the_stock_loop_its_sentinel_id(moe_checkpoints, shape, monkeypatch):
    """transformers' eager expert loop before 5.2x one-hots the ids into num_experts classes (no
    skipped sentinel class): an id of num_experts is an out-of-range one_hot, a device-side assert
    on CUDA (what the H200's transformers 5.17 hit in host-experts {hot}). Here one_hot is held to
    that older contract: every id the stock loop sees must be a real expert, and the split call
    still adds up to the same output as before (catches the sentinel coming back)."""
    from packbench.engine.moe.host_experts import HostExperts

    stock_one_hot = torch.nn.functional.one_hot

    def older_one_hot(tensor, num_classes=-1):
        assert int(tensor.max()) < num_classes - 1, "the stock loop was handed its sentinel id"
        return stock_one_hot(tensor, num_classes)

    path, dt = moe_checkpoints[(shape, "float32")], torch.float32
    model = CpuFirstMoE(path, dtype=dt, device=torch.device("cpu"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    monkeypatch.setattr(torch.nn.functional, "one_hot", older_one_hot)
    model.use_policy(HostExperts(hot=2))
    out = run_episode(model, PROMPT, continuation=CONTINUATION, forced=ref.tokens)
    assert 0 < model.slot.policy.hit_rate < 1  # both sides computed pairs
    assert np.abs(out.logits - ref.logits).max() < 1e-4


def test_a_hot_set_larger_than_a_layer_is_refused(moe_checkpoints):
    moe = moe_checkpoints[("olmoe-tiny", "float32")]
    with pytest.raises(ProtocolError, match=r"conditions\[1\].params.hot.*17 is more than the 16 experts"):
        check_family(freeze(_raw(moe, conditions=[{"policy": "dense-stream"},
                                                  {"policy": "host-experts", "params": {"hot": 17}}])))
