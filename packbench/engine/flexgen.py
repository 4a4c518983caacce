"""The `flexgen` competitor: FlexGen 0.1.8's OPT runtime (`flexgen.flex_opt.OptLM`) under a placement
policy (core/conditions/flexgen.py: the percentages, chosen from the allowance where the condition
leaves `w_gpu_percent` out), CUDA only: `OptLM.__init__` makes CUDA streams, so a CPU worker refuses
the condition at check time, before any episode.

The checkpoint is converted once into FlexGen's own layout (one numpy file per tensor, bare names,
`decoder.layer_norm`, `lm_head.weight` a copy of the tied embedding: what
`flexgen.opt_config.download_opt_weights` writes from the Hub's `.bin` files) under the model cache,
keyed by the checkpoint's files, and read from there by `OptLM` into pinned host memory and the
device as the policy places it.

FlexGen runs a whole generate, not one call at a time: `OptLM.generate` owns the loop over steps,
layers and GPU batches. So an episode is one generate (`FlexGenModel.episode`, which the episode
loop runs in place of its per-call loop, engine/episode.py), and what every condition records is
read at FlexGen's own sites:

- logits: `TorchDevice.opt_output_embed` of the model's own GPU device is replaced by
  `output_embed`, the same arithmetic (final LayerNorm, `F.linear` with the token embedding, the
  last position) that keeps the last-position logits in float32 on the host, and returns the
  teacher-forced token (the reference's, for the fidelity gate) instead of the argmax where the
  episode is forced. The argmax of the float32 logits is the episode's token, as in the per-call loop;
- per-call times: FlexGen synchronises after every layer (`OptLM.sync`, in its overlapped loop) and
  reads each step's token ids back to the host (`store_hidden`); the host clock is read right after
  the last layer's `store_hidden` of each step, so call i's wall is the time between the tokens of
  steps i - 1 and i reaching the host (call 0's from the generate's start: FlexGen's own TTFT, its
  cache allocation and first weight loads included). Nothing is synchronised beyond what FlexGen does;
  the logits readback (as in every condition's loop, charged as recording) is one more;
- bytes: each FlexGen layer's `load_weight` stores `(tensor, copied)` pairs from
  `TorchTensor.smart_copy`; every pair it copied adds its home tensor's bytes to the step whose compute
  it serves (with `overlap`, the next step's first loads are issued during the last layer of the one
  before: they go to the next step), in the ledger of its decoder layer (embeddings: the first, the
  output embedding: the last), as whole `hidden`-sized rows. KV-cache copies (`cache_gpu_percent`
  below 100) are not counted.

FlexGen's `pad_token_id` is set to -1 in its config: FlexGen masks every prompt id equal to it out of
attention (`update_attention_mask`), and packbench's prompts are unpadded, equal-length token ids
that may contain OPT's pad id (1), which the reference attends to.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from packbench.core.conditions.flexgen import (CPU_REFUSAL, EXTRA, cache_bytes, check_shape, choose_policy,
                                              replay_policy)
from packbench.core.errors import PackbenchError
from packbench.engine.episode import EpisodeOutput
from packbench.engine.ledger import Recorder
from packbench.engine.placed import files_key, place_once

LAYOUT = "packbench-np"  # FlexGen reads `{path}/{config.name}-np/`: config.name is "packbench"


class FlexGenUnavailable(PackbenchError):
    """flexgen is missing, the worker has no CUDA device, or the model or allowance does not fit (one line)."""


def fix() -> str:
    return f"pip install --no-build-isolation 'packbench[{EXTRA}]' (flexgen==0.1.8)"


def library():
    """flexgen's flex_opt module; FlexGenUnavailable (one line, with the fix) where it is missing."""
    try:
        return importlib.import_module("flexgen.flex_opt")
    except ImportError as e:
        raise FlexGenUnavailable(f"condition policy flexgen requires flexgen ({e}): {fix()}") from None


def refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why condition flexgen cannot run on this worker (None: it can)."""
    if device.type != "cuda":
        return f"condition policy flexgen runs on CUDA only: {CPU_REFUSAL}; run it on a GPU worker or drop it"
    if dtype != torch.float16:
        return f"condition policy flexgen runs in float16 only (FlexGen's OptConfig.dtype), the protocol says {dtype}"
    return None


def flexgen_name(name: str) -> str:
    """A transformers OPT tensor name as FlexGen's converter (opt_config.download_opt_weights) writes it."""
    return name.removeprefix("model.").replace("decoder.final_layer_norm", "decoder.layer_norm")


def convert(checkpoint: Path, out: Path) -> list[str]:
    """FlexGen's numpy layout from packbench's safetensors, as download_opt_weights writes it from
    the Hub's `.bin` files: bare names (no `.npy` suffix), float16, `lm_head.weight` a copy of the
    tied embedding. Returns the names written."""
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in sorted(checkpoint.glob("*.safetensors")):
        for name, t in load_file(f).items():
            name = flexgen_name(name)
            if t.dtype == torch.float16 or not t.is_floating_point():
                arr = t.numpy()
            else:  # float32 / bfloat16 checkpoints: rounded to FlexGen's float16 (numpy has no bfloat16)
                arr = t.float().numpy().astype(np.float16)
            for target in [name] + (["lm_head.weight"] if name == "decoder.embed_tokens.weight" else []):
                with open(out / target, "wb") as fh:
                    np.save(fh, arr)
                written.append(target)
    return written


def converted(checkpoint: Path, cache: Path) -> Path:
    """The directory FlexGen's `OptLM` reads (`path`, holding `packbench-np/`), converted once per
    checkpoint (keyed by its files' names, sizes and mtimes) under `cache`; a half-written one (no
    `complete` marker) is converted again. Several workers of a host may convert one checkpoint at
    once (engine/placed.py: a loser uses the winner's copy; removing the winner's, as before, pulled
    the files from under its OptLM). A cache that refuses the copy (full, read-only) is one
    FlexGenUnavailable, the partial copy removed."""
    root = cache / "flexgen" / files_key(sorted(checkpoint.glob("*.safetensors")))

    def build(tmp: Path) -> None:
        names = convert(checkpoint, tmp / LAYOUT)
        (tmp / "complete").write_text(json.dumps({"checkpoint": str(checkpoint), "tensors": len(names)}))

    try:
        return place_once(root, build, whole=lambda d: (d / "complete").exists())
    except OSError as e:  # a full or read-only cache (26 GB converted at OPT-13B)
        raise FlexGenUnavailable(f"cannot write FlexGen's layout of {checkpoint} into the model cache {cache} "
                                 f"({e.strerror or e}); free space there, or give --model-cache "
                                 f"(PACKBENCH_MODEL_CACHE) a writable directory with room") from None


def opt_config(fg, config: dict):
    """FlexGen's OptConfig for a packbench OPT config.json (pad id -1: module docstring)."""
    from flexgen.opt_config import OptConfig

    h = config["hidden_size"]
    return OptConfig(name=LAYOUT.removesuffix("-np"), num_hidden_layers=config["num_hidden_layers"],
                     max_seq_len=config["max_position_embeddings"], hidden_size=h,
                     n_head=config["num_attention_heads"], input_dim=h, ffn_embed_dim=config["ffn_dim"],
                     vocab_size=config["vocab_size"], pad_token_id=-1)


def flexgen_policy(fg, plan):
    """FlexGen's Policy from core's PolicyPlan: one GPU batch, overlap, sep_layer, pinned weights,
    attention on the GPU, compression off."""
    from flexgen.compression import CompressionConfig

    off = CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False)  # unused: compression off
    return fg.Policy(plan.gpu_batch_size, 1, plan.w_gpu_percent, 100 - plan.w_gpu_percent, plan.cache_gpu_percent,
                     100 - plan.cache_gpu_percent, plan.act_gpu_percent, 100 - plan.act_gpu_percent, overlap=True,
                     sep_layer=True, pin_weight=True, cpu_cache_compute=False, attn_sparsity=1.0,
                     compress_weight=False, comp_weight_config=off, compress_cache=False, comp_cache_config=off)


