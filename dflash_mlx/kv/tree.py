"""A draft tree laid out for one verify pass over the caches.

The verify writes the tree's N nodes at the committed length ``start``, in
node order (a parent before its children, node 0 the root: the last
committed token). Each node is rotated at ``start + depth`` and attends to
the context and to its own ancestors only. After acceptance the accepted
path's rows move to ``start .. start + a`` (``keep_path``), so that the next
cycle's rollback is again a move of a length.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .. import device
from .buffer import put_positions


@dataclass(frozen=True)
class TreeLayout:
    parents: mx.array  # [N] int32; the root is its own parent
    depths: mx.array  # [N] int32; the root's is 0
    ancestors: mx.array  # [N, N] bool: [i, j] when node j is node i or one of its ancestors

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    def positions(self, start) -> mx.array:
        """Each node's position (RoPE's and a window's): ``start`` plus its depth."""
        return start + self.depths

    def mask(self, start, width: int, window: int | None = None) -> mx.array:
        """Boolean [N, width]: which of ``width`` buffer positions each node
        sees: the ``start`` committed ones, and its ancestors written at
        ``start + j``."""
        n = self.size
        k = device.constant_arange(width)[None]
        node = k - start
        in_tree = (node >= 0) & (node < n)
        column = mx.broadcast_to(mx.clip(node, 0, n - 1), (n, width))
        visible = (k < start) | (in_tree & mx.take_along_axis(self.ancestors, column, axis=1))
        if window is not None:
            visible = visible & (
                self.positions(start)[:, None] - mx.where(in_tree, start + self.depths[column], k) < window
            )
        return visible


def chain(n: int) -> TreeLayout:
    """A block of ``n`` as a tree: node i's parent is node i - 1."""
    nodes = mx.arange(n, dtype=mx.int32)
    return TreeLayout(mx.maximum(nodes - 1, 0), nodes, nodes[None] <= nodes[:, None])


def from_parents(parents: mx.array, max_depth: int, depths: mx.array | None = None) -> TreeLayout:
    """A layout from each node's parent [N] (parents before children, the
    root its own parent), for trees at most ``max_depth`` deep (``depths``
    [N], where known): who reaches whom in one hop, squared until every
    ancestor is in reach."""
    n = parents.shape[0]
    nodes = device.constant_arange(n)
    reach = ((parents[:, None] == nodes[None]) | (nodes[:, None] == nodes[None])).astype(mx.float32)
    hops = 1
    while hops < max_depth:
        # Counts of walks of 2 * hops steps (each step stays or goes up: at
        # most 2 ** 32 before the clamp below) stay far inside float32; a
        # zero stays exact, and only whether one is zero is read.
        reach = reach @ reach
        hops *= 2
        if hops >= 32:
            reach = mx.minimum(reach, 1.0)
    ancestors = reach > 0
    if depths is None:
        depths = ancestors.astype(mx.int32).sum(axis=1) - 1
    return TreeLayout(parents.astype(mx.int32), depths.astype(mx.int32), ancestors)


def keep_path(caches: list, start, path: mx.array) -> None:
    """Move the rows the accepted path's nodes ``path`` [D] (the root first;
    past the accepted depth, the root) wrote at ``start + path`` to ``start ..
    start + D - 1`` in every plain buffer: rows past the accepted depth lie
    past the new length, whatever they hold.

    A buffer that kept the rows a tree's verify wrote (``tree_rows``) takes
    them back in one scatter: each path node's row at its depth, every other
    node's just past the path. Others gather the path's rows, then scatter them."""
    caches = [c for c in caches if c.keys is not None]
    n = path.shape[0]
    made: dict = {}  # each index array once per row of ``start`` (the full layers share one)

    def once(what, row, make, *args):
        key = (what, id(row))
        if key not in made:
            made[key] = row, make(row, *args)  # (the row kept alive: its id stays its own)
        return made[key][1]

    for c in caches:
        row = c.row(start)  # (a sliding layer's buffer starts past dropped positions)
        written = getattr(c, "tree_rows", None)
        if written is None:
            at = once("at", row, mx.add, path)
            to = once("to", row, mx.add, device.constant_arange(n))
            keys, values = mx.take(c.keys, at, axis=2), mx.take(c.values, at, axis=2)
            c.keys, c.values = put_positions(c.keys, keys, to), put_positions(c.values, values, to)
            continue
        keys, values = written
        nodes = keys.shape[2]
        to = once(nodes, row, _destinations, path, nodes)
        c.keys, c.values = put_positions(c.keys, keys, to), put_positions(c.values, values, to)
        c.tree_rows = None


def _destinations(start, path: mx.array, nodes: int) -> mx.array:
    """Where each of a tree's ``nodes`` goes once ``path`` is kept: a path
    node to ``start`` plus its depth, any other just past the accepted depth."""
    match = path[:, None] == device.constant_arange(nodes)[None]  # [D, N]: node n is the path's at depth d
    accepted = (path != 0).astype(mx.int32).sum()  # past it the path holds the root
    return start + mx.where(match.any(axis=0), mx.argmax(match, axis=0).astype(mx.int32), accepted + 1)
