"""bench/error_gain.py: the residual stream's relative error after each layer, on a tiny draw."""

import torch

from bench.error_gain import relative_errors
from packbench.engine.robustness import VARIANTS
from packbench.engine.synth import profile_model


def test_errors_are_zero_without_rounding_and_the_weights_come_back():
    model = profile_model("tiny", seed=0, profile="opt4", dtype=torch.float32).eval()
    ids = torch.tensor([[2, 5, 9, 11, 40, 41], [2, 7, 7, 8, 100, 3]])
    first = [m for m in model.model.decoder.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors, kl = relative_errors(model, ids, first, lambda w: w)
    assert errors == [0.0] * model.config.num_hidden_layers and kl == 0.0
    coarse, kl3 = relative_errors(model, ids, first, VARIANTS["int3-channel"].quantize)
    fine, kl4 = relative_errors(model, ids, first, VARIANTS["int4-channel"].quantize)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored after each variant
    # one hidden state per layer; rounding layer 0 moves its output, the coarser grid more
    assert len(coarse) == model.config.num_hidden_layers and 0 < fine[0] < coarse[0] and 0 < kl4 < kl3
