"""Draft trees: many continuations verified in one target pass (DDTree).

The drafter fills a block in one pass and gives a distribution per position;
where its first choice at a depth is wrong the second is often right. A tree
keeps the ``budget - 1`` most probable prefixes over each depth's ``top_k``
candidates (a prefix's score: the sum of its tokens' log-probabilities), which
is best-first by path probability. Every score is at most its parent's, so
the most probable prefixes always include their parents: the kept set is a
tree. It is built on the device, level by level: the best ``budget - 1``
prefixes of each depth extend only the best of the depth before.

Two branches rank above every drafted prefix: a looked-up continuation
(draft/lookup.py) first, then the drafter's first choice at every depth (the
block a chain verifies). So a tree of a block's rows verifies that block, and
a larger one accepts at least what the block would.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kv.tree import TreeLayout, from_parents

# Ranks above every drafted prefix's score (those are <= 0): the looked-up
# chain, then the drafter's first choices (the block a chain would verify).
LOOKED_UP, FIRST_CHOICES = 2.0, 1.0
# A prefix's rank falls this much a level, so that a child never ties its
# parent (a drafted token of probability 1 adds 0).
DEPTH_PENALTY = 1e-3


@dataclass(frozen=True)
class TreeParams:
    """Draft trees over ``top_k`` candidates per depth, drafted from blocks of
    ``block_size`` (the deepest node is block_size - 1 deep)."""

    block_size: int
    top_k: int = 4

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


def build_tree(logits: mx.array, rows: int, top_k: int, looked_up: mx.array | None = None, hit=None):
    """The tree of ``rows`` nodes over the drafter's logits [D, V] for depths
    1..D, and a looked-up chain ``looked_up`` [D] where ``hit`` (a device bool).
    Returns (tokens [rows], TreeLayout): node 0 is the root (its token 0, the
    caller's to fill), parents before children."""
    depth_count, vocab = logits.shape
    width = rows - 1
    k = min(top_k, vocab)
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)  # best first: rank 0 is the first choice
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    values = mx.take_along_axis(values, order, axis=-1)  # [D, k]
    ranks = mx.tile(mx.arange(k, dtype=mx.int32), width)

    # per slot of a depth: its rank, its path's log-probability, parent slot, token, kind
    levels = []
    rank, score = mx.array([FIRST_CHOICES]), mx.zeros((1,), mx.float32)
    first, looked = mx.array([True]), mx.array([looked_up is not None])
    for d in range(depth_count):
        n = score.shape[0]
        cand_score = (score[:, None] + values[d][None]).reshape(-1)
        parent = mx.repeat(mx.arange(n, dtype=mx.int32), k)
        token = mx.broadcast_to(ids[d][None], (n, k)).reshape(-1)
        cand_first = mx.repeat(first, k) & (ranks[: n * k] == 0)
        cand_rank = mx.where(cand_first, FIRST_CHOICES, cand_score)
        cand_looked = mx.zeros(cand_rank.shape, mx.bool_)
        if looked_up is not None:
            on_chain = mx.argmax(looked).astype(mx.int32)  # the previous depth's looked-up slot
            on = hit & looked[on_chain]
            token_d = looked_up[d : d + 1].astype(mx.int32)
            cand_score = mx.concatenate([score[on_chain][None] + logprobs[d][token_d], cand_score])
            cand_rank = mx.concatenate([mx.where(on, LOOKED_UP, -mx.inf)[None].astype(mx.float32), cand_rank])
            parent = mx.concatenate([on_chain[None], parent])
            token = mx.concatenate([token_d, token])
            cand_first = mx.concatenate([mx.array([False]), cand_first])
            cand_looked = mx.concatenate([mx.array([True]), cand_looked])
        # the depth's best ``width`` (fewer where there are fewer), padded to a fixed width
        keep = mx.argsort(-cand_rank)[:width].astype(mx.int32)
        pad = width - keep.shape[0]
        rank, score, parent, token, first, looked = (
            _padded(a[keep], pad, fill)
            for a, fill in (
                (cand_rank, -mx.inf),
                (cand_score, -mx.inf),
                (parent, 0),
                (token, 0),
                (cand_first, False),
                (cand_looked, False),
            )
        )
        levels.append((rank, parent, token))

    # the best ``width`` prefixes of all depths, in depth order (parents first)
    ranked = mx.concatenate([r - DEPTH_PENALTY * (d + 1) for d, (r, _, _) in enumerate(levels)])
    chosen = mx.sort(mx.argsort(-ranked)[:width]).astype(mx.int32)
    node_of = mx.zeros((depth_count * width,), mx.int32).at[chosen].add(mx.arange(1, rows, dtype=mx.int32))
    level = chosen // width
    parent_flat = (level - 1) * width + mx.concatenate([p for _, p, _ in levels])[chosen]
    parent_node = mx.where(level == 0, 0, node_of[mx.maximum(parent_flat, 0)])
    node_parents = mx.concatenate([mx.zeros((1,), mx.int32), parent_node.astype(mx.int32)])
    node_tokens = mx.concatenate([mx.zeros((1,), mx.int32), mx.concatenate([t for _, _, t in levels])[chosen]])
    return node_tokens, from_parents(node_parents, depth_count)


def _padded(a: mx.array, pad: int, fill) -> mx.array:
    return a if pad == 0 else mx.concatenate([a, mx.full((pad,), fill, a.dtype)])


def accepted_path(tokens: mx.array, layout: TreeLayout, target: mx.array, depth_count: int):
    """Walk the tree along the target: a node is kept when every node from
    the root to it holds the target's token at its parent (``target`` [N]:
    the target's token after each node). Returns (accepted depth a, path
    [depth_count + 1]: the kept nodes by depth, root first; entries past a
    are the root)."""
    nodes = tokens.shape[0]
    agrees = (tokens == target[layout.parents]) | (mx.arange(nodes) == 0)
    kept = ~mx.any(layout.ancestors & ~agrees[None], axis=1)
    deepest = mx.argmax(mx.where(kept, layout.depths, -1))
    accepted = layout.depths[deepest]
    on_path = layout.ancestors[deepest][None] & (layout.depths[None] == mx.arange(depth_count + 1)[:, None])
    return accepted, mx.argmax(on_path, axis=1).astype(mx.int32)
