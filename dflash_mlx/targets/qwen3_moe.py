"""Qwen3 MoE: mlx-lm's ``qwen3_moe`` models, e.g. Qwen3-Coder-30B-A3B.

The decoder loop is the dense one: the sparse MLP is inside mlx-lm's layer
module, and routing is per token, so a verify block routes each position as
a single decode step would."""

from .base import DenseTarget


class Qwen3MoeTarget(DenseTarget):
    family = "qwen3_moe"
