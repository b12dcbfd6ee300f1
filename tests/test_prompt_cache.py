"""A prompt cache cannot go wrong: a generator left alive, interrupts at any
moment, another model pair, odd inputs. After each, the next call on the
cache decodes exactly what mlx-lm's greedy decoding of the whole
conversation gives."""

import random
import signal

import mlx.core as mx
import numpy as np
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

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cache.prompt import StaleGenerationError, common_prefix
from dflash_mlx.draft.dflash import DraftConfig
from dflash_mlx.kv.buffer import BufferKVCache

VOCAB = 24


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.tokens]


def run(pair, prompt, cache, **kw):
    model, draft = pair
    return tokens_of(stream_generate(model, draft, make_tokenizer(VOCAB), prompt, prompt_cache=cache, **kw))


def test_a_generator_left_alive_is_settled_by_the_next_call(agreeing_pair):
    model, draft = agreeing_pair
    tok = make_tokenizer(VOCAB)
    cache = make_prompt_cache(model, draft)
    prompt = [3, 4, 5, 6]
    gen = stream_generate(model, draft, tok, prompt, max_tokens=60, prompt_cache=cache, block_size=4)
    seen = next(gen).tokens + next(gen).tokens + next(gen).tokens  # then the caller walks away, gen still alive
    assert cache.tokens == prompt + seen[:-1]
    conversation = prompt + seen + [7, 8]
    assert run(agreeing_pair, conversation, cache, max_tokens=20) == greedy_reference(model, conversation, 20)
    held = list(cache.tokens)
    with pytest.raises(StaleGenerationError, match="newer call took over"):
        next(gen)
    gen.close()  # a stale generator closed later changes nothing
    assert cache.tokens == held and cache.consistent()
    more = held + [9]
    assert run(agreeing_pair, more, cache, max_tokens=20) == greedy_reference(model, more, 20)


def test_closing_mid_stream_keeps_exactly_what_was_yielded(agreeing_pair):
    model, draft = agreeing_pair
    tok = make_tokenizer(VOCAB)
    cache = make_prompt_cache(model, draft)
    for stop_after in (1, 2, 5):
        prompt = list(cache.tokens) + [1, 2, 3]
        gen = stream_generate(model, draft, tok, prompt, max_tokens=50, prompt_cache=cache, block_size=16)
        seen = [t for _, r in zip(range(stop_after), gen) for t in r.tokens]
        gen.close()
        assert cache.tokens == prompt + seen[:-1] and cache.consistent()
        following = cache.tokens + [seen[-1], 4]
        assert run(agreeing_pair, following, cache, max_tokens=15) == greedy_reference(model, following, 15)


class Interrupt:
    """Raise KeyboardInterrupt at the ``at``-th write into any cache layer:
    inside a prefill chunk between two layers, inside a drafter pass, inside
    a verify, wherever that write falls."""

    def __init__(self, monkeypatch, at: int):
        self.count, self.at = 0, at
        real = BufferKVCache.write

        def write(cache, keys, values, start):
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt
            return real(cache, keys, values, start)

        monkeypatch.setattr(BufferKVCache, "write", write)


@pytest.mark.parametrize("block_size", [4, 16, "auto"])
def test_an_interrupt_at_any_write_leaves_the_cache_exact(agreeing_pair, monkeypatch, block_size):
    model, draft = agreeing_pair
    tok = make_tokenizer(VOCAB)
    rng = random.Random(str(block_size))
    cache = make_prompt_cache(model, draft)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(30)]
    for trial in range(8):
        conversation += [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 40))]
        with monkeypatch.context() as m:
            interrupt = Interrupt(m, at=rng.randrange(1, 60))
            got = []
            with pytest.raises(KeyboardInterrupt):
                for r in stream_generate(
                    model,
                    draft,
                    tok,
                    conversation,
                    max_tokens=40,
                    prompt_cache=cache,
                    block_size=block_size,
                    prefill_step_size=rng.choice([7, 16, 64]),
                ):
                    got += r.tokens
                if interrupt.count < interrupt.at:
                    raise KeyboardInterrupt  # finished before its moment: still a valid trial
        assert cache.consistent(), trial
        assert cache.tokens == (conversation + got)[: len(cache.tokens)]
        conversation += got + [rng.randrange(VOCAB - 1)]
        want = greedy_reference(model, conversation, 12)
        assert run(agreeing_pair, conversation, cache, max_tokens=12, block_size=block_size) == want, trial
        conversation += want


