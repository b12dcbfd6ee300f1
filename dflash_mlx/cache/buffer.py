"""A KV cache whose length may live on the device.

mlx-lm's KVCache keeps its length (``offset``) as a Python int and hands
attention exactly the filled part of its buffer. A pipelined speculative
loop cannot: how many drafted positions a verify keeps is known only on the
device, and the next cycle must be queued before the host reads it. This
cache therefore

- keeps a buffer of fixed capacity (grown by the host, ``reserve``, in steps
  of ``step`` positions, ahead of any write);
- writes new keys/values at ``offset``, a Python int or an int32 scalar
  array, without reading it on the host;
- hands attention its buffer up to ``bound`` (a host-side upper bound on
  the length) and makes its own mask (mlx-lm's ``make_mask`` protocol):
  positions at or past the valid length are hidden. Inside a compiled cycle,
  whose shapes must not change from one cycle to the next, and on MLX's
  CUDA backend (below), it hands the whole buffer instead;
- rolls back by moving ``offset``: positions past it are garbage that the
  next write overwrites.

Fixed shapes have a second benefit on MLX's CUDA backend, where attention
with several query rows rebuilds a backend graph for every key length it has
not seen (~30 ms each on an H200, see the project's reference notes).
"""

from __future__ import annotations

import mlx.core as mx

from .. import device


def positions_mask(L: int, offset, total: int, window: int | None = None, causal: bool = True, limit=None) -> mx.array:
    """Boolean [L, total]: which of ``total`` buffer positions each of ``L``
    query rows at positions offset..offset+L-1 sees. Keys at or past ``limit``
    (default offset + L) are unfilled; ``causal`` hides keys after the query;
    ``window`` hides keys ``window`` or more positions away (before the query,
    and after it too when not causal). ``offset`` and ``limit`` may be arrays."""
    q = device.constant_arange(L)[:, None] + offset
    k = device.constant_arange(total)[None]
    visible = k < (offset + L if limit is None else limit)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


def put_positions(buffer: mx.array, new: mx.array, positions: mx.array) -> mx.array:
    """``buffer`` [B, H, N, d] with ``new`` [B, H, n, d] stored at the ``n``
    buffer positions ``positions`` (a device array, not read on the host).

    A scatter (``put_along_axis``), not ``mx.slice_update`` at an array
    offset: MLX 0.32's CUDA backend copies the whole buffer for every
    dynamic slice update, which at a 16k context was ~5 ms of a verify's
    ~35 (72 writes of 34 MB each, benchmarks/long_context.py), while the
    scatter updates the buffer in place whenever MLX may reuse it."""
    at = mx.broadcast_to(positions.astype(mx.int32)[None, None, :, None], new.shape)
    return mx.put_along_axis(buffer, at, new, axis=2)


class SharedPositions:
    """``length + arange(n)`` (``at``) and ``length + n`` (``end``), made once
    for every cache given ``length`` together (``set_lengths``). A forward's
    layers all write at the same positions and end at the same length; each
    making its own positions cost two kernels (an arange and an add) per
    layer, 88 of the 1,023 a Qwen3-8B cycle launched on a GPU (BENCHMARKS.md,
    session 10), where launching is what a cycle's host time is spent on."""

    def __init__(self, length: mx.array):
        self.length = length
        self.made: dict[int, mx.array] = {}
        self.ends: dict[int, mx.array] = {}

    def at(self, n: int) -> mx.array:
        if n not in self.made:
            self.made[n] = self.length + device.constant_arange(n)
        return self.made[n]

    def end(self, n: int) -> mx.array:
        """``length + n``: every layer's length once it has written ``n``
        positions, which attention kernels read (a device scalar, see
        device.device_scalar)."""
        if n not in self.ends:
            self.ends[n] = device.device_scalar(self.length, n)
        return self.ends[n]


