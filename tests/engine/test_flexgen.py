"""The `flexgen` condition without FlexGen installed: its placement arithmetic against hand-computed
values (FlexGen's own rule, flex_opt.py init_weight_list), the protocol's freezing of its policy,
the refusals (CPU worker, missing library, float16, allowance), the checkpoint conversion, the
output-embedding wrapper (logits kept, teacher forcing) on a stand-in with FlexGen's signature, and
the episode record built from what FlexGen's sites collected. The real FlexGen on the CPU (CUDA
stand-ins) is tests/engine/test_flexgen_cpu.py (marker `flexgen`)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from packbench.core.conditions.flexgen import (CPU_REFUSAL, PolicyRefused, cache_bytes, choose_policy, h2d_bytes,
                                               placement, working_bytes)
from packbench.core.errors import ProtocolError
from packbench.core.protocol import freeze
from packbench.core.registry import SHAPES

MIB = 1 << 20


def opt(shape: str) -> dict:
    d = SHAPES[shape]
    return {"hidden_size": d["hidden"], "ffn_dim": d["ffn"], "num_hidden_layers": d["layers"],
            "num_attention_heads": d["heads"], "vocab_size": d["vocab"], "max_position_embeddings": d["max_positions"]}


def total_elements(h: int, layers: int, vocab: int = 50272, positions: int = 2050) -> int:
    """Every weight FlexGen holds for OPT, by hand: the token embedding twice (input and output
    embedding), positions, per layer attention (4 h^2 + 4 h biases + 2 h LayerNorm) and MLP
    (8 h^2 + 4 h + h biases + 2 h LayerNorm), the final LayerNorm."""
    return 2 * vocab * h + positions * h + layers * (4 * h * h + 6 * h + 8 * h * h + 7 * h) + 2 * h


def test_placement_at_81_percent_is_what_flexgen_put_on_the_h200_not_81_percent():
    """The bug it catches: the probe took w_gpu_percent as the GPU's share of OptConfig.model_bytes
    (81 % of 5047 MiB = 4088 MiB) while FlexGen places whole tensors by their cumulative midpoint per
    layer and holds the embedding twice. By hand at 81 %: only each attention's w_q (midpoint 12.5 %
    of its layer, below 19 %) and the final LayerNorm (the output embedding's first two vectors) stay
    on the CPU; fc1's midpoint is 24.99 %, above 19 %."""
    h, layers = 2560, 32
    cpu = (layers * h * h + 2 * h) * 2
    gpu, per_layer = placement(opt("opt-2.7b"), 81)
    assert sum(per_layer) == cpu
    assert gpu == total_elements(h, layers) * 2 - cpu
    assert round(gpu / MIB) == 4903  # + the 165 MiB cache: 5068 of the 5160 MiB measured peak
    # 75 %: w_q, b_q (midpoint 24.99 %) and fc1 (24.99 %) of every layer go to the CPU as well
    gpu75, per75 = placement(opt("opt-2.7b"), 75)
    assert sum(per75) == (layers * (h * h + h + 4 * h * h) + 2 * h) * 2 and gpu75 == total_elements(h, layers) * 2 - sum(per75)
    assert placement(opt("opt-2.7b"), 100) == (total_elements(h, layers) * 2, [0] * (2 * layers + 2))


def test_the_probes_policy_is_refused_and_the_chosen_one_fits_4800_mib_at_opt_2_7b():
    """The probe's 81 % went 360 MiB over 4800 MiB on the H200 (5160 MiB peak, batch 1, 512 + 16).
    Frozen, it is refused in one line naming what it needs, at least the measured peak; its working
    space term bounds the 92 MiB that the measured peak holds beyond weights and cache. Omitted,
    the share chosen is the largest that fits: 75 % (76-81 % place the same 4903 MiB)."""
    c = opt("opt-2.7b")
    with pytest.raises(PolicyRefused) as e:
        choose_policy(c, {"w_gpu_percent": 81}, allowance=4800 * MIB, context=0, held=0, batch=1, prompt=528, gen=0,
                      cuda=True)
    msg = str(e.value)
    need = int(msg.split(" needs ")[1].split(" MiB")[0])
    assert "\n" not in msg and need >= 5160 and "lower w_gpu_percent" in msg
    _, cpu81 = placement(c, 81)
    assert working_bytes(c, batch=1, prompt=528, cpu_layers=cpu81, cuda=True) >= (5160 - 4903 - 165) * MIB
    p = choose_policy(c, {}, allowance=4800 * MIB, context=0, held=0, batch=1, prompt=528, gen=0, cuda=True)
    assert (p.w_gpu_percent, p.chosen, p.cache_gpu_percent, p.act_gpu_percent) == (75, True, 100, 100)
    assert p.weights_gpu == placement(c, 75)[0] and p.needed <= 4800 * MIB
    assert p.cache_gpu == 2 * 527 * 2560 * 2 * 32  # keys and values of 527 positions (prompt + gen - 1), fp16
    assert choose_policy(c, {}, allowance=4800 * MIB, context=600 * MIB, held=0, batch=1, prompt=528, gen=0,
                         cuda=True).needed <= 4800 * MIB  # the context is inside the allowance
    # `protocol plan`'s estimate of the omitted share: the same 75 % here (81 % places 4903 MiB > 4800)
    from packbench.core.conditions.base import CallInputs
    from packbench.core.estimate import Activity, ModelShape

    call = CallInputs(phase="decode", tokens=1, shape=ModelShape.of("opt-2.7b"), row_bytes=2 * 2560,
                      activity=Activity(0.1), allowance_bytes=4800 * MIB)
    assert h2d_bytes({}, call) == (32 * (2560 * 2560 + 2560 + 4 * 2560 * 2560) + 2 * 2560) * 2


def test_opt_13b_under_20480_mib_by_hand():
    """OPT-13B (hidden 5120, 40 layers) holds 24,98x MiB of weights in FlexGen: 76-100 % cannot fit
    20480 MiB (at 81 % only w_q is on the CPU: 24,0xx MiB on the GPU), 75 % moves w_q, b_q and fc1
    of every layer to the CPU."""
    c, h, layers = opt("opt-13b"), 5120, 40
    p = choose_policy(c, {}, allowance=20480 * MIB, context=0, held=0, batch=1, prompt=528, gen=0, cuda=True)
    cpu = (layers * (h * h + h + 4 * h * h) + 2 * h) * 2
    assert p.w_gpu_percent == 75 and p.weights_gpu == total_elements(h, layers) * 2 - cpu
    assert placement(c, 76)[0] == total_elements(h, layers) * 2 - (layers * h * h + 2 * h) * 2 > 20480 * MIB
    # the byte estimate of the frozen share is its host-homed weights, every call
    from packbench.core.conditions.base import CallInputs
    from packbench.core.estimate import Activity, ModelShape

    call = CallInputs(phase="decode", tokens=1, shape=ModelShape.of("opt-13b"), row_bytes=2 * h,
                      activity=Activity(0.1), allowance_bytes=20480 * MIB)
    assert h2d_bytes({"w_gpu_percent": 75}, call) == cpu


def test_no_placement_fits_a_tiny_allowance_names_what_it_needs():
    with pytest.raises(PolicyRefused, match=r"needs an allowance of at least \d+ MiB with every weight on the CPU"):
        choose_policy(opt("opt-2.7b"), {}, allowance=100 * MIB, context=0, held=0, batch=1, prompt=528, gen=0,
                      cuda=True)


def protocol(model, *, dtype="float16", params=None, allowance=256, schema=None, batch=None) -> dict:
    body = {"name": "fg", "model": {"path": str(model)}, "dtype": dtype,
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8, "continuation_tokens": 2,
            "conditions": [{"policy": "dense-stream"}, {"policy": "flexgen", **({"params": params} if params else {})}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": allowance,
            "gates": {"faithfulness": {}, "fidelity": {"min_top1": 0.5}}}
    if schema is not None:
        body["schema"] = schema
    if batch is not None:
        body["batch"] = batch
    return body


def test_the_policy_is_frozen_when_given_and_left_to_the_worker_when_omitted(tiny):
    """An omitted w_gpu_percent stays out of the frozen body (the worker chooses it; a written
    default would claim a share nobody chose); a given one is frozen, and changes the hash."""
    omitted = freeze(protocol(tiny)).protocol.conditions[1]
    assert "w_gpu_percent" not in omitted.params and omitted.resolved_params["w_gpu_percent"] is None
    assert omitted.params["cache_gpu_percent"] == 100 and omitted.params["mode"] == "eager"
    given = freeze(protocol(tiny, params={"w_gpu_percent": 40, "activations": "cpu"}))
    assert given.protocol.conditions[1].params["w_gpu_percent"] == 40
    assert given.sha256 != freeze(protocol(tiny)).sha256
    assert freeze(protocol(tiny)).body["schema"] == 10


@pytest.mark.parametrize("params, schema, match", [
    ({"w_gpu_percent": 101}, None, r"w_gpu_percent"),
    ({"cache_gpu_percent": -1}, None, r"cache_gpu_percent"),
    ({"activations": "disk"}, None, r"activations"),
    ({"mode": "graph"}, None, r"graph is not possible for flexgen \(cannot be captured: FlexGen's OptLM runs its own Python schedule"),
    (None, 9, r"'flexgen' needs schema 10"),
])
def test_bad_flexgen_params_are_refused_in_one_line(tiny, params, schema, match):
    with pytest.raises(ProtocolError, match=match) as e:
        freeze(protocol(tiny, params=params, schema=schema))
    assert "\n" not in str(e.value)


def test_submit_refuses_what_flexgen_cannot_run_before_anything_is_queued(tiny):
    """float32, or a frozen share the allowance cannot hold: one line each, at validate/plan/submit."""
    from packbench.service.submit import check_family

    check_family(freeze(protocol(tiny)))  # float16, 256 MiB: a tiny model fits (64 of them the allocator slack)
    with pytest.raises(ProtocolError, match=r"`dtype`: condition flexgen \(flexgen\) runs in float16 only"):
        check_family(freeze(protocol(tiny, dtype="float32")))
    with pytest.raises(ProtocolError, match=r"`allowance_mib`: condition policy flexgen needs an allowance"):
        check_family(freeze(protocol(tiny, allowance=1)))


def test_missing_flexgen_is_refused_at_submit_with_the_offload_extra(monkeypatch, tiny):
    from packbench.service.submit import check_libraries

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flexgen" else real(name, *a))
    with pytest.raises(ProtocolError) as e:
        check_libraries(freeze(protocol(tiny)).protocol)
    msg = str(e.value)
    assert "\n" not in msg and "conditions[1].policy" in msg and msg.endswith("pip install --no-build-isolation 'packbench[offload]'"), msg


class FakeHolder:
    def __init__(self, device: str, dtype=torch.float16):
        self.device, self.dtype = torch.device(device), dtype
        self.dropped = False

    def drop_model(self):
        self.dropped = True


def test_a_cpu_worker_refuses_flexgen_at_check_with_flexgens_reason():
    """Before any episode, in one line, the reason verbatim (OptLM makes CUDA streams)."""
    from packbench.engine.conditions import RUNTIMES
    from packbench.engine.flexgen import FlexGenUnavailable

    with pytest.raises(FlexGenUnavailable) as e:
        RUNTIMES["flexgen"].check(FakeHolder("cpu"), [])
    assert CPU_REFUSAL in str(e.value) and "\n" not in str(e.value)


def test_a_missing_flexgen_is_refused_on_the_worker_with_the_fix(monkeypatch):
    import sys

    from packbench.engine.flexgen import FlexGenUnavailable, library

    monkeypatch.setitem(sys.modules, "flexgen.flex_opt", None)  # its import fails, as when not installed
    with pytest.raises(FlexGenUnavailable, match=r"requires flexgen .*pip install --no-build-isolation 'packbench\[offload\]'"):
        library()


def test_conversion_writes_flexgens_names_and_shapes(tiny, tmp_path):
    """Every tensor FlexGen's OPT layers read (flex_opt.py init_weight: `decoder.layer_norm`, bare
    names, `lm_head.weight` beside the embedding), float16, at the checkpoint's shapes; converted once."""
    from packbench.engine.flexgen import LAYOUT, converted

    config = json.loads((tiny / "config.json").read_text())
    h, v = config["hidden_size"], config["vocab_size"]
    root = converted(tiny, tmp_path)
    d = root / LAYOUT
    want = {"decoder.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
            "decoder.embed_positions.weight": (config["max_position_embeddings"] + 2, h),
            "decoder.layer_norm.weight": (h,), "decoder.layer_norm.bias": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"decoder.layers.{i}."
        want.update({p + f"self_attn.{m}_proj.{k}": (h, h) if k == "weight" else (h,)
                     for m in "qkv" for k in ("weight", "bias")})
        want.update({p + "self_attn.out_proj.weight": (h, h), p + "self_attn.out_proj.bias": (h,),
                     p + "self_attn_layer_norm.weight": (h,), p + "self_attn_layer_norm.bias": (h,),
                     p + "fc1.weight": (4 * h, h), p + "fc1.bias": (4 * h,), p + "fc2.weight": (h, 4 * h),
                     p + "fc2.bias": (h,), p + "final_layer_norm.weight": (h,), p + "final_layer_norm.bias": (h,)})
    for name, shape in want.items():
        arr = np.load(d / name)
        assert arr.shape == shape and arr.dtype == np.float16, name
    assert np.array_equal(np.load(d / "lm_head.weight"), np.load(d / "decoder.embed_tokens.weight"))
    stamp = (root / "complete").stat().st_mtime_ns
    assert converted(tiny, tmp_path) == root and (root / "complete").stat().st_mtime_ns == stamp  # once


class StandIn:
    """FlexGen's TorchTensor as opt_output_embed uses it: .data, .shape, delete, create_from_torch."""

    def __init__(self, data):
        self.data, self.shape = data, tuple(data.shape)

    def delete(self):
        self.data = None

    @classmethod
    def create_from_torch(cls, data, device):
        return cls(data)


def test_a_layout_another_worker_placed_meanwhile_is_kept_not_removed(tiny, tmp_path, monkeypatch):
    """Two workers of one host converting one checkpoint at once: the one that finished second
    removed the first one's complete layout (`rmtree(root)`) to rename its own into place, while the
    first one's OptLM may be reading it (its np.load then finds no file). The loser drops its copy."""
    import packbench.engine.flexgen as fx
    import packbench.engine.placed as placed

    real = fx.convert

    def convert_while_another_worker_finishes(checkpoint, out):
        names = real(checkpoint, out)
        monkeypatch.setattr(fx, "convert", real)
        monkeypatch.setattr(placed.os, "getpid", lambda: 2)  # another process's private folder
        other = fx.converted(checkpoint, tmp_path)  # the other worker's copy, placed meanwhile
        (other / "reading").write_text("its OptLM reads from here")
        return names

    monkeypatch.setattr(fx, "convert", convert_while_another_worker_finishes)
    root = fx.converted(tiny, tmp_path)
    assert (root / "reading").exists() and (root / "complete").exists()
    assert sorted(p.name for p in root.parent.iterdir()) == [root.name]  # the loser's copy is gone


def test_a_cache_that_refuses_the_layout_is_one_line_and_leaves_no_partial_copy(tiny, tmp_path, monkeypatch):
    """A full (or read-only) model cache: the conversion failed with a bare `OSError: [Errno 28] No
    space left on device` and left its partial .tmpPID copy (a converted OPT-13B is 26 GB) behind."""
    import errno

    import packbench.engine.flexgen as fx

    real_save = np.save
    calls = []

    def save(fh, arr):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(fh, arr)

    monkeypatch.setattr(fx.np, "save", save)
    with pytest.raises(fx.FlexGenUnavailable) as e:
        fx.converted(tiny, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and str(tmp_path) in msg and "PACKBENCH_MODEL_CACHE" in msg
    assert list((tmp_path / "flexgen").iterdir()) == []


def test_the_output_embedding_keeps_float32_logits_and_feeds_the_forced_token():
    """FlexGen's opt_output_embed returns only argmax ids; the wrapper keeps the last position's
    logits (float32, exact upcast) and feeds the forced token while the episode is forced (not at
    its last step), the argmax after that and outside an episode."""
    from packbench.engine.flexgen import GenerateRecord, output_embed

    torch.manual_seed(0)
    b, s, h, v = 2, 5, 8, 16
    inputs = torch.randn(b, s, h, dtype=torch.float16)
    w_ln, b_ln, w_tok = torch.randn(h).half(), torch.randn(h).half(), torch.randn(v, h).half()
    want = torch.nn.functional.linear(torch.nn.functional.layer_norm(inputs, (h,), w_ln, b_ln), w_tok)[:, -1, :]
    forced = torch.tensor([[3, 4], [5, 6]])
    ep = GenerateRecord(batch=b, steps=3, layers=1, forced=forced)
    embed = output_embed(lambda: ep, StandIn)
    args = (StandIn(w_ln), StandIn(b_ln), StandIn(w_tok), [False], False, 1.0)
    ids = [embed(None, StandIn(inputs), *args).data for _ in range(3)]
    assert ids[0].tolist() == [[3], [5]] and ids[1].tolist() == [[4], [6]]
    assert ids[2].tolist() == want.argmax(dim=1, keepdim=True).tolist()  # the last step is never forced
    assert all(x.dtype == np.float32 and np.array_equal(x, want.float().numpy()) for x in ep.logits)
    assert len(ep.logits_at) == 3
    free = output_embed(lambda: None, StandIn)(None, StandIn(inputs), *args).data
    assert free.tolist() == want.argmax(dim=1, keepdim=True).tolist()


def test_an_episode_record_is_built_from_flexgens_stamps_and_loads():
    """Call i's wall is the time between the stamps of steps i - 1 and i (call 0's from the start),
    its bytes the loads that served it, in whole rows per ledger layer; tokens are the argmax of
    the float32 logits; nothing is invented for a step FlexGen did not stamp."""
    from packbench.engine.flexgen import GenerateRecord, FlexGenModel
    from packbench.engine.ledger import Recorder

    m = FlexGenModel.__new__(FlexGenModel)
    m.device, m.config, m.row_bytes = torch.device("cpu"), opt("tiny"), 128
    m.recorder = Recorder(2)
    ep = GenerateRecord(batch=1, steps=3, layers=2, forced=None)
    ep.logits = [np.eye(4, dtype=np.float32)[[k]] for k in (1, 2, 3)]
    ep.logits_at, ep.stamps = [10.5, 11.5, 12.5], [10.6, 11.7, 12.6]
    ep.moved[0] = [300, 0]
    ep.moved[2] = [0, 256]
    out = m.finish(ep, [[5, 6, 7]], t_start=10.0, wall=2.7)
    assert [round(c.wall_s, 6) for c in out.calls] == [0.6, 1.1, 0.9]
    assert [c.phase for c in out.calls] == ["prefill", "decode", "decode"] and out.calls[0].tokens == 3
    assert out.calls[0].h2d_weight_bytes == [256, 0] and out.calls[0].h2d_index_bytes == [44, 0]
    assert out.calls[1].h2d_weight_bytes == [0, 0] and out.calls[2].rows_copied == [0, 2]
    assert out.tokens == [[1, 2, 3]] and out.logits.shape == (1, 3, 4) and out.first_logit_at == 10.5
    assert out.kv_bytes == cache_bytes(opt("tiny"), batch=1, prompt=3, gen=3)


def test_the_episode_loop_hands_a_whole_episode_model_its_episode():
    """run_episode runs a model with `episode` through it (FlexGen owns its generate loop), batch 1
    shapes as for every model."""
    from packbench.engine.episode import EpisodeOutput, run_episode

    seen = {}

    class Whole:
        mode = "eager"

        def episode(self, prompts, *, continuation, mode, forced):
            seen.update(prompts=prompts, continuation=continuation, forced=forced)
            return EpisodeOutput(tokens=[[1, 2]], logits=np.zeros((1, 2, 4), np.float32), calls=[], wall_s=0.0,
                                 kv_bytes=0, peak_allocated_bytes=0, peak_reserved_bytes=0, first_logit_at=0.0)

    out = run_episode(Whole(), [7, 8, 9], continuation=2, forced=[3])
    assert seen == {"prompts": [[7, 8, 9]], "continuation": 2, "forced": [[3]]}
    assert out.tokens == [1, 2] and out.logits.shape == (2, 4)


def test_the_offload_extra_pins_flexgen():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"flexgen==0.1.8"' in text.split("offload = [")[1].split("]")[0]


def test_protocol_plan_says_a_cpu_screen_fails_flexgen_before_any_episode(tiny, tmp_path, packbench_cli):
    """Planned for the CPU, a flexgen condition is named as CUDA only with FlexGen's reason and the
    fix; planned for a GPU, no such line. The bug it catches: `plan` said a screen dispatched here runs
    on the CPU and printed flexgen's bytes, and the screen then failed at the worker's check."""
    import yaml

    path = tmp_path / "fg.yaml"
    path.write_text(yaml.safe_dump(protocol(tiny)))
    line = ("flexgen (flexgen): mode eager; cannot be captured: FlexGen's OptLM runs its own Python schedule, "
            "synchronising after every layer; CUDA only: a screen run on the CPU fails before any episode "
            "(FlexGen's OptLM makes CUDA streams (flex_opt.py OptLM.__init__: torch.cuda.Stream())): dispatch it "
            "to a GPU worker")
    db = ["--db", f"sqlite:///{tmp_path / 'none.db'}"]
    cpu = packbench_cli("protocol", "plan", str(path), "--device", "cpu", *db)
    assert cpu.returncode == 0, cpu.stderr
    assert line in cpu.stdout.splitlines()
    gpu = packbench_cli("protocol", "plan", str(path), "--device", "NVIDIA H200", *db)
    assert gpu.returncode == 0, gpu.stderr
    assert "CUDA only" not in gpu.stdout and line.split("; CUDA only")[0] in gpu.stdout.splitlines()
