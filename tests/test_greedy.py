"""Greedy DFlash output equals the target's own greedy decoding (mlx-lm),
token for token."""

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
)

from dflash_mlx import generate, make_prompt_cache, stream_generate

VOCAB = 48


@pytest.fixture(scope="module")
def pair():
    tcfg = target_config("qwen3", vocab=VOCAB)
    model = make_target(tcfg, seed=3)
    dcfg = draft_config(tcfg, layers=2, block_size=16)
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=4))
    return model, draft


def dflash_tokens(model, draft, tokenizer, prompt, **kw):
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kw))
    tokens = [t for r in responses for t in r.tokens]
    return tokens, responses


@pytest.mark.parametrize("which", ["pair", "agreeing_pair"])
def test_greedy_equals_target_over_block_sizes_and_prompt_lengths(which, request):
    model, draft = request.getfixturevalue(which)
    VOCAB = model.args.vocab_size
    tok = make_tokenizer(VOCAB)
    rng = random.Random(0)
    lengths = [1, 2, 3, 7, 16, 17, 64, 129, 300]
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in lengths]
    refs = [greedy_reference(model, p, 48) for p in prompts]
    accepted = set()
    for bs in range(2, 17):
        for i in range(3):
            k = (bs * 3 + i) % len(prompts)
            tokens, responses = dflash_tokens(
                model, draft, tok, prompts[k], max_tokens=48, block_size=bs, prefill_step_size=37
            )
            assert tokens == refs[k], f"block_size={bs}, prompt length {lengths[k]}"
            assert responses[-1].finish_reason == "length"
            assert responses[-1].generation_tokens == 48
            assert all(r.accepted is None or 0 <= r.accepted <= r.block_size - 1 for r in responses)
            accepted |= {(r.accepted, r.block_size) for r in responses[1:]}
    # Vacuous if no draft were ever accepted; with the agreeing pair whole
    # blocks are accepted too (the bonus then comes from the last position).
    assert any(a for a, _ in accepted)
    if which == "agreeing_pair":
        assert any(a == bs - 1 and bs > 2 for a, bs in accepted)


def test_greedy_with_eos_in_play(pair):
    model, draft = pair
    rng = random.Random(1)
    stops = 0
    for trial in range(12):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 40))]
        ref = greedy_reference(model, prompt, 40)
        # Make a token the target actually emits mid-way the EOS.
        eos = ref[rng.randrange(1, len(ref))]
        tok = make_tokenizer(VOCAB, eos=eos)
        want = greedy_reference(model, prompt, 40, eos={eos})
        tokens, responses = dflash_tokens(model, draft, tok, prompt, max_tokens=40, block_size=2 + trial)
        assert tokens == want
        assert tokens[-1] == eos and eos not in tokens[:-1]
        assert responses[-1].finish_reason == "stop"
        assert all(r.finish_reason is None for r in responses[:-1])
        stops += 1
    assert stops == 12


def test_llama_and_tied_and_quantized_targets():
    rng = random.Random(2)
    for family, tie, quantize in [
        ("llama", False, False),
        ("qwen3", True, False),
        ("qwen3", False, True),
        ("llama", True, True),
    ]:
        tcfg = target_config(family, vocab=64, hidden=64, tie=tie)
        model = make_target(tcfg, seed=5)
        if quantize:
            nn.quantize(model, group_size=32, bits=4)
            mx.eval(model.parameters())
        dcfg = draft_config(tcfg, layers=1, block_size=6)
        draft = make_draft(dcfg, random_draft_weights(dcfg))
        tok = make_tokenizer(64)
        for n in (1, 5, 90):
            prompt = [rng.randrange(63) for _ in range(n)]
            tokens, _ = dflash_tokens(model, draft, tok, prompt, max_tokens=30)
            assert tokens == greedy_reference(model, prompt, 30), (family, tie, quantize, n)


