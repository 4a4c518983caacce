"""Does FlexGen 0.1.8's OPT runtime (FMInference/FlexLLMGen) run on this stack? One probe, no fix-ups.

It converts a packbench checkpoint (safetensors) into FlexGen's own layout (one `.npy` per tensor,
names without the `model.` prefix: what flexgen.opt_config.download_opt_weights writes from the Hub
`.bin` files, which cannot be fetched on the GPU machine), builds `OptLM` under a placement policy
that keeps the weights inside the allowance (weights GPU/CPU percentages from FlexGen's model-size
arithmetic, cache and activations on the GPU, compression off), and generates greedily at each
batch of `--batches` (FlexGen's `gpu_batch_size`, one GPU batch; a fresh OptLM per batch, since the
policy fixes it; the cache's share of the allowance grows with the batch, the weights' shrinks). It
prints the versions, then per batch either the decode ms/token or the exact exception and where it
was raised. FlexGen's cost model / policy search (experimental/cost_model.py) is not in the 0.1.8
wheel, so the policy printed here is the probe's, not FlexGen's search's.

    python -m bench.flexgen_probe CHECKPOINT_DIR --allowance-mib 4800 [--gen 16] [--prompt 512] [--batches 1,8,32]
        [--cache MODEL_CACHE] [--work DIR]

With `--cache` it reads the layout the flexgen condition converted into the model cache (converting it
there once if absent) instead of writing a second copy under `--work`: an OPT-13B layout is 26 GB.
"""

import argparse
import inspect
import json
import sys
import time
import traceback
from pathlib import Path

from packbench.engine.flexgen import LAYOUT, convert, converted  # the product's converter (the flexgen condition reads the same layout)


def policy_for(config, *, batch: int, prompt: int, gen: int, allowance_mib: int):
    """FlexGen's Policy for one GPU batch of `batch`: cache and activations on the GPU, the weights'
    GPU share what the allowance leaves after the cache and 512 MiB of working space (FlexGen's own
    model_bytes / cache_bytes arithmetic), the rest pinned on the CPU, compression off."""
    from flexgen.compression import CompressionConfig
    from flexgen.flex_opt import Policy

    budget = allowance_mib * 2**20 - config.cache_bytes(batch, prompt + gen) - (512 << 20)
    w_gpu = max(0, min(100, int(100 * budget / config.model_bytes())))
    return Policy(batch, 1, w_gpu, 100 - w_gpu, 100, 0, 100, 0, overlap=True, sep_layer=True, pin_weight=True,
                  cpu_cache_compute=False, attn_sparsity=1.0, compress_weight=False,
                  comp_weight_config=CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False),
                  compress_cache=False,
                  comp_cache_config=CompressionConfig(num_bits=4, group_size=64, group_dim=2, symmetric=False))


def prompt_ids(length: int, sequence: int) -> list[int]:
    """The probe's prompt `sequence` of `length` ids (BOS, then a ramp that differs per sequence)."""
    return [2] + [100 + (sequence * 7 + k) % 50000 for k in range(length - 1)]


def failure(e: BaseException) -> dict:
    """The verdict of a failed step: the exception verbatim and the line that raised it."""
    where = traceback.extract_tb(e.__traceback__)[-1]
    return {"verdict": "fails", "error": f"{type(e).__name__}: {e}",
            "at": f"{where.filename.split('site-packages/')[-1]}:{where.lineno}: {where.line}"}


