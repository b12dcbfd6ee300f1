"""Muse Glimmer: mlx-lm's ``muse_glimmer`` text model. A dense loop with
sliding/global attention (global layers without RoPE), a scaleless RMSNorm on
the embeddings and soft-capped, scaled logits. The drafter shares the raw
``embed`` and ``lm_head`` (its config applies the multiplier and cap)."""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..layers.blocks import attend
from .base import DenseTarget


class MuseGlimmerTarget(DenseTarget):
    family = "muse_glimmer"

    def __init__(self, model):
        super().__init__(model)
        args = self.text.args
        self.tied = bool(args.tie_word_embeddings)
        self.multiplier, self.softcap = args.output_multiplier, args.final_logit_softcapping

    def windows(self):
        return [self.inner.window if layer.self_attn.is_sliding else None for layer in self.inner.layers]

    def layer_block(self, layer: nn.Module, window: int | None) -> Callable:
        return block(layer, window)

    def first_input(self, tokens: mx.array) -> mx.array:
        return mx.fast.rms_norm(self.embed(tokens), None, self.inner.embed_eps)

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        logits = self.lm_head(h, norm) * self.multiplier
        return mx.tanh(logits / self.softcap) * self.softcap


def block(layer: nn.Module, window: int | None) -> Callable:
    """mlx-lm's muse_glimmer DecoderLayer forward (h, mask, cache) -> h."""
    attn = layer.self_attn
    rope = attn.rope if attn.use_rope else None

    def forward(h: mx.array, mask, cache) -> mx.array:
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q = attn.q_proj(x).reshape(B, L, attn.n_heads, attn.head_dim)
        k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, attn.head_dim)
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, attn.head_dim)
        q = mx.fast.rms_norm(q, None, attn.eps) * attn.qk_scale_factor
        k = mx.fast.rms_norm(k, None, attn.eps)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        out = attend(rope, q, k, v, cache=cache, scale=attn.scale, mask=mask, window=window)
        out = attn.o_proj(out * mx.sigmoid(attn.gate_proj(x)))
        h = h + layer.post_attention_layernorm(out)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))

    return forward
