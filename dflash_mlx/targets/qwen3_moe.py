"""Qwen3 MoE: mlx-lm's ``qwen3_moe`` models. Routing is per token, so a verify
block routes each position as a decode step would."""

from ..layers.blocks import own_block
from .base import DenseTarget


class Qwen3MoeTarget(DenseTarget):
    family = "qwen3_moe"

    def layer_block(self, layer, window):
        return own_block(layer, window)
