"""Synthetic OPT checkpoints with real shapes: a calibrated profile, or a chosen uniform sparsity.

Two recipes. A **profile** (core/registry.py PROFILES; `profile_tensors` below, docs/workloads.md)
makes weights whose activation statistics match measured real OPT: per-token density with a layer
trend, the growth of a prompt's union of active neurons, the overlap of consecutive tokens,
heavy-tailed firing rates, peaked next-token distributions, (opt-6.7b, opt-13b) outlier features,
and (`opt2`, `opt3`) real OPT's response to weight quantization. The **uniform** recipe (`sparsity`,
optional hot neurons), what every protocol written before profiles froze, sets every neuron's
firing rate alike:

Why the fc1 bias sets sparsity: in a pre-LN OPT layer, fc1 sees LayerNorm output x with unit
weight and zero bias, so every token has mean 0 and variance 1 across `hidden`. With fc1 rows
w_j ~ N(0, std^2) iid, the pre-activation z_j = w_j . x + b is N(b, std^2 * hidden) for every
neuron. Choosing b = -std * sqrt(hidden) * Phi^-1(sparsity) makes P(z_j <= 0), the fraction of
exact zeros after ReLU, equal `sparsity` (0.94 gives about -1.555 * std * sqrt(hidden), the
-1.6 the design notes measured against pretrained OPT).
"""

import concurrent.futures
import contextlib
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from packbench.core.errors import CheckpointError
from packbench.core.registry import PROFILES, SHAPES, SynthProfile, synth_spec
from packbench.engine.dtypes import dtype_of

INIT_STD = 0.02  # OPT's initializer_range


def fc1_bias_for(sparsity: float, *, hidden: int, std: float = INIT_STD) -> float:
    """The fc1 bias that makes `sparsity` of post-ReLU activations exactly zero (see module doc)."""
    if not 0.0 < sparsity < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity}")
    return -std * math.sqrt(hidden) * NormalDist().inv_cdf(sparsity)


