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

    # Each depth keeps ``width`` slots (the root's depth: the root and padding),
    # each its path's log-probability and whether it is a first choice; the
    # looked-up candidate, where there is one, is a depth's candidate 0.
    extra = 1 if looked_up is not None else 0
    slot = mx.arange(width, dtype=mx.int32)
    score = mx.where(slot == 0, 0.0, -mx.inf).astype(mx.float32)
    first, looked = slot == 0, slot == 0
    first_rank = mx.arange(k) == 0
    kept, ranks, chains = [], [], []
    for d in range(depth_count):
        cand_score = (score[:, None] + values[d : d + 1]).reshape(-1)
        cand_first = (first[:, None] & first_rank[None]).reshape(-1)
        cand_rank = mx.where(cand_first, FIRST_CHOICES, cand_score)
        if extra:
            on_chain = mx.argmax(looked)  # the previous depth's looked-up slot
            on = hit & looked[on_chain]
            gain = logprobs[d][looked_up[d]]
            chain_score = mx.where(on, score[on_chain] + gain, -mx.inf).astype(mx.float32)  # -inf: no children
            cand_score = mx.concatenate([chain_score[None], cand_score])
            cand_rank = mx.concatenate([mx.where(on, LOOKED_UP, -mx.inf).astype(mx.float32)[None], cand_rank])
            cand_first = mx.concatenate([mx.array([False]), cand_first])
            chains.append(on_chain)
        keep = mx.argpartition(-cand_rank, width - 1)[:width].astype(mx.int32)
        score, first = cand_score[keep], cand_first[keep]
        if extra:
            looked = keep == 0
        kept.append(keep)
        ranks.append(cand_rank[keep])

    # each slot's parent slot and token, for every depth at once
    kept = mx.stack(kept)  # [D, width]
    drafted = kept - extra  # the index among the drafted candidates (-1: looked up)
    parents = mx.maximum(drafted, 0) // k
    tokens = mx.take_along_axis(ids, mx.maximum(drafted, 0) % k, axis=1)
    if extra:
        parents = mx.where(drafted < 0, mx.stack(chains)[:, None].astype(mx.int32), parents)
        tokens = mx.where(drafted < 0, looked_up[:, None].astype(mx.int32), tokens)

    # the best ``width`` prefixes of all depths, in depth order (parents first)
    depth_rank = mx.stack(ranks) - DEPTH_PENALTY * mx.arange(1, depth_count + 1)[:, None]
    chosen = mx.sort(mx.argpartition(-depth_rank.reshape(-1), width - 1)[:width]).astype(mx.int32)
    node_of = mx.zeros((depth_count * width,), mx.int32).at[chosen].add(mx.arange(1, rows, dtype=mx.int32))
    level = chosen // width
    parent_flat = (level - 1) * width + parents.reshape(-1)[chosen]
    parent_node = mx.where(level == 0, 0, node_of[mx.maximum(parent_flat, 0)])
    node_parents = mx.concatenate([mx.zeros((1,), mx.int32), parent_node.astype(mx.int32)])
    node_tokens = mx.concatenate([mx.zeros((1,), mx.int32), tokens.reshape(-1)[chosen]])
    return node_tokens, from_parents(node_parents, depth_count)


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
