"""A sliding-window layer's keys and values, bounded.

A row at position q of a layer with a sliding window W sees positions
q - W + 1 .. q. So the layer needs, for the rows still to come, only the
last W - 1 positions before them; mlx-lm holds exactly those in a ring.
Here the buffer holds the positions from ``base`` on, in time order (row i
is position base + i), and drops the oldest in one copy once ``margin``
positions beyond the window and its margin have gathered. Lengths handed in and
RoPE positions are absolute; ``offset`` and ``bound`` count from ``base``,
so masks, kernels, trees and rollback, which all work in buffer rows, work
unchanged. ``margin`` positions behind the window stay: a verify's rollback
and a prompt cache cut back land there.

A cache cut back below what it holds cannot serve (``earliest``). A reply's
start may be ``pin``-ned: the window before it is saved as the buffer
drops it, so that the next prompt of a conversation, which shares the
conversation up to that reply's start, can be read from there.
"""

from __future__ import annotations

import mlx.core as mx

from ..arguments import MAX_TREE_BUDGET
from .buffer import BufferKVCache


class WindowKVCache(BufferKVCache):
    """One sliding-window layer's keys and values (see the module docstring)."""

    # Positions kept behind the window: more than two queued verifies' rows
    # (their rollback; a tree's are at most MAX_TREE_BUDGET), and room for a
    # prompt cache's cut back near its end.
    margin = 256
    traced = ("keys", "values", "shift")

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.base = 0  # positions dropped: buffer row i holds position base + i
        self.shift = mx.array(0, mx.int32)  # base on the device (an input of compiled cycles)
        self.pin: int | None = None  # a reply's start, whose window is saved before it is dropped
        self.saved: tuple[int, mx.array, mx.array] | None = None  # (pin, keys, values) of the window before pin

    @property
    def position(self):
        """The absolute position of the next row written (RoPE's)."""
        shared = self.shared
        if shared is not None and self.offset is shared.length:
            return shared.position
        return self.offset + (self.shift if isinstance(self.offset, mx.array) else self.base)

    def row(self, position):
        shared = self.shared
        if shared is not None and position is shared.position and shared.base == self.base:
            return shared.length  # (made once for every layer of this window)
        return position - (self.shift if isinstance(position, mx.array) else self.base)

    @property
    def earliest(self) -> int:
        """The shortest length this cache can be cut back to."""
        return self.base + self.window - 1 if self.base else 0

    def set_length(self, length, bound: int | None = None, read: str = "bound") -> None:
        """Keep the first ``length`` positions (absolute, as every layer's)."""
        if isinstance(length, int) and length < self.earliest:
            raise LookupError(f"positions before {length} were dropped from a sliding-window layer")
        shared = self.shared
        if shared is not None and shared.base is None and length is shared.length:  # once for the window's layers
            self.shared = shared.from_base(self.window, self.base, self.shift)
            rows = self.shared.length
        else:
            rows = self.row(length)
        super().set_length(rows, None if bound is None else bound - self.base, read)

    def reserve(self, n: int) -> None:
        """Drop what is passed, then grow to hold ``n`` positions (absolute)."""
        self.drop_passed()
        super().reserve(n - self.base)

    def drop_passed(self) -> None:
        """Drop positions no row still to come can see, once ``margin`` of
        them have gathered; never inside a compiled trace (its shapes and
        ``shift`` are fixed there)."""
        if self.keys is None or self.read == "fixed":
            return
        end = self.base + self.bound  # host bound on the length
        keep_from = end - (self.window - 1) - self.margin
        if keep_from - self.base < self.margin:
            return
        if self.pin is not None and self.pin <= end:
            if self.pin - self.window + 1 < keep_from:
                self._save_pin()
        self.compact(keep_from)

    def _save_pin(self) -> None:
        """Save the window before ``pin`` (it is about to be dropped)."""
        pin, self.pin = self.pin, None
        first = max(pin - self.window + 1, 0)
        if first < self.base:  # (dropped already: a cut back to the pin reads afresh)
            return
        rows = slice(first - self.base, pin - self.base)
        self.saved = (pin, mx.contiguous(self.keys[..., rows, :]), mx.contiguous(self.values[..., rows, :]))

    def compact(self, keep_from: int) -> None:
        """Make ``keep_from`` (absolute, at most the bound) the first position held."""
        drop = keep_from - self.base
        if drop <= 0:
            return
        held = max(self.bound - drop, 0)
        room = self.steady_room(held)
        keys = padded(self.keys[..., drop : drop + held, :], room)
        values = padded(self.values[..., drop : drop + held, :], room)
        offset = self.offset - drop
        # one assignment: an interrupt leaves the cache as it was or compacted in full
        self.keys, self.values, self.offset, self.bound, self.base, self.shift, self.floor = (
            keys,
            values,
            offset,
            self.bound - drop,
            keep_from,
            mx.array(keep_from, mx.int32),
            0,
        )

    def steady_room(self, held: int) -> int:
        """The buffer's length once it holds ``held`` positions after a drop."""
        return max(self.steady_capacity, self.rounded(held))

    @property
    def steady_capacity(self) -> int:
        """The buffer's length between compactions: the window, its margin,
        the margin gathered before the next drop and a verify's rows beyond
        it (a prompt's longer chunk grows it until the next drop)."""
        return self.rounded(self.window + 2 * self.margin + MAX_TREE_BUDGET)

    def restore_pin(self) -> int | None:
        """Make the cache hold the saved window before ``pin`` and end there;
        return that length, or None if none is saved."""
        if self.saved is None:
            return None
        pin, keys, values = self.saved
        held = keys.shape[2]
        room = self.steady_room(held)
        self.keys, self.values = padded(keys, room), padded(values, room)
        self.base, self.shift, self.floor, self.saved = pin - held, mx.array(pin - held, mx.int32), 0, None
        self.set_length(pin)
        return pin

    def hold(self, keys: mx.array, values: mx.array, base: int) -> None:
        """Hold ``keys``/``values`` [B, H, n, d] as positions base..base+n-1 (a file's)."""
        room = self.rounded(keys.shape[2])
        self.keys, self.values = padded(keys, room), padded(values, room)
        self.base, self.shift, self.pin, self.saved = base, mx.array(base, mx.int32), None, None
        self.set_length(base + keys.shape[2])

    @property
    def state(self):
        return (self.keys, self.values, self.shift) + (self.saved[1:] if self.saved is not None else ())

    @property
    def nbytes(self) -> int:
        held = 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
        return held + (0 if self.saved is None else self.saved[1].nbytes + self.saved[2].nbytes)