def test_random_sigints_over_a_conversation(agreeing_pair):
    """Real signals at random moments (prefill, queuing a cycle, reading it,
    the caller holding a response) over many turns of one conversation."""
    model, draft = agreeing_pair
    tok = make_tokenizer(VOCAB)
    rng = random.Random(7)
    cache = make_prompt_cache(model, draft)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(20)]

    def alarm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, alarm)
    interrupted = 0
    try:
        for turn in range(24):
            conversation += [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 30))]
            got = []
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0005, 0.05))
            try:
                for r in stream_generate(
                    model,
                    draft,
                    tok,
                    conversation,
                    max_tokens=60,
                    prompt_cache=cache,
                    block_size=rng.choice([3, 8, 16, "auto"]),
                    prefill_step_size=rng.choice([5, 32]),
                ):
                    got += r.tokens
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupted += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert cache.consistent(), turn
            conversation += got + [rng.randrange(VOCAB - 1)]
            want = greedy_reference(model, conversation, 10)
            assert run(agreeing_pair, conversation, cache, max_tokens=10) == want, turn
            conversation += want
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted >= 6


def test_a_cache_refuses_another_model_pair(agreeing_pair):
    model, draft = agreeing_pair
    tcfg = target_config("qwen3", vocab=VOCAB, layers=5)
    other = make_target(tcfg, seed=99)
    cache = make_prompt_cache(model, draft)
    with pytest.raises(ValueError, match="made for another model pair"):
        stream_generate(other, draft, make_tokenizer(VOCAB), [1, 2], prompt_cache=cache)
    dcfg = draft_config(tcfg, layers=2, block_size=16, taps=[0, 3])
    with pytest.raises(ValueError, match="made for another model pair"):
        stream_generate(
            model,
            make_draft(dcfg, random_draft_weights(dcfg, seed=5)),
            make_tokenizer(VOCAB),
            [1, 2],
            prompt_cache=cache,
        )


def test_prompts_of_any_integer_kind(agreeing_pair):
    model, draft = agreeing_pair
    want = greedy_reference(model, [1, 2, 3], 8)
    for prompt in (
        [1, 2, 3],
        np.array([1, 2, 3]),
        np.array([[1, 2, 3]], np.int64),
        mx.array([[1, 2, 3]]),
        mx.array([1, 2, 3], mx.uint32),
        [np.int32(1), np.int64(2), 3],
    ):
        assert run(agreeing_pair, prompt, None, max_tokens=8) == want, type(prompt)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"prompt": [1, True]}, "integer token ids"),
        ({"prompt": [1.5, 2]}, "integer token ids"),
        ({"prompt": np.array([[1, 2], [3, 4]])}, "batch of one"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"prefill_step_size": 2.5}, "prefill_step_size must be an integer"),
        ({"prefill_step_size": None}, "prefill_step_size must be an integer"),
        ({"max_tokens": None}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": "1"}, "seed must be an integer"),
        ({"block_size": 17}, "larger than the block the drafter was trained for"),
        ({"block_size": True}, "block_size must be an integer >= 2"),
    ],
)
def test_bad_arguments_are_one_sentence(agreeing_pair, kwargs, message):
    model, draft = agreeing_pair
    kwargs = {"prompt": [1, 2], **kwargs}
    with pytest.raises(ValueError, match=message):
        stream_generate(model, draft, make_tokenizer(VOCAB), **kwargs)


