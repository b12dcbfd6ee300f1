"""Log-probabilities: each committed token's log-softmax of the target's raw
logits, and the top k, equal the target's own (one mlx-lm forward over the
prompt and the reply); asking for them changes no token."""

import random

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_tokenizer

from dflash_mlx import stream_generate


def reference_logprobs(model, prompt: list[int], reply: list[int]) -> np.ndarray:
    """[len(reply), V]: the target's log-softmax before each reply token."""
    logits = model(mx.array(prompt + reply[:-1])[None])[0, len(prompt) - 1 :].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def run(model, draft, prompt, **kw):
    responses = list(stream_generate(model, draft, make_tokenizer(model.args.vocab_size), prompt, **kw))
    tokens = [t for r in responses for t in r.tokens]
    return tokens, responses


def check_against_reference(model, prompt, tokens, responses, k):
    ref = reference_logprobs(model, prompt, tokens)
    got = [lp for r in responses for lp in r.logprobs]
    assert all(len(r.logprobs) == len(r.tokens) for r in responses)
    np.testing.assert_allclose(got, ref[np.arange(len(tokens)), tokens], rtol=1e-4, atol=1e-4)
    if k == 0:
        assert all(r.top_logprobs is None for r in responses)
        return
    top = [pairs for r in responses for pairs in r.top_logprobs]
    assert len(top) == len(tokens)
    for row, pairs in zip(ref, top):
        ids = [i for i, _ in pairs]
        assert ids == np.argsort(-row, kind="stable")[:k].tolist()
        np.testing.assert_allclose([v for _, v in pairs], row[ids], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [4, "auto", 2])
@pytest.mark.parametrize("k", [0, 3])
def test_greedy_logprobs_equal_the_targets(agreeing_pair, compiled, block_size, k):
    model, draft = agreeing_pair
    rng = random.Random(1)
    for n in (1, 9, 40):
        prompt = [rng.randrange(23) for _ in range(n)]
        tokens, responses = run(model, draft, prompt, max_tokens=40, block_size=block_size, logprobs=k)
        plain, plain_responses = run(model, draft, prompt, max_tokens=40, block_size=block_size)
        assert tokens == plain
        assert all(r.logprobs is None and r.top_logprobs is None for r in plain_responses)
        check_against_reference(model, prompt, tokens, responses, k)


@pytest.mark.parametrize("block_size", [4, 16])
def test_sampled_tokens_unchanged_and_logprobs_are_the_raw_distributions(agreeing_pair, compiled, block_size):
    model, draft = agreeing_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    kw = dict(max_tokens=48, block_size=block_size, temperature=0.9, top_p=0.9, seed=11)
    tokens, responses = run(model, draft, prompt, logprobs=5, **kw)
    plain, _ = run(model, draft, prompt, **kw)
    assert tokens == plain
    check_against_reference(model, prompt, tokens, responses, 5)


def test_a_reply_cut_by_max_tokens_or_eos_carries_one_logprob_per_token(agreeing_pair):
    model, draft = agreeing_pair
    for max_tokens in (1, 2, 7):
        tokens, responses = run(model, draft, [1, 2, 3], max_tokens=max_tokens, block_size=16, logprobs=2)
        assert len(tokens) == max_tokens
        check_against_reference(model, [1, 2, 3], tokens, responses, 2)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_out_of_range_logprobs_are_refused(agreeing_pair, bad):
    model, draft = agreeing_pair
    with pytest.raises(ValueError, match="logprobs"):
        stream_generate(model, draft, make_tokenizer(24), [1, 2], logprobs=bad)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_dflash2_drafters_selected_candidates_carry_the_targets_logprobs(tmp_path, temperature):
    from test_dflash2 import dflash2_config, random_dflash2_weights
    from tiny import make_target, target_config, write_zlab_draft

    from dflash_mlx import load_draft

    tcfg = target_config("qwen3", vocab=24, layers=5)
    model = make_target(tcfg, seed=21)
    cfg = dflash2_config(tcfg, block_size=16, taps=(0, 3), window=16, selector_top_k=4)
    draft = load_draft(write_zlab_draft(tmp_path / "d", cfg, random_dflash2_weights(cfg, seed=22), dtype=mx.float32))
    prompt = [5, 3, 8, 1, 2]
    kw = dict(max_tokens=30, block_size=5, temperature=temperature, seed=3)
    tokens, responses = run(model, draft, prompt, logprobs=4, **kw)
    assert tokens == run(model, draft, prompt, **kw)[0]
    check_against_reference(model, prompt, tokens, responses, 4)
