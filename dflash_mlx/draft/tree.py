"""Draft trees: many continuations verified in one target pass (DDTree).

The drafter fills a block in one pass and gives a distribution per position;
where its first choice at a depth is wrong the second is often right. A tree
keeps the ``budget - 1`` most probable prefixes over each depth's ``top_k``
candidates (a prefix's score: the sum of its tokens' log-probabilities), which
is best-first by path probability. Every score is at most its parent's, so
the most probable prefixes always include their parents: the kept set is a
tree. It is built on the device, level by level: the best ``budget - 1``
prefixes of each depth extend only the best of the depth before, three
kernels a depth (the candidates' table, its order, the kept slots).

A looked-up continuation (draft/lookup.py) ranks above every drafted prefix.
The drafter's first choices get no such place: kept by their probability
alone, a tree accepts more on the whole than one that keeps the block they
make (benchmarks/tree_oracle.py), though not at every cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..device import constant_arange
from ..kv.tree import TreeLayout, from_parents

# Ranks above every drafted prefix's score (those are <= 0): the root, then the looked-up chain.
ROOT, LOOKED_UP = 3.0, 2.0
# A prefix's rank falls this much a level, so that a child never ties its
# parent (a drafted token of probability 1 adds 0).
DEPTH_PENALTY = 1e-3


@dataclass(frozen=True)
class TreeParams:
    """Draft trees over ``top_k`` candidates per depth, drafted from blocks of
    ``block_size`` (the deepest node is block_size - 1 deep)."""

    block_size: int
    top_k: int = 8

    def __post_init__(self):
        if self.block_size < 2 or self.top_k < 1:
            raise ValueError(
                f"a tree needs a block of at least 2 and top_k of at least 1, got {self.block_size} and {self.top_k}."
            )

    def rows(self, budget: int) -> int:
        """The rows a tree of ``budget`` verifies, the root included: the
        budget, or fewer where the block's depths hold fewer prefixes."""
        width, held, reach = budget - 1, 0, 1
        for _ in range(self.block_size - 1):
            reach = min(reach * self.top_k, width)
            held += reach
        return 1 + min(width, held)


