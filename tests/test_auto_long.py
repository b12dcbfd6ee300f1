"""``block_size="auto"`` with long prompts: where a block costs more than it
commits (a long context makes every cycle dearer, a block's faster than a
plain step's) auto turns to plain steps within a few cycles and stays
within 3% of plain decoding; where drafts are accepted it keeps block 16's
gain; the context each reply starts at keeps one context's times from
deciding another's; the output is the target's own whatever auto picks."""

import random

from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
)

from dflash_mlx import stream_generate
from dflash_mlx.auto.chooser import BlockChooser, chooser_for, forget


def h100_8b(b: int, context: int) -> float:
    """Qwen3-8B shapes on an H100 (seconds), as benchmarks/auto_sim.py models
    them: a block-16 cycle costs 1.2 plain steps at 8k, 1.44 at 16k, 1.88 at 32k."""
    k = context / 1000
    return (10.5 + 0.05 * k) / 1000 if b == 1 else (9.9 + 0.40 * k) / 1000


def h100_8b_measured(b: int, context: int) -> float:
    """The same shapes as long_context.py measures them: a block-16 cycle
    costs 1.09 plain steps at 16k and 1.22 at 32k, so a drafter must have its
    first draft accepted about one cycle in six at 32k to pay."""
    return 0.0118 if b == 1 else (11.4 + 0.0925 * context / 1024) / 1000


CHANGE = 0.002  # what a change of block size costs the host on top


def replies(chooser, prompts, accept_rate, cycles=64, seed=0, seconds=h100_8b):
    """A reply of ``cycles`` cycles per prompt length, the chooser told of
    each as the decode loop tells it; per reply: (blocks used, tokens, seconds)."""
    rng = random.Random(seed)
    out, last = [], None
    for prompt in prompts:
        chooser.new_reply(prompt)
        context, used, tokens, spent = prompt, [], 0, 0.0
        for _ in range(cycles):
            b = chooser.choose()
            accepted = 0
            while accepted < b - 1 and rng.random() < accept_rate:
                accepted += 1
            t = seconds(b, context) + (CHANGE if last not in (None, b) else 0.0)
            chooser.record(b, accepted, t)
            used.append(b)
            tokens, spent, context, last = tokens + accepted + 1, spent + t, context + accepted + 1, b
        out.append((used, tokens, spent))
    return out


def rate_against(runs, seconds) -> float:
    """The replies' tokens a second against ``seconds`` a token (plain decoding's)."""
    tokens = sum(n for _, n, _ in runs)
    return tokens * seconds / sum(s for _, _, s in runs)


def test_nothing_accepted_after_a_long_prompt_turns_plain_within_a_few_cycles():
    """Random weights at Qwen3-8B shapes: with 64 cycles a reply, auto ran at
    0.70x plain decoding with an 8k prompt and 0.42x at 32k when plain steps
    could win only after 64 drafting cycles. At 16k and 32k it turns plain
    once its probes are done; at 8k, where a block costs 1.2 plain steps,
    by the end of the first reply. After that first reply (speed.py's warm-up
    round), its replies run within 3% of plain decoding."""
    for k, first_plain in ((8, 72), (16, 32), (32, 20)):
        prompt = k * 1024
        runs = replies(BlockChooser(4, 16), [prompt] * 9, 0.0)
        used = [b for u, _, _ in runs for b in u]
        settled = next(i for i in range(16, len(used)) if set(used[i : i + 8]) == {1})
        assert settled <= first_plain, (k, used[:80])
        assert rate_against(runs[1:], h100_8b(1, prompt)) >= 0.97, k


def test_nothing_accepted_at_32k_runs_mostly_plain_within_the_first_reply():
    """At 1.22 plain steps a block-16 cycle, auto drafted for a whole 64-token
    reply with nothing accepted: its hopeful acceptance stayed near 0.2 while
    the faded counts held 32 cycles at most. Counted whole, the first drafts
    none of which was accepted show within the first reply that no block pays."""
    for seed in range(3):
        first, second = replies(BlockChooser(4, 16), [32768] * 2, 0.0, seed=seed, seconds=h100_8b_measured)
        assert first[0].count(1) > 32, (seed, first[0])
        assert first[0][-16:] == [1] * 16, seed
        assert second[0].count(1) > 0.85 * len(second[0]), seed


