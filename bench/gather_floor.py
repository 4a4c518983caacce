"""How near can one decode token's active-row copies come to their PCIe floor, and where does the
device gather lose against it? (issue 26, target 2)

Usage (GPU machine): python -m bench.gather_floor [--shape opt-2.7b] [--density 0.033] [--replays 30]

One decode token at the calibrated profile's density (opt-2.7b: 3.3 % of 10240 neurons a layer,
55.5 MB a token): every variant runs its layers' copies, one per layer, captured in one CUDA graph
and timed by CUDA events, so no launch gap counts, the variants alternated in 5 rounds; each
layer reads its own pinned host matrix.
Per token, microseconds:

  memcpy, one copy     the token's bytes in one pinned -> device copy: the large-copy rate the
                       target's floor uses
  memcpy, per layer    each layer's active rows, already contiguous in pinned memory, in one
                       copy each: the copy engine at the size one layer moves (layers cannot share
                       a copy: each layer's rows are known only after its fc1)
  gather (shipped)     engine.gather's kernel: activity test, reads over PCIe, stores into
                       workspace columns (hidden, ffn) -- what packet {gather: device} runs
  gather, row stores   the same reads, stored as rows of an (ffn, hidden) buffer: contiguous stores
  gather, reads only   the same reads, summed, one store per program: the reads alone
  listed rows          a program per (active row, column share) from a precomputed index list:
                       the same bytes with every program busy (a compaction pass not counted)
  fc2 after gather     the shipped gather then the layer's F.linear over the workspace, against
                       F.linear alone: what the workspace's fresh columns cost the matmul
  SM reads, contiguous the token's bytes, already contiguous, read (summed) by the SMs in large
                       tiles: the ceiling of any kernel that reads host memory with ordinary loads
  TMA ...              the same reads through Hopper's bulk tensor copy (a tensor descriptor over
                       the mapped host rows, one box of 1 x 256 columns = 512 bytes per request):
                       "TMA rows" as the shipped grid (blocks of neurons, a program per column
                       tile), stored into workspace columns or only summed; "TMA contiguous" boxes
                       of 8 x 256 over the contiguous bytes, summed
  listed rows, compact, shuffled
                       the listed-rows program over the layer's rows already compact in pinned
                       memory, in shuffled order: separate rows without the spread over the matrix
  ..., huge pages      listed rows and the shipped gather over a copy of the rows in memory advised
                       to transparent huge pages and registered with cudaHostRegister (the header
                       line says how much of it the kernel actually backed with huge pages)

Each gather's result (layer 0) is checked bit for bit against engine.gather's plain-torch
reference before anything is timed; the memcpy rows are the copy engine's and are not checked.
"""

import argparse
import mmap

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # CPU builds of torch come without Triton
    raise SystemExit("bench.gather_floor runs on a CUDA machine: Triton, which CUDA builds of torch bring, "
                     "is not installed here") from None

from triton.tools.tensor_descriptor import TensorDescriptor

from packbench.engine import gather
from packbench.engine.checkpoint import HOST_REGISTER_DEFAULT, PAGE, _aligned, _Mapping
from packbench.engine.mapped import cuda_view
from packbench.core.registry import SHAPES
from packbench.engine.triton_gather import _active_rows