def build_tree(
    logits: mx.array, rows: int, top_k: int, looked_up: mx.array | None = None, hit=None, root=0
) -> tuple[mx.array, TreeLayout]:
    """The tree of ``rows`` nodes over the drafter's logits [D, V] for depths
    1..D, and a looked-up chain ``looked_up`` [D] where ``hit`` (a device bool).
    Returns (tokens [rows], TreeLayout): node 0 is the root, its token
    ``root``; parents before children."""
    depth_count, vocab = logits.shape
    width = rows - 1
    k = min(top_k, vocab)
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    # A slot's candidates (``columns``): its drafted children, after the
    # looked-up one where there is a chain; ``ids[:, offset:]`` their tokens.
    ids = mx.argpartition(logits, vocab - k, axis=-1)  # [D, V]: each depth's k best last, in no order
    offset, columns = vocab - k, k
    if looked_up is not None:
        if k == vocab:
            ids = mx.concatenate([ids[:, :1], ids], axis=1)
        drafted = ids[:, -(k + 1) :]
        ids = mx.where(constant_arange(k + 1) == 0, looked_up[:, None].astype(drafted.dtype), drafted)
        offset, columns = 0, k + 1
    values = mx.take_along_axis(logits, ids[:, offset:], axis=-1) - lse  # [D, columns]: log-probabilities
    const = _constants(width, columns, depth_count)

    # Slots are kept in rank order, so a looked-up chain, where found, holds
    # slot 0 (as the root does at depth 0). Each depth's candidates cost
    # their negated rank plus DEPTH_PENALTY a level (argsort's order, and
    # across depths a child never ties its parent); the chain's is fixed.
    step = values[:, None, :]  # [D, 1, columns]: what each candidate adds to its slot's path
    special = None
    if looked_up is not None:
        looking = (const.slot == 0) & (const.column == 0) & hit  # [1, width, columns]
        special = mx.where(looking, const.looked_cost, mx.inf)
        step = mx.where((const.column == 0) & ~looking, -mx.inf, step)  # no looked-up child off its chain
    lowered = const.penalty - step  # a candidate's cost but its slot's score

    # Each depth keeps ``width`` slots, a table [3, width]: cost, the path's
    # log-probability, and the candidate it holds (parent slot * columns + column).
    kept, history = const.kept, const.history
    for d in range(depth_count):
        at = slice(d, d + 1)  # (an int index is a gather)
        score = kept[1:2].T
        cost = lowered[at] - score if special is None else mx.minimum(lowered[at] - score, special[at])
        table = mx.where(const.is_cost, cost, mx.where(const.is_score, score + step[at], const.candidate))
        table = table.reshape(3, -1)
        order = mx.argsort(table[:1])[:, :width].reshape(-1)
        kept = mx.take(table, order, axis=1)
        history = mx.where(const.level[at], kept[::2, None], history)

    # the ``width`` cheapest prefixes of all depths after the root, in depth order (parents first)
    history = history.reshape(2, -1)
    chosen = mx.sort(mx.argpartition(history[:1], width)[:, :rows]).reshape(-1)
    picked = mx.take(history[1:], chosen, axis=1).reshape(-1)  # its candidate, as a float
    depths = (chosen // width).astype(mx.int32)
    parent_at = (depths - 1) * width + (picked // columns).astype(mx.int32)  # in ``history`` (the root's: < 0)
    parents = (chosen[None] < parent_at[:, None]).astype(mx.int32).sum(axis=1)
    at = mx.maximum(depths - 1, 0) * ids.shape[1] + offset + (picked % columns).astype(mx.int32)
    tokens = mx.where(depths == 0, root, mx.take(ids.reshape(-1), at)).astype(mx.int32)
    return tokens, from_parents(parents, depth_count, depths)


@dataclass(frozen=True)
class _Constants:
    """What a tree's build reads that depends on its size alone."""

    slot: mx.array  # [1, width, 1]
    column: mx.array  # [1, 1, columns]
    penalty: mx.array  # [D, 1, 1]: DEPTH_PENALTY a level
    looked_cost: mx.array  # [D, 1, 1]: the looked-up chain's costs
    candidate: mx.array  # [width, columns] float32: each candidate's index
    is_cost: mx.array  # [3, 1, 1]: a table's rows
    is_score: mx.array
    level: mx.array  # [D, D + 1, 1]: each depth's rows in ``history``
    kept: mx.array  # [3, width]: the depth before the first, the root in slot 0
    history: mx.array  # [2, D + 1, width]: costs and candidates, the root's alone


_constants_made: dict[tuple[int, int, int], _Constants] = {}


def _constants(width: int, columns: int, depth_count: int) -> _Constants:
    """The size's constants, evaluated once (a compiled build captures them)."""
    key = (width, columns, depth_count)
    if key not in _constants_made:
        depth = mx.arange(depth_count)[:, None, None]
        row = mx.arange(3)[:, None, None]
        root = mx.arange(width) == 0
        penalty = DEPTH_PENALTY * (depth + 1).astype(mx.float32)
        cost = mx.where(root, -ROOT, mx.inf)
        made = _Constants(
            slot=mx.arange(width)[None, :, None],
            column=mx.arange(columns)[None, None],
            penalty=penalty,
            looked_cost=penalty - LOOKED_UP,
            candidate=mx.arange(width * columns, dtype=mx.float32).reshape(width, columns),
            is_cost=row == 0,
            is_score=row == 1,
            level=mx.arange(depth_count + 1)[None, :, None] == depth + 1,
            kept=mx.stack([cost, mx.where(root, 0.0, -mx.inf), mx.zeros((width,))]).astype(mx.float32),
            history=mx.stack([mx.broadcast_to(cost, (depth_count + 1, width)), mx.zeros((depth_count + 1, width))]),
        )
        mx.eval(*vars(made).values())
        _constants_made[key] = made
    return _constants_made[key]


def accepted_path(tokens: mx.array, layout: TreeLayout, target: mx.array, depth_count: int):
    """Walk the tree along the target: a node is kept when every node from
    the root to it holds the target's token at its parent (``target`` [N]:
    the target's token after each node). Returns (accepted depth a, path
    [depth_count + 1], uint32: the kept nodes by depth, root first; entries
    past a are the root)."""
    nodes = tokens.shape[0]
    agrees = (tokens == target[layout.parents]) | (constant_arange(nodes) == 0)
    kept = ~mx.any(layout.ancestors & ~agrees[None], axis=1)
    deepest = mx.argmax(mx.where(kept, layout.depths, -1))
    accepted = layout.depths[deepest]
    on_path = layout.ancestors[deepest][None] & (layout.depths[None] == constant_arange(depth_count + 1)[:, None])
    return accepted, mx.argmax(on_path, axis=1)