_ENVS: dict[str, object] = {}


def environment(device: torch.device, scratch: Path):
    """FlexGen's ExecutionEnv for `device`, one per process (TorchDisk starts copy threads that live
    as long as the process; nothing is placed on its disk: every policy here keeps disk at 0 %)."""
    from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice
    from flexgen.utils import ExecutionEnv

    name = f"cuda:{device.index or 0}"
    if name not in _ENVS:
        gpu, cpu = TorchDevice(name), TorchDevice("cpu")
        disk = TorchDisk(str(scratch), cuda_id=device.index or 0)
        _ENVS[name] = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))
    return _ENVS[name]


class GenerateRecord:
    """One generate's record, filled at FlexGen's sites: float32 logits and host stamps per step,
    the forced ids, bytes per step and layer."""

    def __init__(self, *, batch: int, steps: int, layers: int, forced: torch.Tensor | None) -> None:
        self.batch, self.steps, self.forced = batch, steps, forced
        self.logits: list[np.ndarray] = []  # per step, (B, vocab) float32
        self.logits_at: list[float] = []
        self.stamps: list[float] = []  # per step, the host clock after its token ids reached the host
        self.moved = np.zeros((steps + 1, layers), dtype=np.int64)  # bytes copied host -> device per step and layer


def output_embed(episode_of, torch_tensor):
    """A replacement for `TorchDevice.opt_output_embed` (pytorch_backend.py 265-285, same arguments):
    the same arithmetic, the last position's logits kept in float32 on the host in the episode
    `episode_of()` returns, and the token fed on: the forced one at that step where the episode is
    forced (not at its last step), else the argmax (FlexGen's greedy choice). Sampling is not offered,
    nor FlexGen's decompression of a compressed token embedding (compression is off). Outside an
    episode (`episode_of()` None) it is FlexGen's greedy output embedding, recording nothing."""
    import torch.nn.functional as F

    def opt_output_embed(self, inputs, w_ln, b_ln, w_token, donate, do_sample, temperature):
        b, s, h = inputs.shape
        hidden = F.layer_norm(inputs.data, (h,), weight=w_ln.data, bias=b_ln.data)
        if donate[0]:
            inputs.delete()
        last = F.linear(hidden, w_token.data)[:, -1, :]
        ep = episode_of()
        if ep is None:
            return torch_tensor.create_from_torch(last.argmax(dim=1, keepdim=True), self)
        step = len(ep.logits)
        ep.logits.append(last.float().cpu().numpy())  # synchronises: FlexGen's store_hidden reads the ids back next
        ep.logits_at.append(time.perf_counter())
        if ep.forced is not None and step < ep.forced.shape[1]:
            ids = ep.forced[:, step:step + 1]
        else:
            ids = last.argmax(dim=1, keepdim=True)
        return torch_tensor.create_from_torch(ids, self)

    return opt_output_embed


def count_loads(layer, index: int, episode_of, step_of) -> None:
    """Wrap FlexGen layer `layer`'s load_weight: each (tensor, copied) pair its smart_copy stored
    adds the home tensor's bytes to the episode's step (`step_of()`) and ledger layer `index`."""
    inner = layer.load_weight

    def load_weight(weight_home, weight_read_buf, k):
        inner(weight_home, weight_read_buf, k)
        if k != 0 or weight_read_buf.val is None:
            return
        moved = sum(int(home.bytes) for home, (_, copied) in zip(weight_home.val, weight_read_buf.val) if copied)
        ep = episode_of()
        if ep is not None and moved:
            ep.moved[min(step_of(), ep.steps), index] += moved

    layer.load_weight = load_weight


