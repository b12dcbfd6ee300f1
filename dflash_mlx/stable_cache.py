"""A KV cache whose attention shapes stay fixed between buffer growths.

mlx-lm's KVCache hands attention exactly the filled part of its buffer, so
the key length changes on every call. On MLX's CUDA backend, attention with
several query rows rebuilds a backend graph for every key length it has not
seen (~30 ms each, measured on an H200; see the project's reference notes),
which a speculative loop meets on every cycle. This cache hands out its whole
buffer, whose length changes only every ``step`` positions, and the caller
masks the unfilled tail. Rollback stays a move of the offset.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class StableKVCache(KVCache):
    step = 256

    def capacity_for(self, n: int) -> int:
        """The buffer length after storing ``n`` more positions."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        need = self.offset + n
        return cap if need <= cap else -(-need // self.step) * self.step

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        cap = self.capacity_for(n)
        if self.keys is None or cap > self.keys.shape[2]:
            B, H, _, kd = keys.shape
            new_k = mx.zeros((B, H, cap, kd), keys.dtype)
            new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
            if self.keys is not None and prev:
                new_k[..., :prev, :] = self.keys[..., :prev, :]
                new_v[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset = prev + n
        return self.keys, self.values


def stable_shapes_by_default() -> bool:
    """Fixed attention shapes pay off on MLX's CUDA backend only: Metal builds
    its attention kernels per dtype and head size, and the CPU per call."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def causal_mask(L: int, offset: int, total: int, window: int | None = None) -> mx.array:
    """Boolean [L, total]: query i (at offset + i) sees keys at or before it,
    within ``window`` positions if given; keys past offset + L are unfilled."""
    q = offset + mx.arange(L)[:, None]
    k = mx.arange(total)[None]
    visible = k <= q
    if window is not None:
        visible = visible & (q - k < window)
    return visible
