"""Llama: mlx-lm's ``llama`` models, e.g. Llama-3.1-8B-Instruct.

Sliding-window layers, where a config has them, keep a plain KV cache (so
rollback stays a trim) and see the window through their mask."""

from .base import DenseTarget


class LlamaTarget(DenseTarget):
    family = "llama"
    fuse_projections = True

    def windows(self):
        window = getattr(self.inner, "sliding_window", None)
        return [window if layer.use_sliding else None for layer in self.inner.layers]