def run_batch(config, env, weights_root: Path, *, batch: int, prompt: int, gen: int, allowance_mib: int) -> dict:
    """One OptLM under the batch's policy: a warm-up generate, then a timed one; its figures."""
    import torch
    from flexgen.flex_opt import OptLM

    from flexgen.timer import timers

    timers.timers.clear()  # FlexGen's global timers: a generate that raised leaves "generate" started
    policy = policy_for(config, batch=batch, prompt=prompt, gen=gen, allowance_mib=allowance_mib)
    row = {"batch": batch, "policy": {"w_gpu_percent": policy.w_gpu_percent, "w_cpu_percent": policy.w_cpu_percent,
                                      "cache_gpu_percent": 100, "act_gpu_percent": 100, "compress": False}}
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = OptLM(config, env, str(weights_root), policy)
    row["load_s"] = time.perf_counter() - t0
    try:
        prompts = [prompt_ids(prompt, b) for b in range(batch)]
        model.generate(prompts, max_new_tokens=2)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=1)  # the prefill alone: TTFT
        torch.cuda.synchronize()
        row["ttft_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = model.generate(prompts, max_new_tokens=gen)
        torch.cuda.synchronize()
        row["generate_s"] = time.perf_counter() - t0
        row["tokens"] = [list(map(int, r[prompt:])) for r in ids[:1]]  # the first sequence's, for fidelity
        # FlexGen's own decode figure (its benchmark's): (generate - prefill) / (gen - 1), per sequence too
        row["decode_ms_per_token"] = 1e3 * (row["generate_s"] - row["ttft_s"]) / max(1, gen - 1)
        row["decode_ms_per_token_per_seq"] = row["decode_ms_per_token"] / batch
        row["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        row["verdict"] = "runs"
    finally:
        del model  # OptLM.__del__ frees its weights
        torch.cuda.empty_cache()
    return row


def reference_tokens(checkpoint: Path, prompt: list[int], gen: int) -> list[int]:
    """Stock transformers' greedy continuation of `prompt` from the same checkpoint, resident on the
    GPU with eager attention: dense-stream's tokens (every exact policy gives the resident model's
    logits bit for bit under eager attention on the H200, /work/shared/device/NOTES.md)."""
    import torch
    from transformers import DynamicCache, OPTForCausalLM

    model = OPTForCausalLM.from_pretrained(checkpoint, dtype=torch.float16, attn_implementation="eager").cuda().eval()
    try:
        out, cache, ids = [], DynamicCache(), torch.tensor([prompt], device="cuda")
        # the cache's keyword: past_key_values in transformers 5.17, cache in 5.25 (as engine/accelerate.py finds it)
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.inference_mode():
            for _ in range(gen):  # plain greedy, no EOS stop (FlexGen's generate has none either)
                logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1]
                out.append(int(logits.argmax()))
                ids = torch.tensor([[out[-1]]], device="cuda")
        return out
    finally:
        del model
        torch.cuda.empty_cache()


def agreement(got: list[int], want: list[int]) -> dict:
    """Greedy tokens against the reference's: equal or not, and the first step where they differ."""
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    return {"tokens_equal": got == want, "first_divergence_step": first, "steps": len(want)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--allowance-mib", type=int, default=4800)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--shape", default="opt-2.7b")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",") if x], default=[1])
    ap.add_argument("--work", type=Path, default=Path("/tmp/flexgen-probe"))
    ap.add_argument("--cache", type=Path, help="a packbench model cache: reuse (or make) its converted layout")
    a = ap.parse_args()
    import torch
    import transformers

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "python": sys.version.split()[0]}
    try:
        import importlib.metadata as md

        facts["flexgen"] = md.version("flexgen")
        from flexgen.flex_opt import get_opt_config
        from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice
        from flexgen.utils import ExecutionEnv

        config = get_opt_config(f"facebook/{a.shape}")
        layout = a.work / "weights" / f"{a.shape}-np"  # where OptLM reads it: {path}/{config.name}-np
        if a.cache:  # the condition's copy, linked rather than written twice
            shared = converted(a.checkpoint, a.cache) / LAYOUT
            layout.parent.mkdir(parents=True, exist_ok=True)
            layout.unlink(missing_ok=True)
            layout.symlink_to(shared, target_is_directory=True)
            facts["converted"] = len(list(shared.iterdir()))
        else:
            facts["converted"] = len(convert(a.checkpoint, layout))
        gpu, cpu, disk = TorchDevice("cuda:0"), TorchDevice("cpu"), TorchDisk(str(a.work / "offload"))
        env = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))
    except BaseException as e:  # the verdict is the exception itself, verbatim
        facts.update(failure(e))
        print(json.dumps(facts, indent=1))
        return 0
    facts["batches"] = []
    for batch in a.batches:
        try:
            facts["batches"].append(run_batch(config, env, a.work / "weights", batch=batch, prompt=a.prompt,
                                              gen=a.gen, allowance_mib=a.allowance_mib))
        except BaseException as e:
            facts["batches"].append({"batch": batch, **failure(e)})
        print(json.dumps(facts["batches"][-1]), file=sys.stderr, flush=True)  # a call cut short keeps it
    env.close_copy_threads()
    ran = [b for b in facts["batches"] if b.get("tokens")]
    if ran:  # fidelity: FlexGen's greedy tokens (first sequence of its smallest batch) against stock transformers'
        try:
            want = reference_tokens(a.checkpoint, prompt_ids(a.prompt, 0), a.gen)
            facts["fidelity"] = {"batch": ran[0]["batch"], "reference": "transformers OPT, resident, eager attention",
                                 **agreement(ran[0]["tokens"][0], want)}
        except BaseException as e:
            facts["fidelity"] = failure(e)
    facts["verdict"] = "runs" if any(b.get("verdict") == "runs" for b in facts["batches"]) else "fails"
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
