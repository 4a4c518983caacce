"""Read a local Hugging Face OPT checkpoint and build the model on `meta`.

`build_model(dir, dtype=)` returns stock transformers' OPTForCausalLM in host memory (the
reference of the tests). `build_weights` returns the same tensors in plain torch modules
(engine/opt_weights.py) without importing transformers; with `device=` and `host_keys=` it
reads each tensor once, straight to where it will live (the outgoing weights pinned on the
host, the rest on the device: `read_placed`). Which tensors stay on the host is
engine/model.py's decision (`is_outgoing`).
"""

import ctypes
import mmap
import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from packbench.core.errors import CheckpointError
from packbench.core.text import one_line
from packbench.engine.config import check_weight_files, not_safetensors, read_config, safetensors_header
from packbench.engine.opt_weights import OPTWeights

# Key remaps: some OPT exports omit the `model.` prefix (OPTModel state dicts).
KEY_PREFIXES = {"decoder.": "model.decoder."}


def read_state_dict(model_dir: Path, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, in host memory, cast to `dtype`."""
    check_weight_files(model_dir, moe=False)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for file in files:
        safetensors_header(file)  # a damaged file: one line naming it, not the reader's own error
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = key
                    for old, new in KEY_PREFIXES.items():
                        if name.startswith(old):
                            name = new + name[len(old):]
                    sd[name] = f.get_tensor(key).to(dtype)
        except SafetensorError as e:  # what safetensors_header does not check (gaps between tensors, metadata's types)
            raise not_safetensors(file, one_line(str(e))[:200]) from None
    return sd


# safetensors dtype names -> torch; the header is JSON after an 8-byte little-endian length.
SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
CHUNK = 32 << 20  # one read / one H2D copy: large enough for full-rate copies (NOTES: 53 GB/s at 16 MiB)
RING = 8  # pinned chunks in flight per wave; two waves alternate (reads overlap copies)


def reads_whole(model_dir: Path) -> bool:
    """Whether `model_dir` holds safetensors files that each read whole: a header and tensor
    extents that fit the file (`safetensors_header`; no weight is read)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    try:
        for file in files:
            safetensors_header(file)
    except (CheckpointError, OSError):
        return False
    return bool(files)


def _entries(model_dir: Path) -> list[tuple[str, Path, int, int, torch.dtype, tuple]]:
    """(name, file, byte offset, byte length, stored dtype, shape) of every tensor, names remapped."""
    check_weight_files(model_dir, moe=False)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    out = []
    for file in files:
        base, header = safetensors_header(file)
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


def _pread(fd: int, dst: torch.Tensor, offset: int, populate: bool = False) -> None:
    """Fill the uint8 host tensor `dst` from file offset `offset` (the GIL is released in the read).

    `populate`: first map the whole pages of `dst` in one call (MADV_POPULATE_WRITE) instead of
    one page fault per 4 KiB inside the read (measured: several times slower on fresh memory).
    """
    if populate:
        _populate(dst.data_ptr(), dst.numel())
    view = memoryview(dst.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"short read at byte {offset + done}: the checkpoint file is truncated")
        done += n


PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_can_populate = [sys.platform == "linux"]


def _populate(addr: int, length: int) -> None:
    """Map (and zero) the whole pages inside [addr, addr + length) now; ctypes releases the GIL,
    so pool threads populate in parallel. A kernel without MADV_POPULATE_WRITE: the read faults."""
    start, end = -(-addr // PAGE) * PAGE, (addr + length) // PAGE * PAGE
    if end > start and _can_populate[0] and _libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        _can_populate[0] = False


class _Mapping(mmap.mmap):
    """An mmap (anonymous, or of a checkpoint file) whose CUDA registrations are undone before
    it is unmapped. Tensors made with torch.frombuffer keep it alive."""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls, *args, **kwargs)
        self.registered: list[int] = []
        self.address = self.tensor().data_ptr()  # not kept: a tensor would keep self alive
        return self

    def tensor(self) -> torch.Tensor:
        """All its bytes as a uint8 tensor that keeps this mapping alive."""
        with warnings.catch_warnings():  # a read-only mapping: torch warns that it is not writable
            warnings.simplefilter("ignore")
            return torch.frombuffer(self, dtype=torch.uint8)

    def register(self, start: int, length: int, flags: int) -> bool:
        """cudaHostRegister [start, start + length) of this mapping (page-aligned)."""
        ptr = self.address + start
        if int(torch.cuda.cudart().cudaHostRegister(ptr, length, flags)) != 0:
            return False
        self.registered.append(ptr)
        return True

    def __del__(self) -> None:
        try:
            for ptr in self.registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: the process's mappings go with it
            pass
        self.registered = []


# cudaHostRegister flags (cuda_runtime_api.h)
HOST_REGISTER_DEFAULT, HOST_REGISTER_READ_ONLY = 0, 8


def _aligned(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


def _blocks(sizes: list[int]) -> list[list[int]]:
    """Group tensors (their byte sizes, in order) into blocks for PyTorch's pinned allocator,
    which rounds every allocation up to a power of two (a 52 MB fc2 weight took 64 MiB, the 32
    of OPT-2.7B 2.15 GB for 1.68 GB): each block is the largest power of two not above what is
    left, filled with whole tensors (OPT-2.7B: 20 + 10 + 1 + 1 weights, 1.74 GB)."""
    out, i = [], 0
    while i < len(sizes):
        left = sum(_aligned(n) for n in sizes[i:])
        cap = max(1 << (left.bit_length() - 1), 1 << (_aligned(sizes[i]) - 1).bit_length())
        group, used = [], 0
        while i < len(sizes) and used + _aligned(sizes[i]) <= cap:
            group.append(i)
            used += _aligned(sizes[i])
            i += 1
        out.append(group)
    return out


def _host_tensors(host: list, fds: dict, pool: ThreadPoolExecutor, cuda: bool, pin: str,
                  clock: "_Clock") -> dict[str, torch.Tensor]:
    """The host tensors of `host` (entries), filled from the file; pinned on CUDA (see PIN_MODES)."""
    if pin == "map":
        sd = _map_host(host, fds, pool, cuda, clock)
        if sd is not None:
            return sd
        pin = "blocks"  # this driver refused to register the page cache: read into pinned blocks
    sd, jobs, regions = {}, [], []  # regions: (mapping, start, length) to register, "register" only
    if pin == "tensors":
        flats = [torch.empty(length, dtype=torch.uint8, pin_memory=cuda) for _, _, _, length, _, _ in host]
    elif pin == "blocks":
        flats = [None] * len(host)
        for group in _blocks([e[3] for e in host]):
            at = [0]
            for i in group:
                at.append(at[-1] + _aligned(host[i][3]))
            block = torch.empty(at[-1], dtype=torch.uint8, pin_memory=cuda)
            for k, i in enumerate(group):
                flats[i] = block[at[k]:at[k] + host[i][3]]
    else:  # "register": one private anonymous mapping, exact size
        total = sum(_aligned(e[3], PAGE) for e in host)
        mapping = _Mapping(-1, max(total, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole, flats, at = mapping.tensor(), [], 0
        for e in host:
            flats.append(whole[at:at + e[3]])
            regions.append((mapping, at, _aligned(e[3], PAGE)))
            at += _aligned(e[3], PAGE)
    clock.lap("alloc_host")
    populate = not cuda or pin == "register"  # pageable memory: map its pages before the read
    for (name, file, offset, length, stored, shape), flat in zip(host, flats, strict=True):
        sd[name] = flat.view(stored).view(shape) if length else torch.empty(shape, dtype=stored)
        for start in range(0, length, CHUNK):
            jobs.append(pool.submit(_pread, fds[file], flat[start:start + CHUNK], offset + start, populate))
    for job in jobs:
        job.result()
    clock.lap("read_host")
    if cuda and regions:
        ok = list(pool.map(lambda r: r[0].register(r[1], r[2], HOST_REGISTER_DEFAULT), regions))
        if not all(ok):
            raise CheckpointError("cudaHostRegister refused the host weights' memory")
        clock.lap("register")
    return sd


def _map_host(host: list, fds: dict, pool: ThreadPoolExecutor, cuda: bool, clock: "_Clock"):
    """Pin = "map": each host tensor is a view of a read-only mapping of the checkpoint file (its
    pages are the page cache's: no copy, no fresh memory), registered with CUDA read-only.
    None when the driver refuses (the caller reads instead)."""
    maps, sd = [], {}
    for name, file, offset, length, stored, shape in host:
        if not length:
            sd[name] = torch.empty(shape, dtype=stored)
            continue
        base = offset // PAGE * PAGE
        span = min(_aligned(offset + length - base, PAGE), os.fstat(fds[file]).st_size - base)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = _Mapping(fds[file], span, flags=flags, prot=mmap.PROT_READ, offset=base)
        sd[name] = m.tensor()[offset - base:offset - base + length].view(stored).view(shape)
        maps.append((m, span))
    clock.lap("map_host")
    if cuda:
        ok = list(pool.map(lambda ms: ms[0].register(0, ms[1], HOST_REGISTER_READ_ONLY), maps))
        if not all(ok):
            for m, _ in maps:
                m.__del__()
            _clear_cuda_error()
            return None
        clock.lap("register")
    return sd


def _clear_cuda_error() -> None:
    """A refused cudaHostRegister leaves its error as CUDA's last error, which the next kernel
    launch check would report as its own: consume it here."""
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


class _Clock:
    """Stage times into `timings` (a dict, or None for nothing), per thread of the read."""

    def __init__(self, timings: dict | None) -> None:
        self.timings, self.t = timings, time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.timings is not None:
            now = time.perf_counter()
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.t
            self.t = now


# How the host tensors (the outgoing weights) are made, see docs/engine.md. On CUDA they are
# pinned: "tensors", one pinned tensor each (PyTorch rounds each up to a power of two);
# "blocks", a few pinned blocks (the same allocator, ~4 % rounding); "register", one exact
# anonymous mapping whose pages the reading threads map, then cudaHostRegister; "map", views of
# the checkpoint file's mapping registered read-only (no copy; falls back to "blocks"). On the
# CPU the same layouts, pageable ("map": the file's pages, read-only).
PIN_MODES = ("tensors", "blocks", "register", "map")
PIN = "blocks"


def read_placed(model_dir: Path, *, dtype: torch.dtype, device: torch.device, host_keys,
                threads: int | None = None, pin: str | None = None,
                timings: dict | None = None) -> dict[str, torch.Tensor] | None:
    """Every tensor of the checkpoint read once, in parallel, straight to where it will live.

    Tensors whose name satisfies `host_keys` (the outgoing weights) are read into host memory,
    pinned on CUDA (`pin`, default PIN: how, see PIN_MODES): the file's bytes land where
    HostWeights keeps them, with no copy after. The others are read through a small ring of
    pinned chunks and copied to their device tensors as each chunk arrives (reads of one wave
    overlap the copies of the last), so no host copy of them outlives the load; the host side
    runs on its own thread meanwhile. On the CPU everything is a host tensor. Returns None when
    a tensor is stored in another dtype than `dtype` (the caller then takes the converting
    path, `read_state_dict`). `timings`: a dict that receives the seconds of each stage (host
    and device stages overlap).
    """
    clock = _Clock(timings)
    entries = _entries(model_dir)
    if any(stored != dtype for _, _, _, _, stored, _ in entries if stored.is_floating_point):
        return None
    pin = pin or PIN
    if pin not in PIN_MODES:
        raise ValueError(f"pin {pin!r}: one of {', '.join(PIN_MODES)}")
    cuda = device.type == "cuda"
    threads = threads or min(16, os.cpu_count() or 1)
    fds = {file: os.open(file, os.O_RDONLY) for file in {e[1] for e in entries}}
    host = [e for e in entries if not cuda or host_keys(e[0])]
    on_device = [e for e in entries if cuda and not host_keys(e[0])]
    sd: dict[str, torch.Tensor] = {}
    try:
        with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(1) as side:
            clock.lap("plan")
            host_side = side.submit(_host_tensors, host, fds, pool, cuda, pin, _Clock(timings))
            if on_device:
                device_jobs = []  # (fd, file offset, uint8 destination)
                for name, file, offset, length, stored, shape in on_device:
                    t = torch.empty(shape, dtype=stored, device=device)
                    sd[name] = t
                    flat = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
                    device_jobs += [(fds[file], offset + s, flat[s:s + CHUNK]) for s in range(0, length, CHUNK)]
                clock.lap("alloc_device")
                _stream_to_device(pool, device_jobs, device, clock)
            sd.update(host_side.result())
    finally:
        for fd in fds.values():
            os.close(fd)
    clock.lap("wait")
    return {e[0]: sd[e[0]] for e in entries}


def _stream_to_device(pool: ThreadPoolExecutor, jobs: list, device: torch.device, clock: _Clock,
                      rings: list[list[torch.Tensor]] | None = None) -> None:
    """Read `jobs` (fd, offset, device tensor) through two pinned rings of RING chunks, copying
    one ring to the device while the other fills. `rings`: bench/legacy_read.py's own buffers."""
    if rings is None:
        block = torch.empty(2 * RING * CHUNK, dtype=torch.uint8, pin_memory=True)  # one allocation
        rings = [[block[(w * RING + i) * CHUNK:(w * RING + i + 1) * CHUNK] for i in range(RING)] for w in range(2)]
    clock.lap("ring")
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
    clock.lap("stream_device")


def assign_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], model_dir: Path) -> None:
    """Assign `sd` to a model built on `meta`, every shape checked; lm_head tied to the embedding
    unless config.json unties it."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if "lm_head.weight" not in sd and _tied(model):  # tied to the token embedding: no tensor of its own
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


def _tied(model: torch.nn.Module) -> bool:
    """Whether the model's lm_head is the token embedding (config.json's tie_word_embeddings,
    true by default as in OPTConfig); an untied one needs its own lm_head.weight."""
    return bool(getattr(model.config, "tie_word_embeddings", True))


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
    assign_state(weights, sd, model_dir)
    return weights


def build_model(model_dir: Path, *, dtype: torch.dtype):
    """Stock transformers' OPTForCausalLM in host memory: built on `meta`, tensors assigned.

    Eager attention: on CUDA the default SDPA path is not reproducible run to run in decode
    (docs/engine.md), and bit-identity is judged on logits.
    """
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(**{k: v for k, v in read_config(model_dir).items() if k != "packbench_synth"})
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = OPTForCausalLM(config)
    assign_state(model, read_state_dict(model_dir, dtype=dtype), model_dir)
    return model.to(dtype)
