"""Decoder-layer forwards that reproduce mlx-lm's op for op, their attention
through ``attention.attention_output``."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels.norm_rope import norm_rope, rotate
from . import experts
from .attention import attention_output
from .linear import apply_linear_output


def attend(
    rope, queries, keys, values, *, cache, scale: float, mask, window: int | None = None, sinks: mx.array | None = None
) -> mx.array:
    """mlx-lm's attention after the projections: RoPE at the cache's offset
    (``rope`` None: NoPE), the cache write (``cache`` None: no cache), then
    attention of the new rows. Returns [B, L, heads * D]."""
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
    """``attend``'s output in its stored layout, as ``attention_output`` gives it."""
    start = None if cache is None else cache.offset
    if rope is not None and cache is not None:
        at = rope_positions(cache)
        queries, keys = rotate(rope, queries, at), rotate(rope, keys, at)
    elif rope is not None:
        queries, keys = rope(queries), rope(keys)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    return attention_output(
        queries, keys, values, cache=cache, scale=scale, mask=mask, start=start, window=window, sinks=sinks
    )


def rope_positions(cache):
    """Where the rows being written are rotated: from the cache's length on
    (its absolute position), or at their depths in a draft tree (kv/tree.py)."""
    tree = getattr(cache, "tree", None)
    return cache.position if tree is None else tree.positions(cache.position)


def own_projections(attn: nn.Module) -> Callable:
    """(h, norm) -> (q, k, v) of norm(h) through the attention module's own three products."""

    def qkv(h, norm):
        x = norm(h)
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    return qkv


def dense_block(layer: nn.Module, qkv: Callable, mlp: Callable, window: int | None = None) -> Callable:
    """The forward (h, mask, cache) -> h of a qwen3/llama-shaped layer, with
    q, k, v from ``qkv(h, norm)`` and ``mlp(h, norm)`` returning h plus the
    MLP; each is handed its norm to take into its product's launch."""
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
            q, k = norm_rope(q, k, q_norm, k_norm, rope, rope_positions(cache))
            rope = None
        else:
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        out, as_rows = attend_output(rope, q, k, v, cache=cache, scale=attn.scale, mask=mask, window=window)
        h = apply_linear_output(attn.o_proj, out, as_rows, residual=h)
        return mlp(h, layer.post_attention_layernorm)

    return forward


def own_block(layer: nn.Module, window: int | None = None) -> Callable:
    """``dense_block`` of a qwen3/llama-shaped layer through its own modules:
    its three projections and its MLP."""
    mlp = experts.mlp(layer.mlp)  # (a MoE block's experts through the expert verify product)
    return dense_block(layer, own_projections(layer.self_attn), lambda h, norm: h + mlp(norm(h)), window)
