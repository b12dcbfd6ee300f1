"""DeepSeek V3 and Kimi K2 / K2.5: mlx-lm's ``deepseek_v3`` models (``kimi_k25``
wraps one). Multi-head latent attention (MLA) caches, per position, the normed
latent row and the rotated key, both shared by every head: a plain buffer
holds them (keys: the latent, values: the rotary key), so rollback stays a
move of the length.

A block attends in one of mlx-lm's two forms, whichever takes fewer
multiply-adds: absorbed, the form of mlx-lm's one-token decode step (each
head's query taken into the latent space, every head reading the one latent
row), for short blocks such as a verify's; expanded, the form of mlx-lm's
prefill (the latent turned into per-head keys and values), for long chunks."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels.norm_rope import rotate
from ..layers import linear
from ..layers.blocks import rope_positions
from .base import DenseTarget


class DeepseekV3Target(DenseTarget):
    family = "deepseek_v3"
    runs_a_stage = True  # its own layer forwards, over this rank's slice like the base class's

    rotates_rows = True
    array_masks = True  # mla_attention selects with mx.where(mask, ...)

    def make_blocks(self) -> None:
        self.blocks = [mla_block(self.inner.layers[i]) for i in self.here]
        linear.prepare(self.dtype)


def mla_block(layer: nn.Module, selection: Callable | None = None) -> Callable:
    """mlx-lm's DeepSeek V3 decoder layer forward (h, mask, cache) -> h.
    ``selection``: DeepSeek sparse attention's indexer (see glm_moe_dsa.py)."""
    attn = layer.self_attn

    def forward(h: mx.array, mask, cache) -> mx.array:
        out = mla_attention(attn, layer.input_layernorm(h), mask, cache, selection)
        h = h + attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return forward


def absorbs(attn: nn.Module, rows: int) -> bool:
    """Whether ``rows`` queries attend in the absorbed form: per (row, key)
    pair it costs 2 * rank + rope multiply-adds against the expanded form's
    nope + rope + v, which first pays rank * (nope + v) per key to expand."""
    rank, nope, v = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim
    return rows * (2 * rank - nope - v) < rank * (nope + v)


def mla_attention(attn: nn.Module, x: mx.array, mask, cache, selection: Callable | None = None) -> mx.array:
    """Latent attention of ``x`` [B, L, hidden] (already normed) over ``cache``
    (None: the rows alone); returns [B, L, heads * v_head_dim]."""
    B, L, _ = x.shape
    if attn.q_lora_rank is None:
        q_low, q = None, attn.q_proj(x)
    else:
        q_low = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_low)
    q = q.reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(latent), axis=1)
    offset = rope_positions(cache) if cache is not None else 0
    q_pe, k_pe = rotate(attn.rope, q_pe, offset), rotate(attn.rope, k_pe, offset)

    if selection is not None:
        latent, k_pe, mask = selection(x, q_low, latent, k_pe, mask, cache)
    elif cache is not None:
        latent, k_pe = cache.update_and_fetch(latent, k_pe)

    pe_scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    if mask is not None:
        pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    if absorbs(attn, L):
        out = mx.fast.scaled_dot_product_attention(
            attn.embed_q(q_nope), latent, latent, scale=attn.scale, mask=pe_scores
        )
        out = attn.unembed_out(out)
    else:
        keys, values = attn.embed_q(latent, transpose=False), attn.unembed_out(latent)
        out = mx.fast.scaled_dot_product_attention(q_nope, keys, values, scale=attn.scale, mask=pe_scores)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)
