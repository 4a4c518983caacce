"""`packbench simulate` against the engine on a real GPU (CUDA twin of test_simulate_engine.py):
the device gathers' counts come from the Triton kernels here, the sets from readbacks on the
device; every ledger field of every call and layer must still be the simulation's.

Run on a GPU machine with `pytest -m gpu`."""

import pytest
import torch

from test_simulate_engine import MOE_RUNS, OPT_RUNS, assert_equal_call_by_call, engine_and_simulation

pytestmark = pytest.mark.gpu


def test_every_opt_policy_simulated_equals_the_engine_on_cuda(tmp_path):
    from packbench.engine.model import CpuFirstModel
    from packbench.engine.synth import synth_checkpoint

    path = synth_checkpoint(tmp_path / "tiny", shape="tiny", dtype="float16", sparsity=0.94, seed=0)
    model = CpuFirstModel(path, dtype=torch.float16, device=torch.device("cuda"))
    assert_equal_call_by_call(engine_and_simulation(model, OPT_RUNS, tmp_path))


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_every_moe_policy_simulated_equals_the_engine_on_cuda(shape, tmp_path):
    from packbench.engine.moe.model import CpuFirstMoE
    from packbench.engine.moe.synth import synth_moe

    path = synth_moe(tmp_path / shape, shape=shape, seed=3, dtype="float16")
    model = CpuFirstMoE(path, dtype=torch.float16, device=torch.device("cuda"))
    assert_equal_call_by_call(engine_and_simulation(model, MOE_RUNS, tmp_path))