def test_text_stats_and_generate(pair):
    model, draft = pair
    tok = make_tokenizer(VOCAB)
    prompt = "w1 w2 w3 w4"
    tokens, responses = dflash_tokens(model, draft, tok, prompt, max_tokens=20, block_size=4)
    assert tokens == greedy_reference(model, [1, 2, 3, 4], 20)
    text = "".join(r.text for r in responses)
    assert text.split() == [f"w{t}" for t in tokens]
    assert generate(model, draft, tok, prompt, max_tokens=20, block_size=4) == text
    first, rest = responses[0], responses[1:]
    assert first.accepted is None and first.tokens == tokens[:1]
    last = responses[-1]
    cycles = len(rest)
    accepted = sum(r.accepted for r in rest)
    assert last.cycles == cycles
    assert last.acceptance_length == pytest.approx((len(tokens) - 1) / cycles)
    proposed = sum(r.block_size - 1 for r in rest)
    assert last.acceptance_rate == pytest.approx(accepted / proposed)
    assert sum(last.accepted_by_position) == accepted
    assert last.prompt_tokens == 4 and last.generation_tokens == 20
    assert last.peak_memory > 0 and last.generation_tps > 0 and last.prompt_tps > 0


def test_max_tokens_one_and_two(pair):
    model, draft = pair
    tok = make_tokenizer(VOCAB)
    for m in (1, 2, 3):
        tokens, responses = dflash_tokens(model, draft, tok, [5, 6], max_tokens=m, block_size=16)
        assert tokens == greedy_reference(model, [5, 6], m)
        assert responses[-1].finish_reason == "length"


def test_prompt_cache_reuses_prefix_and_survives_early_stop(pair):
    model, draft = pair
    tok = make_tokenizer(VOCAB)
    cache = make_prompt_cache(model, draft)
    turn1 = [3, 4, 5, 6, 7]
    out1, _ = dflash_tokens(model, draft, tok, turn1, max_tokens=12, prompt_cache=cache)
    assert out1 == greedy_reference(model, turn1, 12)
    # The next turn extends the conversation: only the new part is prefilled.
    turn2 = turn1 + out1 + [8, 9]
    out2, responses = dflash_tokens(model, draft, tok, turn2, max_tokens=12, prompt_cache=cache)
    assert out2 == greedy_reference(model, turn2, 12)
    assert cache.tokens[: len(turn2)] == turn2
    # Stop a reply after its first cycle: the cache keeps only what was committed.
    gen = stream_generate(model, draft, tok, turn2 + [10], max_tokens=30, prompt_cache=cache, block_size=4)
    seen = next(gen).tokens + next(gen).tokens
    gen.close()
    assert cache.tokens == turn2 + [10] + seen[:-1]
    assert cache.target[0].offset == len(cache.tokens)
    assert cache.draft[0].offset == len(cache.tokens)
    # A different conversation after that still decodes exactly.
    other = [11, 12, 13]
    out3, _ = dflash_tokens(model, draft, tok, other, max_tokens=15, prompt_cache=cache)
    assert out3 == greedy_reference(model, other, 15)


def test_interrupted_prefill_leaves_the_cache_consistent(pair, monkeypatch):
    model, draft = pair
    tok = make_tokenizer(VOCAB)
    cache = make_prompt_cache(model, draft)
    real_extend, calls = draft.extend, []

    def interrupted(taps, c):
        calls.append(taps.shape[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_extend(taps, c)

    monkeypatch.setattr(draft, "extend", interrupted)
    prompt = list(range(1, 30))
    with pytest.raises(KeyboardInterrupt):
        list(stream_generate(model, draft, tok, prompt, prompt_cache=cache, prefill_step_size=10))
    monkeypatch.undo()
    assert cache.tokens == prompt[:10]
    assert cache.target[0].offset == cache.draft[0].offset == 10
    out, _ = dflash_tokens(model, draft, tok, prompt, max_tokens=10, prompt_cache=cache)
    assert out == greedy_reference(model, prompt, 10)


def test_buffer_boundaries_decode_exactly(pair, request):
    """Caches hand attention their whole buffer (fixed shapes between growths
    of 256 positions, the unfilled tail masked): prompts and replies that
    cross a growth decode exactly."""
    for model, draft in (pair, request.getfixturevalue("agreeing_pair")):
        vocab = model.args.vocab_size
        tok = make_tokenizer(vocab)
        rng = random.Random(5)
        for bs, n in [(2, 1), (5, 40), (16, 250), (16, 300)]:
            prompt = [rng.randrange(vocab - 1) for _ in range(n)]
            cache = make_prompt_cache(model, draft)
            tokens, _ = dflash_tokens(
                model, draft, tok, prompt, max_tokens=40, block_size=bs, prompt_cache=cache, prefill_step_size=64
            )
            assert tokens == greedy_reference(model, prompt, 40), (bs, n)
            assert all(c.keys.shape[2] % 256 == 0 for c in cache.target + cache.draft)
