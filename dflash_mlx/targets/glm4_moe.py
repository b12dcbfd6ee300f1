"""GLM-4.5 / 4.6 / 4.7: mlx-lm's ``glm4_moe`` models, qwen3-shaped attention
(per-head q/k norms, RoPE over part of each head, biased projections) and
routed experts after the first dense layers."""

from ..layers.blocks import own_block
from .base import DenseTarget


class Glm4MoeTarget(DenseTarget):
    family = "glm4_moe"

    def layer_block(self, layer, window):
        return own_block(layer, window)
