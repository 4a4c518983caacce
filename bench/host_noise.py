"""A second worker's host gathers, without its GPU (issue 13's proxy on a one-GPU machine).

Two workers on one host slowed each other's host-gathering policies (docs/experiments/queue.md,
"Queue on two GPUs"). On a machine of one GPU, a second worker would also share the GPU, so this
stands in for it on the host side alone: it gathers the active rows of each layer's outgoing weights
with `torch.index_select` on the OMP threads, as `RowPacket.pack` does, then idles as a worker
waits for its device, until it is stopped (SIGTERM/SIGINT). Its gathers per second go to stdout.

    python -m bench.host_noise [--shape opt-1.3b] [--active 0.11] [--idle-us 300]
"""

import argparse
import signal
import time

import torch

from packbench.core.registry import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-1.3b", choices=sorted(SHAPES))
    ap.add_argument("--active", type=float, default=0.11, help="fraction of each layer's rows gathered per call")
    ap.add_argument("--idle-us", type=float, default=300.0, help="idle time per layer (a worker's device wait)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    ffn, hidden, layers = shape["ffn"], shape["hidden"], shape["layers"]
    weights = [torch.randn(ffn, hidden).to(torch.float16) for _ in range(2 * layers)]  # fc1 and fc2 rows
    k = max(1, int(args.active * ffn))
    out = torch.empty(k, hidden, dtype=torch.float16)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    gathers, t0 = 0, time.perf_counter()
    while not stop:
        for layer in range(layers):
            rows = torch.randperm(ffn)[:k].sort().values
            for w in weights[2 * layer: 2 * layer + 2]:
                torch.index_select(w, 0, rows, out=out)
                gathers += 1
            time.sleep(args.idle_us * 1e-6)
    wall = time.perf_counter() - t0
    print(f"host_noise: {gathers} gathers of {k} x {hidden} in {wall:.1f} s: {gathers / wall:.0f}/s, "
          f"{gathers * k * hidden * 2 / wall / 1e9:.1f} GB/s read, {torch.get_num_threads()} threads", flush=True)


if __name__ == "__main__":
    main()
