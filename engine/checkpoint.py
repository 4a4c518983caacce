"""Read a local Hugging Face OPT checkpoint and build the model on `meta`.

`build_model(dir, dtype=)` returns stock transformers' OPTForCausalLM in host memory (the
reference of the tests). `build_weights` returns the same tensors in plain torch modules
(engine/opt_weights.py) without importing transformers; with `device=` and `host_keys=` it
reads each tensor once, straight to where it will live (the outgoing weights pinned on the
host, the rest on the device: `read_placed`). Which tensors stay on the host is
engine/model.py's decision (`is_outgoing`).
"""

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from core.errors import CheckpointError
from engine.config import read_config
from engine.opt_weights import OPTWeights

# Key remaps: some OPT exports omit the `model.` prefix (OPTModel state dicts).
KEY_PREFIXES = {"decoder.": "model.decoder."}


def read_state_dict(model_dir: Path, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, in host memory, cast to `dtype`."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors files; packbench reads safetensors only")
    sd: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key
                for old, new in KEY_PREFIXES.items():
                    if name.startswith(old):
                        name = new + name[len(old):]
                sd[name] = f.get_tensor(key).to(dtype)
    return sd


# safetensors dtype names -> torch; the header is JSON after an 8-byte little-endian length.
SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
CHUNK = 32 << 20  # one read / one H2D copy: large enough for full-rate copies (NOTES: 53 GB/s at 16 MiB)
RING = 8  # pinned chunks in flight per wave; two waves alternate (reads overlap copies)


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _entries(model_dir: Path) -> list[tuple[str, Path, int, int, torch.dtype, tuple]]:
    """(name, file, byte offset, byte length, stored dtype, shape) of every tensor, names remapped."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors files; packbench reads safetensors only")
    out = []
    for file in files:
        base, header = _header(file)
        for key, meta in header.items():
            name = key
            for old, new in KEY_PREFIXES.items():
                if name.startswith(old):
                    name = new + name[len(old):]
            if meta["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{file}: tensor {key} has dtype {meta['dtype']}; packbench reads "
                                      f"{', '.join(SAFETENSORS_DTYPES)}")
            begin, end = meta["data_offsets"]
            out.append((name, file, base + begin, end - begin, SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"])))
    return out


def _pread(fd: int, dst: torch.Tensor, offset: int) -> None:
    """Fill the uint8 host tensor `dst` from file offset `offset` (the GIL is released in the read)."""
    view = memoryview(dst.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"short read at byte {offset + done}: the checkpoint file is truncated")
        done += n


def read_placed(model_dir: Path, *, dtype: torch.dtype, device: torch.device, host_keys,
                threads: int | None = None) -> dict[str, torch.Tensor] | None:
    """Every tensor of the checkpoint read once, in parallel, straight to where it will live.

    Tensors whose name satisfies `host_keys` (the outgoing weights) are read into their own
    host tensors, pinned on CUDA: the file's bytes land where HostWeights keeps them, with no
    copy after. The others are read through a small ring of pinned chunks and copied to their
    device tensors as each chunk arrives (reads of one wave overlap the copies of the last), so
    no host copy of them outlives the load. On the CPU everything is read into its final host
    tensor. Returns None when a tensor is stored in another dtype than `dtype` (the caller then
    takes the converting path, `read_state_dict`).
    """
    entries = _entries(model_dir)
    if any(stored != dtype for _, _, _, _, stored, _ in entries if stored.is_floating_point):
        return None
    cuda = device.type == "cuda"
    threads = threads or min(16, os.cpu_count() or 1)
    fds = {file: os.open(file, os.O_RDONLY) for file in {e[1] for e in entries}}
    sd: dict[str, torch.Tensor] = {}
    host_jobs, device_jobs = [], []  # (fd, file offset, uint8 destination)
    try:
        for name, file, offset, length, stored, shape in entries:
            on_host = not cuda or host_keys(name)
            t = torch.empty(shape, dtype=stored, pin_memory=cuda and on_host, device="cpu" if on_host else device)
            sd[name] = t
            flat = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
            for start in range(0, length, CHUNK):
                job = (fds[file], offset + start, flat[start:start + CHUNK])
                (host_jobs if on_host else device_jobs).append(job)
        with ThreadPoolExecutor(threads) as pool:
            pending = [pool.submit(_pread, fd, dst, off) for fd, off, dst in host_jobs]
            if device_jobs:
                _stream_to_device(pool, device_jobs, device)
            for f in pending:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return sd


def _stream_to_device(pool: ThreadPoolExecutor, jobs: list, device: torch.device) -> None:
    rings = [[torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(RING)] for _ in range(2)]
    done = [None, None]  # the event after each ring's last copies
    for wave, first in enumerate(range(0, len(jobs), RING)):
        ring = rings[wave % 2]
        if done[wave % 2] is not None:
            done[wave % 2].synchronize()  # this ring's previous copies have left it
        batch = jobs[first:first + RING]
        reads = [pool.submit(_pread, fd, ring[i][: dst.numel()], off) for i, (fd, off, dst) in enumerate(batch)]
        for i, ((_, _, dst), read) in enumerate(zip(batch, reads)):
            read.result()
            dst.copy_(ring[i][: dst.numel()], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        done[wave % 2] = event
    torch.cuda.synchronize(device)


def _assign(model: torch.nn.Module, sd: dict[str, torch.Tensor], model_dir: Path) -> None:
    """Assign `sd` to a model built on `meta`, every shape checked; lm_head tied to the embedding."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if "lm_head.weight" not in sd:  # tied to the token embedding in every OPT
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{model_dir} lacks {len(missing)} tensors (first: {missing[0]}); the checkpoint is incomplete")
    for key, shape in expected.items():
        if tuple(sd[key].shape) != tuple(shape):
            raise CheckpointError(
                f"{model_dir}: tensor {key} has shape {tuple(sd[key].shape)}, config.json implies {tuple(shape)}"
            )
    model.load_state_dict({k: sd[k] for k in expected}, strict=False, assign=True)
    model.tie_weights()
    model.eval()


def build_weights(model_dir: Path, *, dtype: torch.dtype, device: torch.device | None = None,
                  host_keys=None) -> OPTWeights:
    """The checkpoint's tensors in plain torch modules (engine/opt_weights.py), no transformers.

    Without `device`, every tensor is in host memory (converting dtypes if the checkpoint's
    differ). With `device` and `host_keys`, `read_placed` puts each tensor where it will live
    (the outgoing weights pinned on the host, the rest on the device) when the checkpoint
    already holds `dtype`; otherwise the host path is taken.
    """
    config = read_config(model_dir)  # refuse an unsupported checkpoint before reading it
    sd = None
    if device is not None and host_keys is not None:
        sd = read_placed(model_dir, dtype=dtype, device=device, host_keys=host_keys)
    if sd is None:
        sd = read_state_dict(model_dir, dtype=dtype)
    with torch.device("meta"):
        weights = OPTWeights(config)
    _assign(weights, sd, model_dir)
    return weights


def build_model(model_dir: Path, *, dtype: torch.dtype):
    """Stock transformers' OPTForCausalLM in host memory: built on `meta`, tensors assigned.

    Eager attention: on CUDA the default SDPA path is not reproducible run to run in decode
    (shared/device/NOTES.md), and bit-identity is judged on logits.
    """
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(**{k: v for k, v in read_config(model_dir).items() if k != "packbench_synth"})
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = OPTForCausalLM(config)
    _assign(model, read_state_dict(model_dir, dtype=dtype), model_dir)
    return model.to(dtype)
