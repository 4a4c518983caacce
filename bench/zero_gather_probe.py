"""The most parameter elements DeepSpeed ZeRO-3 holds gathered during one decode call, on the CPU
(docs/experiments/competitors.md, "The offloading peers"): a hook at every module boundary sums the
elements of the parameters in status AVAILABLE or INFLIGHT (persistent ones aside), over the
decode call after a 16-token prefill, for the zero-inference condition's configuration at an
allowance, or DeepSpeedExamples' setting without one.

    python -m bench.zero_gather_probe opt-125m 160        # the allowance's configuration, 160 MiB
    python -m bench.zero_gather_probe opt-125m none       # DeepSpeedExamples' 2 x hidden^2, reuse distance 1e9
    python -m bench.zero_gather_probe opt-125m none 0     # the same with reuse distance 0

A synthetic float32 checkpoint of SHAPE is written once under /tmp/zero-gather-probe."""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import packbench.engine.zero_inference as zi  # noqa: E402
from packbench.engine.synth import synth_checkpoint  # noqa: E402


def main(shape: str, allowance: str, reuse: str | None = None) -> None:
    path = Path("/tmp/zero-gather-probe") / shape
    if not path.exists():
        synth_checkpoint(path, shape=shape, dtype="float32", sparsity=0.94, seed=0)
    if reuse is not None:
        real = zi.ds_config

        def config(**kw):
            c = real(**kw)
            c["zero_optimization"]["stage3_max_reuse_distance"] = int(reuse)
            return c

        zi.ds_config = config
    m = zi.ZeroInferenceModel(path, dtype=torch.float32, device=torch.device("cpu"), capacity=22,
                              allowance_bytes=None if allowance == "none" else int(allowance) << 20)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list({id(p): p for p in m._model.parameters()}.values())
    peak = [0]

    def hook(*_):
        peak[0] = max(peak[0], sum(p.ds_numel for p in params
                                   if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist))

    for mod in m._model.modules():
        mod.register_forward_pre_hook(hook)
        mod.register_forward_hook(hook)
    cache = m.new_cache()
    m.forward(torch.arange(4, 20)[None], cache)
    peak[0] = 0
    m.forward(torch.tensor([[5]]), cache)
    b = m.budget
    print(f"{shape} allowance {allowance} reuse {reuse or 'config'}: peak gathered {peak[0]} elements "
          f"({peak[0] * 4} B); budget {b.gather_bytes if b else '-'} B, max_live {b.max_live if b else '-'}, "
          f"largest module {b.largest_module if b else '-'}, needs {-(-b.needed // (1 << 20)) if b else '-'} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:])
