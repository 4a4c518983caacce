"""Can a layer's q, k and v projections run faster with the same bits? (issue 11, GPU only)

bench.step_profile found the decode step's matmuls at 2.2 ms of its 3.2 ms of kernel time, at
about half the H200's HBM bandwidth: batch-1 GEMVs of 2560 x 2560 are too small to fill it.
Two ways to give the GPU more work per launch without changing any kernel's arithmetic, checked
here bit for bit against three separate `F.linear` calls (stock's), then timed as 32 layers'
worth in one CUDA graph (so host launches do not count):

  separate   q, k, v one after the other (stock, and mode graph today)
  streams    the same three calls on three streams inside the graph (same kernels, same bits)
  fused      one F.linear over the concatenated weight [Wq; Wk; Wv] (a different GEMV shape:
             cuBLAS may pick another kernel, so the bits must be checked, per shape and T)

    python -m bench.qkv_probe --hidden 2560,4096,5120 --tokens 1,32,512
"""

import argparse
import time

import torch
import torch.nn.functional as F


def graph_of(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    fn()  # warm-up: cuBLAS picks its kernels, workspaces exist
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        g.capture_begin()
        fn()
        g.capture_end()
    torch.cuda.synchronize()
    return g


def timed_us(g: torch.cuda.CUDAGraph, reps: int) -> float:
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="2560,4096,5120")
    ap.add_argument("--tokens", default="1,32,512")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.qkv_probe needs a CUDA device")
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    branches = [torch.cuda.Stream() for _ in range(3)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fp16, {args.layers} layers per graph")
    print(f"{'hidden':>7}{'T':>5}{'fused bits equal':>18}{'separate us':>13}{'streams us':>12}{'fused us':>10}"
          f"{'per layer saved (best)':>24}")
    for hidden in map(int, args.hidden.split(",")):
        n = args.layers
        w = [[torch.randn(hidden, hidden, device="cuda", dtype=torch.float16) * hidden ** -0.5 for _ in range(3)]
             for _ in range(n)]
        b = [[torch.randn(hidden, device="cuda", dtype=torch.float16) * 0.02 for _ in range(3)] for _ in range(n)]
        wf = [torch.cat(ws) for ws in w]
        bf = [torch.cat(bs) for bs in b]
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(1, t, hidden, device="cuda", dtype=torch.float16)
            out = [[None] * 3 for _ in range(n)]
            fused_out = [None] * n

            def separate():
                for i in range(n):
                    for j in range(3):
                        out[i][j] = F.linear(x, w[i][j], b[i][j])

            def streams():
                main = torch.cuda.current_stream()
                for i in range(n):
                    for j, s in enumerate(branches):
                        s.wait_stream(main)
                        with torch.cuda.stream(s):
                            out[i][j] = F.linear(x, w[i][j], b[i][j])
                    for s in branches:
                        main.wait_stream(s)

            def fused():
                for i in range(n):
                    fused_out[i] = F.linear(x, wf[i], bf[i])

            separate()
            ref = [[o.clone() for o in row] for row in out]
            fused()
            equal = all(torch.equal(torch.cat(ref[i], dim=-1), fused_out[i]) for i in range(n))
            times = {}
            for name, fn in (("separate", separate), ("streams", streams), ("fused", fused)):
                g = graph_of(fn, side)
                times[name] = timed_us(g, args.reps)  # replays: out now holds the graph's results
                if name == "streams" and not all(torch.equal(out[i][j], ref[i][j]) for i in range(n) for j in range(3)):
                    raise SystemExit("three streams changed the bits: the kernels differ per stream")
            best = min(times["streams"], times["fused"] if equal else float("inf"))
            print(f"{hidden:7d}{t:5d}{str(equal):>18}{times['separate']:13.1f}{times['streams']:12.1f}"
                  f"{times['fused']:10.1f}{(times['separate'] - best) / n:24.2f}")


if __name__ == "__main__":
    main()
