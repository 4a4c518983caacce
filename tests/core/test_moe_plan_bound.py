"""core/moe.py's `call_bytes_bound` (the `bound` column of `protocol plan` on an MoE model) against
what the engine's forecast rule moves, counted by hand.

Bug caught: `expert-forecast` was said to move "at least" `call_bytes`' estimate in every call.
The estimate is min(E, k x tokens) experts a layer, the demand only of a one-token call; in a longer
call (every prefill, a decode at batch > 1) tokens share experts, and a forecast that guessed right
moves fewer. A screen (qwen3-moe-tiny, 12-token prompts) planned 1,179,648 B "at least" for the
prefill and moved 1,081,344."""

from packbench.core.expert_cache import forecast_step
from packbench.core.moe import MoeShape, call_bytes, call_bytes_bound


def test_a_forecast_moves_less_than_the_estimate_in_a_call_of_two_tokens():
    shape = MoeShape.of("mixtral-tiny", layers=1)  # 8 experts, top 2
    eb = shape.expert_bytes("float32")
    # Two tokens, both routed to experts 0 and 1, and the forecast right: 2 experts prefetched, no
    # miss left to fetch, so 2 experts move (engine/moe/cache.py: prefetched + misses not brought).
    f = forecast_step([0, 1], cached=(), routed=[0, 1])
    moved = len(f.prefetched) + len({0, 1} - set(f.used))
    estimate = call_bytes(shape, "float32", "expert-forecast", tokens=2, phase="decode")
    assert moved * eb == 2 * eb < estimate == 4 * eb
    assert call_bytes_bound("expert-forecast", {}, tokens=2) != "at least"
    assert call_bytes_bound("expert-forecast", {}, tokens=2) == "about"


def test_a_forecast_of_one_token_moves_at_least_the_estimate():
    # One token: its k experts are distinct, the estimate is the demand, and a wrong forecast adds.
    shape = MoeShape.of("mixtral-tiny", layers=1)
    eb = shape.expert_bytes("float32")
    f = forecast_step([5, 6], cached=(), routed=[0, 1])  # both wrong: 2 wasted, 2 misses fetched
    moved = len(f.prefetched) + len({0, 1} - set(f.used))
    assert moved * eb >= call_bytes(shape, "float32", "expert-forecast", tokens=1, phase="decode") == 2 * eb
    assert call_bytes_bound("expert-forecast", {}, tokens=1) == "at least"
    assert call_bytes_bound("packet", {}, tokens=64) == "at most"
    assert call_bytes_bound("expert-cache", {"capacity": 2, "forecast": "on"}, tokens=1) == "about"


def test_a_qwen3_moe_with_dense_layers_is_planned_by_its_moe_layers_as_the_engine_moves(tmp_path):
    """Bug caught: the byte arithmetic counted experts in every layer, so a Qwen3-MoE whose
    `mlp_only_layers` (or `decoder_sparse_step`) leaves some layers dense was planned 1.5x the
    bytes its dense-stream moved (here 3 layers against 2 with experts), its device part without
    the dense MLP, and an expert cache's slots in layers that have none. transformers-saved
    checkpoints, one with layer 1 dense and its all-MoE twin: dense-stream's every call equals
    `call_bytes`, and the device part grows by what the engine's device bytes grow by."""
    import json

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from packbench.core.moe import policy_need_bytes, shape_of_config
    from packbench.engine.episode import run_episode
    from packbench.engine.moe.model import CpuFirstMoE

    torch.set_num_threads(1)
    built = {}
    for name, only in (("dense", [1]), ("moe", [])):
        torch.manual_seed(0)
        config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                                num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
                                mlp_only_layers=only, tie_word_embeddings=False)
        Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / name)
        shape = shape_of_config(json.loads((tmp_path / name / "config.json").read_text()))
        built[name] = shape, CpuFirstMoE(tmp_path / name, dtype=torch.float32, device=torch.device("cpu"))
    (shape, model), (twin, twin_model) = built["dense"], built["moe"]
    assert (shape.layers, shape.moe_layers, shape.dense_layers, shape.dense_intermediate) == (3, 2, 1, 64)
    assert (twin.moe_layers, twin.dense_layers) == (3, 0)
    model.use("dense-stream")
    for c in run_episode(model, list(range(2, 10)), continuation=3).calls:
        moved = sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes)
        assert moved == call_bytes(shape, "float32", "dense-stream", tokens=c.tokens, phase=c.phase) == \
            2 * 4 * shape.expert_bytes("float32")
    # A dense MLP on the device in place of a router: the same growth in the plan as on the device.
    assert shape.device_part_bytes("float32") - twin.device_part_bytes("float32") == \
        model.start.device_param_bytes - twin_model.start.device_param_bytes == (3 * 32 * 64 - 4 * 32) * 4
    assert policy_need_bytes(shape, "float32", "expert-cache", params={"capacity": 2}) == \
        (2 * 2 + 4) * shape.expert_bytes("float32")  # 2 slots in each of 2 MoE layers, one layer's workspace
