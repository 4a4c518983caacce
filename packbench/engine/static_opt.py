"""packbench's own OPT decoder step: every position-dependent value is a device tensor.

Why it exists: stock transformers derives the KV write slot, the positions and the mask from
host-side state (`cache.get_seq_length()`), so a CUDA graph captured around its forward freezes
them at capture (a probe on the H200 left the eager logits from the second replayed step). Here
the static KV cache is preallocated for prefix + continuation, the call's positions are one
device tensor `pos`, and the slot, the position embedding and the mask are all computed from it
on the device (gpt-fast's shape). The graph itself lives in `engine/graph.py`.

The math is stock OPT's eager path, op for op (transformers' `OPTDecoderLayer` and
`eager_attention_forward`), on the SAME modules of the CPU-first model (nothing is copied);
fc2 goes through `OutgoingLinear`, so every loader policy serves this decoder too. A decode
call attends over the live keys (`span` = position + 1), stock's shapes; `decode(span=capacity)`
attends over the whole static cache with the unwritten keys masked instead (a measured variant:
the extra terms are exact zeros but the reduction order changes, so logits may leave stock's in
the last bits). Prefill attends over exactly its own tokens.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVLayer:
    keys: torch.Tensor  # (1, heads, capacity, head_dim)
    values: torch.Tensor


class StaticKV:
    """The episode's KV cache, allocated once for `capacity` positions of `batch` sequences
    (charged in full).

    `length` is the host's count of positions written; the device never reads it. `graph` is
    the decode step captured on this cache (engine/graph.py), or None.
    """

    def __init__(self, *, layers: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, batch: int = 1) -> None:
        shape = (batch, heads, capacity, head_dim)
        # zeros, never empty: unwritten slots meet the mask, and 0 * NaN would not be 0.
        self.layers = [KVLayer(torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]
        self.capacity = capacity
        self.batch = batch
        self.length = 0
        self.graph = None
        self.eager_reason: str | None = None  # why decode was not captured (graph mode)
        self.attention = "live"  # engine/graph.py GraphDecoder.ATTENTION


class StaticOPT:
    """The decoder over a CpuFirstModel's modules: `prefill(ids, kv)` and `decode(ids, pos, kv)`.

    A call is `embed`, then per layer `pre` (LayerNorm, q/k/v, the KV write at device
    positions `pos`), `attend` and `post` (out_proj, residual, the FFN through the policy),
    then `head`. Every piece but `attend` reads no host state beyond shapes, so it can be
    captured once and replayed with new ids and pos (engine/graph.py); `attend` reads the
    live span, a host int, exactly as stock transformers' eager attention does.
    """

    def __init__(self, causal_lm, slot) -> None:
        decoder = causal_lm.model.decoder
        if decoder.project_in is not None or decoder.project_out is not None or decoder.final_layer_norm is None:
            raise ValueError("the static decoder supports pre-LayerNorm OPT without embedding projections only")
        self.slot = slot
        self.embed_weight = decoder.embed_tokens.weight
        self.positions = decoder.embed_positions.weight
        self.position_offset = decoder.embed_positions.offset  # 2 in every OPT
        self.final_norm = decoder.final_layer_norm
        self.lm_head = causal_lm.lm_head.weight
        self.layers = list(decoder.layers)
        attn = self.layers[0].self_attn
        self.heads, self.head_dim, self.scaling = attn.num_heads, attn.head_dim, attn.scaling
        self.hidden = self.heads * self.head_dim
        self.dtype = self.embed_weight.dtype
        # A CUDA stream for k and v, set by engine/graph.py for the length of a capture only: a
        # layer's q, k and v projections are independent GEMVs too small to fill the GPU alone,
        # so the graph runs k and v beside q. Same kernels, same inputs: same bits.
        self.branch: "torch.cuda.Stream | None" = None

    def new_cache(self, capacity: int, batch: int = 1) -> StaticKV:
        return StaticKV(layers=len(self.layers), heads=self.heads, head_dim=self.head_dim, capacity=capacity,
                        dtype=self.dtype, device=self.embed_weight.device, batch=batch)

    def prefill(self, ids: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """(B, T) ids at positions 0..T-1 -> last logits ((vocab,) at batch 1, else (B, vocab));
        attends over exactly T keys."""
        t = ids.shape[1]
        if t > kv.capacity:
            raise ValueError(f"prefill of {t} tokens does not fit a cache of {kv.capacity}")
        pos = torch.arange(t, device=ids.device)
        # stock eager's causal mask: 0 where allowed, finfo.min above the diagonal, (1, 1, T, T)
        logits = self._forward(ids, pos, kv, span=t, mask=self.mask(pos, t))
        kv.length = t
        return logits

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, kv: StaticKV, *, span: int) -> torch.Tensor:
        """(B, 1) ids at device position pos (1,) -> logits ((vocab,) at batch 1, else (B, vocab)),
        attending over `span` keys (every sequence of a batch is at the same position).

        span = position + 1 (the live keys) is stock's computation, bit for bit where the same
        kernels run. span = kv.capacity attends over the whole static cache with the unwritten
        keys masked (finfo.min, exact zeros after softmax): no host int left in the step, so it
        can be captured whole, but softmax and attn @ V then reduce over a longer row and may
        round differently from stock (docs/experiments/engine.md, "Graph decode", says what that did).
        """
        mask = None if span < kv.capacity else self.mask(pos, span)
        return self._forward(ids, pos, kv, span=span, mask=mask)

    def mask(self, pos: torch.Tensor, span: int) -> torch.Tensor:
        keys = torch.arange(span, device=pos.device)
        allowed = keys[None, :] <= pos[:, None]  # (T, span)
        zero = torch.zeros((), dtype=self.dtype, device=pos.device)
        low = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=pos.device)
        return torch.where(allowed, zero, low)[None, None]  # (1, 1, T, span)

    def _forward(self, ids, pos, kv: StaticKV, *, span: int, mask) -> torch.Tensor:
        h = self.embed(ids, pos)
        for i in range(len(self.layers)):
            q = self.pre(i, h, pos, kv)
            h = self.post(i, h, self.attend(q, kv.layers[i], span, mask))
        return self.head(h)

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # OPTLearnedPositionalEmbedding: position ids + offset; then inputs_embeds + pos_embeds
        return F.embedding(ids, self.embed_weight) + F.embedding((pos + self.position_offset)[None], self.positions)

    def pre(self, i: int, h: torch.Tensor, pos: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """Layer i up to attention: (B, T, hidden) -> q (B, heads, T, head_dim); writes K, V at pos."""
        layer, t = self.layers[i], h.shape[1]
        attn, ln = layer.self_attn, layer.self_attn_layer_norm
        x = F.layer_norm(h, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        cache, branch = kv.layers[i], self.branch
        if branch is None:
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias) * self.scaling
            self._write_kv(x, attn, cache, pos)
        else:  # fork k and v off the capturing stream, rejoin before attention reads them
            main = torch.cuda.current_stream()
            branch.wait_stream(main)
            with torch.cuda.stream(branch):
                self._write_kv(x, attn, cache, pos)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias) * self.scaling
            main.wait_stream(branch)
        return q.view(h.shape[0], t, self.heads, self.head_dim).transpose(1, 2)

    def _write_kv(self, x: torch.Tensor, attn, cache: KVLayer, pos: torch.Tensor) -> None:
        """k and v of `x`, written at the device positions `pos`: no host state, so a replay
        writes where it should."""
        shape = (x.shape[0], x.shape[1], self.heads, self.head_dim)
        for proj, into in ((attn.k_proj, cache.keys), (attn.v_proj, cache.values)):
            into.index_copy_(2, pos, F.linear(x, proj.weight, proj.bias).view(shape).transpose(1, 2))

    def attend(self, q: torch.Tensor, cache: KVLayer, span: int, mask: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """eager_attention_forward over the first `span` keys -> (B, T, hidden) (into `out` if given).

        Stock calls it with scaling=1.0 (q is already scaled; x * 1.0 is exact, skipped) and, in
        decode, a mask of zeros (x + 0 is exact, skipped: mask None)."""
        b, t = q.shape[0], q.shape[2]
        scores = torch.matmul(q, cache.keys[:, :, :span].transpose(-1, -2))
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, cache.values[:, :, :span]).transpose(1, 2)
        if out is not None:
            return out.view(o.shape).copy_(o).view(b, t, -1)  # a bitwise copy into a static buffer
        return o.contiguous().reshape(b, t, -1).contiguous()

    def attention_views(self, q: torch.Tensor, cache: KVLayer, out: torch.Tensor) -> tuple:
        """3D views for `attend_views` (batch 1 only): q (1, heads, 1, head_dim) -> (heads, 1, head_dim), the
        cache's keys and values -> (heads, capacity, head_dim), `out` (1, 1, hidden) -> (heads, 1,
        head_dim). Views of the same memory with the strides torch.matmul's own reshapes give."""
        heads, d = self.heads, self.head_dim
        return (q.view(heads, 1, d), cache.keys.view(heads, -1, d), cache.values.view(heads, -1, d),
                out.view(heads, 1, d))

    @staticmethod
    def attend_views(views: tuple, span: int) -> None:
        """`attend` for one decode token on `attention_views`, written into their `out`.

        torch.matmul of (1, heads, 1, d) by (1, heads, d, span) folds the batch and calls bmm on
        exactly these (heads, 1, d) and (heads, d, span) views, and softmax sees the same rows: so
        the same cuBLAS calls and kernels, the same bits, in half the host ops. The second bmm
        writes the static output (contiguous (heads, 1, d), the layout of the result bmm would
        allocate) instead of a copy after it."""
        q, keys, values, out = views
        probs = F.softmax(torch.bmm(q, keys[:, :span].mT), dim=-1, dtype=torch.float32).to(q.dtype)
        torch.bmm(probs, values[:, :span], out=out)

    def post(self, i: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Layer i after attention: out_proj, residual, then the FFN with fc2 from the policy."""
        layer = self.layers[i]
        out_proj = layer.self_attn.out_proj
        h = h + F.linear(a, out_proj.weight, out_proj.bias)
        shape = h.shape
        h = h.reshape(-1, h.size(-1))  # (B x T, hidden), as stock does before the FFN
        residual = h
        ln = layer.final_layer_norm
        x = F.layer_norm(h, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        policy = self.slot.policy
        if policy.starts_early:
            policy.before_layer(i)  # where stock's fc1 pre-hook fires
        x = F.relu(F.linear(x, layer.fc1.weight, layer.fc1.bias))  # (B x T, ffn); exact zeros are the point
        x = layer.fc2(x)  # OutgoingLinear: the policy's device weight, then F.linear
        return (residual + x).view(shape)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        norm = self.final_norm
        h = F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        logits = F.linear(h[:, -1:, :], self.lm_head)[:, -1]  # logits_to_keep=1: (B, vocab)
        return logits[0] if logits.shape[0] == 1 else logits
