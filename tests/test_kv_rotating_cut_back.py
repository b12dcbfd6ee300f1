"""A bounded cache (max_kv_size) cut back to a prefix longer than max_size:
a position at or past max_size saw only part of its past, and which part
depends on how it was read (alone, as a decoded token or a prompt's last
token is, or in a chunk, through mlx-lm's window mask), so a prefix holding
one is not what a fresh read of the new prompt computes; mlx-lm itself
trims its RotatingKVCache only while it holds fewer than max_size positions.
Such a prompt is read afresh and gives mlx-lm's own output."""

import random

import pytest

from dflash_mlx import make_prompt_cache
from test_kv_rotating import M, VOCAB, pair, reference, run  # noqa: F401  (pair: the fixture)


@pytest.mark.parametrize("step", [2048, 7])
def test_a_cut_back_past_max_size_gives_mlx_lms_fresh_output(pair, step):  # noqa: F811
    model, draft = pair
    for seed in range(3):
        rng = random.Random(seed)
        first = [rng.randrange(VOCAB - 1) for _ in range(M + 6)]
        cache = make_prompt_cache(model, draft, max_kv_size=M)
        got = run(pair, first, cache, 2, 4, step)
        ring = cache.target[0]
        assert M < len(cache.tokens) and ring.written <= ring.slots  # no slot overwritten yet
        other = first + [(got[0] + 1) % (VOCAB - 1), 5]  # leaves the conversation after the prompt
        assert run(pair, other, cache, 30, 5, step) == reference(model, other, 30, step), seed
        assert cache.consistent()


def test_a_cut_back_within_max_size_is_still_kept(pair):  # noqa: F811
    model, draft = pair
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    run(pair, first, cache, 3, 4, 2048)
    assert not cache.target[0].wrapped  # a prompt that leaves it keeps its common prefix
    other = first[:5] + [8, 8]
    assert cache.keep_prefix(other) == 5
