"""The placed read as it was at commit 042d5e6 (before the host layouts), for bench.coldstart's
`@legacy` variant and `read@legacy` probe: the baseline measured in the same run."""

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from packbench.engine.checkpoint import CHUNK, RING, _Clock, _entries, _pread, _stream_to_device


def read_placed(model_dir, *, dtype: torch.dtype, device: torch.device, host_keys,
                threads=None, pin=None, timings=None):
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
                # The old ring: one pinned allocation per chunk (the engine makes one block).
                rings = [[torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(RING)]
                         for _ in range(2)]
                _stream_to_device(pool, device_jobs, device, _Clock(None), rings)
            for f in pending:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return sd
