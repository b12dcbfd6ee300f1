"""MiniMax M2 / M2.5: mlx-lm's ``minimax`` models (it maps ``minimax_m2`` to
them). The q/k norms span all heads at once, before the heads are split;
RoPE turns the first ``rotary_dim`` of each head; every layer routes experts."""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..layers.blocks import attend
from .base import DenseTarget


class MiniMaxTarget(DenseTarget):
    family = "minimax"

    def layer_block(self, layer: nn.Module, window: int | None) -> Callable:
        return block(layer)


def block(layer: nn.Module) -> Callable:
    """mlx-lm's MiniMax decoder layer forward (h, mask, cache) -> h."""
    attn = layer.self_attn

    def forward(h: mx.array, mask, cache) -> mx.array:
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if attn.use_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.reshape(B, L, attn.num_attention_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        h = h + attn.o_proj(attend(attn.rope, q, k, v, cache=cache, scale=attn.scale, mask=mask))
        return h + layer.block_sparse_moe(layer.post_attention_layernorm(h))

    return forward
