"""A quantized target KV cache with a device-side length (``--kv-bits``).

mlx-lm's QuantizedKVCache stores each position's keys and values quantized
in groups of ``group_size`` along the head dimension, (packed, scales,
biases), and its attention modules take the quantized path whenever the
cache has ``bits`` (mlx_lm.models.base.scaled_dot_product_attention). Every
position is quantized on its own, so this cache can keep BufferKVCache's
scheme: a fixed-capacity buffer written at ``offset`` (an int, or an int32
array the host does not read), rollback by moving ``offset``, exactly.

mlx-lm starts quantizing once the cache holds ``quantized_kv_start``
positions (maybe_quantize_kv_cache, after every forward): a position is
computed against a quantized cache exactly when the forward that reads it
starts at or past that point. The token loop keeps to that rule:

- ``PromptCache.chunks`` cuts a prompt as mlx-lm does (all but the last id
  in chunks, then the last one alone) while the cache is not yet quantized;
- ``maybe_quantize`` converts the target caches after each chunk and before
  each cycle once the cache holds enough positions (one list assignment, so
  an interrupt leaves either all layers converted or none);
- ``may_queue`` / ``ready`` keep a verify block from straddling the start:
  such a block waits for the exact length and is cut to end at the start.

Only the target's cache is quantized; the drafter's stays as it is.
"""

from __future__ import annotations

import mlx.core as mx

from .buffer import BufferKVCache, DeviceLengthCache, put_positions

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


class QuantizedBufferKVCache(DeviceLengthCache):
    """BufferKVCache's scheme over quantized buffers: ``keys`` and
    ``values`` are tuples (packed uint32, scales, biases), each [B, H, capacity, ...]."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__()
        self.group_size, self.bits = group_size, bits

    @classmethod
    def from_buffer(cls, cache: BufferKVCache, group_size: int, bits: int) -> QuantizedBufferKVCache:
        """The same positions, quantized (as mlx-lm's KVCache.to_quantized)."""
        q = cls(group_size, bits)
        if cache.keys is not None:
            q.keys = tuple(mx.quantize(cache.keys, group_size=group_size, bits=bits))
            q.values = tuple(mx.quantize(cache.values, group_size=group_size, bits=bits))
        q.offset, q.bound, q.floor = cache.offset, cache.bound, cache.floor
        return q

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _grow(self, n: int, like: tuple, like_v: tuple) -> None:
        cap = self.room(n)
        if cap == self.capacity:
            return

        def grown(buf: tuple | None, new: tuple) -> tuple:
            if buf is None:
                return tuple(mx.zeros((*a.shape[:2], cap, a.shape[3]), a.dtype) for a in new)
            pad = cap - buf[0].shape[2]
            return tuple(mx.concatenate([a, mx.zeros((*a.shape[:2], pad, a.shape[3]), a.dtype)], axis=2) for a in buf)

        self.keys, self.values = grown(self.keys, like), grown(self.values, like_v)

    def write(self, keys: mx.array, values: mx.array, start) -> tuple[tuple, tuple]:
        """Quantize keys/values [B, H, n, d] and store them at start..start+n-1."""
        n = keys.shape[2]
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self._grow(self.bound + n, qk, qv)
        if isinstance(start, int):
            for buf, new in ((self.keys, qk), (self.values, qv)):
                for a, b in zip(buf, new):
                    a[..., start : start + n, :] = b
        else:
            at = self.positions(start, n)
            self.keys = tuple(put_positions(a, b, at) for a, b in zip(self.keys, qk))
            self.values = tuple(put_positions(a, b, at) for a, b in zip(self.values, qv))
        return self.keys, self.values

    @property
    def state(self) -> tuple:
        return () if self.keys is None else (*self.keys, *self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


# -- settings and the token loop's calls ---------------------------------------


def check_settings(adapter, kv_bits: int | None, kv_group_size: int, quantized_kv_start: int) -> None:
    """Refuse, in one sentence, settings mlx-lm would refuse or this target cannot use."""
    if kv_bits is None:
        return
    if kv_bits not in BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, BITS))}, not {kv_bits}.")
    if kv_group_size not in GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, not {kv_group_size}.")
    if quantized_kv_start < 0:
        raise ValueError(f"quantized_kv_start must be 0 or more, not {quantized_kv_start}.")
    plain = adapter.family in ("dense", "llama", "qwen3", "qwen3_moe") and all(w is None for w in adapter.windows())
    if not plain:
        raise ValueError(f"a quantized KV cache is not supported for {adapter.family} targets; run without kv_bits.")
    args = adapter.model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    if head_dim % kv_group_size:
        raise ValueError(f"kv_group_size {kv_group_size} does not divide the target's head dimension {head_dim}.")
