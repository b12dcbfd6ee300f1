"""A quantized target KV cache with a device-side length (``--kv-bits``).

Like mlx-lm's QuantizedKVCache, each position is quantized on its own in
groups along the head dimension, so BufferKVCache's scheme (write at
``offset``, roll back by moving it) stays exact. mlx-lm starts quantizing at
``quantized_kv_start``; PromptCache reads prompts as mlx-lm does, converts all
layers in one assignment, and keeps a verify block from straddling that start.
Only the target's cache is quantized.
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

    # Attention reads what a BufferKVCache's would: up to the bound, not the
    # whole capacity, which a reused cache grew for an earlier, longer prompt.
    read_width = BufferKVCache.read_width

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
        """Quantize keys/values [B, H, n, d] and store them at start..start+n-1;
        returns the buffers as attention reads them (``read_width`` positions)."""
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
        width = self.read_width(n)
        if width == self.capacity:
            return self.keys, self.values
        return tuple(a[..., :width, :] for a in self.keys), tuple(a[..., :width, :] for a in self.values)

    # A compiled cycle (decode/cycle.py) takes and hands back each tuple's three arrays.
    traced_returns = 6

    def traced_inputs(self) -> list:
        return [*self.keys, *self.values]

    def set_traced(self, given) -> None:
        self.keys = tuple(next(given) for _ in self.keys)
        self.values = tuple(next(given) for _ in self.values)

    def traced_outputs(self) -> tuple:
        return (*self.keys, *self.values)

    def take_outputs(self, outputs, start: mx.array) -> None:
        self.keys, self.values = tuple(outputs[:3]), tuple(outputs[3:])

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
