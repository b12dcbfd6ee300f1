"""Sampling is lossless: DFlash's sampled output follows the target's own
sampling distribution (mlx-lm's temperature, top-p, top-k).

Each statistical check is a chi-square goodness-of-fit test at a false-alarm
rate of 1e-3 (bins with an expected count under 5 are pooled); the seeds are
fixed, so a pass or a fail is reproducible."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import stream_generate
from dflash_mlx.decode.sampling import SamplingParams, accept_proposals, gumbel_noise, pick, seed_words, target_logprobs

ALPHA = 1e-3


def reference_probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """mlx-lm's sampling chain written out in numpy: top-p on the
    temperature-1 distribution (keep a token while the mass strictly above it
    is < top_p), then top-k, then softmax(logprobs / temperature)."""
    logits = logits.astype(np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    keep = np.ones_like(logprobs, dtype=bool)
    if 0 < top_p < 1:
        probs = np.exp(logprobs)
        for i in range(len(probs)):
            keep[i] = probs[probs > probs[i]].sum() < top_p
    if 0 < top_k < len(logprobs):
        keep &= logprobs >= np.sort(logprobs)[-top_k]
    scaled = np.where(keep, logprobs / temperature, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper tail of Pearson's chi-square (Wilson-Hilferty approximation),
    with bins of expected count < 5 pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token with zero probability was produced"
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


SETTINGS = [(1.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 0), (1.0, 0.8, 4), (0.7, 1.0, 3)]


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_target_logprobs_is_mlx_lm_chain(temperature, top_p, top_k):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.standard_normal(11).astype(np.float32) * 2
        ours = np.array(
            mx.softmax(target_logprobs(mx.array(logits)[None], SamplingParams(temperature, top_p, top_k)), axis=-1)
        )[0]
        np.testing.assert_allclose(ours, reference_probs(logits, temperature, top_p, top_k), atol=1e-5)


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_gumbel_max_pick_follows_target_distribution(temperature, top_p, top_k):
    """The seeded Gumbel-max pick draws from the target's distribution, and
    the noise of one (seed, position) is the same however rows are grouped."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(9) * 1.5).astype(np.float32)
    p = reference_probs(logits, temperature, top_p, top_k)
    n = 6000
    rows = mx.broadcast_to(mx.array(logits)[None], (n, 9))
    counts = np.zeros(9)
    for seed in range(2):
        tokens = np.array(
            pick(rows, mx.arange(n, dtype=mx.int32), SamplingParams(temperature, top_p, top_k), seed_words(seed))
        )
        counts += np.bincount(tokens, minlength=9)
    assert chi_square_pvalue(counts, 2 * n * p) > ALPHA
    positions = mx.array([5, 6, 7], mx.int32)
    together = np.array(gumbel_noise(seed_words(3), positions, 9))
    alone = np.stack([np.array(gumbel_noise(seed_words(3), positions[i : i + 1], 9))[0] for i in range(3)])
    np.testing.assert_array_equal(together, alone)
    assert not np.array_equal(together[0], np.array(gumbel_noise(seed_words(4), positions[:1], 9))[0])


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS[:3])
@pytest.mark.parametrize("proposal", ["one-hot", "smooth"])
def test_general_rejection_rule_emits_target_distribution(temperature, top_p, top_k, proposal):
    """accept_proposals (min(1, p/q), kept for drafters that propose from a
    distribution): the first committed token is distributed as p at position
    0, and the second as p at position 1 given the first was the draft."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, 7)) * 1.5).astype(np.float32)
    p0 = reference_probs(logits[0], temperature, top_p, top_k)
    p1 = reference_probs(logits[1], temperature, top_p, top_k)
    if proposal == "smooth":
        q = rng.dirichlet(np.ones(7), size=2).astype(np.float32)
    else:
        q = np.eye(7, dtype=np.float32)[[int(np.argsort(p0)[-2]), 2]]
    n = 4000
    first, second = np.zeros(7), np.zeros(7)
    keys = mx.random.split(mx.random.key(11), n)
    draws = rng.random((n, 2))
    for i in range(n):
        drafts = mx.array([int(np.searchsorted(np.cumsum(q[j]), draws[i, j] * q[j].sum())) for j in range(2)], mx.int32)
        out = accept_proposals(
            drafts, mx.array(q), mx.array(logits), SamplingParams(temperature, top_p, top_k), keys[i]
        ).tolist()
        first[out[1]] += 1
        if out[0] >= 1:
            second[out[2]] += 1
    assert chi_square_pvalue(first, n * p0) > ALPHA
    assert chi_square_pvalue(second, second.sum() * p1) > ALPHA


@pytest.fixture(scope="module")
def small_pair():
    tcfg = target_config("qwen3", vocab=6, layers=3, hidden=32)
    model = make_target(tcfg, seed=7)
    model.update({"model": {"norm": {"weight": mx.full((32,), 1.5)}}})
    dcfg = draft_config(tcfg, layers=1, block_size=3, taps=[1], mask_token_id=5)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=8)), make_tokenizer(6)


def sequence_distribution(model, prompt, length, temperature, top_p, top_k):
    """Exact probability of every sequence of ``length`` tokens under the
    target's own sampling, from full forward passes over each prefix."""
    vocab = model.args.vocab_size
    probs = {}
    for prefix_len in range(length):
        for prefix in itertools.product(range(vocab), repeat=prefix_len):
            logits = np.array(model(mx.array([prompt + list(prefix)]))[0, -1].astype(mx.float32))
            probs[prefix] = reference_probs(logits, temperature, top_p, top_k)
    seqs = list(itertools.product(range(vocab), repeat=length))
    return seqs, np.array([math.prod(probs[s[:i]][s[i]] for i in range(length)) for s in seqs])


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 0.8, 4)])
def test_generated_sequences_follow_target_distribution(small_pair, temperature, top_p, top_k):
    model, draft, tok = small_pair
    prompt, length, n = [1, 2, 3], 4, 1500
    seqs, expected = sequence_distribution(model, prompt, length, temperature, top_p, top_k)
    index = {s: i for i, s in enumerate(seqs)}
    observed = np.zeros(len(seqs))
    accepted = rejected = 0
    for seed in range(n):
        responses = list(
            stream_generate(
                model,
                draft,
                tok,
                prompt,
                max_tokens=length,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                block_size=3,
                seed=seed,
            )
        )
        observed[index[tuple(t for r in responses for t in r.tokens)]] += 1
        accepted += sum(r.accepted for r in responses[1:])
        rejected += sum(r.accepted < r.block_size - 1 for r in responses[1:])
    # Both branches of the rule were exercised.
    assert accepted > n // 10 and rejected > n // 10
    assert chi_square_pvalue(observed, n * expected) > ALPHA


