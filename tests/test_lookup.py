"""Prompt lookup (draft/lookup.py): the device's n-gram search is a plain
search's, and decoding with it, beside a DFlash drafter or alone, is the
target's own: greedy token for token on every kind of family, seeded
samples the plain sampler's, prompt caches exact across turns and stops."""

import math
import random

import mlx.core as mx
import pytest
from family_models import family_config, make_family_target
from mlx.utils import tree_flatten
from test_sampling import plain_sampled
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
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.draft.lookup import LookupGate, LookupParams, TokenHistory, find, find_believed, lookup_drafter

VOCAB = 48


def python_lookup(history: list[int], k: int, longest: int):
    """The plain search: for n from ``longest`` down, the last place before
    the end where the last n tokens occur, and the k tokens after it (past
    the end, the copied span repeats)."""
    last = len(history) - 1
    for n in range(longest, 0, -1):
        if n > len(history):
            continue
        suffix = history[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if history[end - n + 1 : end + 1] == suffix:
                period = last - end
                extended = list(history)
                while len(extended) < end + 1 + k:
                    extended.append(extended[len(extended) - period])
                return extended[end + 1 : end + 1 + k], n
    return None, 0


def test_device_lookup_is_the_plain_search():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 40])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 600))]
        buffer = TokenHistory(history)
        scratch = buffer.capacity - len(history)  # past the end: garbage a later cycle overwrites
        buffer.tokens[len(history) :] = mx.array([rng.randrange(vocab) for _ in range(scratch)], mx.int32)
        k, longest = rng.randrange(1, 16), rng.randrange(1, 6)
        drafts, n = find(buffer.tokens, mx.array(len(history) - 1, mx.int32), k, LookupParams(1, longest))
        want, want_n = python_lookup(history, k, longest)
        assert n.item() == want_n, trial
        if want_n:
            assert drafts.tolist() == want, trial


def python_believed(history: list[int], logits: list[list[float]], params: LookupParams):
    """The plain choice beside a drafter: the longest match's continuation
    where n >= min_ngram; else, of the places where the last token occurred
    before, the first whose continuation the drafter expects most accepted,
    drafted where that is at least ``belief`` times what it expects of its own
    first choices. Returns (drafts or None, drafted, the margin of each choice)."""
    k, last = len(logits), len(history) - 1
    logprobs = [[x - math.log(sum(math.exp(y) for y in row)) for x in row] for row in logits]

    def continuation(end):
        extended = list(history[: last + 1])
        while len(extended) < end + 1 + k:
            extended.append(extended[len(extended) - (last - end)])
        return extended[end + 1 : end + 1 + k]

    def expected(tokens):
        total, product = 0.0, 1.0
        for row, t in zip(logprobs, tokens):
            product *= math.exp(row[t])
            total += product
        return total

    drafts, n = python_lookup(history, k, params.max_ngram)
    if n >= params.min_ngram:
        return drafts, True, math.inf
    scored = sorted(
        ((expected(continuation(end)), continuation(end)) for end in range(last) if history[end] == history[last]),
        key=lambda pair: -pair[0],
    )
    if not scored:
        return None, False, math.inf
    own = expected([max(range(len(row)), key=row.__getitem__) for row in logprobs])
    best, drafts = scored[0]
    rival = next((e for e, c in scored[1:] if c != drafts), -math.inf)
    return drafts, best >= params.belief * own, min(abs(best - params.belief * own), best - rival)


