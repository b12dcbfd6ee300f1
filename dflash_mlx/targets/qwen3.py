"""Qwen3 (dense): mlx-lm's ``qwen3`` models, e.g. Qwen3-4B / Qwen3-8B."""

from .base import DenseTarget


class Qwen3Target(DenseTarget):
    family = "qwen3"
    fuse_projections = True
