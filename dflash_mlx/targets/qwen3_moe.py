"""Qwen3 MoE: mlx-lm's ``qwen3_moe`` models, e.g. Qwen3-Coder-30B-A3B.

The decoder loop is the dense one: the sparse MLP is inside mlx-lm's layer
module, and routing is per token, so a verify block routes each position as
a single decode step would. The attention is qwen3's (q/k norms), run as
layers.dense_block runs it, through ``attention.attention_output``, with mlx-lm's
own projections and MLP."""

from ..layers.blocks import dense_block, own_projections
from .base import DenseTarget


class Qwen3MoeTarget(DenseTarget):
    family = "qwen3_moe"

    def layer_block(self, layer, window):
        return dense_block(layer, own_projections(layer.self_attn), lambda h, norm: h + layer.mlp(norm(h)), window)
