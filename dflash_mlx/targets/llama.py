"""Llama: mlx-lm's ``llama`` models. Sliding layers keep a plain buffer (the
window lives in the mask), so rollback stays a trim."""

from .base import DenseTarget


class LlamaTarget(DenseTarget):
    family = "llama"
    fuse_projections = True

    def windows(self):
        window = getattr(self.inner, "sliding_window", None)
        return [window if layer.use_sliding else None for layer in self.inner.layers]