def padded(rows: mx.array, room: int) -> mx.array:
    """``rows`` [B, H, n, d] followed by zeros up to ``room`` positions."""
    return mx.pad(rows, [(0, 0), (0, 0), (0, room - rows.shape[2]), (0, 0)])


def is_buffer(cache) -> bool:
    """Whether ``cache`` is a plain buffer read in place from row 0 (kernels,
    trees, exact steps): a BufferKVCache or a sliding layer's WindowKVCache."""
    return type(cache) in (BufferKVCache, WindowKVCache)


def drop_passed(caches: list) -> None:
    """Let every sliding-window layer drop what no row to come can see
    (before a forward, whose masks are made from the layers' buffers)."""
    for c in caches:
        if isinstance(c, WindowKVCache):
            c.drop_passed()


def pin(caches: list, position: int) -> None:
    """Keep the window before ``position`` (a reply's start) in every sliding layer."""
    for c in caches:
        if isinstance(c, WindowKVCache):
            c.pin, c.saved = position, None


def earliest(caches: list) -> int:
    """The shortest length every layer of ``caches`` can be cut back to."""
    return max((c.earliest for c in caches if isinstance(c, WindowKVCache)), default=0)


def saved_pin(caches: list) -> int | None:
    """The reply start every sliding layer of ``caches`` saved its window
    before, or None where one has none (or they differ: an interrupt)."""
    windows = [c for c in caches if isinstance(c, WindowKVCache)]
    pins = {None if c.saved is None else c.saved[0] for c in windows}
    return pins.pop() if len(pins) == 1 else None


def restore_pins(caches: list) -> None:
    """Bring every sliding layer back to its saved reply start (saved_pin)."""
    for c in caches:
        if isinstance(c, WindowKVCache):
            c.restore_pin()