def test_drafts_accepted_at_32k_keep_drafting_within_the_first_reply():
    """Where a block-16 cycle commits more than its 1.22 plain steps (first
    drafts accepted at 0.3 or 0.7), the first reply drafts past its probes."""
    n = BlockChooser.PROBE_RUN
    for accept in (0.3, 0.7):
        for seed in range(3):
            runs = replies(BlockChooser(4, 16), [32768] * 2, accept, seed=seed, seconds=h100_8b_measured)
            first = runs[0][0][4 * n :]
            assert sum(b > 1 for b in first) > 0.9 * len(first), (accept, seed, first)
            assert sum(b > 1 for b in runs[1][0]) > 0.9 * len(runs[1][0]), (accept, seed)


def test_a_size_probed_once_does_not_set_the_cost_line():
    """Blocks 4 and 8 timed once in their probes, a little fast; block 16
    timed every cycle since: the line at 16 is block 16's own time, not one
    the two single probes pull down (which kept auto drafting at 16k, where
    a block-16 cycle costs 1.09 plain steps)."""
    c = BlockChooser(4, 16)
    for b, t in [(4, 0.0120)] * 4 + [(8, 0.0120)] * 4 + [(16, 0.0128), (16, 0.0134)] * 18:
        c.record(b, 0, t)
    a, slope = c.cost()
    assert abs(a + slope * 16 - c._median_times()[16]) < 0.003 * c._median_times()[16]


def test_probes_first_then_plain_at_32k():
    c = BlockChooser(4, 16)
    used = replies(c, [32768], 0.0, cycles=24)[0][0]
    n = BlockChooser.PROBE_RUN
    assert used[: 4 * n] == [16] * n + [4] * n + [8] * n + [1] * n
    assert set(used[4 * n + 2 :]) == {1}  # no drafting cycle past the probes but the few the fit needs
    assert c.reason == "plain: blocks cost more than they commit"


def test_a_drafter_that_accepts_little_on_a_long_prompt_runs_plain():
    """A drafter at 0.2 on a 32k prompt commits 1.25 tokens a block-16 cycle,
    which costs 1.88 plain steps: plain steps win within two replies, at
    once where the first cycles accepted nothing."""
    for seed in range(4):
        runs = replies(BlockChooser(4, 16), [32768] * 9, 0.2, seed=seed)
        assert runs[1][0][-32:] == [1] * 32, seed  # plain by the second reply
        # exploring included, which may lose 2% of the time where plain steps win
        assert rate_against(runs[1:], h100_8b(1, 32768)) >= 0.965, seed


def test_good_acceptance_on_a_long_prompt_keeps_block_16s_gain():
    """A drafter at 0.78 pays at 32k too (4.4 tokens a cycle of 1.88 plain
    steps): auto keeps drafting with block 16 and runs within 5% of it,
    probes and exploring included."""
    for seed in range(3):
        c = BlockChooser(4, 16)
        runs = replies(c, [32768] * 9, 0.78, seed=seed)
        block16 = replies(_Fixed(16), [32768] * 9, 0.78, seed=seed)
        used = [b for u, _, _ in runs[1:] for b in u]
        assert used.count(16) > 0.9 * len(used), seed
        assert rate_against(runs[1:], 1.0) >= 0.95 * rate_against(block16[1:], 1.0), seed
        assert rate_against(runs[1:], h100_8b(1, 32768)) > 2.0, seed  # over twice plain decoding's rate


def test_drafting_comes_back_when_the_drafter_turns_good_on_a_long_prompt():
    """After replies where nothing was accepted (plain steps won), a drafter
    at 0.78 pays again at 32k: a reply's drafting run or an exploring one
    finds it and goes on while it pays, a dip of the counts back below plain
    steps' rate notwithstanding (the counts still hold the bad replies)."""
    for seed in range(6):
        c = BlockChooser(4, 16)
        replies(c, [32768] * 4, 0.0, seed=seed)
        runs = replies(c, [32768] * 8, 0.78, seed=seed)
        back = next(k for k, (u, _, _) in enumerate(runs) if sum(b > 1 for b in u) > 48)
        assert back <= 3, seed
        later = [b for u, _, _ in runs[back:] for b in u]
        assert sum(b > 1 for b in later) > 0.9 * len(later), seed