def test_any_integer_seed(agreeing_pair):
    model, draft = agreeing_pair
    for seed in (-1, 2**64, 2**200, np.int64(3)):
        assert len(run(agreeing_pair, [1, 2], None, max_tokens=5, temperature=0.9, seed=seed)) == 5


@pytest.mark.parametrize(
    "change,message",
    [
        ({"block_size": None}, "block_size must be an integer >= 2"),
        ({"block_size": 1}, "block_size must be an integer >= 2"),
        ({"dflash_config": {"target_layer_ids": [], "mask_token_id": 23}}, "target_layer_ids is empty"),
        ({"dflash_config": {"target_layer_ids": [1, 1], "mask_token_id": 23}}, "target_layer_ids repeats 1"),
    ],
)
def test_bad_drafter_configs_are_refused_at_load(change, message):
    cfg = draft_config(target_config("qwen3", vocab=VOCAB, layers=5), layers=2, block_size=16, taps=[0, 3])
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        DraftConfig.from_dict(cfg)


@pytest.mark.parametrize("new, step", [(10, 4), (9, 4), (1, 4), (5, 2048)])
def test_a_prompt_is_read_as_mlx_lms_generate_step_reads_it(agreeing_pair, new, step):
    """Its ids but the last in chunks of ``step`` from the first, then the
    last alone (a one-row product rounds unlike a row of many, so the cache
    then holds mlx-lm's bits); after a reply, its uncached last token alone first."""
    model, draft = agreeing_pair
    cache = make_prompt_cache(model, draft)
    ids = list(range(1, new + 1))
    body = ids[:-1]
    assert cache.chunks(ids, step) == [body[i : i + step] for i in range(0, len(body), step)] + [ids[-1:]]
    reply = run(agreeing_pair, [1, 2, 3], cache, max_tokens=3)
    follow = [1, 2, 3, *reply, 4, 5]
    held = cache.keep_prefix(follow)
    assert cache.chunks(follow[held:], step)[0] == [reply[-1]]


def test_common_prefix_is_the_ids_shared_from_the_start():
    """Lists, tuples and arrays alike, where they part inside, at and
    around the slices it compares at once, and when one ends first."""
    rng = random.Random(5)

    def plain(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for _ in range(400):
        a = [rng.randrange(3) for _ in range(rng.choice([0, 1, 511, 512, 513, 1100]))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(600))]
        want = plain(a, b)
        for x, y in ((a, b), (b, a), (tuple(a), b), (np.array(a, np.int64), b), (a, np.array(b, np.int32))):
            assert common_prefix(x, y) == want


@pytest.mark.parametrize("compiled_cycles", [False, True], ids=["eager", "compiled"])
def test_a_long_prompt_grows_each_buffer_once(agreeing_pair, buffer_copies, monkeypatch, compiled_cycles):
    """A prompt read in many chunks, then a reply's first cycles: the buffers
    are made once at the prompt's size, never copied a chunk at a time."""
    from dflash_mlx.decode.cycle import Cycle

    monkeypatch.setattr(Cycle, "compile_graphs", compiled_cycles)
    model, draft = agreeing_pair
    prompt = [(i * 5) % 21 + 2 for i in range(700)]
    cache = make_prompt_cache(model, draft)
    got = run(agreeing_pair, prompt, cache, max_tokens=24, block_size=8, prefill_step_size=64)
    assert got == greedy_reference(model, prompt, 24)
    assert buffer_copies == []
    follow = cache.tokens + got[-1:] + [(i * 3) % 19 + 2 for i in range(300)]
    assert run(agreeing_pair, follow, cache, max_tokens=8, prefill_step_size=64) == greedy_reference(model, follow, 8)
    # the follow-up grows the kept buffers once, to the new prompt's size
    assert len({after for _, after in buffer_copies}) == 1
