"""A KV cache whose length may live on the device.

How many drafted positions a verify keeps is known only on the device, and
the next cycle is queued before the host reads it. So the length
(``offset``) may be an int32 scalar array; the buffer is grown by the host
ahead of writes from ``bound``, a host-side upper bound; the cache makes its
own mask hiding positions past the length; rollback just moves ``offset``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import device


def positions_mask(L: int, offset, total: int, window: int | None = None, causal: bool = True, limit=None) -> mx.array:
    """Boolean [L, total]: which buffer positions each query row at
    offset..offset+L-1 sees. Keys at or past ``limit`` (default offset + L)
    are unfilled; ``window`` hides keys that far away or more."""
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
    """``buffer`` [B, H, N, d] with ``new`` [B, H, n, d] stored at
    ``positions`` (a device array, not read on the host).

    A scatter, not a slice update at an array offset: the CUDA backend copies
    the whole buffer for a dynamic slice update; the scatter works in place."""
    at = mx.broadcast_to(positions.astype(mx.int32)[None, None, :, None], new.shape)
    return mx.put_along_axis(buffer, at, new, axis=2)


class SharedPositions:
    """``length + arange(n)`` (``at``) and ``length + n`` (``end``), made once
    for all caches given ``length`` together, so that layers do not each
    launch the same two kernels."""

    def __init__(self, length: mx.array, position: mx.array | None = None, base: int | None = None):
        self.length = length
        # RoPE's position of row ``length``: the length itself, or where rows
        # count from ``base`` (kv/window.py), the absolute length
        self.position = length if position is None else position
        self.base = base
        self.made: dict[int, mx.array] = {}
        self.ends: dict[int, mx.array] = {}
        self.based: dict = {}

    def from_base(self, window: int, base: int, shift: mx.array) -> SharedPositions:
        """The same length in rows of buffers holding positions from ``base``
        on (``shift``: the base on the device), made once for every layer of a
        sliding ``window`` at that base (a window's layers drop together)."""
        key = (window, base)
        if key not in self.based:
            self.based[key] = SharedPositions(self.length - shift, self.length, base)
        return self.based[key]

    def at(self, n: int) -> mx.array:
        if n not in self.made:
            self.made[n] = self.length + device.constant_arange(n)
        return self.made[n]

    def end(self, n: int) -> mx.array:
        """Every layer's length after writing ``n`` positions (a device scalar)."""
        if n not in self.ends:
            self.ends[n] = device.device_scalar(self.length, n)
        return self.ends[n]


class DeviceLengthCache:
    """Bookkeeping shared by caches with a device-side length.

    ``bound`` is a host-side upper bound on ``offset``, so growing never waits
    for the device. Subclasses provide ``capacity``, ``_grow``, ``write``,
    ``state`` and ``nbytes``."""

    step = 256
    shared: SharedPositions | None = None  # set by set_lengths
    tree = None  # a draft tree's TreeLayout (kv/tree.py) while a verify of one is built
    tree_rows = None  # (keys, values) a tree's verify wrote, until keep_path (kv/tree.py) takes them back
    # What a compiled cycle (decode/cycle.py) takes in, and how many arrays it hands back.
    traced = ("keys", "values")
    traced_returns = 2

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset: int | mx.array = 0
        self.bound = 0
        self.floor = 0  # the least capacity to grow to (see ``align``)

    @property
    def position(self) -> int | mx.array:
        """The absolute position of the next row written (RoPE's)."""
        return self.offset

    def row(self, position):
        """The buffer row holding an absolute ``position``."""
        return position

    def room(self, n: int) -> int:
        """The capacity needed to hold ``n`` positions."""
        return max(self.capacity, self.floor, self.rounded(n))

    def rounded(self, n: int) -> int:
        """``n`` positions rounded up to whole steps of the buffer's growth."""
        return -(-n // self.step) * self.step

    def width_after(self, n: int) -> int:
        """The buffer's length once ``n`` more positions are written."""
        return self.room(self.bound + n)

    # How attention spans the buffer in the next forward, set with the length:
    # "bound" up to the host bound; "fixed" the whole buffer (a compiled trace,
    # whose shapes must not follow the bound); "exact" a one-row step whose
    # bound is its exact length, which reads only filled keys and needs no mask
    # (so attention may take the fused one-row kernel; plain buffers only).
    read = "bound"
    takes_exact = False

    def read_width(self, n: int) -> int:
        """How much of the buffer attention (and ``make_mask``) spans after ``n`` more writes."""
        return self.width_after(n)

    def after(self, n: int) -> int | mx.array:
        """The length once ``n`` more positions are written."""
        shared = self.shared
        if shared is not None and self.offset is shared.length:
            return shared.end(n)
        return self.offset + n

    def positions(self, start: mx.array, n: int) -> mx.array:
        """The ``n`` positions from ``start`` (an array)."""
        shared = self.shared
        if shared is not None and start is shared.length:
            return shared.at(n)
        return start + device.constant_arange(n)

    def reserve(self, n: int) -> None:
        """Grow an existing buffer ahead of time to hold ``n`` positions."""
        if self.keys is not None:
            self._grow(n, self.keys, self.values)

    def enter_trace(self, length: mx.array, bound: int) -> dict:
        """Before a compiled cycle: the arrays a trace replaces with tracers."""
        return {name: getattr(self, name) for name in self.traced}

    def traced_inputs(self) -> list:
        return [getattr(self, name) for name in self.traced]

    def set_traced(self, given) -> None:
        """Inside a trace: the tracers of ``traced_inputs``, from the iterator ``given``."""
        for name in self.traced:
            setattr(self, name, next(given))

    def leave_trace(self, held: dict) -> None:
        for name, a in held.items():
            setattr(self, name, a)

    def traced_outputs(self) -> tuple:
        """At a compiled cycle's end (a trace changes no other traced array)."""
        return self.keys, self.values

    def take_outputs(self, outputs, start: mx.array) -> None:
        self.keys, self.values = outputs

    def set_length(self, length: int | mx.array, bound: int | None = None, read: str = "bound") -> None:
        """Keep the first ``length`` positions (rollback is this move). An
        array length comes with ``bound``, a host-side upper bound on it;
        ``read``: how the next forward spans the buffer (see above)."""
        self.read = "bound" if read == "exact" and not self.takes_exact else read
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
        """The mask for ``N`` positions about to be written, spanning the
        buffer as it will be then; None where the row sees every key read;
        "causal" (unless ``return_array``) where the rows read exactly the
        filled keys, as mlx-lm's own caches give it."""
        if self.tree is not None:
            return self.tree.mask(self.offset, self.read_width(N), window_size)
        width = self.read_width(N)
        # One row reading exactly the filled keys (its length exact, or on the
        # host): no mask, as mlx-lm's step; a mask takes another attention kernel.
        filled = self.read == "exact" or isinstance(self.offset, int)
        if N == 1 and filled and width == self.bound + 1 and (window_size is None or self.bound < window_size):
            return None
        # A prompt chunk at a host length reading only the filled keys: MLX's
        # own causal mask, which its fused attention takes without an array.
        if (
            N > 1
            and not return_array
            and isinstance(self.offset, int)
            and width == self.offset + N
            and (window_size is None or width <= window_size)
        ):
            return "causal"
        return positions_mask(N, self.offset, width, window_size)

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

    # Attention reads up to ``bound``, skipping the unfilled tail, except where
    # shapes must not change: a compiled trace, and a cycle on the CUDA
    # backend, which builds a graph for every key length it sees. A length
    # known on the host (a prompt chunk, an exact step) is read exactly on
    # every backend, as mlx-lm reads it.
    takes_exact = True

    def read_width(self, n: int) -> int:
        """Up to the bound, or the whole buffer at a fixed width."""
        if self.read == "fixed":
            return self.width_after(n)
        if isinstance(self.offset, int) or (self.read == "exact" and n == 1) or device.backend() != "cuda":
            return self.bound + n
        return self.width_after(n)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def window_start(self, n: int, window: int) -> int:
        """After a write of ``n`` rows, the first position any of them sees
        through a sliding ``window``, where the host knows their positions (a
        prompt chunk, an exact step; a verify at a device length: 0)."""
        if self.read == "fixed" or not (isinstance(self.offset, int) or self.read == "exact"):
            return 0
        return max(0, self.bound - n - window + 1)

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
        """Store keys/values at start..start+n-1 without moving ``offset``;
        returns the buffers as attention reads them."""
        n = keys.shape[2]
        self._grow(self.bound + n, keys, values)
        if isinstance(start, int):
            self.keys[..., start : start + n, :] = keys
            self.values[..., start : start + n, :] = values
        else:
            at = self.positions(start, n)
            self.keys = put_positions(self.keys, keys, at)
            self.values = put_positions(self.values, values, at)
        self.tree_rows = (keys, values) if self.tree is not None else None
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


def set_lengths(caches: list, length: int | mx.array, bound: int | None = None, read: str = "bound") -> None:
    shared = SharedPositions(length) if isinstance(length, mx.array) else None
    for c in caches:
        c.shared = shared  # (before: a sliding layer takes its rows' length from it)
        c.set_length(length, bound, read)


def align(caches: list) -> None:
    """Let layers of one kind (a sliding window's, or full attention) that
    grew or dropped unevenly (an interrupted write) regrow to one capacity
    and hold one span, so the mask made by the first of them fits them all."""
    kinds: dict = {}
    for c in caches:
        kinds.setdefault(getattr(c, "window", None), []).append(c)
    for kind in kinds.values():
        dropping = [c for c in kind if hasattr(c, "compact")]  # (kv/window.py's sliding layers)
        base = max((c.base for c in dropping), default=0)
        for c in dropping:
            c.compact(base)
        floor = max(c.capacity for c in kind)
        for c in kind:
            c.floor = floor