def opt_config(shape: str, dtype: str) -> dict:
    """A Hugging Face OPTConfig dict for a preset shape."""
    s = SHAPES[shape]
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": s["hidden"],
        "ffn_dim": s["ffn"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": s["max_positions"],
        "word_embed_proj_dim": s["hidden"],
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "layerdrop": 0.0,
        "init_std": INIT_STD,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def synth_checkpoint(
    out: Path, *, shape: str, dtype: str, seed: int, sparsity: float | None = None, hot_fraction: float | None = None,
    hot_bias: float | None = None, profile: str | None = None, force: bool = False,
    progress: Callable[[int, int], None] | None = None
) -> Path:
    """Write config.json + model.safetensors for `shape` into `out`. Deterministic for a seed.

    `profile` names a calibrated recipe (core/registry.py PROFILES, `profile_tensors`); without
    it, the uniform recipe below with `sparsity` (and optional hot neurons).

    Tensors are drawn in float32 from one seeded generator in a fixed order, then cast, so a
    seed gives the same weights whatever the output dtype.

    Hot neurons: real OPT activity is heavy-tailed (a minority of neurons fire far more often),
    which decides whether retention and forecasts can pay. A `hot_fraction` of each layer's
    neurons (chosen by the seed) gets fc1 bias `hot_bias` x std x sqrt(hidden) instead: 0.0
    makes them fire for about half the tokens, against 1 - sparsity for the rest.

    `progress(done, total)` is called once per decoder layer drawn (total = the shape's
    layers); after the last one the file is written, which for a large shape takes a while too.
    """
    # The arguments a protocol's model.synth allows, no others: a SynthArgumentError (a
    # ValueError) names the bad one. The values are used as given, so config.json stays as it was.
    spec = synth_spec(shape=shape, dtype=dtype, sparsity=sparsity, seed=seed, hot_fraction=hot_fraction,
                      hot_bias=hot_bias, profile=profile)
    torch_dtype = dtype_of(dtype)
    out = Path(out)
    if (out / "config.json").exists() and not force:
        raise CheckpointError(
            f"{out} already holds a checkpoint; choose another --out or pass --force to replace it"
        )
    if profile is not None:
        sd = profile_tensors(shape, seed=seed, profile=profile, dtype=torch_dtype, progress=progress)
        return _write(out, sd, shape, dtype, dict(spec))
    sparsity, hot_fraction, hot_bias = spec["sparsity"], spec["hot_fraction"], spec["hot_bias"]
    s = SHAPES[shape]
    h, f = s["hidden"], s["ffn"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * INIT_STD).to(torch_dtype)

    def const(value: float, n: int) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch_dtype)

    bias = fc1_bias_for(sparsity, hidden=h)
    hot_gen = torch.Generator().manual_seed(seed + 1)  # separate stream: weights stay the same
    n_hot = int(round(hot_fraction * f))
    sd: dict[str, torch.Tensor] = {
        "model.decoder.embed_tokens.weight": normal(s["vocab"], h),
        # OPT's learned positions carry an offset of 2 rows.
        "model.decoder.embed_positions.weight": normal(s["max_positions"] + 2, h),
        "model.decoder.final_layer_norm.weight": const(1.0, h),
        "model.decoder.final_layer_norm.bias": const(0.0, h),
    }
    for i in range(s["layers"]):
        p = f"model.decoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            sd[p + f"self_attn.{proj}.weight"] = normal(h, h)
            sd[p + f"self_attn.{proj}.bias"] = const(0.0, h)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            sd[p + f"{norm}.weight"] = const(1.0, h)
            sd[p + f"{norm}.bias"] = const(0.0, h)
        sd[p + "fc1.weight"] = normal(f, h)
        fc1_bias = torch.full((f,), bias)
        if n_hot:
            fc1_bias[torch.randperm(f, generator=hot_gen)[:n_hot]] = hot_bias * INIT_STD * math.sqrt(h)
        sd[p + "fc1.bias"] = fc1_bias.to(torch_dtype)
        sd[p + "fc2.weight"] = normal(h, f)
        sd[p + "fc2.bias"] = const(0.0, h)
        if progress is not None:
            progress(i + 1, s["layers"])

    return _write(out, sd, shape, dtype, {"shape": shape, "sparsity": sparsity, "seed": seed, "fc1_bias": bias,
                                          "hot_fraction": hot_fraction, "hot_bias": hot_bias})


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Run the block on one intra-op thread, then give the caller back its own count. A matrix
    product or a reduction splits its sums among its threads, so its last bits depend on how many
    there are and, on a busy machine, on how many actually took part: a seed's checkpoint drawn
    with 2 threads beside other work differed in bytes from the one drawn with 1 or 4, and so in
    the digest a re-execution audit compares. Random draws (one stream, in order), products and
    reductions run serially; elementwise arithmetic, whose every element is computed alone, and
    casts keep the caller's threads (most of a large shape's draw)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