def test_seed_makes_runs_repeatable(small_pair):
    model, draft, tok = small_pair

    def run(seed):
        return [
            t
            for r in stream_generate(model, draft, tok, [1, 2], max_tokens=30, temperature=1.0, seed=seed)
            for t in r.tokens
        ]

    assert run(5) == run(5)
    assert any(run(5) != run(s) for s in (6, 7, 8))
    assert run(-1) == run(2**64 - 1) and run(2**64 + 5) == run(5)  # any integer, folded


def plain_sampled(model, prompt, max_tokens, seed, temperature, top_p, top_k):
    """The target alone (mlx-lm's generate_step) sampling with the same noise:
    the token at position t is the Gumbel-max pick for (seed, t)."""
    position = [len(prompt)]

    def sampler(logprobs):
        token = pick(
            logprobs, mx.array(position, mx.int32), SamplingParams(temperature, top_p, top_k), seed_words(seed)
        )
        position[0] += 1
        return token

    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler)]


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 1.0, 0), (1.0, 0.9, 0), (0.7, 1.0, 20)])
def test_seeded_text_is_the_same_at_every_block_size(agreeing_pair, temperature, top_p, top_k):
    """A seed fixes the text whatever the blocks (2..16 and auto), and it is
    the text the target alone samples with the same noise."""
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    prompt = [3, 1, 4, 1, 5]
    for seed in (0, 1):
        want = plain_sampled(model, prompt, 40, seed, temperature, top_p, top_k)
        accepted = 0
        for bs in [*range(2, 17), "auto"]:
            responses = list(
                stream_generate(
                    model,
                    draft,
                    tok,
                    prompt,
                    max_tokens=40,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    block_size=bs,
                    seed=seed,
                )
            )
            assert [t for r in responses for t in r.tokens] == want, (seed, bs)
            accepted += sum(r.accepted for r in responses[1:])
        assert accepted > 0
