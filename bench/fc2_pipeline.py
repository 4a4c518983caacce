"""Can a layer's fc2 start before its gather ends? (issue 26, target 2)

Usage (GPU machine): python -m bench.fc2_pipeline [--shape opt-2.7b ...]

A packet decode layer is fc1 -> gather -> fc2, one after the other. fc2's output rows
[c0, c1) read only the workspace's rows [c0, c1) (columns c0..c1 of each outgoing row), so
split in K chunks of output rows, chunk k's matmul can run while chunk k+1's columns still cross
PCIe: the copy (PCIe-bound) under the matmul (HBM-bound). That keeps packets exact only if a
chunk's matmul gives the bits the whole matmul gives for those rows (cuBLAS picks its kernel by
shape), so first:

  bits   F.linear(a, W[c0:c1], b[c0:c1]) against F.linear(a, W, b)[:, c0:c1], at each shape,
         dtype, token count and K (random weights, ReLU-sparse input as a decode call has)
  time   every layer's gather + fc2 in one CUDA graph: serial (the gather, then the whole fc2)
         against engine.gather.gather_fc2 with K chunks (gather chunk k, then its matmul on a
         second stream once chunk k has landed), and each part alone; then gather_fc2's outputs
         replayed from a graph against serial's, bit for bit
"""

import time

import torch
import torch.nn.functional as F
from engine import gather
from engine.mapped import cuda_view
from engine.shapes import SHAPES


def decode_input(tokens: int, ffn: int, dtype, seed: int) -> torch.Tensor:
    """A ReLU output about as sparse as the calibrated profile's decode call (3-4 % active)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.rand(ffn, generator=g) < 0.01
    return torch.relu(torch.randn(tokens, ffn, generator=g) - 1.95 + 3.0 * hot).to(dtype).cuda()


def bounds(hidden: int, k: int) -> list[tuple[int, int]]:
    return gather.fc2_chunks(hidden, k, gather.tile()["block_h"])


def check_bits(shapes, dtypes, tokens, ks) -> list[tuple]:
    rows = []
    for shape in shapes:
        ffn, hidden = SHAPES[shape]["ffn"], SHAPES[shape]["hidden"]
        for dtype in dtypes:
            g = torch.Generator().manual_seed(1)
            w = (torch.randn(hidden, ffn, generator=g) * 0.02).to(dtype).cuda()
            b = (torch.randn(hidden, generator=g) * 0.02).to(dtype).cuda()
            for t in tokens:
                a = decode_input(t, ffn, dtype, seed=t)
                whole = F.linear(a, w, b)
                for k in ks:
                    same = all(torch.equal(F.linear(a, w[c0:c1], b[c0:c1]), whole[:, c0:c1]) for c0, c1 in bounds(hidden, k))
                    rows.append((shape, str(dtype).split(".")[1], t, k, same))
    return rows


def graph_time(fn, reps: int = 20) -> float:
    """Microseconds per replay of fn captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up (Triton compiles, cuBLAS picks) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def time_layers(shape: str, dtype, ks) -> list[tuple]:
    ffn, hidden, layers = SHAPES[shape]["ffn"], SHAPES[shape]["hidden"], SHAPES[shape]["layers"]
    g = torch.Generator().manual_seed(2)
    hosts = [(torch.randn(ffn, hidden, generator=g) * 0.02).to(dtype).pin_memory() for _ in range(8)]  # cycled
    srcs = [cuda_view(hosts[i % len(hosts)]) for i in range(layers)]
    hs = [decode_input(1, ffn, dtype, seed=100 + i) for i in range(layers)]
    bias = (torch.randn(hidden, generator=g) * 0.02).to(dtype).cuda()
    ws = torch.zeros(hidden, ffn, dtype=dtype, device="cuda")
    counts = torch.zeros(layers, dtype=torch.int32, device="cuda")
    out = torch.empty(1, hidden, dtype=dtype, device="cuda")
    nbytes = sum(int((h != 0).any(0).sum()) for h in hs) * hidden * dtype.itemsize
    side = torch.cuda.Stream()
    results = {}

    def serial():
        for i in range(layers):
            gather.gather_active_rows(hs[i], srcs[i], ws, counts, i)
            out.copy_(F.linear(hs[i], ws, bias))

    def gather_only():
        for i in range(layers):
            gather.gather_active_rows(hs[i], srcs[i], ws, counts, i)

    def fc2_only():
        for i in range(layers):
            out.copy_(F.linear(hs[i], ws, bias))

    def piped(k):
        def run():
            gather.FC2_CHUNKS_OVERRIDE = k
            for i in range(layers):
                out.copy_(gather.gather_fc2(hs[i], srcs[i], ws, counts, i, bias, side))
            gather.FC2_CHUNKS_OVERRIDE = None
        return run

    results["serial (shipped gather, whole fc2)"] = graph_time(serial)
    results["gather alone"] = graph_time(gather_only)
    results["fc2 alone"] = graph_time(fc2_only)
    for k in ks:
        results[f"{k} chunks on two streams"] = graph_time(piped(k))
    # the piped step's output against serial, every layer, replayed from one graph
    refs = []
    for i in range(layers):
        gather.gather_active_rows(hs[i], srcs[i], ws, counts, i)
        refs.append(F.linear(hs[i], ws, bias))
    outs = []

    def piped_all():
        gather.FC2_CHUNKS_OVERRIDE = max(ks)
        outs.clear()
        for i in range(layers):
            outs.append(gather.gather_fc2(hs[i], srcs[i], ws, counts, i, bias, side))
        gather.FC2_CHUNKS_OVERRIDE = None

    graph_time(piped_all, reps=1)
    torch.cuda.synchronize()
    exact = all(torch.equal(a, b) for a, b in zip(outs, refs))
    return [(shape, str(dtype).split(".")[1], name, us, nbytes, exact) for name, us in results.items()]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="OPT shapes (default opt-2.7b, opt-13b)")
    ap.add_argument("--chunks", default="2,4,5,8")
    args = ap.parse_args()
    shapes = args.shape or ["opt-2.7b", "opt-13b"]
    ks = [int(k) for k in args.chunks.split(",")]
    bits = check_bits(["opt-2.7b", "opt-6.7b", "opt-13b"], (torch.float16, torch.bfloat16, torch.float32),
                      (1, 2, 4, 8, 32), ks)
    bad = [r for r in bits if not r[-1]]
    print(f"bits: {len(bits) - len(bad)} of {len(bits)} (shape, dtype, tokens, K) cases give the whole matmul's bits")
    for r in bad:
        print("  differs:", *r[:-1])
    print(f"\n{'shape':9} {'dtype':8} {'variant':36} {'us / 32-40 layers':>18} {'GB/s of rows':>13} exact")
    for shape in shapes:
        for row in time_layers(shape, torch.float16, ks):
            s, dt, name, us, nbytes, exact = row
            print(f"{s:9} {dt:8} {name:36} {us:18.1f} {nbytes / us / 1e3:13.1f} {exact}")


if __name__ == "__main__":
    main()