def test_drafts_beside_a_drafter_are_the_plain_choice():
    rng = random.Random(1)
    by_match = by_belief = declined = 0
    for trial in range(300):
        vocab = rng.choice([3, 5, 12])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(2, 300))]
        buffer = TokenHistory(history)
        scratch = buffer.capacity - len(history)
        buffer.tokens[len(history) :] = mx.array([rng.randrange(vocab) for _ in range(scratch)], mx.int32)
        k = rng.randrange(1, 12)
        params = LookupParams(rng.randrange(2, 5), rng.randrange(5, 9), rng.choice([0.0, 0.2, 0.6, 1.0]))
        scale = rng.choice([0.5, 2.0, 6.0])
        logits = [[rng.gauss(0, scale) for _ in range(vocab)] for _ in range(k)]
        length = mx.array(len(history) - 1, mx.int32)
        drafts, drafted = find_believed(buffer.tokens, length, mx.array(logits), params)
        want, want_drafted, margin = python_believed(history, logits, params)
        if margin < 1e-4:  # a tie in float32 that float64 breaks
            continue
        assert drafted.item() == want_drafted, trial
        if want_drafted:
            assert drafts.tolist() == want, trial
            n = find(buffer.tokens, length, k, params)[1].item()
            by_match += n >= params.min_ngram
            by_belief += n < params.min_ngram
        else:
            declined += 1
    assert by_match > 30 and by_belief > 30 and declined > 30  # every branch is exercised


def test_history_writes_at_a_device_offset_and_grows():
    buffer = TokenHistory([1, 2, 3])
    buffer.reserve(300)
    assert buffer.capacity == 512 and buffer.tokens[:3].tolist() == [1, 2, 3]
    buffer.write(mx.array([7, 8, 9]), mx.array(3, mx.int32))
    assert buffer.tokens[:6].tolist() == [1, 2, 3, 7, 8, 9]


def test_the_gate_keeps_lookup_while_it_wins():
    gate = LookupGate()
    assert gate.enabled  # starts on
    gate.record(True, True, 5, 1)  # lookup's chain kept 5, the drafter's would have kept at least 1
    gate.record(False, False, 3, -1)  # no match: no comparison
    assert gate.enabled
    gate.record(True, True, 0, 1)
    gate.record(True, False, 4, 0)  # lookup off: the drafter kept 4, lookup's chain would have kept 0
    gate.record(True, False, 3, 0)
    assert not gate.enabled


def copy_heavy(rng: random.Random, n: int = 24) -> list[int]:
    """A prompt that repeats itself, as an edit of a given file does."""
    text = [rng.randrange(VOCAB - 1) for _ in range(n)]
    return text + text[: n // 2] + [rng.randrange(VOCAB - 1)] + text[n // 2 :]


def dense_pair():
    tcfg = target_config("qwen3", vocab=VOCAB)
    model = make_target(tcfg, seed=3)
    dcfg = draft_config(tcfg, layers=1, block_size=8)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=4))


def family_pair(family: str):
    cfg = family_config(family, vocab=VOCAB, layers=6 if family.startswith("gemma") else 4)
    model = make_family_target(cfg, seed=1)
    dcfg = draft_config(cfg, layers=1, block_size=8)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=2))


def decoded(model, draft, prompt, **kw):
    responses = list(stream_generate(model, draft, make_tokenizer(VOCAB), prompt, **kw))
    return [t for r in responses for t in r.tokens], responses


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_5"])
def test_greedy_with_lookup_equals_mlx_lm(family, compiled):
    """Dense, sliding-window and hybrid targets, beside a drafter and alone,
    over block sizes and lookup on and auto; prompts past the window (8)."""
    model, draft = dense_pair() if family == "qwen3" else family_pair(family)
    rng = random.Random(1)
    hits = accepted = 0
    for i, (bs, lookup) in enumerate([(2, True), (5, "auto"), (8, True), ("auto", True)]):
        prompt = copy_heavy(rng, 12 + 7 * i)
        want = greedy_reference(model, prompt, 32)
        for drafter in (draft, None):
            tokens, responses = decoded(model, drafter, prompt, max_tokens=32, block_size=bs, lookup=lookup)
            assert tokens == want, (bs, lookup, drafter is None)
            hits += responses[-1].lookup_hits
            accepted += sum(r.accepted for r in responses[1:])
    assert hits and accepted  # vacuous if nothing were looked up or accepted


def test_lookup_statistics_count_hit_cycles_and_their_tokens():
    model, draft = dense_pair()
    prompt = copy_heavy(random.Random(2))
    tokens, responses = decoded(model, None, prompt, max_tokens=40, block_size=8, lookup=True)
    assert tokens == greedy_reference(model, prompt, 40)
    last = responses[-1]
    # a lookup-only drafter looks up every block it drafts; nothing else is drafted
    assert 0 < last.lookup_hits <= last.cycles - last.plain_cycles
    assert last.lookup_tokens <= len(tokens) - 1
    plain, _ = decoded(model, draft, prompt, max_tokens=40, block_size=8)
    assert plain == tokens
    off = decoded(model, draft, prompt, max_tokens=40, block_size=8)[1][-1]
    assert off.lookup_hits == off.lookup_tokens == 0


