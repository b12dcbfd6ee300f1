"""Draft trees (issue 37) over the Gemma and gpt-oss adapters: one verify of
a tree gives at each node the logits of a plain forward over the path from
the root to it, sliding windows and Gemma 4's reused keys/values included;
after keep_path, the caches are those of a run that only saw the path."""

import mlx.core as mx
import pytest
from family_models import family_config, make_family_target

from dflash_mlx.kv.tree import from_parents
from dflash_mlx.targets import adapt

VOCAB = 48
TAPS = [1]
# The root (node 0), two children, and branches down to depth 5.
PARENTS = [0, 0, 0, 1, 1, 2, 3, 6, 7]
TREE = [5, 11, 30, 7, 19, 2, 40, 8, 13]
CONTEXT = [(7 * i + 3) % (VOCAB - 1) for i in range(11)]  # past the sliding window (8)


def target_of(family: str):
    cfg = family_config(family, vocab=VOCAB, layers=6 if family.startswith("gemma") else 4)
    return adapt(make_family_target(cfg, seed=4))


def path_to(node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def prefilled(target, ids: list[int]) -> list:
    cache = target.make_cache()
    target(mx.array(ids)[None], cache, TAPS)
    return cache


@pytest.mark.parametrize("family", ["gemma4_text", "gemma3_text", "gpt_oss"])
def test_tree_verify_equals_each_path(family):
    target = target_of(family)
    cache = prefilled(target, CONTEXT)
    assert target.takes_trees(cache)
    start = len(CONTEXT)
    layout = from_parents(mx.array(PARENTS, mx.int32), max_depth=5)
    target.set_tree(cache, layout)
    logits, hidden = target(mx.array(TREE)[None], cache, TAPS)
    target.set_tree(cache, None)
    for node in range(len(TREE)):
        tokens = [TREE[j] for j in path_to(node)]
        plain, plain_hidden = target(mx.array(tokens)[None], prefilled(target, CONTEXT), TAPS)
        assert mx.allclose(logits[0, node], plain[0, -1], atol=1e-4).item(), node
        assert mx.allclose(hidden[0, node], plain_hidden[0, -1], atol=1e-4).item(), node

    # Accept the path to node 8 (depth 5) up to depth 3, then go on plainly.
    path = path_to(8)
    accepted = 3
    target.keep_path(cache, start, mx.array(path, mx.int32))
    target.set_length(cache, start + accepted + 1, start + len(TREE))
    after = [9, 21, 4]
    logits, _ = target(mx.array(after)[None], cache, TAPS)
    kept = [TREE[j] for j in path[: accepted + 1]]
    plain, _ = target(mx.array(after)[None], prefilled(target, CONTEXT + kept), TAPS)
    assert mx.allclose(logits, plain, atol=1e-4).item()
    assert not mx.allclose(logits, target(mx.array(after)[None], prefilled(target, CONTEXT), TAPS)[0]).item()
