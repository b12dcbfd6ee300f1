"""Llama: mlx-lm's ``llama`` models, e.g. Llama-3.1-8B-Instruct.

Sliding-window layers, where a config has them, keep a plain KV cache (so
rollback stays a trim) and see the window through their mask."""

from mlx_lm.models.base import create_attention_mask, create_causal_mask

from .base import DenseTarget


class LlamaTarget(DenseTarget):
    family = "llama"

    def masks(self, h, cache):
        full = create_attention_mask(h, cache[0])
        window = getattr(self.inner, "sliding_window", None)
        if not window:
            return [full] * self.num_layers
        L, offset = h.shape[1], cache[0].offset
        sliding = create_causal_mask(L, offset, window_size=window) if offset + L > window else full
        return [sliding if layer.use_sliding else full for layer in self.inner.layers]