@triton.jit
def _gather_variant(h_ptr, n_tokens, src_ptr, out_ptr, sums_ptr, ffn, hidden, STORE: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """The shipped kernel's activity test and reads (columns split); STORE 1: rows of out (ffn, hidden),
    STORE 0: no copy, the tiles' sum into sums[program] (so the reads are not optimised away)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < ffn
    rows64 = rows.to(tl.int64)
    active = _active_rows(h_ptr, n_tokens, rows64, in_range, ffn, BLOCK_R, BLOCK_T)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    if tl.sum(active.to(tl.int32), axis=0) > 0:
        for h0 in range(tl.program_id(1) * BLOCK_H, hidden, tl.num_programs(1) * BLOCK_H):
            cols = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            m = active[:, None] & (cols[None, :] < hidden)
            tile = tl.load(src_ptr + rows64[:, None] * hidden + cols[None, :], mask=m, other=0)
            if STORE:
                tl.store(out_ptr + rows64[:, None] * hidden + cols[None, :], tile, mask=m)
            else:
                acc += tile.to(tl.float32)
    if not STORE:
        tl.store(sums_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _listed_rows(idx_ptr, n_rows, src_ptr, ws_ptr, ffn, hidden, BLOCK_H: tl.constexpr):
    """Program (i, c): active row idx[i]'s column tiles c, c + shares, ... into workspace column idx[i]."""
    i = tl.program_id(0)
    row = tl.load(idx_ptr + i).to(tl.int64)
    for h0 in range(tl.program_id(1) * BLOCK_H, hidden, tl.num_programs(1) * BLOCK_H):
        cols = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        m = cols < hidden
        tl.store(ws_ptr + cols * ffn + row, tl.load(src_ptr + row * hidden + cols, mask=m), mask=m)


@triton.jit
def _tma_rows(h_ptr, desc, ws_ptr, sums_ptr, ffn, hidden, STORE: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_H: tl.constexpr):
    """Program (r, c): the active rows of neuron block r (one token), column tiles c, c + shares, ...,
    each row's tile one bulk tensor copy from the mapped host rows; STORE 1: into workspace columns,
    STORE 0: summed into sums[program]."""
    acc = tl.zeros([1, BLOCK_H], dtype=tl.float32)
    for r in range(tl.program_id(0) * BLOCK_R, tl.minimum(tl.program_id(0) * BLOCK_R + BLOCK_R, ffn)):
        if tl.load(h_ptr + r) != 0:
            for h0 in range(tl.program_id(1) * BLOCK_H, hidden, tl.num_programs(1) * BLOCK_H):
                tile = desc.load([r, h0])
                if STORE:
                    cols = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
                    tl.store(ws_ptr + cols[None, :] * ffn + r, tile, mask=cols[None, :] < hidden)
                else:
                    acc += tile.to(tl.float32)
    if not STORE:
        tl.store(sums_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _tma_contiguous(desc, sums_ptr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (r, c): box (r, c) of the contiguous rows through one bulk tensor copy, summed."""
    tile = desc.load([tl.program_id(0) * BLOCK_R, tl.program_id(1) * BLOCK_H])
    tl.store(sums_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(tile.to(tl.float32), 1), 0))


@triton.jit
def _sm_contiguous(src_ptr, sums_ptr, n, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Program p: elements [p * PER_PROGRAM, (p + 1) * PER_PROGRAM) of src, BLOCK at a time, summed."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    for i in range(0, PER_PROGRAM, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n, other=0).to(tl.float32)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(acc, 0))


def huge_page_pinned(like: torch.Tensor) -> torch.Tensor:
    """A copy of `like` in anonymous memory advised to transparent huge pages (2 MiB, aligned),
    page-locked and mapped for the GPU as engine.checkpoint's "register" layout is (the tensor keeps
    its mapping, and so the registration, alive)."""
    size, align = like.numel() * like.element_size(), 2 << 20
    mapping = _Mapping(-1, size + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -mapping.address % align
    host = mapping.tensor()[start:start + size].view(like.dtype).view(like.shape)
    host.copy_(like)
    if not mapping.register(start, _aligned(size, PAGE), HOST_REGISTER_DEFAULT):
        raise RuntimeError("cudaHostRegister refused the huge-page copy")
    return host


def anon_huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages, KiB (/proc/self/smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured in one CUDA graph, after a warm-up call (Triton compiles, cuBLAS picks its kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def alternated_times(graphs: dict[str, torch.cuda.CUDAGraph], replays: int, rounds: int = 5) -> dict[str, float]:
    """Microseconds per replay, the median over `rounds` in which every graph is timed in turn
    (CUDA events around `replays` replays)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-2.7b", choices=sorted(SHAPES))
    ap.add_argument("--density", type=float, default=0.033, help="share of a layer's neurons active (0-1)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--shares", default="5,10,20", help="column shares of the listed-rows variant")
    ap.add_argument("--no-tma", action="store_true", help="leave out the bulk tensor copy (TMA) variants")
    args = ap.parse_args(argv)
    if not 0 < args.density <= 1 or args.replays < 1:
        ap.error("--density is in (0, 1] and --replays at least 1")
    try:
        shares = [int(s) for s in args.shares.split(",")]
    except ValueError:
        ap.error(f"--shares {args.shares!r}: a comma-separated list of column shares, e.g. 5,10,20")
    if any(not 1 <= s <= 64 for s in shares):
        ap.error("--shares: each share count is in [1, 64]")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (it times copies from pinned host memory to the GPU)")
    ffn, hidden, layers = (SHAPES[args.shape][k] for k in ("ffn", "hidden", "layers"))
    dtype = torch.float16
    torch.manual_seed(0)
    base = torch.randn(ffn, hidden, dtype=dtype)
    hosts = []  # each layer reads its own pinned matrix (the same values: cheap to make at opt-13b)
    for _ in range(layers):
        hosts.append(torch.empty(ffn, hidden, dtype=dtype, pin_memory=True))
        hosts[-1].copy_(base)
    srcs = [cuda_view(t) for t in hosts]
    hs = [torch.where(torch.rand(1, ffn) < args.density, torch.rand(1, ffn) + 0.1, 0.0).to(dtype).cuda()
          for _ in range(layers)]
    idxs = [(h != 0).any(0).nonzero().squeeze(1).to(torch.int32) for h in hs]
    rows_per_layer = [int(i.numel()) for i in idxs]
    nbytes = sum(rows_per_layer) * hidden * dtype.itemsize
    compact = [hosts[l][idxs[l].long().cpu()].pin_memory() for l in range(layers)]
    landed = [torch.empty_like(c, device="cuda") for c in compact]
    whole_host = torch.cat(compact).pin_memory()
    whole_dev = torch.empty_like(whole_host, device="cuda")
    ws = torch.zeros(hidden, ffn, dtype=dtype, device="cuda")
    rows_out = torch.zeros(ffn, hidden, dtype=dtype, device="cuda")
    counts = torch.zeros(layers, dtype=torch.int32, device="cuda")
    block_r, block_h, num_warps = gather.TILE_OVERRIDE or (gather.BLOCK_R, gather.BLOCK_H, gather.NUM_WARPS)
    grid = (triton.cdiv(ffn, block_r), triton.cdiv(hidden, block_h))
    sums = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device="cuda")
    x = [torch.randn(1, ffn, dtype=dtype, device="cuda") for _ in range(layers)]

    def kernel_variant(l, store):
        _gather_variant[grid](hs[l], 1, srcs[l], rows_out, sums, ffn, hidden, STORE=store, BLOCK_R=block_r,
                              BLOCK_H=block_h, BLOCK_T=gather.BLOCK_T, num_warps=num_warps)

    tma_h = 256  # a bulk tensor copy's box holds at most 256 elements a dimension
    tma_grid = (triton.cdiv(ffn, block_r), triton.cdiv(hidden, tma_h))
    descs = [TensorDescriptor.from_tensor(s, [1, tma_h]) for s in srcs]
    whole_view = cuda_view(whole_host)
    whole_rows = whole_view.view(-1, hidden)
    whole_desc = TensorDescriptor.from_tensor(whole_rows, [8, tma_h])
    whole_grid = (triton.cdiv(whole_rows.shape[0], 8), triton.cdiv(hidden, tma_h))
    sm_per_program = 16384
    sm_grid = (triton.cdiv(whole_view.numel(), sm_per_program),)
    tma_sums = torch.zeros(max(tma_grid[0] * tma_grid[1], whole_grid[0] * whole_grid[1], sm_grid[0]),
                           dtype=torch.float32, device="cuda")

    def tma_rows(l, store):
        _tma_rows[tma_grid](hs[l], descs[l], ws, tma_sums, ffn, hidden, STORE=store, BLOCK_R=block_r, BLOCK_H=tma_h,
                            num_warps=4)

    huge_kib_before = anon_huge_kib()
    huge = [huge_page_pinned(t) for t in hosts]  # the same rows, in huge-page-backed registered memory
    huge_kib = anon_huge_kib() - huge_kib_before
    huge_srcs = [cuda_view(host) for host in huge]
    compact_srcs = [cuda_view(c) for c in compact]
    shuffled = [torch.randperm(n, dtype=torch.int32).cuda() for n in rows_per_layer]

    def listed(l, n_shares=10, src=None, idx=None):
        """Layer l's active rows by listed-row programs, from `src` (its mapped matrix) at `idx` (its list)."""
        _listed_rows[(rows_per_layer[l], n_shares)](idxs[l] if idx is None else idx, rows_per_layer[l],
                                                     srcs[l] if src is None else src, ws, ffn, hidden,
                                                     BLOCK_H=triton.next_power_of_2(triton.cdiv(hidden, n_shares)),
                                                     num_warps=4)

    def shipped(l):
        gather.gather_active_rows(hs[l], srcs[l], ws, counts, l)

    per_layer = {  # what each variant does for layer l
        "gather (shipped)": shipped,
        "gather, row stores": lambda l: kernel_variant(l, 1),
        "gather, reads only": lambda l: kernel_variant(l, 0),
        **{f"listed rows, {n} shares": (lambda l, n=n: listed(l, n)) for n in shares},
        "listed rows, compact, shuffled": lambda l: listed(l, src=compact_srcs[l], idx=shuffled[l]),
        "listed rows, huge pages": lambda l: listed(l, src=huge_srcs[l]),
        "gather (shipped), huge pages": lambda l: gather.gather_active_rows(hs[l], huge_srcs[l], ws, counts, l),
        "TMA rows, workspace stores": lambda l: tma_rows(l, 1),
        "TMA rows, reads only": lambda l: tma_rows(l, 0),
        "fc2 alone": lambda l: F.linear(x[l], ws),
        "gather then fc2": lambda l: (shipped(l), F.linear(x[l], ws)),
    }
    if args.no_tma:
        per_layer = {name: f for name, f in per_layer.items() if not name.startswith("TMA")}
    variants = {
        "memcpy, one copy": lambda: whole_dev.copy_(whole_host, non_blocking=True),
        "memcpy, per layer": lambda: [d.copy_(c, non_blocking=True) for d, c in zip(landed, compact)],
        "SM reads, contiguous": lambda: _sm_contiguous[sm_grid](whole_view.view(-1), tma_sums, whole_view.numel(),
                                                               BLOCK=2048, PER_PROGRAM=sm_per_program, num_warps=8),
        **({} if args.no_tma else {"TMA contiguous, 8x256": lambda: _tma_contiguous[whole_grid](
            whole_desc, tma_sums, BLOCK_R=8, BLOCK_H=tma_h, num_warps=4)}),
        **{name: (lambda f=f: [f(l) for l in range(layers)]) for name, f in per_layer.items()},
    }

    # Exactness of each copying variant against the reference, layer 0 (the others read the same way):
    # the variant's output buffer and what it must hold.
    ref = torch.zeros_like(ws)
    gather.gather_active_rows_reference(hs[0], srcs[0], ref, torch.zeros_like(counts), 0)
    checked = {"gather (shipped)": (ws, ref), "gather, row stores": (rows_out, ref.t()),
               **({} if args.no_tma else {"TMA rows, workspace stores": (ws, ref)}),
               "listed rows, huge pages": (ws, ref), "gather (shipped), huge pages": (ws, ref),
               **{f"listed rows, {n} shares": (ws, ref) for n in shares}}
    checks = {}
    for name, (out, want) in checked.items():
        out.zero_()
        per_layer[name](0)
        torch.cuda.synchronize()
        checks[name] = torch.equal(out, want)

    print(f"{args.shape} fp16, {layers} layers, {sum(rows_per_layer) / layers:.0f} active rows a layer of {ffn} "
          f"({sum(rows_per_layer) / layers / ffn:.1%}), {nbytes / 1e6:.1f} MB a token; tile {block_r}x{block_h} "
          f"w{num_warps}, columns split into {grid[1]}; huge-page copies: {huge_kib / 1024:.0f} MiB in transparent "
          f"huge pages of {sum(t.numel() * t.element_size() for t in huge) / 2**20:.0f} MiB")
    results = alternated_times({name: capture(fn) for name, fn in variants.items()}, args.replays)
    floor = results["memcpy, one copy"]
    print(f"\n{'variant':28} {'us/token':>9} {'us/layer':>9} {'GB/s':>6} {'x one copy':>10} {'exact':>5}")
    for name, us in results.items():
        moves = "fc2" not in name  # the rows variants move; the fc2 rows are compute
        print(f"{name:28} {us:9.1f} {us / layers:9.2f} {(nbytes / us / 1e3 if moves else float('nan')):6.1f} "
              f"{(us / floor if moves else float('nan')):10.2f} {str(checks.get(name, '-')):>5}")
    extra = results["gather then fc2"] - results["gather (shipped)"] - results["fc2 alone"]
    print(f"\ngather then fc2 minus the sum of its parts: {extra:.1f} us a token")


if __name__ == "__main__":
    main()
