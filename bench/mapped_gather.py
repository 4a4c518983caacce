"""Can the GPU gather outgoing rows straight from pinned host memory, and is it faster?

Usage (GPU machine): python -m bench.mapped_gather
Compares, for OPT-2.7B-sized outgoing weights (ffn 10240 x hidden 2560, fp16) and ~6 % active
rows: (a) host gather into pinned staging + one H2D copy (the packet policy today), and (b) a
CUDA view of the pinned host tensor (UVA: a cudaHostAlloc pointer is valid on the device)
indexed by a device-resident index, so the GPU pulls the rows over PCIe itself.
"""

import time

import torch

from engine.mapped import cuda_view


def timed(fn, reps=50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ffn, hidden, k = 10240, 2560, 614
    for dtype in (torch.float16, torch.bfloat16):
        host = torch.randn(ffn, hidden).to(dtype).pin_memory()
        idx_host = torch.randperm(ffn)[:k].sort().values
        idx_dev = idx_host.cuda()
        staging = torch.empty(k, hidden, dtype=dtype, pin_memory=True)
        dev = torch.empty(k, hidden, dtype=dtype, device="cuda")

        def host_path():
            torch.index_select(host, 0, idx_host, out=staging)
            dev.copy_(staging, non_blocking=True)

        try:
            view = cuda_view(host)
        except Exception as e:
            print(f"{dtype}: no CUDA view of pinned memory: {type(e).__name__}: {e}")
            continue

        def device_path():
            torch.index_select(view, 0, idx_dev, out=dev)

        host_path()
        a = dev.clone()
        device_path()
        exact = torch.equal(a, dev) and torch.equal(a.cpu(), host[idx_host])
        th, td = timed(host_path), timed(device_path)
        print(f"{dtype}: rows {k} x {hidden}: host gather + copy {th:.0f} us, device gather from mapped {td:.0f} us, "
              f"equal {exact}, threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
