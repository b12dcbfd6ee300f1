"""A bounded cache (max_kv_size) cut back to a prefix longer than max_size:
a position at or past max_size saw only part of its past, and which part
depends on how it was read (alone, as a decoded token or a prompt's last
token is, or in a chunk, through mlx-lm's window mask), so a prefix holding
one is not what a fresh read of the new prompt computes; mlx-lm itself
trims its RotatingKVCache only while it holds fewer than max_size positions.
Such a prompt is read afresh and gives mlx-lm's own output."""

import random

import mlx.core as mx
import numpy as np
import pytest
from test_kv_rotating import VOCAB, M, pair, reference, run  # noqa: F401  (pair: the fixture)

from dflash_mlx import make_prompt_cache


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


@pytest.mark.parametrize("step", [64, 7])
def test_a_prefill_interrupted_mid_chunk_keeps_the_ring_exact(pair, step):  # noqa: F811
    """A Ctrl-C while a prompt chunk is read (its keys already written to
    the ring, the chunk not yet committed) leaves the bounded cache as it
    was: the turn read again gives what mlx-lm gives reusing its cache."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache
    from test_kv_rotating import make_tokenizer, stream_generate

    model, draft = pair
    rng = random.Random(step)
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    theirs = mlx_prompt_cache(model, max_kv_size=M)
    first = [rng.randrange(VOCAB - 1) for _ in range(10)]
    reply = reference(model, first, 5, step, cache=theirs)
    assert run(pair, first, cache, 5, 4, step) == reply
    new = [rng.randrange(VOCAB - 1) for _ in range(30)]
    conversation = first + reply + new
    held = [(c.keys + 0, c.values + 0) for c in cache.target]  # copies: a write replaces the array in place
    n = len(cache.tokens)

    calls = []
    extend = draft.extend

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second chunk, past every old position's slot
            raise KeyboardInterrupt
        return extend(*a, **k)

    draft.extend = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            list(
                stream_generate(
                    model,
                    draft,
                    make_tokenizer(VOCAB),
                    conversation,
                    max_tokens=20,
                    block_size=5,
                    prompt_cache=cache,
                    prefill_step_size=step,
                )
            )
    finally:
        del draft.extend
    assert cache.consistent()
    at = mx.array(cache.target[0].slot(np.arange(n)))
    for c, (k, v) in zip(cache.target, held):  # every position the cache holds, as it was
        assert mx.array_equal(mx.take(c.keys, at, axis=2), mx.take(k, at, axis=2))
        assert mx.array_equal(mx.take(c.values, at, axis=2), mx.take(v, at, axis=2))
    assert run(pair, conversation, cache, 20, 5, step) == reference(model, new, 20, step, cache=theirs)
