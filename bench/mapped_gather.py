"""How fast can the GPU get a layer's active outgoing rows from pinned host memory?

Usage (GPU machine): python -m bench.mapped_gather [--grid] [--shape opt-2.7b ...]
OPT-sized outgoing weights (opt-2.7b: ffn 10240 x hidden 2560) and one decode token's activity
(~6 % of neurons, 5 % hot), per layer, three ways:
  host     gather the rows on the host into pinned staging, one H2D copy (packet, gather=host)
  sync     nonzero + index_select from a mapped view + index_copy_ (the old gather=device:
           nonzero synchronises for its output size)
  kernel   engine.gather's Triton kernel at several tiles (rows x columns per program, warps;
           --grid: a wider sweep): activity test, copy, count in one launch, no synchronisation
Each is checked bit for bit against the reference, then timed per layer, and as 32 layers in
a row each followed by the dense matmul a layer does (what decode sees: whether the host can
run ahead of the GPU).
"""

import time

import torch
import torch.nn.functional as F

from packbench.engine import gather
from packbench.engine.mapped import cuda_view


def timed(fn, reps: int = 50) -> float:
    """Microseconds per call, wall, after a warm-up call, synchronised at both ends."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


TILES = ((8, 128, 4), (16, 128, 4), (16, 256, 4), (32, 128, 4), (64, 128, 4))
GRID = tuple((br, bh, nw) for br in (1, 4, 16, 32, 64, 128) for bh in (64, 128, 256, 512) for nw in (4, 8))


def main() -> None:
    import argparse

    from packbench.core.registry import SHAPES
    from packbench.engine.triton_gather import gather_active_rows_cuda

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="OPT shapes (default opt-2.7b); repeat for more")
    ap.add_argument("--grid", action="store_true", help="sweep GRID's tiles (fp16 only) instead of TILES")
    ap.add_argument("--tiles", default="", help="extra tiles as R:H:W,... (rows, columns, warps)")
    args = ap.parse_args()
    tiles = GRID if args.grid else TILES
    tiles += tuple(tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",") if t)
    rows = []
    for shape in args.shape or ["opt-2.7b"]:
        ffn, hidden, layers = SHAPES[shape]["ffn"], SHAPES[shape]["hidden"], SHAPES[shape]["layers"]
        rows += measure(shape, ffn, hidden, layers, tiles, (torch.float16,) if args.grid else (torch.float16, torch.bfloat16),
                        gather_active_rows_cuda)
    print(f"\n{'shape':9} {'dtype':9} {'variant':20} {'rows':>5} {'exact':>5} {'us/layer':>9} {'GB/s':>6} "
          f"{'us/32 layers+matmul':>20}")
    for shape, dt, name, k, nbytes, exact, per, loop in rows:
        print(f"{shape:9} {dt:9} {name:20} {k:5d} {str(exact):>5} {per:9.1f} {nbytes / per / 1e3:6.1f} {loop:20.1f}")
    print("\nfastest kernels per shape and dtype, by the 32-layer loop (the shipped tile: gather_active_rows):")
    for key in dict.fromkeys((r[0], r[1]) for r in rows):
        kernels = sorted((r for r in rows if (r[0], r[1]) == key and r[2].startswith(("kernel", "gather"))),
                         key=lambda r: r[-1])
        print(f"  {key[0]:9} {key[1]:9} " + ", ".join(f"{r[2].removeprefix('kernel ')} {r[-1]:.0f}" for r in kernels[:5]))
    print("\nhost time to launch (tiny problem, 200 launches queued, no sync inside):")
    for name, us in launch_costs().items():
        print(f"  {name:28} {us:6.1f} us")


def measure(shape, ffn, hidden, layers, tiles, dtypes, gather_active_rows_cuda) -> list[tuple]:
    rows = []
    torch.manual_seed(0)
    for dtype in dtypes:
        host = torch.randn(ffn, hidden).to(dtype).pin_memory()
        src = cuda_view(host)
        hot = torch.rand(ffn) < 0.05
        h = torch.relu(torch.randn(1, ffn) - 1.75 + 3.0 * hot).to(dtype).cuda()  # ~6-8 % active
        k = int((h != 0).any(0).sum())
        nbytes = k * hidden * dtype.itemsize
        idx_host = (h != 0).any(0).nonzero().squeeze(1).cpu()
        staging = torch.empty(k, hidden, dtype=dtype, pin_memory=True)
        counts = torch.zeros(layers, dtype=torch.int32, device="cuda")
        ref = torch.zeros(hidden, ffn, dtype=dtype, device="cuda")
        gather.gather_active_rows_reference(h, src, ref, counts, 0)
        ws = torch.zeros_like(ref)
        x = torch.randn(1, ffn, dtype=dtype, device="cuda")

        def host_path():
            mask = (h != 0).any(0).cpu()  # the readback the host-gather packet waits for
            torch.index_select(host, 0, mask.nonzero().squeeze(1), out=staging)
            dense = staging.to("cuda", non_blocking=True)
            ws.index_copy_(1, idx_host.cuda(non_blocking=True), dense.t())

        def sync_path():
            gather.gather_active_rows_reference(h, src, ws, counts, 0)

        variants = {"host": host_path, "sync": sync_path}
        for br, bh, nw in tiles:
            variants[f"kernel {br}x{bh} w{nw}"] = (lambda br=br, bh=bh, nw=nw: gather_active_rows_cuda(
                h, src, ws, counts, 0, block_r=br, block_h=bh, block_t=gather.BLOCK_T, num_warps=nw))
        variants["gather_active_rows"] = lambda: gather.gather_active_rows(h, src, ws, counts, 0)
        for name, fn in variants.items():
            ws.zero_()
            fn()
            torch.cuda.synchronize()
            exact = torch.equal(ws, ref)

            def decode_like(fn=fn):
                for _ in range(layers):
                    fn()
                    F.linear(x, ws)

            rows.append((shape, str(dtype).split(".")[1], name, k, nbytes, exact, timed(fn), timed(decode_like, reps=20)))
    return rows


    print(f"\n{'dtype':9} {'variant':16} {'rows':>5} {'exact':>5} {'us/layer':>9} {'us/32 layers+matmul':>20}")
    for dt, name, k, exact, per, loop in rows:
        print(f"{dt:9} {name:16} {k:5d} {str(exact):>5} {per:9.1f} {loop:20.1f}")
    print("\nhost time to launch (tiny problem, 200 launches queued, no sync inside):")
    for name, us in launch_costs().items():
        print(f"  {name:28} {us:6.1f} us")


def launch_costs() -> dict[str, float]:
    """What the host spends to enqueue one launch: the decode loop is host-bound at this size."""
    h = torch.ones(1, 64, dtype=torch.float16, device="cuda")
    src = torch.ones(64, 64, dtype=torch.float16, device="cuda")
    ws = torch.zeros(64, 64, dtype=torch.float16, device="cuda")
    counts = torch.zeros(4, dtype=torch.int32, device="cuda")
    out = {}
    for name, fn in {"gather_active_rows (Triton)": lambda: gather.gather_active_rows(h, src, ws, counts, 1),
                     "torch add_ (one kernel)": lambda: ws.add_(1),
                     "torch (h != 0).any(0)": lambda: (h != 0).any(0)}.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        out[name] = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    return out


if __name__ == "__main__":
    main()