PRODUCT_ROWS = 1024  # rows of one block of a `product`


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, the same bits on any thread count, and the bits one thread gives: fixed blocks of
    PRODUCT_ROWS rows of `a`, each a one-thread product (a row's sums never split), run side by
    side on the caller's threads. The draws' products are tall and thin (a (rows, rank) weight
    times the stream's (rank, hidden) basis): one thread spent most of a large shape's draw on them."""
    threads = torch.get_num_threads()
    blocks = torch.split(a, PRODUCT_ROWS)
    if threads == 1 or len(blocks) == 1:
        with serial():
            return a @ b
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.promote_types(a.dtype, b.dtype))

    def one(i: int) -> None:
        torch.set_num_threads(1)  # this thread's own setting (OpenMP's is per thread)
        torch.matmul(blocks[i], b, out=out[i * PRODUCT_ROWS:i * PRODUCT_ROWS + blocks[i].shape[0]])

    with serial(), concurrent.futures.ThreadPoolExecutor(min(threads, len(blocks))) as pool:
        list(pool.map(one, range(len(blocks))))
    return out


def one_thread(draw: Callable) -> Callable:
    """`draw` run wholly within `serial()`."""
    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        with serial():
            return draw(*args, **kwargs)
    return drawn


@contextlib.contextmanager
def os_errors() -> Iterator[None]:
    """safetensors reports a write the file system refused (a full disk, a read-only mount) as its
    own SafetensorError ("I/O error: Read-only file system (os error 30)"), not an OSError: raise
    it as the OSError it is, so callers that handle a refused write handle this one too."""
    try:
        yield
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from e


def _write(out: Path, sd: dict[str, torch.Tensor], shape: str, dtype: str, recipe: dict) -> Path:
    """model.safetensors and config.json (whose `packbench_synth` says how the weights were made)."""
    out.mkdir(parents=True, exist_ok=True)
    with os_errors():
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = opt_config(shape, dtype)
    config["packbench_synth"] = recipe
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


POSITION_FEATURES = 512  # random Fourier features of the smooth positional process
POSITION_DIMS = 0.5  # share of the hidden dims that carry it
READOUT_POSITION = 0.25  # the readout's fc1 weight on those dims (measured: at 1.0, greedy continuations of
# different prompts converged on the same position-driven tokens)


@dataclass(frozen=True)
class _Draws:
    """What the steps of `profile_tensors` share: the one generator, drawn from in a fixed order
    (embeddings, outlier dims, then layer by layer), and the scales derived from the shape and
    profile. Every tensor is drawn in float32 and cast to `dtype` when stored.

    `basis` (a profile with a `rank`): the (hidden, dims) orthonormal directions the residual
    stream lives in, orthogonal to the all-ones vector (so LayerNorm's centring leaves them
    alone). Every weight that reads the stream reads only these directions, every weight that
    writes it writes only into them; without it, dims == hidden and the stream fills them all."""

    gen: torch.Generator
    dtype: torch.dtype
    hidden: int
    ffn: int
    dims: int  # the residual stream's directions: `hidden`, or the profile's rank
    n_pos: int  # positions live in the first `n_pos` of them ...
    pos_std: float  # ... with `position_share` of the embedding's variance
    embed_std: float  # rms entry of token + position
    update: float  # each attention / FFN update's std over the embedding's
    basis: torch.Tensor | None = None

    def normal(self, *size: int, std: float = INIT_STD) -> torch.Tensor:
        with serial():
            w = torch.randn(*size, generator=self.gen)
        return w * std

    def read(self, rows: int, gain: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """A (rows, hidden) weight that reads the stream's LayerNorm output (times `gain`): iid
        INIT_STD over the stream's directions, `columns` weighting them, divided by `gain` per
        hidden dim. A pre-activation's std is INIT_STD * sqrt(hidden) either way, since the
        LayerNorm output has norm sqrt(hidden) in its directions."""
        if self.basis is None:
            w = self.normal(rows, self.hidden) / gain
            return w if columns is None else w * columns
        w = self.normal(rows, self.dims)
        if columns is not None:
            w *= columns
        return product(w, self.basis.T) / gain

    def write(self, inputs: int, std: float) -> torch.Tensor:
        """A (hidden, inputs) weight that writes into the stream: an output of the same norm as
        iid N(0, std^2) entries would give, in the stream's directions only."""
        if self.basis is None:
            return self.normal(self.hidden, inputs, std=std)
        return product(self.basis, self.normal(self.dims, inputs, std=std * math.sqrt(self.hidden / self.dims)))

    def stream(self, latent: torch.Tensor) -> torch.Tensor:
        """(n, dims) coordinates in the stream's directions -> (n, hidden)."""
        return latent if self.basis is None else product(latent, self.basis.T)


def _basis(gen: torch.Generator, hidden: int, dims: int) -> torch.Tensor:
    """(hidden, dims) orthonormal columns orthogonal to the all-ones vector, drawn from `gen`."""
    g = torch.randn(hidden, dims, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(g - g.mean(dim=0))
    return q.float()


def profile_tensors(shape: str, *, seed: int, profile: str, dtype: torch.dtype = torch.float32,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of a calibrated profile (core/registry.py PROFILES; docs/workloads.md).

    What makes each statistic, all of it ordinary OPT arithmetic:
    - Token embeddings are iid; positional embeddings are a smooth random process over
      positions (squared-exponential kernel of length `position_length`) carrying
      `position_share` of the embedding's variance. So fc1's pre-activation of a neuron is a
      token-specific part plus a part that drifts slowly with position: consecutive tokens share
      many active neurons, a long prompt's union keeps growing.
    - Every neuron's fc1 bias is its own offset, N(mu_l, rate_spread^2) in pre-activation stds,
      with mu_l set so layer l's mean density is its target: heavy-tailed firing rates, and a
      density rising with depth (`layer_densities`).
    - Attention and FFN updates are small against the embedding (together `update_share` of its
      variance), so every layer's fc1 sees the statistics above; the last FFN's output is
      `readout` times the embedding's, and the next token is read from it; the final LayerNorm's
      gain makes the logits' std `logit_std` (peaked next-token distributions).
    - Outliers (opt-6.7b, opt-13b): in a share of layers, both LayerNorms scale a few hidden dims
      by `magnitude` (LayerNorm gains are where pretrained models carry them), and the columns of
      q/k/v and fc1 that read those dims are divided by it, so the linear layers meet inputs of
      large magnitude while every pre-activation keeps its distribution.
    - Robustness (a profile with a `rank`, `opt2` to `opt4`): all of the above lives in `rank` directions of
      the hidden dims (`_Draws.basis`): embeddings are drawn there, every weight reading the stream
      reads only them and every weight writing it writes only into them, with the same
      pre-activation and update scales. Rounding noise in a weight fills every hidden dim, so only
      about rank / hidden of its power meets the signal, as in trained weights whose activations
      align with a few large singular directions (docs/workloads.md, "Robustness").
    - Salient input channels (a profile with `salient`, `opt3`): after each layer is drawn, every
      decoder Linear gets a share of heavy input columns, by a reparameterisation exact in real
      arithmetic (`_salient_channels`), drawn from a second generator (seed + 1), so every other
      weight is the one the profile draws without them. With a power-of-two scale the
      reparameterisation is exact in binary floating point too (both factors scale exponents only).
    - Readers at OPT's scale (a profile with `opt_scale_readers`, `opt4`): q, k, v and fc1 times a power
      of two, their LayerNorms divided by it (`_scale_readers`), exact as the salient channels are.
    Drawn in float32 from one generator seeded with `seed`, in a fixed order, then cast; the same
    bytes on any thread count (`serial`).
    """
    p = PROFILES[profile]
    s = SHAPES[shape]
    h, layers = s["hidden"], s["layers"]
    gen = torch.Generator().manual_seed(seed)
    dims = h if p.rank is None else min(p.rank, h // 4)
    with serial():
        basis = None if p.rank is None else _basis(gen, h, dims)
    n_pos = max(1, round(POSITION_DIMS * dims))
    d = _Draws(gen=gen, dtype=dtype, hidden=h, ffn=s["ffn"], dims=dims, n_pos=n_pos,
               pos_std=INIT_STD * math.sqrt(p.position_share / (1.0 - p.position_share) * h / n_pos),
               embed_std=INIT_STD / math.sqrt(1.0 - p.position_share),
               update=math.sqrt(p.update_share / (2 * layers)), basis=basis)
    with serial():
        sd = _embeddings(d, p, vocab=s["vocab"], max_positions=s["max_positions"])
        readout_inputs = _readout_inputs(d)
        n_out, magnitude, share = p.outliers.get(shape, (0, 1.0, 0.0))
        out_dims = torch.randperm(h, generator=d.gen)[:n_out]
    # the salient channels' own stream: the rest of the weights are the same draws as without them
    salient_gen = None if p.salient is None else torch.Generator().manual_seed((seed + 1) % 2**63)
    for i, density in enumerate(p.layer_densities(shape)):
        pre = f"model.decoder.layers.{i}."
        gain = torch.ones(h)
        if n_out and (i + 1) * share // 1 != i * share // 1:  # `share` of the layers, spread evenly
            gain[out_dims] = magnitude
        layer = {**_attention(d, pre, gain),
                 **_ffn(d, p, pre, gain, density, readout=readout_inputs if i == layers - 1 else None)}
        if salient_gen is not None:
            flat = () if p.outlier_salience is None or not bool((gain != 1.0).any()) else \
                _OUTLIER_FLAT[p.outlier_salience]
            _salient_channels(layer, pre, salient_gen, *p.salient, count=p.salient_count, flat=flat)
        if p.opt_scale_readers and d.basis is not None:
            _scale_readers(layer, pre, 2.0 ** round(math.log2(math.sqrt(h / dims))))
        sd.update({k: v.to(dtype) for k, v in layer.items()})
        if progress is not None:
            progress(i + 1, layers)
    # logits = embed_tokens @ (gain * LayerNorm(x)): std gain * INIT_STD * sqrt(h), or, token rows and
    # LayerNorm output both in the stream's `dims` directions, gain * INIT_STD * h / sqrt(dims)
    logit_gain = INIT_STD * (math.sqrt(h) if d.basis is None else h / math.sqrt(d.dims))
    sd["model.decoder.final_layer_norm.weight"] = torch.full((h,), p.logit_std / logit_gain, dtype=dtype)
    sd["model.decoder.final_layer_norm.bias"] = torch.zeros(h, dtype=dtype)
    return sd


def _embeddings(d: _Draws, p: SynthProfile, *, vocab: int, max_positions: int) -> dict[str, torch.Tensor]:
    """Token embeddings (iid) and positional embeddings: random Fourier features of a smooth
    process over positions, in the first `n_pos` hidden dims."""
    omega = torch.randn(POSITION_FEATURES, generator=d.gen, dtype=torch.float64) / p.position_length
    phase = torch.rand(POSITION_FEATURES, generator=d.gen, dtype=torch.float64) * 2 * math.pi
    t = torch.arange(max_positions + 2, dtype=torch.float64) - 2  # OPT's positions carry an offset of 2
    basis = (math.sqrt(2.0 / POSITION_FEATURES) * torch.cos(t[:, None] * omega + phase)).float()
    positions = torch.zeros(max_positions + 2, d.dims)
    positions[:, :d.n_pos] = basis @ d.normal(POSITION_FEATURES, d.n_pos, std=d.pos_std)
    # token rows of norm INIT_STD * sqrt(hidden) in the stream's directions
    tokens = d.normal(vocab, d.dims, std=INIT_STD * math.sqrt(d.hidden / d.dims))
    return {
        "model.decoder.embed_tokens.weight": d.stream(tokens).to(d.dtype),
        "model.decoder.embed_positions.weight": d.stream(positions).to(d.dtype),
    }


def _readout_inputs(d: _Draws) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns, variance) of the readout (the last FFN): it reads the position dims at
    READOUT_POSITION of their weight, so the next token follows the token and its context more
    than its position. Its pre-activation std is over LayerNorm(token + position), whose
    per-dim variance is (tok^2 [+ pos^2]) / embed^2."""
    variance = torch.full((d.dims,), INIT_STD ** 2 * (d.hidden / d.dims))
    variance[:d.n_pos] += d.pos_std ** 2
    variance /= variance.mean()
    variance *= d.hidden / d.dims  # the LayerNorm output's norm is sqrt(hidden) over `dims` directions
    columns = torch.ones(d.dims)
    columns[:d.n_pos] = READOUT_POSITION
    return columns, variance


def _attention(d: _Draws, pre: str, gain: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's LayerNorms (gain: the outlier dims' magnitude) and attention projections, float32."""
    h = d.hidden
    sd: dict[str, torch.Tensor] = {}
    for norm in ("self_attn_layer_norm", "final_layer_norm"):
        sd[pre + f"{norm}.weight"] = gain.clone()
        sd[pre + f"{norm}.bias"] = torch.zeros(h)
    for proj in ("q_proj", "k_proj", "v_proj"):
        sd[pre + f"self_attn.{proj}.weight"] = d.read(h, gain)
        sd[pre + f"self_attn.{proj}.bias"] = torch.zeros(h)
    # (h, h) @ v: entries ~ std * sqrt(h) * (INIT_STD * sqrt(h)); scaled to `update` x embed_std
    sd[pre + "self_attn.out_proj.weight"] = d.write(h, d.update * d.embed_std / (INIT_STD * h))
    sd[pre + "self_attn.out_proj.bias"] = torch.zeros(h)
    return sd


def _ffn(d: _Draws, p: SynthProfile, pre: str, gain: torch.Tensor, density: float, *,
         readout: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """One layer's fc1 (each neuron's bias its own offset: mean density `density`) and fc2
    (scaled so the update is `update`, or for the readout `p.readout`, times the embedding), in float32
    (fc1's bias in float64: cast once, as it always was)."""
    h, f = d.hidden, d.ffn
    fc1 = d.read(f, gain, None if readout is None else readout[0])
    std = INIT_STD * math.sqrt(h)  # std of a neuron's fc1 pre-activation before its bias
    with serial():  # a draw and reductions
        if readout is not None:
            columns, variance = readout
            std = INIT_STD * math.sqrt(float((columns ** 2 * variance).sum()))
        mu = NormalDist().inv_cdf(density) * math.sqrt(1.0 + p.rate_spread ** 2)  # mean of Phi(mu + spread Z) = density
        offsets = (mu + p.rate_spread * torch.randn(f, generator=d.gen, dtype=torch.float64))
        # E[relu(z)^2] / pre_std^2 for z ~ N(m pre_std, pre_std^2): (m^2 + 1) Phi(m) + m phi(m)
        m = offsets
        square = float(((m * m + 1) * torch.special.ndtr(m)
                        + m * torch.exp(-m * m / 2) / math.sqrt(2 * math.pi)).mean())
    scale = p.readout if readout is not None else d.update
    fc2 = d.write(f, scale * d.embed_std / (std * math.sqrt(f * square)))
    bias = torch.zeros(h)
    if readout is not None:  # centred: its bias cancels the mean output, E[relu(z)] = std (m Phi(m) + phi(m)), so
        # no token is favoured by every input (measured: uncentred, greedy decode fell into repeats)
        mean = std * (m * torch.special.ndtr(m) + torch.exp(-m * m / 2) / math.sqrt(2 * math.pi))
        with serial():
            bias = -(fc2.double() @ mean).float()
    return {pre + "fc1.weight": fc1, pre + "fc1.bias": offsets * std, pre + "fc2.weight": fc2,
            pre + "fc2.bias": bias}


def _norm_readers(pre: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A layer's two LayerNorms, each with the Linears that read its output."""
    attn = pre + "self_attn."
    return ((pre + "self_attn_layer_norm", (attn + "q_proj", attn + "k_proj", attn + "v_proj")),
            (pre + "final_layer_norm", (pre + "fc1",)))


def _scale_readers(sd: dict[str, torch.Tensor], pre: str, scale: float) -> None:
    """SynthProfile.opt_scale_readers, in place: q, k, v and fc1 times `scale` (a power of two), the
    LayerNorms feeding them (gain and bias) divided by it. y = (W s)(x / s) + b is y, in binary floating
    point too, while x @ W_int8 (int8 units: W over its row's step) falls by `scale`."""
    for norm, readers in _norm_readers(pre):
        sd[norm + ".weight"] = sd[norm + ".weight"] / scale
        sd[norm + ".bias"] = sd[norm + ".bias"] / scale
        for reader in readers:
            sd[reader + ".weight"] = sd[reader + ".weight"] * scale


# SynthProfile.outlier_salience: in a layer with outlier dims, the inputs whose salient columns stay flat
_OUTLIER_FLAT = {"inputs": ("self_attn_layer_norm", "final_layer_norm"),
                 "layer": ("self_attn_layer_norm", "final_layer_norm", "out_proj", "fc2")}


def _salient_channels(sd: dict[str, torch.Tensor], pre: str, gen: torch.Generator, share: float,
                      scale: float, count: int | None = None, flat: tuple[str, ...] = ()) -> None:
    """Give one layer's Linears salient input channels, in place and exactly in real arithmetic: in
    each, a `share` of the input channels (at least one; or `count` of them whatever the width; drawn
    from `gen`) has its weight column multiplied by `scale`, and what feeds the channel is divided by it:
    - q, k, v read the attention LayerNorm (y = gain * norm(x) + bias: gain and bias divided), fc1
      the FFN's LayerNorm (the same);
    - out_proj reads the attention's mix of values, linear in v_proj's output: v_proj's row and
      bias divided (the softmax weights do not depend on v);
    - fc2 reads relu(fc1 x + b), positively homogeneous: fc1's row and bias divided, so every
      neuron fires exactly when it did, and every activation statistic stays.
    A row's largest entries then sit in a few columns, so a per-row quantizer's step grows with
    `scale`, while a group-128 quantizer's grows only in the groups that hold a salient column.
    `flat` names inputs (a LayerNorm, "out_proj", "fc2") whose readers keep their columns as drawn: their
    channels are still drawn from `gen`, so every other Linear's are the same as without `flat`."""

    def channels(n: int, name: str) -> torch.Tensor:
        c = torch.ones(n)
        with serial():
            drawn = torch.randperm(n, generator=gen)
        c[drawn[:max(1, round(share * n)) if count is None else min(count, n)]] = scale
        return torch.ones(n) if name in flat else c

    attn = pre + "self_attn."
    for norm, readers in _norm_readers(pre):
        c = channels(sd[norm + ".weight"].numel(), norm.removeprefix(pre))  # (hidden,)
        sd[norm + ".weight"] = sd[norm + ".weight"] / c
        sd[norm + ".bias"] = sd[norm + ".bias"] / c
        for reader in readers:
            sd[reader + ".weight"] = sd[reader + ".weight"] * c  # (out, hidden): columns
    for reader, writer in ((attn + "out_proj", attn + "v_proj"), (pre + "fc2", pre + "fc1")):
        c = channels(sd[reader + ".weight"].shape[1], reader.removeprefix(attn).removeprefix(pre))
        sd[reader + ".weight"] = sd[reader + ".weight"] * c
        sd[writer + ".weight"] = sd[writer + ".weight"] / c[:, None]
        sd[writer + ".bias"] = sd[writer + ".bias"] / c


def profile_model(shape: str, *, seed: int, profile: str, dtype: torch.dtype) -> torch.nn.Module:
    """Stock transformers' OPTForCausalLM holding `profile_tensors`, in host memory, never written to
    disk: the same weights `synth_checkpoint` writes (bench/robustness.py draws large shapes this way)."""
    from transformers import OPTConfig, OPTForCausalLM

    from packbench.engine.checkpoint import assign_state

    config = OPTConfig(**opt_config(shape, str(dtype).removeprefix("torch.")))
    config._attn_implementation = "eager"  # as engine.checkpoint.build_model
    with torch.device("meta"):
        model = OPTForCausalLM(config)
    assign_state(model, profile_tensors(shape, seed=seed, profile=profile, dtype=dtype), Path(f"<profile {profile} {shape}>"))
    return model.to(dtype)
