"""GPT-OSS: mlx-lm's ``gpt_oss`` models. Every layer keeps a plain buffer
(sliding windows live in the mask) so rollback stays a move of the length;
attention sinks are per-head logits, as in mx.fast's attention."""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..layers import experts
from ..layers.blocks import attend, own_projections
from .base import DenseTarget


class GptOssTarget(DenseTarget):
    family = "gpt_oss"
    runs_a_stage = True  # its layers over this rank's slice, as the base class runs them

    def windows(self):
        window = int(self.inner.window_size)
        return [window if t == "sliding_attention" else None for t in self.inner.layer_types]

    def layer_block(self, layer: nn.Module, window: int | None) -> Callable:
        """mlx-lm's gpt_oss TransformerBlock forward (h, mask, cache) -> h."""
        attn = layer.self_attn
        qkv = own_projections(attn)
        mlp = experts.mlp(layer.mlp)

        def forward(h: mx.array, mask, cache) -> mx.array:
            B, L, _ = h.shape
            q, k, v = (p.reshape(B, L, -1, attn.head_dim).swapaxes(1, 2) for p in qkv(h, layer.input_layernorm))
            out = attend(
                attn.rope, q, k, v, cache=cache, scale=attn.sm_scale, mask=mask, window=window, sinks=attn.sinks
            )
            h = h + attn.o_proj(out)
            return h + mlp(layer.post_attention_layernorm(h))

        return forward
