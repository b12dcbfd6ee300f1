"""Gemma 3 and Gemma 4: mlx-lm's ``gemma3_text`` and ``gemma4_text``, and the
multimodal ``gemma3`` / ``gemma4`` checkpoints (their text model, wrapped).

What sets them apart from the dense loop: embeddings scaled by sqrt(hidden)
(the drafter's block embeddings too), sliding-window layers (a plain buffer
each, the window in the mask), and for Gemma 4 a final logit softcap,
per-layer input embeddings, and trailing layers that reuse an earlier layer's
keys/values (they keep no cache of their own).

The softcap is the target's own (``logits``), not the shared ``lm_head``'s:
the drafter gets the raw head, as Z Lab's reference and the official MLX code
feed it (Hugging Face caps in the causal-LM forward), and applies only its
own config's ``final_logit_softcapping``, so it is never capped twice."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from ..kv_cache import BufferKVCache
from .base import DenseTarget


class Gemma3Target(DenseTarget):
    family = "gemma3_text"

    def __init__(self, model):
        super().__init__(model)
        self.tied = bool(getattr(self.text, "tie_word_embeddings", False)) or "lm_head" not in self.text

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.inner.embed_tokens(tokens)
        # As mlx-lm does it: the scale rounded to bfloat16 first.
        return h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def windows(self):
        p, w = self.inner.sliding_window_pattern, self.inner.window_size
        return [None if i % p == p - 1 else w for i in range(self.num_layers)]


class Gemma4Target(DenseTarget):
    family = "gemma4_text"

    def __init__(self, model):
        super().__init__(model)
        self.tied = bool(self.text.tie_word_embeddings)
        self.softcap = self.text.final_logit_softcapping
        self.types = [layer.layer_type for layer in self.inner.layers]
        self.with_kv = sum(layer.self_attn.has_kv for layer in self.inner.layers)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens) * self.inner.embed_scale

    def logits(self, h: mx.array) -> mx.array:
        logits = self.lm_head(h)
        if self.softcap is not None:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits

    def make_cache(self) -> list:
        return [BufferKVCache() for _ in range(self.with_kv)]

    def windows(self):
        w = self.inner.window_size
        return [w if t == "sliding_attention" else None for t in self.types]

    def masks(self, h, cache):
        # One mask per layer type, made by the first cache of that type; the
        # layers sharing keys/values see the buffers of their source layer.
        made = {}
        for i, t in enumerate(self.types[: self.with_kv]):
            if t not in made:
                window = self.inner.window_size if t == "sliding_attention" else None
                made[t] = create_attention_mask(h, cache[i], window_size=window, return_array=True)
        return [made[t] for t in self.types]

    def __call__(self, tokens: mx.array, cache: list, taps: Sequence[int], last_only: bool = False):
        inner = self.inner
        h = self.embed(tokens)
        per_layer = [None] * self.num_layers
        if inner.hidden_size_per_layer_input:
            inputs = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens))
            per_layer = [inputs[:, :, i, :] for i in range(self.num_layers)]
        caches = list(cache) + [None] * (self.num_layers - len(cache))
        order = {layer: i for i, layer in enumerate(taps)}
        tapped: list = [None] * len(taps)
        shared = [(None, None)] * self.num_layers
        for i, (layer, c, mask) in enumerate(zip(inner.layers, caches, self.masks(h, cache))):
            kvs, offset = shared[inner.previous_kvs[i]]
            h, kvs, offset = layer(h, mask, c, per_layer_input=per_layer[i], shared_kv=kvs, offset=offset)
            shared[i] = (kvs, offset)
            if i in order:
                tapped[order[i]] = h
        if last_only:
            h = h[:, -1:]
        return self.logits(inner.norm(h)), mx.concatenate(tapped, axis=-1)
