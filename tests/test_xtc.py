"""XTC and min_tokens_to_keep (issue 35): the filters are mlx-lm's, and
XTC's coin is fixed by (seed, position), so a seeded text stays the same at
every block size and equals the target's own sampling with that seed."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.sample_utils import apply_xtc as mlx_lm_xtc
from test_sampling import chi_square_pvalue
from tiny import make_tokenizer

from dflash_mlx import stream_generate
from dflash_mlx.decode.sampling import (
    SamplingParams,
    accept_proposals,
    gumbel_noise,
    pick,
    seed_words,
    target_logprobs,
    xtc_coins,
)


def normalised(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def mlx_lm_chain(logits, *, top_p=1.0, min_p=0.0, min_tokens_to_keep=1, top_k=0, threshold=0.1, special=()):
    """make_sampler's filters in its order, with XTC's coin always landing
    (probability 1)."""
    x = normalised(logits)
    if 0 < top_p < 1:
        x = apply_top_p(x, top_p)
    if min_p:
        x = apply_min_p(x, min_p, min_tokens_to_keep)
    x = mlx_lm_xtc(x, 1.0, threshold, list(special))
    if top_k:
        x = apply_top_k(x, top_k)
    return x


def removed(logprobs: mx.array) -> np.ndarray:
    return np.array(mx.isinf(logprobs))


@pytest.mark.parametrize(
    "settings",
    [
        dict(threshold=0.1),
        dict(threshold=0.05),
        dict(threshold=0.2, special=(0, 3)),
        dict(threshold=0.1, top_p=0.9),
        dict(threshold=0.1, min_p=0.05, min_tokens_to_keep=3),
        dict(threshold=0.08, top_k=5),
    ],
)
def test_surviving_tokens_are_mlx_lm_apply_xtc(settings):
    """With the coin landing, the surviving tokens are mlx-lm's (apply_xtc in
    make_sampler's chain); with it missing, none is removed by XTC."""
    logits = mx.random.normal((64, 16), key=mx.random.key(1)) * 1.6
    threshold, special = settings["threshold"], settings.get("special", ())
    others = {k: v for k, v in settings.items() if k not in ("threshold", "special")}
    params = SamplingParams(
        1.0,
        others.get("top_p", 1.0),
        others.get("top_k", 0),
        others.get("min_p", 0.0),
        xtc_probability=0.5,
        xtc_threshold=threshold,
        min_tokens_to_keep=others.get("min_tokens_to_keep", 1),
        xtc_special_tokens=special,
    )
    rows = logits.shape[0]
    landed = target_logprobs(logits, params, mx.full((rows,), 0.25))
    want = removed(mlx_lm_chain(logits, **settings))
    np.testing.assert_array_equal(removed(landed), want)
    plain = SamplingParams(**{**params.__dict__, "xtc_probability": 0.0})
    missed = target_logprobs(logits, params, mx.full((rows,), 0.75))
    np.testing.assert_array_equal(removed(missed), removed(target_logprobs(logits, plain)))
    assert (want != removed(missed)).any(), "XTC changed nothing: a weak test"
    if special:
        assert not removed(landed)[:, list(special)].any() or others


def test_xtc_needs_two_tokens_above_the_threshold():
    one = mx.array([[4.0, 0.0, 0.0, 0.0, 0.0]])  # only token 0 above 0.1
    params = SamplingParams(1.0, xtc_probability=1.0, xtc_threshold=0.1)
    assert not removed(target_logprobs(one, params, mx.array([0.5]))).any()
    two = mx.array([[3.0, 2.0, -3.0, -3.0]])
    np.testing.assert_array_equal(removed(target_logprobs(two, params, mx.array([0.5]))), [[True, False, False, False]])


def test_coin_is_a_function_of_seed_and_position_alone():
    positions = mx.arange(20000, dtype=mx.int32)
    coins = np.array(xtc_coins(seed_words(7), positions))
    some = mx.array([5, 900, 17], mx.int32)
    alone = [np.array(xtc_coins(seed_words(7), some[i : i + 1]))[0] for i in range(3)]
    np.testing.assert_array_equal(np.array(xtc_coins(seed_words(7), some)), alone)
    np.testing.assert_array_equal(alone, coins[[5, 900, 17]])
    np.testing.assert_array_equal(coins, np.array(xtc_coins(seed_words(7), positions)))
    assert not np.array_equal(coins, np.array(xtc_coins(seed_words(8), positions)))
    assert 0 < coins.min() and coins.max() < 1
    for p in (0.1, 0.5, 0.9):  # uniform: lands with the asked probability
        assert abs((coins <= p).mean() - p) < 0.015
    # a stream of its own: not the first column's Gumbel noise in disguise
    g = np.array(gumbel_noise(seed_words(7), positions[:2000], 1))[:, 0]
    assert abs(np.corrcoef(g, coins[:2000])[0, 1]) < 0.1


