"""A bounded target KV cache (``max_kv_size``) with a device-side length,
reproducing mlx-lm's RotatingKVCache(max_size=M, keep=4) exactly.

In mlx-lm a prompt chunk attends to [the cache in temporal order, the chunk]
under a sliding window of M; a single token sees the kept positions and the
last M - keep up to itself. Here keys live in a ring of ``keep + window``
slots, ``window`` being M - keep plus the largest verify block less one, so a
block never overwrites a position it or a rolled-back block still needs. A
prompt chunk gets mlx-lm's concatenated array and mask, and its ring writes
are staged until committed, so an interrupted chunk leaves the ring intact.

DraftWindowCache bounds the drafter's context to match, turning kept keys
back with RoPE so relative positions are preserved; it changes proposals
only, never the output.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import rope_utils

from .buffer import BufferKVCache, DeviceLengthCache, positions_mask, put_positions

KEEP = 4  # mlx-lm's make_prompt_cache: RotatingKVCache(max_size=max_kv_size, keep=4)


def check_max_kv_size(adapter, max_kv_size: int | None, kv_bits: int | None) -> None:
    """Refuse, in one sentence, a bound this target cannot use."""
    if max_kv_size is None:
        return
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size <= KEEP:
        raise ValueError(
            f"max_kv_size must be an integer above {KEEP} (the first {KEEP} positions are always kept), "
            f"not {max_kv_size}."
        )
    if kv_bits is not None:
        raise ValueError(
            "max_kv_size and kv_bits cannot be combined (mlx-lm cannot quantize its rotating cache "
            "either); drop one of them."
        )
    plain = adapter.family in ("dense", "llama", "qwen3", "qwen3_moe") and all(w is None for w in adapter.windows())
    if not plain:
        raise ValueError(f"max_kv_size is not supported for {adapter.family} targets; run without it.")


class RotatingBufferKVCache(DeviceLengthCache):
    """mlx-lm's RotatingKVCache(max_size, keep) semantics in a ring buffer
    with a device-side length; ``slack``: the largest block written at a
    device-side length."""

    def __init__(self, max_size: int, slack: int, keep: int = KEEP):
        super().__init__()
        self.max_size, self.keep = max_size, keep
        self.window = max_size - keep + max(slack, 1) - 1
        self.written = 0  # host bound on the positions ever written: beyond keep + window, the ring has wrapped
        self.staged = None  # a prompt chunk's ring writes, made once it is committed: (end, slots, keys, values)

    @property
    def slots(self) -> int:
        return self.keep + self.window

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.slots

    def width_after(self, n: int) -> int:
        return self.slots

    @property
    def wrapped(self) -> bool:
        """The cache can no longer be cut back exactly: a position past
        max_size was written, whose view of its past depends on how it was
        read (mlx-lm's RotatingKVCache stops being trimmable there too)."""
        return self.written > self.max_size

    def _grow(self, n: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is None:
            B, H, _, kd = keys.shape
            self.keys = mx.zeros((B, H, self.slots, kd), keys.dtype)
            self.values = mx.zeros((B, H, self.slots, values.shape[3]), values.dtype)

    def slot(self, positions):
        """The slot of each position (ints, numpy or mx arrays)."""
        k = self.keep
        if isinstance(positions, mx.array):
            return mx.where(positions < k, positions, k + (positions - k) % self.window)
        positions = np.asarray(positions)
        return np.where(positions < k, positions, k + (positions - k) % self.window)

    def write(self, keys: mx.array, values: mx.array, start) -> tuple[mx.array, mx.array]:
        """Store keys/values at positions start.. in their slots; return the ring."""
        n = keys.shape[2]
        self._grow(n, keys, values)
        idx = self.slot(self.positions(start, n))
        self.keys = put_positions(self.keys, keys, idx)
        self.values = put_positions(self.values, values, idx)
        self.written = max(self.written, self.bound + n)
        return self.keys, self.values

    def _commit(self) -> None:
        """Write the staged chunk into the ring (idempotent until it is
        cleared, so an interrupt inside leaves it to be done again)."""
        end, idx, keys, values = self.staged
        self.keys = put_positions(self.keys, keys, idx)
        self.values = put_positions(self.values, values, idx)
        self.written = max(self.written, end)
        self.staged = None

    def set_length(self, length, bound: int | None = None, read: str = "bound") -> None:
        if self.staged is not None:
            if isinstance(length, int) and length < self.staged[0]:
                self.staged = None  # an unfinished chunk (an interrupt): dropped, the ring as it was before it
            else:
                self._commit()
        super().set_length(length, bound, read)
        if not isinstance(length, int):  # (after a compiled cycle, whose writes ran no host code)
            self.written = max(self.written, bound)

    def enter_trace(self, length, bound: int) -> dict:
        if self.staged is not None:  # (committed inside, a trace would replay this chunk's writes)
            self._commit()
        return super().enter_trace(length, bound)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.staged is not None:
            self._commit()
        n = keys.shape[2]
        if n == 1 or not isinstance(self.offset, int):
            return super().update_and_fetch(keys, values)
        # a prompt chunk: mlx-lm's _update_concat
        P = self.offset
        old = self._temporal(P)
        if len(old):
            at = mx.array(self.slot(old))
            full_k = mx.concatenate([mx.take(self.keys, at, axis=2), keys], axis=2)
            full_v = mx.concatenate([mx.take(self.values, at, axis=2), values], axis=2)
        else:
            full_k, full_v = keys, values
        positions = P + np.arange(n)
        kept = np.nonzero((positions < self.keep) | (positions >= P + n - self.window))[0]
        self._grow(n, keys, values)
        rows = mx.array(kept)
        self.staged = (
            P + n,
            mx.array(self.slot(positions[kept])),
            mx.take(keys, rows, axis=2),
            mx.take(values, rows, axis=2),
        )
        self.offset, self.bound = P + n, P + n
        return full_k, full_v

    def _temporal(self, P: int) -> np.ndarray:
        """The positions mlx-lm's cache holds, in order, before a chunk at P."""
        M, k = self.max_size, self.keep
        if P <= M - 1:
            return np.arange(P)
        return np.concatenate([np.arange(k), np.arange(P - (M - 1 - k), P)])

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        if N > 1 and isinstance(self.offset, int):  # a prompt chunk: mlx-lm's mask over its concatenated array
            held = min(self.offset, self.max_size - 1)
            return positions_mask(N, held, held + N, self.max_size)
        return self.ring_mask(self.offset, N)

    def ring_mask(self, start, N: int) -> mx.array:
        """[N, slots]: rows at positions start..start+N-1 (just written) each
        see the kept positions and the last max_size - keep up to themselves."""
        k, W = self.keep, self.window
        end = start + N
        s = mx.arange(self.slots)
        held = mx.where(s < k, s, (end - 1) - ((end - 1 - s) % W))  # the latest position written to each slot
        filled = mx.where(s < k, s < end, held >= k)
        q = start + mx.arange(N)[:, None]
        return filled & (held <= q) & ((held < k) | (held > q - (self.max_size - k)))

    @property
    def state(self):
        return (self.keys, self.values) + (self.staged[2:] if self.staged is not None else ())

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _rotation(rope):
    """(dims, traditional, base, scale, freqs) of ``rope``'s per-position
    rotation, or None where it has no fixed one (dynamic NTK) or is unknown."""
    kind = type(rope)
    if kind is nn.RoPE:
        return rope.dims, rope.traditional, rope.base, rope.scale, None
    if kind is rope_utils.SuScaledRoPE:  # (its input scaling is not a rotation: kept keys already carry it)
        return rope.dim, False, None, 1.0, rope._freqs
    fixed = tuple(
        getattr(rope_utils, n) for n in ("Llama3RoPE", "YarnRoPE", "ProportionalRoPE") if hasattr(rope_utils, n)
    )
    if kind in fixed:  # (Yarn's mscale, like SuScaled's, was applied before the rotation)
        return rope.dims, rope.traditional, None, 1.0, rope._freqs
    return None


def can_shift(rope) -> bool:
    return _rotation(rope) is not None


def shift_rope(rope, x: mx.array, delta: int) -> mx.array:
    """Keys [B, H, T, d] roped at positions p turned into keys roped at
    p + delta (a rotation per frequency); ``rope`` must pass can_shift."""
    dims, traditional, base, scale, freqs = _rotation(rope)
    B, H, T, d = x.shape
    flat = x.reshape(B * H * T, 1, d)  # one row each: every key turned by the same delta
    out = mx.fast.rope(flat, dims, traditional=traditional, base=base, scale=scale, offset=delta, freqs=freqs)
    return out.reshape(B, H, T, d)


class DraftWindowCache(BufferKVCache):
    """The drafter's context, holding the last ``window`` to ``window + step``
    positions. Lengths set are the target's; ``base`` positions were dropped,
    so ``offset`` is length - base and kept keys are turned back by ``base``."""

    def __init__(self, window: int, rope):
        if not can_shift(rope):
            raise ValueError(
                f"max_kv_size cannot bound this drafter's context: its RoPE ({type(rope).__name__}) "
                "cannot move kept keys to new positions; run without max_kv_size."
            )
        super().__init__()
        self.window, self.rope = window, rope
        self.base = 0

    def set_length(self, length, bound: int | None = None, read: str = "bound") -> None:
        if isinstance(length, int):
            if length < self.base:
                raise ValueError("the drafter's context no longer holds this position; rebuild the prompt cache.")
            super().set_length(length - self.base, read=read)
        else:
            super().set_length(length - self.base, bound - self.base, read)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        if self.keys is not None and self.bound + n > self.window + self.step:
            # at a device-side length n is a small verify block: what is dropped is held
            drop = min(self.bound + n - self.window, self.bound)
            kept_k = shift_rope(self.rope, self.keys[..., drop : self.bound, :], -drop)
            pad = [(0, 0), (0, 0), (0, self.capacity - (self.bound - drop)), (0, 0)]
            keys = shift_rope(self.rope, keys, -drop)
            # one assignment: an interrupt leaves the cache as it was or compacted in full
            self.keys, self.values, self.base, self.offset, self.bound = (
                mx.pad(kept_k, pad),
                mx.pad(self.values[..., drop : self.bound, :], pad),
                self.base + drop,
                self.offset - drop,
                self.bound - drop,
            )
        return super().update_and_fetch(keys, values)
