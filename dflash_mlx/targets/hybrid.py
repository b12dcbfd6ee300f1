"""Hybrid targets: gated delta-net layers mixed with full attention.
mlx-lm's ``qwen3_5`` (Qwen3.5 / 3.6 dense), ``qwen3_5_moe`` (Qwen3.5 / 3.6
A3B / A10B) and ``qwen3_next`` (Qwen3-Coder-Next).

Attention layers keep plain buffers; delta-net layers keep a DeltaCache
(recurrent.py), whose rollback is exact. When a shortened conversation asks
for a state no cache kept, the missing tokens are read again from the
nearest checkpoint: the delta-net layers recompute, the attention layers
read their keys and values in place (never rewritten below the committed
length)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..kv_cache import BufferKVCache, positions_mask
from .base import DenseTarget
from .recurrent import DeltaCache, _value


class HybridCache(list):
    """The per-layer caches, plus the ids written at each position (a log of
    (start, ids) per write, read by the host only to re-read tokens)."""

    def __init__(self, layers):
        super().__init__(layers)
        self.log: list[tuple[int | mx.array, mx.array]] = []

    def ids(self, n: int) -> list[int]:
        """The ids at positions 0..n-1, as last written."""
        seq: list[int] = []
        for start, ids in self.log:
            s = _value(start)
            if s >= n:
                continue
            seq[s:] = ids.tolist()[: n - s]
        if len(seq) < n:
            raise LookupError(f"positions up to {n} were never written")
        self.log = [(0, mx.array(seq[:n], mx.int32))] if n else []
        return seq[:n]


class _Reading:
    """An attention layer's cache during a re-read: keys and values already
    in place are read, nothing is written."""

    def __init__(self, kv: BufferKVCache, start: int):
        self.kv, self.offset = kv, start

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return self.kv.keys, self.kv.values

    def make_mask(self, N: int, window_size=None, return_array=False):
        return positions_mask(N, self.offset, self.kv.capacity, window_size)


class HybridTarget(DenseTarget):
    family = "qwen3_5"

    def __init__(self, model: nn.Module):
        super().__init__(model)  # qwen3_5 wraps a text model
        self.linear = [layer.is_linear for layer in self.inner.layers]
        self.first_attention = self.linear.index(False)

    def make_cache(self) -> HybridCache:
        return HybridCache(DeltaCache() if linear else BufferKVCache() for linear in self.linear)

    def masks(self, h, cache):
        mask = create_attention_mask(h, cache[self.first_attention], return_array=True)
        return [None if linear else mask for linear in self.linear]

    def _layer(self, layer, h, mask, c):
        if not layer.is_linear:
            return layer(h, mask, c)
        h = h + c.forward(layer.linear_attn, layer.input_layernorm(h))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def __call__(self, tokens: mx.array, cache: list, taps: Sequence[int], last_only: bool = False):
        if isinstance(cache, HybridCache):
            cache.log.append((cache[self.first_attention].offset, tokens[0]))
        h = self.embed(tokens)
        order = {layer: i for i, layer in enumerate(taps)}
        tapped: list = [None] * len(taps)
        for i, (layer, c, mask) in enumerate(zip(self.inner.layers, cache, self.masks(h, cache))):
            h = self._layer(layer, h, mask, c)
            if i in order:
                tapped[order[i]] = h
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.inner.norm(h)), mx.concatenate(tapped, axis=-1)

    def set_length(self, cache: list, length, bound: int | None = None) -> None:
        """An array length: a verify's rollback, on the device. An int: the
        exact state after ``length`` positions (a sync; settling only)."""
        if not isinstance(length, int):
            for c in cache:
                c.set_length(length, bound)
            return
        delta = [c for c in cache if isinstance(c, DeltaCache)]
        for c in cache:
            if isinstance(c, BufferKVCache):
                c.set_length(length)
        ids = cache.ids(length) if isinstance(cache, HybridCache) else None
        if not all(c.restore(length) for c in delta):
            if ids is None:
                raise LookupError(f"no state kept at length {length}")
            self._reread(cache, ids)

    def _reread(self, cache: HybridCache, ids: list[int]) -> None:
        """Bring every delta-net layer to exactly ``len(ids)`` positions from
        the nearest checkpoint all of them hold, re-reading the ids between."""
        n = len(ids)
        delta = [c for c in cache if isinstance(c, DeltaCache)]
        m = min(c.restorable(n) for c in delta)
        for c in delta:
            c.restore(m)
        reading = [c if isinstance(c, DeltaCache) else _Reading(c, m) for c in cache]
        h = self.embed(mx.array(ids[m:], mx.int32)[None])
        for layer, c, mask in zip(self.inner.layers, reading, self.masks(h, reading)):
            h = self._layer(layer, h, mask, c)
        for c in delta:
            c.restore(n)
        mx.eval([a for c in delta for a in c.state if a is not None])


class Qwen3_5MoeTarget(HybridTarget):
    family = "qwen3_5_moe"


class Qwen3NextTarget(HybridTarget):
    family = "qwen3_next"