def test_pick_follows_the_xtc_mixture():
    """The seeded pick draws from mlx-lm's XTC sampler: with probability p
    the filtered distribution, else the plain one."""
    logits = mx.array([[2.0, 1.6, 1.0, 0.2, -0.5, -1.0, -2.0]])
    params = SamplingParams(1.0, xtc_probability=0.4, xtc_threshold=0.1)
    plain = np.array(mx.softmax(target_logprobs(logits, SamplingParams(1.0)), axis=-1))[0]
    cut = np.array(mx.softmax(target_logprobs(logits, params, mx.array([0.0])), axis=-1))[0]
    n, counts = 6000, np.zeros(7)
    rows = mx.broadcast_to(logits, (n, 7))
    for seed in range(2):
        counts += np.bincount(np.array(pick(rows, mx.arange(n, dtype=mx.int32), params, seed_words(seed))), minlength=7)
    assert chi_square_pvalue(counts, 2 * n * (0.4 * cut + 0.6 * plain)) > 1e-3


@pytest.mark.parametrize("block", [2, 4, 16])
def test_picks_are_the_same_however_positions_are_grouped(block):
    """A verify picks a block's positions together: the tokens do not depend
    on how positions are grouped into blocks."""
    logits = mx.random.normal((48, 24), key=mx.random.key(3)) * 2
    params = SamplingParams(0.9, 0.95, 0, 0.02, xtc_probability=0.5, xtc_threshold=0.08, min_tokens_to_keep=2)
    positions = mx.arange(100, 148, dtype=mx.int32)
    whole = np.array(pick(logits, positions, params, seed_words(11)))
    grouped = np.concatenate(
        [
            np.array(pick(logits[i : i + block], positions[i : i + block], params, seed_words(11)))
            for i in range(0, 48, block)
        ]
    )
    np.testing.assert_array_equal(grouped, whole)


@pytest.mark.parametrize("min_p,keep", [(0.2, 1), (0.3, 3), (0.6, 5), (0.9, 16)])
def test_min_tokens_to_keep_is_mlx_lm_apply_min_p(min_p, keep):
    logits = mx.random.normal((32, 16), key=mx.random.key(2)) * 2.5
    ours = target_logprobs(logits, SamplingParams(1.0, min_p=min_p, min_tokens_to_keep=keep))
    ref = apply_min_p(normalised(logits), min_p, keep)
    np.testing.assert_array_equal(removed(ours), removed(ref))
    assert (np.sum(~removed(ours), axis=1) >= keep).all()


def test_accept_proposals_takes_xtc_coins_from_its_key():
    """The general rule draws its coins from the key; without XTC the key's
    use is unchanged."""
    logits = mx.random.normal((4, 9), key=mx.random.key(5))
    q = mx.softmax(mx.random.normal((3, 9), key=mx.random.key(6)), axis=-1)
    drafts = mx.array([1, 2, 3], mx.int32)
    key = mx.random.key(9)
    with_xtc = SamplingParams(1.0, xtc_probability=1.0, xtc_threshold=0.05)
    out = accept_proposals(drafts, q, logits, with_xtc, key)
    again = accept_proposals(drafts, q, logits, with_xtc, key)
    assert out.tolist() == again.tolist() and 0 <= out[0].item() <= 3


def plain_sampled(model, prompt, max_tokens, seed, params):
    """The target alone (mlx-lm's generate_step) picking with the seed's noise
    and coins: the token at position t is a function of (seed, t)."""
    position = [len(prompt)]

    def sampler(logprobs):
        token = pick(logprobs, mx.array(position, mx.int32), params, seed_words(seed))
        position[0] += 1
        return token

    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler)]


@pytest.mark.parametrize("xtc_probability,min_p,keep", [(0.5, 0.0, 1), (1.0, 0.1, 3)])
def test_seeded_xtc_text_is_the_same_at_every_block_size(agreeing_pair, xtc_probability, min_p, keep):
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    special = tuple(sorted({*tok.encode("\n"), *tok.eos_token_ids}))
    prompt = [3, 1, 4, 1, 5]
    settings = dict(temperature=0.9, min_p=min_p, xtc_probability=xtc_probability, xtc_threshold=0.1)
    params = SamplingParams(
        0.9,
        min_p=min_p,
        xtc_probability=xtc_probability,
        xtc_threshold=0.1,
        min_tokens_to_keep=keep,
        xtc_special_tokens=special,
    )
    for seed in (0, 1):
        want = plain_sampled(model, prompt, 40, seed, params)
        assert want != plain_sampled(model, prompt, 40, seed, SamplingParams(0.9, min_p=min_p))
        for bs in (2, 4, 16, "auto"):
            responses = stream_generate(
                model, draft, tok, prompt, max_tokens=40, block_size=bs, seed=seed, min_tokens_to_keep=keep, **settings
            )
            assert [t for r in responses for t in r.tokens] == want, (seed, bs)