class DeviceLengthCache:
    """What every cache with a device-side length shares: the bookkeeping.

    ``offset`` is the valid length (an int, or an int32 scalar array that the
    host does not read); ``bound`` is a host-side upper bound on it, from
    which the buffer is grown before every write, so growing never waits for
    the device. Subclasses hold the storage: ``capacity``, ``_grow``,
    ``write``, ``state`` and ``nbytes``."""

    step = 256
    shared: SharedPositions | None = None  # set by set_lengths

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset: int | mx.array = 0
        self.bound = 0
        self.floor = 0  # the least capacity to grow to (see ``align``)

    def room(self, n: int) -> int:
        """The capacity needed to hold ``n`` positions."""
        return max(self.capacity, self.floor, -(-n // self.step) * self.step)

    def width_after(self, n: int) -> int:
        """The buffer's length once ``n`` more positions are written."""
        return self.room(self.bound + n)

    # Set while a one-row step is built whose host bound is its length (a
    # plain step after plain steps, cycle.py): it reads exactly the filled
    # keys and needs no mask, so attention takes the fused one-row kernel
    # (on MLX's CUDA backend a mask costs that kernel's fallback: 36 one-row
    # calls 0.56 -> 2.3 ms, BENCHMARKS.md). Plain buffers only (BufferKVCache).
    exact_bound = False

    def read_width(self, n: int) -> int:
        """How much of the buffer attention reads once ``n`` more positions
        are written (and the width of ``make_mask``): all of it."""
        return self.width_after(n)

    def after(self, n: int) -> int | mx.array:
        """The length once ``n`` more positions are written: shared with the
        caches whose length was set with this one."""
        shared = self.shared
        if shared is not None and self.offset is shared.length:
            return shared.end(n)
        return self.offset + n

    def positions(self, start: mx.array, n: int) -> mx.array:
        """The ``n`` positions from ``start`` (an array), shared with the
        caches whose length was set with this one where ``start`` is it."""
        shared = self.shared
        if shared is not None and start is shared.length:
            return shared.at(n)
        return start + device.constant_arange(n)

    def reserve(self, n: int) -> None:
        """Grow a buffer already made to hold ``n`` positions (the layer's
        next write would grow it anyway; this grows it ahead)."""
        if self.keys is not None:
            self._grow(n, self.keys, self.values)

    def set_length(self, length: int | mx.array, bound: int | None = None) -> None:
        """Keep the first ``length`` positions (rollback is this move). An
        array length comes with ``bound``, a host-side upper bound on it."""
        self.offset = length
        self.bound = length if isinstance(length, int) else bound

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """mlx-lm's cache protocol: append at ``offset`` and return the buffers."""
        out = self.write(keys, values, self.offset)
        n = keys.shape[2]
        self.offset = self.after(n)
        self.bound += n
        return out

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        """The mask for ``N`` positions about to be stored by
        ``update_and_fetch`` (mlx-lm asks before the layers run): it spans
        the buffer as it will be after that write; None where the row sees
        every key read (an exact one-row step within its window)."""
        if (
            N == 1
            and self.exact_bound
            and self.read_width(1) == self.bound + 1
            and (window_size is None or self.bound < window_size)
        ):
            return None
        return positions_mask(N, self.offset, self.read_width(N), window_size)

    # mlx-lm's trimming protocol
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.offset = self.offset - n
        if isinstance(self.offset, int):
            self.bound = self.offset
        return n


class BufferKVCache(DeviceLengthCache):
    """Keys and values in a fixed-capacity buffer with a device-side length."""

    # Attention reads the buffer up to ``bound``, not its whole capacity: on
    # a CPU at short contexts the unfilled tail costs as much as the filled
    # part (a plain step of the built-in pair, 11.3 -> 10.6 ms, BENCHMARKS.md).
    # Fixed widths where shapes must not change: a compiled trace sets
    # ``fixed_width`` on the caches while it traces (cycle.py), and MLX's CUDA
    # backend builds a graph for every key length (the module docstring).
    fixed_width = False

    def read_width(self, n: int) -> int:
        """Up to the bound, or the whole buffer at a fixed width."""
        if self.fixed_width or (device.backend() == "cuda" and not (self.exact_bound and n == 1)):
            return self.width_after(n)
        return self.bound + n

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, n: int, keys: mx.array, values: mx.array) -> None:
        cap = self.room(n)
        if cap == self.capacity:
            return
        B, H, _, kd = keys.shape
        vd = values.shape[3]
        if self.keys is None:
            self.keys = mx.zeros((B, H, cap, kd), keys.dtype)
            self.values = mx.zeros((B, H, cap, vd), values.dtype)
            return
        pad = cap - self.capacity
        self.keys = mx.concatenate([self.keys, mx.zeros((B, H, pad, kd), self.keys.dtype)], axis=2)
        self.values = mx.concatenate([self.values, mx.zeros((B, H, pad, vd), self.values.dtype)], axis=2)

    def write(self, keys: mx.array, values: mx.array, start) -> tuple[mx.array, mx.array]:
        """Store keys/values [B, H, n, d] at positions start..start+n-1, where
        start is ``offset`` (an int or an array), without moving it; returns
        the buffers as attention reads them (``read_width``)."""
        n = keys.shape[2]
        self._grow(self.bound + n, keys, values)
        if isinstance(start, int):
            self.keys[..., start : start + n, :] = keys
            self.values[..., start : start + n, :] = values
        else:
            at = self.positions(start, n)
            self.keys = put_positions(self.keys, keys, at)
            self.values = put_positions(self.values, values, at)
        width = self.read_width(n)
        if width == self.capacity:
            return self.keys, self.values
        return self.keys[..., :width, :], self.values[..., :width, :]

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def set_lengths(caches: list, length: int | mx.array, bound: int | None = None) -> None:
    shared = SharedPositions(length) if isinstance(length, mx.array) else None
    for c in caches:
        c.set_length(length, bound)
        c.shared = shared


def align(caches: list) -> None:
    """Let layers that grew unevenly (a write interrupted between two layers)
    grow to the same capacity on their next write, so that one mask, made by
    the first layer's cache, fits every layer."""
    floor = max((c.capacity for c in caches), default=0)
    for c in caches:
        c.floor = floor