def test_a_reply_at_another_context_is_not_judged_by_the_last_ones_times():
    """Replies after 1k and after 32k tokens in turn, a drafter at 0.4: a
    block-16 cycle pays after 1k (1.67 tokens for 0.98 plain steps) and not
    after 32k (for 1.88). Each context's replies follow their own times:
    the ones after 1k draft, the ones after 32k run plain."""
    c = BlockChooser(4, 16)
    prompts = [32768 if i % 2 == 0 else 1024 for i in range(40)]
    runs = replies(c, prompts, 0.4, seed=1)
    late = runs[10:]
    short = [b for i, (u, _, _) in enumerate(late) if prompts[10 + i] == 1024 for b in u]
    long = [b for i, (u, _, _) in enumerate(late) if prompts[10 + i] == 32768 for b in u]
    assert sum(b > 1 for b in short) > 0.75 * len(short)
    assert sum(b == 1 for b in long) > 0.75 * len(long)
    # the same replies without their contexts: every size's times mixed
    blind = BlockChooser(4, 16)
    rng_runs = replies(_Untold(blind), prompts, 0.4, seed=1)
    told, untold = rate_against(late, 1.0), rate_against(rng_runs[10:], 1.0)
    assert told > 1.05 * untold


class _Fixed:
    """A fixed block size, as ``block_size=16`` runs."""

    def __init__(self, block):
        self.block = block

    def new_reply(self, context):
        pass

    def choose(self):
        return self.block

    def record(self, *args):
        pass


class _Untold:
    """A chooser as a decode loop that does not tell it the context drives it."""

    def __init__(self, chooser):
        self.chooser = chooser

    def new_reply(self, context):
        self.chooser.new_reply()

    def choose(self):
        return self.chooser.choose()

    def record(self, *args):
        self.chooser.record(*args)


def test_each_reply_counts_its_plain_steps_and_drafting_cycles():
    c = BlockChooser(4, 16)
    runs = replies(c, [32768] * 3, 0.0)
    used = runs[-1][0]
    assert (c.reply_plain, c.reply_drafting) == (used.count(1), len(used) - used.count(1))
    assert c.reply_plain > 0.9 * len(used)
    assert c.reason.startswith("plain:")
    c.new_reply(32768)
    assert (c.reply_plain, c.reply_drafting) == (0, 0)
    good = BlockChooser(4, 16)
    replies(good, [1024] * 3, 0.8)
    assert good.reason == "drafting: block 16 pays"


def test_the_context_is_remembered_and_a_bad_one_refused():
    c = BlockChooser(4, 16)
    replies(c, [32768] * 2, 0.0)
    state = c.state()
    assert state["context"] == 32768
    again = BlockChooser(4, 16)
    assert again.restore(state, 64) and again.context == 32768
    assert not BlockChooser(4, 16).restore({**state, "context": -1}, 64)
    assert not BlockChooser(4, 16).restore({**state, "context": "long"}, 64)
    older = {k: v for k, v in state.items() if k != "context"}  # a file written before the context was kept
    assert BlockChooser(4, 16).restore(older, 64)


def random_pair():
    """A tiny pair whose drafter is rarely right (random weights)."""
    tcfg = target_config("qwen3", vocab=32, layers=4)
    dcfg = draft_config(tcfg, layers=1, block_size=16, taps=[0, 2])
    return make_target(tcfg, seed=5), make_draft(dcfg, random_draft_weights(dcfg, seed=6))


def test_greedy_output_is_the_targets_whatever_auto_picks():
    """A long prompt for the tiny pair, a drafter rarely right: auto probes,
    turns to plain steps, tries drafting again at each reply; the tokens are
    mlx-lm's greedy decoding of the target every time."""
    model, draft = random_pair()
    forget(draft)
    tok = make_tokenizer(32)
    rng = random.Random(7)
    seen = set()
    for n in (700, 300, 700):
        prompt = [rng.randrange(31) for _ in range(n)]
        responses = list(stream_generate(model, draft, tok, prompt, max_tokens=60, block_size="auto"))
        assert [t for r in responses for t in r.tokens] == greedy_reference(model, prompt, 60)
        seen |= {r.block_size for r in responses[1:]}
    chooser = chooser_for(draft, 4, 16)
    assert 1 in seen and max(seen) == 16  # plain steps and drafting both ran
    assert chooser.reply_plain + chooser.reply_drafting == len(responses) - 1  # the last reply's cycles
