"""Decoder-layer forwards over mlx-lm's own modules whose attention goes
through ``attention.attention_output`` (the block-attention kernel where it pays).

Each reproduces its mlx-lm module's forward op for op, so off the kernel
(the CPU, a quantized or rotating cache) it computes exactly what mlx-lm
computes. ``attend`` is the part every family shares: RoPE at the cache's
offset (where the layer has positions), the write, attention from that
offset. ``dense_block`` is the qwen3/llama-shaped layer (optional q/k norms),
run by fused.py with fused products and by qwen3_moe with mlx-lm's own
products and sparse MLP."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels.norm_rope import norm_rope
from .attention import attention_output
from .linear import apply_linear_output


def attend(
    rope, queries, keys, values, *, cache, scale: float, mask, window: int | None = None, sinks: mx.array | None = None
) -> mx.array:
    """mlx-lm's attention modules after their projections: queries, keys
    and values [B, heads, L, D] rotated by ``rope`` at the cache's offset
    (None: a layer without positions, NoPE), keys and values written to
    ``cache`` (None: a whole sequence, no cache), then attention of the new
    rows from that offset, within ``window``, with per-head ``sinks`` if
    given. Returns [B, L, heads * D]."""
    out, as_rows = attend_output(
        rope, queries, keys, values, cache=cache, scale=scale, mask=mask, window=window, sinks=sinks
    )
    if as_rows:
        return out
    B, _, L, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def attend_output(
    rope, queries, keys, values, *, cache, scale: float, mask, window: int | None = None, sinks: mx.array | None = None
) -> tuple[mx.array, bool]:
    """``attend``'s output as the attention stores it: (rows, True) or
    (heads [B, heads, L, D], False), see ``attention.attention_output``
    (``block_products.apply_linear_output`` takes either without a copy)."""
    start = None if cache is None else cache.offset
    if rope is not None and cache is not None:
        queries, keys = rope(queries, offset=start), rope(keys, offset=start)
    elif rope is not None:
        queries, keys = rope(queries), rope(keys)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    return attention_output(
        queries, keys, values, cache=cache, scale=scale, mask=mask, start=start, window=window, sinks=sinks
    )


def own_projections(attn: nn.Module) -> Callable:
    """(h, norm) -> (q, k, v) of norm(h) through the attention module's own three products."""

    def qkv(h, norm):
        x = norm(h)
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    return qkv


def dense_block(layer: nn.Module, qkv: Callable, mlp: Callable, window: int | None = None) -> Callable:
    """The forward (h, mask, cache) -> h of an mlx-lm qwen3/llama-shaped
    layer (q/k norms where it has them), q, k and v from ``qkv(h, norm)``
    (of norm(h), ``norm`` the layer's input norm), and ``mlp(h, norm)``: h
    plus the MLP of norm(h) (``norm`` the post-attention norm): each may take
    its norm into its product's launch (block_products.apply_linear). The
    attention's output product adds its residual in the same launch where
    the block-product kernel runs."""
    attn = layer.self_attn
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

    def forward(h: mx.array, mask, cache) -> mx.array:
        B, L, _ = h.shape
        q, k, v = qkv(h, layer.input_layernorm)
        q = q.reshape(B, L, attn.n_heads, -1)
        k = k.reshape(B, L, attn.n_kv_heads, -1)
        v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        rope = attn.rope
        if q_norm is not None and cache is not None:
            # normed and rotated in one launch where that kernel checked out (kernels/norm_rope.py)
            q, k = norm_rope(q, k, q_norm, k_norm, rope, cache.offset)
            rope = None
        else:
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        out, as_rows = attend_output(rope, q, k, v, cache=cache, scale=attn.scale, mask=mask, window=window)
        h = apply_linear_output(attn.o_proj, out, as_rows, residual=h)
        return mlp(h, layer.post_attention_layernorm)

    return forward