def test_a_copy_heavy_reply_commits_more_per_cycle_with_lookup():
    """A target that repeats what it has read: looked-up drafts are accepted
    where the random drafter's are not."""
    model, draft = dense_pair()
    prompt = copy_heavy(random.Random(3), 30)
    _, without = decoded(model, draft, prompt, max_tokens=48, block_size=8)
    _, with_lookup = decoded(model, draft, prompt, max_tokens=48, block_size=8, lookup=True)
    assert with_lookup[-1].lookup_hits > 0
    assert with_lookup[-1].lookup_tokens > with_lookup[-1].lookup_hits  # hits committed drafts, not just the bonus
    assert with_lookup[-1].cycles < without[-1].cycles


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 1.0, 0), (1.0, 0.9, 5)])
def test_seeded_samples_with_lookup_are_the_plain_samplers(temperature, top_p, top_k, compiled):
    model, draft = dense_pair()
    prompt = copy_heavy(random.Random(4), 16)
    for seed in (0, 1):
        want = plain_sampled(model, prompt, 32, seed, temperature, top_p, top_k)
        for drafter, bs, lookup in [(draft, 6, True), (draft, 8, "auto"), (None, 4, True)]:
            got, _ = decoded(
                model,
                drafter,
                prompt,
                max_tokens=32,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                block_size=bs,
                lookup=lookup,
            )
            assert got == want, (seed, bs, lookup, drafter is None)


@pytest.mark.parametrize("lookup_only", [False, True])
def test_prompt_cache_exact_across_turns_and_a_stopped_generator(lookup_only):
    model, draft = dense_pair()
    drafter = lookup_drafter(model) if lookup_only else draft
    cache = make_prompt_cache(model, drafter)
    rng = random.Random(5)
    turn1 = copy_heavy(rng, 14)
    out1, _ = decoded(model, drafter, turn1, max_tokens=20, block_size=6, prompt_cache=cache, lookup=True)
    assert out1 == greedy_reference(model, turn1, 20)
    turn2 = turn1 + out1 + turn1[:6]
    out2, _ = decoded(model, drafter, turn2, max_tokens=20, block_size=6, prompt_cache=cache, lookup=True)
    assert out2 == greedy_reference(model, turn2, 20)
    # stop a reply after two cycles: the cache keeps only what was committed
    gen = stream_generate(
        model, drafter, make_tokenizer(VOCAB), turn2 + [9], max_tokens=30, prompt_cache=cache, lookup=True, block_size=5
    )
    seen = next(gen).tokens + next(gen).tokens + next(gen).tokens
    gen.close()
    assert cache.tokens == turn2 + [9] + seen[:-1]
    assert cache.consistent()
    turn3 = turn2 + [9] + seen + turn1[:4]
    out3, _ = decoded(model, drafter, turn3, max_tokens=16, block_size=4, prompt_cache=cache, lookup="auto")
    assert out3 == greedy_reference(model, turn3, 16)


def test_lookup_only_drafter_needs_no_drafter_module():
    model, _ = dense_pair()
    assert lookup_drafter(model) is lookup_drafter(model)
    assert tree_flatten(lookup_drafter(model).parameters()) == []  # no weights
    prompt = copy_heavy(random.Random(6))
    for bs in (2, 3, 16):
        tokens, responses = decoded(model, None, prompt, max_tokens=24, block_size=bs, lookup=True)
        assert tokens == greedy_reference(model, prompt, 24), bs
        assert {r.block_size for r in responses[1:]} == {bs}


def test_bad_lookup_settings_say_how_to_fix_them():
    model, draft = dense_pair()
    tok = make_tokenizer(VOCAB)
    with pytest.raises(ValueError, match="lookup must be"):
        stream_generate(model, draft, tok, [1, 2], lookup="yes")
    with pytest.raises(ValueError, match="lookup must be"):
        stream_generate(model, draft, tok, [1, 2], lookup=1)
    with pytest.raises(ValueError, match="lookup=True"):
        stream_generate(model, None, tok, [1, 2])