@dataclass(frozen=True)
class FlexGenStats:
    """What building the model cost and the policy it runs with, recorded in every episode."""

    library_version: str
    load_s: float  # conversion (first time only) + OptLM's weight placement, to the last synchronisation
    convert_s: float  # 0 when the converted layout was already in the model cache
    policy: dict  # core PolicyPlan.as_dict(): FlexGen's Policy and the allowance's arithmetic behind it
    device_bytes: int  # what the device holds after placement (weights on the GPU), measured
    pinned_bytes: int  # the host-homed weights (pinned)

    def as_dict(self) -> dict:
        return asdict(self)


class FlexGenModel:
    """The checkpoint under FlexGen's OptLM on a CUDA `device`, float16. Eager only; one generate per episode."""

    mode = "eager"
    can_shelve = False

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, params: dict,
                 allowance_bytes: int, context_bytes: int, capacity: int, batch: int, cache: Path,
                 env=None, archived: dict | None = None) -> None:
        """`env`: FlexGen's ExecutionEnv (default: the process's one for `device`; tests give one
        whose "gpu" is a second CPU device). `archived`: an archived episode's `offload` section,
        whose policy a re-execution runs again instead of choosing one (replay_policy)."""
        why = refusal(device, dtype)
        if why is not None:
            raise FlexGenUnavailable(why)
        fg = library()
        config = json.loads((Path(model_dir) / "config.json").read_text())
        bad = check_shape(config)
        if bad is not None:
            raise FlexGenUnavailable(f"condition policy flexgen cannot run {model_dir}: {bad}")
        t0 = time.perf_counter()
        root = converted(Path(model_dir), cache)
        convert_s = time.perf_counter() - t0
        cuda = device.type == "cuda"
        held = torch.cuda.memory_allocated(device) if cuda else 0
        # the cache for every position of an episode; the prefill's working space at the whole capacity (from above)
        from packbench.core.conditions.flexgen import PolicyRefused

        try:
            if archived is not None:  # a re-execution: the archived placement, not one chosen at this context
                self.plan = replay_policy(archived.get("policy") or {}, context=context_bytes, held=held)
            else:
                self.plan = choose_policy(config, params, allowance=allowance_bytes, context=context_bytes, held=held,
                                          batch=batch, prompt=capacity, gen=0, cuda=cuda)
        except PolicyRefused as e:
            raise FlexGenUnavailable(str(e)) from None
        env = env if env is not None else environment(device, root / "offload")
        self.device, self.config, self.vocab = device, config, config["vocab_size"]
        self.layers = config["num_hidden_layers"]
        self.recorder = Recorder(self.layers)
        self.row_bytes = config["hidden_size"] * 2
        self._episode: GenerateRecord | None = None
        self._lm = fg.OptLM(opt_config(fg, config), env, str(root), flexgen_policy(fg, self.plan))
        self._wire(env)
        if cuda:
            torch.cuda.synchronize(device)
        pinned = sum(int(t.bytes) for holder in self._lm.weight_home for t in holder.val if t.device is env.cpu)
        self.stats = FlexGenStats(library_version=importlib.metadata.version("flexgen"),
                                  load_s=time.perf_counter() - t0, convert_s=convert_s, policy=self.plan.as_dict(),
                                  device_bytes=torch.cuda.memory_allocated(device) - held if cuda else 0,
                                  pinned_bytes=pinned)

    def _wire(self, env) -> None:
        """FlexGen's sites, instance by instance: the GPU device's output embedding, each layer's
        weight loads, the model's load_weight (which step a load serves) and store_hidden (the step's end)."""
        from flexgen.pytorch_backend import TorchTensor

        lm, ref = self._lm, weakref.ref(self)

        def episode_of() -> GenerateRecord | None:
            # weak: the process's one ExecutionEnv outlives this model, and must not keep its weights on the device
            model = ref()
            return None if model is None else model._episode

        env.gpu.opt_output_embed = output_embed(episode_of, TorchTensor).__get__(env.gpu)
        self._load_step = 0
        for j, layer in enumerate(lm.layers):  # InputEmbed, (SelfAttention, MLP) per layer, OutputEmbed
            ledger_layer = 0 if j == 0 else min(self.layers - 1, (j - 1) // 2)
            count_loads(layer, ledger_layer, episode_of, lambda: self._load_step)
        load_weight, store_hidden = lm.load_weight, lm.store_hidden

        def load(i, j, k, overlap=True):
            self._load_step = i + 1 if j == lm.num_layers else i  # FlexGen's own corner case: the next step's first layer
            return load_weight(i, j, k, overlap=overlap)

        def store(i, j, k):
            store_hidden(i, j, k)
            if j == lm.num_layers - 1 and self._episode is not None:  # this step's ids are on the host
                self._episode.stamps.append(time.perf_counter())

        lm.load_weight, lm.store_hidden = load, store

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        raise TypeError("a flexgen model runs whole episodes (FlexGenModel.episode), not calls")

    def forward(self, ids, cache):
        raise TypeError("a flexgen model runs whole episodes (FlexGenModel.episode), not calls")

    def episode(self, prompts: list[list[int]], *, continuation: int, mode: str,
                forced: list[list[int]] | None) -> EpisodeOutput:
        """One FlexGen generate of `continuation` tokens over the batch `prompts` (its GPU batch)."""
        if mode != "eager":
            raise ValueError("a flexgen condition runs in mode eager only")
        if len(prompts) != self.plan.gpu_batch_size:
            raise ValueError(f"flexgen was placed for a GPU batch of {self.plan.gpu_batch_size}, got {len(prompts)}")
        device = self.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        fed = None if forced is None else torch.tensor([f[:continuation - 1] for f in forced], dtype=torch.long,
                                                       device=device)
        ep = GenerateRecord(batch=len(prompts), steps=continuation, layers=self.layers, forced=fed)
        self._episode = ep
        from flexgen.timer import timers

        # FlexGen's process-wide timer: a generate that raised (out of memory, say) leaves it started, and
        # every later generate would then fail its assert; reset also drops the costs it keeps per step
        timers("generate").reset()
        if cuda:
            torch.cuda.synchronize(device)
        t_start = time.perf_counter()
        try:
            self._lm.generate(prompts, max_new_tokens=continuation)
        finally:
            self._episode = None
        wall = time.perf_counter() - t_start
        if len(ep.logits) != continuation or len(ep.stamps) != continuation:
            raise RuntimeError(f"FlexGen ran {len(ep.logits)} output embeddings and {len(ep.stamps)} steps for "
                               f"{continuation} tokens")
        return self.finish(ep, prompts, t_start=t_start, wall=wall)

    def finish(self, ep: GenerateRecord, prompts: list[list[int]], *, t_start: float, wall: float) -> EpisodeOutput:
        """The episode's output from its record: per call a ledger (bytes per layer, wall between stamps)."""
        recorder, batch, cuda = self.recorder, len(prompts), self.device.type == "cuda"
        recorder.calls = []
        before = t_start
        for i in range(ep.steps):
            recorder.begin(phase="prefill" if i == 0 else "decode", tokens=batch * (len(prompts[0]) if i == 0 else 1))
            for layer, n in enumerate(ep.moved[i].tolist()):
                if n:
                    rows, rest = divmod(n, self.row_bytes)
                    recorder.add(layer, rows=rows, weight_bytes=rows * self.row_bytes, index_bytes=rest)
            recorder.end(wall_s=ep.stamps[i] - before, logits_d2h_bytes=ep.logits[i].size * 4)
            before = ep.stamps[i]
        logits = np.stack(ep.logits, axis=1)  # (B, calls, vocab)
        tokens = [[int(t) for t in logits[s].argmax(axis=-1)] for s in range(batch)]
        return EpisodeOutput(
            tokens=tokens, logits=logits, calls=list(recorder.calls), wall_s=wall,
            kv_bytes=cache_bytes(self.config, batch=batch, prompt=len(prompts[0]), gen=ep.steps),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else 0,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device) if cuda else 0,
            first_logit_at=ep.logits_at[0], mode="eager", decode_graph=None, batch=batch)
