"""Plain steps leave the drafter's context feed for later (cycle.py): the
output, the drafts and the drafter's context come out exactly as when every
step feeds the drafter at once, whether the decode ends, is closed during
plain steps, or resumes drafting after them, with cycles compiled or not."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import greedy_reference, make_tokenizer

import dflash_mlx.generation as speculative
from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.auto.chooser import BlockChooser
from dflash_mlx.decode.cycle import Cycle

# Runs of plain steps (1) between drafting cycles of several sizes.
SCRIPT = [1, 1, 1, 4, 1, 1, 1, 1, 1, 8, 16, 1, 1, 4, 1, 1, 1, 1, 1, 1, 1, 16, 1]


class Scripted(BlockChooser):
    """A chooser that plays ``script`` (SCRIPT) over and over."""

    def __init__(self, script=SCRIPT):
        super().__init__(4, 16)
        self.turn, self.script = 0, script

    def choose(self, would_build=None) -> int:
        b = self.script[self.turn % len(self.script)]
        self.turn += 1
        return b


def run(
    monkeypatch,
    model,
    draft,
    prompt,
    defer: bool,
    max_tokens=80,
    stop_after=None,
    cache=None,
    compiled: bool = False,
    script=SCRIPT,
):
    """Decode with the script (cycles through mx.compile, as on a GPU, when
    ``compiled``); returns the responses and the prompt cache (closing the
    generator after ``stop_after`` responses when given)."""
    monkeypatch.setattr(Cycle, "defer_feed", defer)
    monkeypatch.setattr(Cycle, "compile_graphs", compiled)
    monkeypatch.setattr(speculative.block_memory, "chooser", lambda *a: Scripted(script))
    cache = cache or make_prompt_cache(model, draft)
    if hasattr(draft, "set_script"):  # (the hybrid pair's drafter proposes the target's reply)
        draft.set_script(prompt + greedy_reference(model, prompt, max_tokens))
    gen = stream_generate(
        model,
        draft,
        make_tokenizer(draft.config.vocab_size),
        prompt,
        max_tokens=max_tokens,
        block_size="auto",
        prompt_cache=cache,
    )
    responses = []
    for r in gen:
        responses.append(r)
        if stop_after is not None and len(responses) == stop_after:
            gen.close()
            break
    return responses, cache


def context(cache) -> list[np.ndarray]:
    """The drafter's context keys and values over the committed positions."""
    n = len(cache.tokens)
    return [np.array(a[:, :, :n].astype(mx.float32)) for c in cache.draft for a in (c.keys, c.values)]


@pytest.fixture(params=["dense", "hybrid"])
def pair(request, agreeing_pair):
    """A pair whose drafts get accepted: a dense target's, or a hybrid
    target's (gated delta-net layers) with a drafter proposing its reply."""
    if request.param == "dense":
        return agreeing_pair
    from test_hybrid import make_pair

    return make_pair("qwen3_5")


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("prompt", [[3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
def test_deferred_feed_changes_nothing_but_the_time(monkeypatch, pair, prompt, compiled):
    model, draft = pair
    now, cache_now = run(monkeypatch, model, draft, prompt, defer=False, compiled=compiled)
    later, cache_later = run(monkeypatch, model, draft, prompt, defer=True, compiled=compiled)
    tokens = [t for r in later for t in r.tokens]
    assert tokens == greedy_reference(model, prompt, 80)
    # the same drafts accepted at every cycle: the drafter saw the same context
    assert [(r.block_size, r.accepted) for r in later] == [(r.block_size, r.accepted) for r in now]
    assert sum(r.accepted or 0 for r in later) > 0 and any(r.block_size == 1 for r in later[1:])
    # and at the end its context holds every committed position, as fed one step at a time
    assert cache_later.tokens == cache_now.tokens and cache_later.consistent()
    for a, b in zip(context(cache_later), context(cache_now)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_closing_during_plain_steps_feeds_what_was_committed(monkeypatch, pair, compiled):
    model, draft = pair
    # responses 1 (the first token), 2-3: two plain steps; a third is queued (not
    # committed) when the generator closes, so three states wait and two are kept
    now, cache_now = run(monkeypatch, model, draft, [2, 9, 4], defer=False, stop_after=3, compiled=compiled)
    later, cache_later = run(monkeypatch, model, draft, [2, 9, 4], defer=True, stop_after=3, compiled=compiled)
    assert [r.block_size for r in later[1:]] == [1, 1]
    assert cache_later.tokens == cache_now.tokens and cache_later.consistent()
    for a, b in zip(context(cache_later), context(cache_now)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the conversation goes on from that cache exactly
    more = cache_later.tokens + [later[-1].tokens[-1], 5]
    again, _ = run(monkeypatch, model, draft, more, defer=True, max_tokens=30, cache=cache_later, compiled=compiled)
    assert [t for r in again for t in r.tokens] == greedy_reference(model, more, 30)


@pytest.mark.parametrize("compiled", [False, True])
def test_drafting_after_plain_steps_grows_the_drafters_buffers_as_the_targets(monkeypatch, agreeing_pair, compiled):
    """Long runs of plain steps across the buffers' 256-position steps: the
    drafter's buffers, fed the deferred states, keep the target's width
    (fed at the bound they were deferred at, not the bound of the cycle
    that resumes drafting, which grew them the run's length wider), and
    each drafting cycle's graphs are those ``would_build`` named beforehand."""
    model, draft = agreeing_pair
    predicted, widths = [], []
    launch = Cycle.launch

    def spy(self, block_size, *args, **kw):
        shape = self._shape(block_size, args[2])  # (last, length, bound)
        flight = launch(self, block_size, *args, **kw)
        if block_size > 1:
            predicted.append(shape[-1])  # the drafter's width
            widths.append(self.caches.draft[0].capacity)
        return flight

    monkeypatch.setattr(Cycle, "launch", spy)
    prompt = list(range(1, 21)) * 11  # 220 positions: a run of 30 plain steps crosses 256, then 4 drafting cycles
    responses, cache = run(
        monkeypatch, model, draft, prompt, defer=True, max_tokens=150, compiled=compiled, script=[1] * 30 + [4] * 4
    )
    assert [t for r in responses for t in r.tokens] == greedy_reference(model, prompt, 150)
    assert widths and widths == predicted
    assert max(widths) > 256 and all(c.capacity <= cache.target[0].capacity for c in cache.draft)