def test_a_looked_up_draft_is_a_one_hot_proposal_on_dflash2s_path(tmp_path):
    """A DFlash 2 drafter samples drafts with their q; a looked-up chain is
    the proposal q = one-hot, accepted by the same rule: sampled sequences
    follow the target's own distribution (chi-square, 1e-3)."""
    import numpy as np
    from test_dflash2 import small_sampling_pair
    from test_sampling import chi_square_pvalue, sequence_distribution

    model, draft = small_sampling_pair(tmp_path)
    tok = make_tokenizer(6)
    # "1 2 y" occurs for every y: whatever the first token, the first block is looked up
    prompt, length, n = [t for y in range(6) for t in (1, 2, y)] + [1, 2], 3, 500
    seqs, expected = sequence_distribution(model, prompt, length, 1.0, 1.0, 0)
    index = {s: i for i, s in enumerate(seqs)}
    observed = np.zeros(len(seqs))
    hits = rejected = 0
    for seed in range(n):
        responses = list(
            stream_generate(
                model, draft, tok, prompt, max_tokens=length, temperature=1.0, block_size=3, seed=seed, lookup=True
            )
        )
        observed[index[tuple(t for r in responses for t in r.tokens)]] += 1
        hits += responses[-1].lookup_hits
        rejected += sum(r.lookup_hit and r.accepted < r.block_size - 1 for r in responses[1:])
    assert hits > n // 2 and rejected > n // 10
    assert chi_square_pvalue(observed, n * expected) > 1e-3


def test_the_servers_usage_carries_the_lookup_figures():
    from dflash_mlx.server.decoder import dflash_figures

    model, draft = dense_pair()
    prompt = copy_heavy(random.Random(7))
    _, responses = decoded(model, draft, prompt, max_tokens=40, block_size=8, lookup=True)
    last = responses[-1]
    figures = dflash_figures(last, {r.block_size for r in responses})
    assert figures["lookup_hits"] == last.lookup_hits > 0
    assert figures["lookup_tokens"] == last.lookup_tokens == sum(len(r.tokens) for r in responses if r.lookup_hit)


def test_a_stale_generator_with_lookup_leaves_the_cache_exact():
    from dflash_mlx.cache.prompt import StaleGenerationError

    model, draft = dense_pair()
    cache = make_prompt_cache(model, draft)
    tok = make_tokenizer(VOCAB)
    prompt = copy_heavy(random.Random(8), 16)
    old = stream_generate(model, draft, tok, prompt, max_tokens=30, prompt_cache=cache, lookup=True, block_size=6)
    next(old), next(old)
    newer = prompt[:10] + [5, 6]
    out, _ = decoded(model, draft, newer, max_tokens=20, block_size=6, prompt_cache=cache, lookup=True)
    assert out == greedy_reference(model, newer, 20)
    with pytest.raises(StaleGenerationError):
        next(old)
    assert cache.consistent()
    follow = newer + out + newer[:5]
    again, _ = decoded(model, draft, follow, max_tokens=12, block_size=6, prompt_cache=cache, lookup="auto")
    assert again == greedy_reference(model, follow, 12)


def test_one_compiled_trace_serves_lookup_on_and_auto(monkeypatch):
    """Whether a match is drafted from is an input of the trace, not a key:
    "auto" switching it on and off replays the same graph."""
    from dflash_mlx.decode.traces import traces_for
    from dflash_mlx.targets import adapt

    monkeypatch.setattr(Cycle, "compile_graphs", True)
    model, draft = dense_pair()
    prompt = copy_heavy(random.Random(9))
    for lookup in (True, "auto", True):
        tokens, _ = decoded(model, draft, prompt, max_tokens=24, block_size=7, lookup=lookup)
        assert tokens == greedy_reference(model, prompt, 24)
    keys = [k for k in traces_for(adapt(model), draft).compiled if k[0] == 7 and "lookup" in k]
    assert len(keys) == 1
