"""block_size="auto": the chooser's arithmetic, and that the output stays the
target's own while the block size changes from cycle to cycle."""

import random

import pytest
from tiny import greedy_reference, make_tokenizer

from dflash_mlx import stream_generate
from dflash_mlx.auto.chooser import BlockChooser, chooser_for, forget
from dflash_mlx.decode.traces import forget_traces


def feed(
    chooser: BlockChooser, accept_rate: float, seconds, cycles: int, seed: int = 0, change: float = 0.0
) -> list[int]:
    """Run ``cycles`` simulated cycles: each draft accepted with ``accept_rate``
    given the ones before, a cycle of block b taking seconds(b), plus ``change``
    when b differs from the last cycle's block (what a GPU's host pays for it)."""
    rng = random.Random(seed)
    used = []
    for _ in range(cycles):
        b = chooser.choose()
        accepted = 0
        while accepted < b - 1 and rng.random() < accept_rate:
            accepted += 1
        chooser.record(b, accepted, seconds(b) + (change if used and used[-1] != b else 0.0))
        used.append(b)
    return used


def best_block(accept_rate: float, seconds, chooser: BlockChooser) -> int:
    def rate(b):
        return sum(accept_rate**i for i in range(b)) / seconds(b)

    return max(chooser.sizes, key=rate)


def test_probes_long_short_and_middle_first():
    c = BlockChooser(4, 16)
    n = BlockChooser.PROBE_RUN
    used = feed(c, 0.5, lambda b: 1.0, 4 * n)
    assert used == [16] * n + [4] * n + [8] * n + [1] * n  # the last: plain target steps
    # cycles cut short (max_tokens below the block) still count as probes
    c = BlockChooser(4, 16)
    for _ in range(4 * n):
        b = c.choose()
        c.record(min(b, 12), 1, 0.01)
    assert all(c.asked[b] >= n for b in c.probe)


def test_flat_cost_picks_the_longest_block():
    # A GPU-like machine: a cycle costs the same whatever its length.
    c = BlockChooser(4, 16, explore=0)
    used = feed(c, 0.8, lambda b: 0.004, 200)
    assert used[-50:] == [16] * 50


def test_cost_growing_with_the_block_picks_the_best_short_block():
    # A CPU-like machine: the cost grows with the tokens verified.
    def seconds(b):
        return 0.010 + 0.004 * b

    c = BlockChooser(4, 16, explore=0)
    used = feed(c, 0.7, seconds, 400)
    want = best_block(0.7, seconds, c)
    assert want < 10
    tail = used[-100:]
    assert max(set(tail), key=tail.count) == want


def h100_pair(b):
    """The built-in pair on an H100, roughly (seconds): plain 1.3 ms, any block 2.8 ms."""
    return 0.0013 if b == 1 else 0.0028


def cpu_pair(b):
    """The built-in pair on the 2-core CPU, roughly: plain 9 ms, a block 24 + 4.5 b ms."""
    return 0.009 if b == 1 else 0.024 + 0.0045 * b


def plain_cost(b):
    """A drafting cycle costs a little more than a plain step, growing with the block."""
    return 0.010 if b == 1 else 0.012 + 0.0005 * b


def test_plain_steps_when_no_block_pays_and_drafting_resumes_when_it_does():
    c = BlockChooser(4, 16, explore=16)
    used = feed(c, 0.0, plain_cost, 300)  # a drafter that is never right
    tail = used[-160:]
    assert tail.count(1) > 0.8 * len(tail)
    assert {4, 16} <= set(tail)  # exploration goes on
    used = feed(c, 0.9, plain_cost, 2500, seed=3)  # the text turns predictable
    # drafting again, with the longest blocks (12 and 16 are within 2% here);
    # plain steps only as exploring runs (the plain step's time stays measured)
    tail = used[-160:]
    assert tail.count(16) + tail.count(12) > 0.8 * len(tail)
    assert tail.count(1) <= BlockChooser.EXPLORE_RUN * (len(tail) // 16 + 1)


def test_good_acceptance_runs_plain_steps_only_to_keep_their_time_measured():
    c = BlockChooser(4, 16, explore=16)
    used = feed(c, 0.7, plain_cost, 600)
    late = used[12:]
    assert 0 < late.count(1) <= BlockChooser.EXPLORE_RUN * (len(late) // 16 + 1)
    runs = [i for i in range(1, len(late)) if late[i] == 1 and late[i - 1] != 1]
    assert runs and all(late[i : i + BlockChooser.EXPLORE_RUN] == [1] * BlockChooser.EXPLORE_RUN for i in runs)
    assert c.exploring_loss[1] <= BlockChooser.EXPLORE_SHARE / 3 * c.seconds


def test_a_change_of_size_is_not_charged_to_the_size():
    """On a GPU the host pays for changing the block size (other graphs to
    launch; a drafting cycle after plain steps also feeds the drafter their
    states). A chooser that settled on plain steps while the drafter was
    wrong must see drafting's own cost once the text turns predictable, not
    the change's, and go back to drafting."""

    def seconds(b):  # the built-in pair on an H100, roughly (ms): plain 1.8, any block 3
        return 0.0018 if b == 1 else 0.003

    c = BlockChooser(4, 16)
    used = feed(c, 0.0, seconds, 300, change=0.0025)  # a drafter that is never right
    assert used[-100:].count(1) > 80
    used = feed(c, 0.75, seconds, 1500, seed=1, change=0.0025)
    assert used[-200:].count(16) > 0.8 * 200
    times = c._median_times()
    assert times[16] == pytest.approx(0.003) and times[1] == pytest.approx(0.0018)


def test_a_sizes_slow_first_cycles_do_not_rule_it_out():
    """In a fresh process a size's first few cycles run slow (kernels and
    graphs met for the first time; ~1.7x on an H100 for the built-in pair).
    Probing leaves a size two timed cycles and takes the lower median, so one
    slow cycle does not make the longest block look dearer than plain steps
    for the rest of the process."""

    def seconds(b):  # the built-in pair on an H100, roughly: plain 1.3 ms, any block 2.5 ms
        return 0.0013 if b == 1 else 0.0025

    for seed in range(3):
        c = BlockChooser(4, 16)
        rng = random.Random(seed)
        met = {}
        used = []
        for _ in range(400):
            b = c.choose()
            accepted = 0
            while accepted < b - 1 and rng.random() < 0.7:
                accepted += 1
            met[b] = met.get(b, 0) + 1
            c.record(b, accepted, seconds(b) * (2.2 if met[b] <= 3 else 1.0))
            used.append(b)
        assert used[-200:].count(16) > 0.85 * 200, seed


def test_a_hard_start_does_not_give_drafting_up_for_good():
    """A fresh process's first reply often starts where the drafter accepts
    little. Plain steps may win only after EVIDENCE drafting cycles: giving
    drafting up after a few dozen cycles of a hard start left the built-in
    pair on plain steps for a thousand cycles on an H100 (exploring a block
    from plain steps costs two changes of size there, so it is rare)."""
    for seed in range(3):
        c = BlockChooser(4, 16)
        rng = random.Random(seed)
        used = []
        for i in range(400):
            b = c.choose()
            accepted = 0
            while accepted < b - 1 and rng.random() < (0.35 if i < 40 else 0.78):
                accepted += 1
            c.record(b, accepted, h100_pair(b) + (0.004 if used and used[-1] != b else 0.0))
            used.append(b)
        assert used[-300:].count(16) > 0.85 * 300, seed


def test_a_long_hard_stretch_is_left_behind_when_the_text_turns():
    """After 100 cycles where the drafter accepts little, plain steps win;
    when the text turns predictable, the few exploring runs that the share
    allows must be enough to bring drafting back: acceptance counts fade
    over MEMORY drafting cycles, so recent runs outweigh the stretch
    (counts kept for 2,000 cycles held plain steps to the end here)."""
    for seed in range(1, 4):
        c = BlockChooser(4, 16)
        used = feed(c, 0.35, h100_pair, 100, seed=seed, change=0.004)
        assert used[-20:] == [1] * 20  # plain steps won the stretch
        used = feed(c, 0.78, h100_pair, 2900, seed=seed, change=0.004)
        assert used[-1000:].count(16) > 0.9 * 1000, seed


def test_jittery_times_of_blocks_that_cost_alike_keep_the_longest():
    """Where every block costs alike (a GPU), a host whose cycle times jitter
    by a quarter gives the few times of a rarely tried size a slope by chance.
    The fit takes the slope down by its standard error, so chance does not
    send the chooser to shorter blocks (without it: 16 for about half of the
    cycles, 12, 8 and 4 for the rest)."""
    for seed in range(3):
        noise = random.Random(100 + seed)
        c = BlockChooser(4, 16)
        used = feed(c, 0.78, lambda b: h100_pair(b) * noise.lognormvariate(0.0, 0.25), 1500, seed=seed, change=0.004)
        assert used[-1000:].count(16) > 0.9 * 1000, seed


def test_an_exploring_run_that_pays_goes_on():
    """On a CPU where plain steps won 1,000 cycles of hard text, a text that
    turns predictable makes long blocks pay. The first exploring run of a
    long block then goes on, since it commits more tokens a second than the
    plain steps, until the counts let drafting win; runs of three, each paid
    from the exploring share, were too rare to move the counts (plain steps
    to the end)."""
    for seed in range(1, 4):
        c = BlockChooser(4, 16)
        used = feed(c, 0.6, cpu_pair, 1000, seed=seed, change=0.0005)
        assert used[-100:].count(1) > 90  # plain steps won the hard text
        used = feed(c, 1.0, cpu_pair, 2000, seed=seed, change=0.0005)
        first = used.index(16)
        assert used[first : first + 20] == [16] * 20, seed  # the run went on
        assert used[-500:].count(16) > 0.85 * 500, seed  # and drafting won (exploring aside)


def test_a_host_that_speeds_up_does_not_send_a_gpu_to_short_blocks():
    """A GPU's host drifts: when it turns twice as fast, the best block's
    times are those of the slow moment until it runs again. An exploring run
    of a short block timed after the change must not go on for beating
    them (on an H100 a block of 4 ran for 161 of 345 cycles so)."""
    for seed in range(3):
        c = BlockChooser(4, 16)
        feed(c, 0.78, h100_pair, 500, seed=seed, change=0.004)
        used = feed(c, 0.78, lambda b: 0.00065 if b == 1 else 0.0014, 1000, seed=seed, change=0.002)
        assert used[-500:].count(16) > 0.9 * 500, seed


def replies(
    chooser: BlockChooser, accept_rates: list[float], seconds, cycles: int, change: float, seed: int = 0
) -> list[list[int]]:
    """One ``feed`` of ``cycles`` cycles per reply, the chooser told of each
    new reply as the decode loop tells it; the blocks used, by reply."""
    used = []
    for k, rate in enumerate(accept_rates):
        chooser.new_reply()
        used.append(feed(chooser, rate, seconds, cycles, seed=seed * 1000 + k, change=change))
    return used


def test_a_reply_after_a_hard_one_starts_by_drafting():
    """Prompts differ: after a hard reply, plain steps win (rightly), and they
    tell nothing of the drafter's acceptance. The next reply starts with a
    drafting run, which goes on while it pays, so an easy reply is drafted
    (without it: plain steps through the easy replies, as on an H100 where a
    process starting from a remembered chooser ran 973 of 1,001 code cycles
    plainly)."""
    for seed in range(3):
        c = BlockChooser(4, 16)
        feed(c, 0.78, h100_pair, 100, seed=seed, change=0.004)  # probes and EVIDENCE behind it
        hard = replies(c, [0.1] * 3, h100_pair, 60, 0.004, seed)
        assert hard[-1][-20:] == [1] * 20, seed  # plain steps won the hard replies
        easy = replies(c, [0.78] * 8, h100_pair, 40, 0.004, seed)
        assert easy[0][:3] == [16] * 3, seed  # the first easy reply starts with a drafting run
        assert sum(b > 1 for r in easy for b in r) > 0.6 * 8 * 40, seed  # and drafting comes back


def test_replies_that_never_pay_start_by_drafting_ever_more_rarely():
    """Where no draft is accepted, each reply whose drafting run fails doubles
    the replies that start plainly before the next try (up to MAX_REPLY_GAP):
    over 100 replies, a handful of runs."""
    c = BlockChooser(4, 16)
    used = replies(c, [0.0] * 100, h100_pair, 30, 0.004)
    started_drafting = [k for k, r in enumerate(used[10:], 10) if r[0] > 1]
    assert 2 <= len(started_drafting) <= 1 + 90 // (BlockChooser.MAX_REPLY_GAP + 1)
    assert sum(b > 1 for r in used[10:] for b in r) < 0.02 * 90 * 30


def test_what_changing_size_costs_counts_against_the_exploring_share():
    # A GPU-like machine with good acceptance: every block costs the same and
    # the longest wins; each change of size costs the host more than a cycle.
    # Decoding keeps within a few percent of the best block's rate, the
    # changes into and out of exploring runs included.
    def seconds(b):
        return 0.0018 if b == 1 else 0.003

    change = 0.006  # the first block-16 cycle after plain steps, on an H100: ~9 ms against ~3.8
    c = BlockChooser(4, 16)
    rng = random.Random(2)
    tokens = spent = 0.0
    last = None
    for cycle in range(3000):
        b = c.choose()
        accepted = 0
        while accepted < b - 1 and rng.random() < 0.75:
            accepted += 1
        t = seconds(b) + (change if last not in (None, b) else 0.0)
        c.record(b, accepted, t)
        last = b
        if cycle >= 500:
            tokens, spent = tokens + accepted + 1, spent + t
    best = sum(0.75**i for i in range(16)) / seconds(16)
    assert tokens / spent > (1 - 2 * BlockChooser.EXPLORE_SHARE) * best
    assert sorted(c.changes)[len(c.changes) // 2] == pytest.approx(change)


def test_exploration_keeps_late_positions_measured_within_its_share():
    def seconds(b):
        return 0.01 + 0.01 * b

    c = BlockChooser(4, 16, explore=8)
    used = feed(c, 0.8, seconds, 400, seed=1)
    late = used[50:]
    assert max(set(late), key=late.count) == 4  # the best block on this machine
    # The long end loses time here (it costs 3.4 short blocks for 1.02 times
    # their tokens): it is tried within the exploring share, not every 16th
    # cycle as the cadence alone would have it,
    assert late.count(16) < len(late) // 16
    assert sum(c.exploring_loss.values()) <= BlockChooser.EXPLORE_SHARE * c.seconds
    # and it goes on being tried (in runs), so late positions keep being measured
    more = feed(c, 0.8, seconds, 1500, seed=2)
    assert more.count(16) >= 2 * BlockChooser.EXPLORE_RUN
    assert sum(c.exploring_loss.values()) <= BlockChooser.EXPLORE_SHARE * c.seconds


def test_exploring_costs_a_cpu_little_when_plain_steps_win():
    # A CPU-like machine and a drafter that is rarely right: a block of 16
    # costs twelve plain steps; decoding keeps within a few percent of
    # plain decoding's rate, exploration included (it may lose EXPLORE_SHARE
    # of all the time, which counts the first cycles' probes too).
    def seconds(b):
        return 0.010 if b == 1 else 0.024 + 0.006 * b

    c = BlockChooser(4, 16)
    rng = random.Random(0)
    tokens = spent = 0.0
    for cycle in range(3000):
        b = c.choose()
        accepted = 0
        while accepted < b - 1 and rng.random() < 0.15:
            accepted += 1
        c.record(b, accepted, seconds(b))
        if cycle >= 500:
            tokens, spent = tokens + accepted + 1, spent + seconds(b)
    assert tokens / spent > (0.98 - 2 * BlockChooser.EXPLORE_SHARE) / seconds(1)


def test_exploration_follows_its_cadence_where_blocks_cost_alike():
    # A GPU-like machine: exploring costs no more than any cycle, so the
    # cadence alone sets it (hi is the best here: lo shows as exploration).
    c = BlockChooser(4, 16, explore=16)
    used = feed(c, 0.8, lambda b: 0.004, 400)
    late = used[50:]
    assert late.count(4) >= len(late) // 32 - 1


def test_a_tree_chooser_finds_the_rows_that_pay():
    """A draft tree's depth-by-depth acceptance grows with its rows, so counts
    pooled over sizes misjudge each (they sent auto to the smallest trees, at
    0.79 of the best size's rate here); each size's own tokens weigh in."""
    import math

    def rate(b):  # the chance a tree of b rows goes one deeper
        return 0.45 + 0.4 * (1 - math.exp(-b / 10))

    def depth(b):
        return min(b - 1, 15)

    def tokens(b):
        return 1.0 if b == 1 else 1 + sum(rate(b) ** i for i in range(1, depth(b) + 1))

    def seconds(b):
        return 0.010 if b == 1 else 0.011 + 0.0006 * b

    sizes = [1, *BlockChooser(4, 32).sizes]
    best = max(tokens(b) / seconds(b) for b in sizes)
    for seed in range(3):
        rng = random.Random(seed)
        c = BlockChooser(4, 32, trees=True)
        made = spent = 0.0
        for cycle in range(3000):
            b = c.choose()
            accepted = 0
            while b > 1 and accepted < depth(b) and rng.random() < rate(b):
                accepted += 1
            c.record(b, accepted, seconds(b))
            if cycle >= 2000:
                made, spent = made + accepted + 1, spent + seconds(b)
        assert made / spent > 0.88 * best, (seed, made / spent / best)


def test_one_unlucky_cycle_does_not_rule_a_tree_size_out():
    c = BlockChooser(4, 32, trees=True)
    for _ in range(60):
        c.record(16, 9, 0.02)
        c.record(4, 2, 0.012)
    c.record(32, 0, 0.03)  # its only cycle committed one token
    assert c.expected_tokens(32) > 5  # the line through every size's tokens weighs in
    assert c.expected_tokens(16) == pytest.approx(10, abs=0.3)
    assert c.expected_tokens(1) == 1.0  # a plain step commits one token, trees or not


def test_expected_tokens_follow_the_counts():
    c = BlockChooser(2, 4)
    assert c.expected_tokens(1) == 1.0
    assert c.expected_tokens(2) == pytest.approx(1.5)  # prior 1/2 with no data
    for _ in range(98):
        c.record(4, 3, None)  # every draft accepted
    # the counts fade over MEMORY drafting cycles: each is a sum of k**j
    k = 1 - 1 / BlockChooser.MEMORY
    n = k * (1 - k**98) / (1 - k)
    assert c.reached[1] == pytest.approx(n) and c.drafted == 98
    # each position's chance: its counts with a prior of two cycles at the
    # chance of the position before it (1/2 before the first)
    r1 = (n + 1) / (n + 2)
    r2 = (n + 2 * r1) / (n + 2)
    r3 = (n + 2 * r2) / (n + 2)
    assert c.expected_tokens(4) == pytest.approx(1 + r1 + r1 * r2 + r1 * r2 * r3)


def test_a_position_never_reached_is_expected_like_the_one_before_it():
    # Blocks of 8 that always accept everything: positions 8..15 were never
    # proposed, and are not taken for coin flips (a block of 16 would then
    # look barely better than one of 8, and a GPU, where both cost alike,
    # would stay on the shorter)
    c = BlockChooser(4, 16)
    for _ in range(200):
        c.record(8, 7, None)
    assert c.expected_tokens(16) > c.expected_tokens(8) + 7.5


def test_bad_range():
    with pytest.raises(ValueError, match="2 <= lo <= hi"):
        BlockChooser(5, 4)


def fresh(draft):
    forget(draft)  # what earlier tests taught it
    return draft


def test_auto_is_lossless_while_the_block_changes(agreeing_pair):
    model, draft = agreeing_pair
    fresh(draft)
    tok = make_tokenizer(24)
    rng = random.Random(5)
    sizes = set()
    for n in (1, 9, 40):
        prompt = [rng.randrange(23) for _ in range(n)]
        responses = list(stream_generate(model, draft, tok, prompt, max_tokens=120, block_size="auto"))
        assert [t for r in responses for t in r.tokens] == greedy_reference(model, prompt, 120)
        # (a cycle near the end is cut to the tokens still wanted)
        sizes |= {r.block_size for r in responses[1:] if 120 - (r.generation_tokens - len(r.tokens)) >= 16}
        assert all(r.accepted is None or r.accepted <= r.block_size - 1 for r in responses)
    drafting = sizes - {1}  # 1: the plain steps probed
    assert len(drafting) >= 3 and min(drafting) >= 4 and max(drafting) == 16


def test_auto_with_sampling(agreeing_pair):
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    responses = list(
        stream_generate(model, fresh(draft), tok, [3, 4, 5], max_tokens=80, temperature=0.8, block_size="auto", seed=7)
    )
    assert sum(len(r.tokens) for r in responses) == 80
    probes = [b for b in (16, 4, 8, 1) for _ in range(BlockChooser.PROBE_RUN)]
    assert [r.block_size for r in responses[1 : 1 + len(probes)]] == probes


def test_each_call_is_a_new_reply(agreeing_pair):
    """The decode loop tells the chooser of every call: a chooser that plain
    steps won for earlier text starts the next call with a drafting run, and
    the pair, whose drafts are always accepted, drafts from there on."""
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    chooser = chooser_for(fresh(draft), 4, 16)
    # a drafter rarely right, past EVIDENCE drafting cycles (block 16 timed often)
    feed(chooser, 0.3, h100_pair, 300, change=0.004)
    assert chooser.choose() == 1  # plain steps won
    responses = list(stream_generate(model, draft, tok, [1, 2, 3], max_tokens=80, block_size="auto"))
    assert responses[1].block_size == 16
    assert sum(r.block_size > 1 for r in responses[1:]) > 0.8 * (len(responses) - 1)


def test_what_one_call_learns_carries_to_the_next(agreeing_pair):
    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    list(stream_generate(model, fresh(draft), tok, [1, 2, 3], max_tokens=240, block_size="auto"))
    chooser = chooser_for(draft, 4, 16)
    cycles = chooser.cycles
    assert cycles > 9 and all(chooser.asked[b] >= BlockChooser.PROBE_RUN for b in chooser.probe)
    asked = dict(chooser.asked)
    responses = list(stream_generate(model, draft, tok, [4, 5, 6], max_tokens=60, block_size="auto"))
    assert chooser_for(draft, 4, 16) is chooser and chooser.cycles == cycles + len(responses) - 1
    # no second round of probes: the same chooser, its probes done, its counts kept
    assert all(chooser.asked[b] >= n for b, n in asked.items())
    probes = [b for b in (16, 4, 8, 1) for _ in range(BlockChooser.PROBE_RUN)]
    first = [r.block_size for r in responses[1 : 1 + len(probes)]]
    assert len(first) < BlockChooser.PROBE_RUN + 1 or first != probes[: len(first)]


def test_bad_block_size(agreeing_pair):
    model, draft = agreeing_pair
    with pytest.raises(ValueError, match="or 'auto'"):
        next(stream_generate(model, draft, make_tokenizer(24), [1, 2], block_size="fast"))


def test_the_callers_time_is_not_the_cycles(agreeing_pair):
    import time

    model, draft = agreeing_pair
    tok = make_tokenizer(24)
    for r in stream_generate(model, fresh(draft), tok, [7, 8], max_tokens=150, block_size="auto"):
        time.sleep(0.05)  # a slow reader (say, a terminal)
    chooser = chooser_for(draft, 4, 16)
    times = sorted(t for ts in chooser.times.values() for _, t in ts)
    assert times and times[len(times) // 2] < 0.04


def test_each_cycle_is_timed_under_its_own_block_size(agreeing_pair, monkeypatch):
    """A cycle whose launch is the bound (the host's graph building on a GPU,
    most of the work on a CPU) is charged to its own size, not to the cycle
    read just before it was queued."""
    import time

    from dflash_mlx.decode.cycle import Cycle

    model, draft = agreeing_pair
    real = Cycle.launch
    # seconds of host time per block size, 3x apart, so that a cycle charged
    # with any other size's cost falls outside its own bounds below even on
    # a loaded machine (whose own cycles add up to ~0.05 s)
    cost = {1: 0.05, 4: 0.15, 8: 0.45, 16: 1.35}

    def slow_launch(self, block_size, *args):
        time.sleep(cost[block_size])
        return real(self, block_size, *args)

    monkeypatch.setattr(Cycle, "launch", slow_launch)
    chooser = chooser_for(fresh(draft), 4, 16)
    seen = []
    record = chooser.record
    monkeypatch.setattr(
        chooser, "record", lambda b, a, s, built=None: seen.append((b, s, built)) or record(b, a, s, built)
    )
    list(stream_generate(model, draft, make_tokenizer(24), [7, 8], max_tokens=40, block_size="auto"))
    assert {b for b, s, _ in seen if s is not None} >= {1, 4, 8, 16}  # the probes change size from cycle to cycle
    for b, s, _ in seen:
        assert s is None or cost[b] <= s < 2 * cost[b] + 0.05, (b, s)


def test_a_cycle_that_built_new_graphs_is_not_timed(agreeing_pair, monkeypatch):
    """The first cycle of each block size at each buffer width builds graphs
    (a trace where cycles are compiled): auto learns acceptance from it but
    not the size's cost."""
    model, draft = agreeing_pair
    forget_traces(draft)  # graphs earlier tests built are built: start as a fresh process does
    chooser = chooser_for(fresh(draft), 4, 16)
    seen = []
    record = chooser.record
    monkeypatch.setattr(
        chooser, "record", lambda b, a, s, built=None: seen.append((b, s, built)) or record(b, a, s, built)
    )
    list(stream_generate(model, draft, make_tokenizer(24), [7, 8], max_tokens=300, block_size="auto"))
    first = {}
    for i, (b, _, _) in enumerate(seen):
        first.setdefault(b, i)
    assert all(seen[i][1] is None for i in first.values())  # each size's first cycle
    assert all(seen[i][2] > 0 for i in first.values())  # its time is told as a build's
    untimed = sum(s is None for _, s, _ in seen)
    # one per size and buffer width (the buffers grow once past 256 positions here)
    assert len(first) <= untimed <= 2 * len(first) + 1
    assert untimed < len(seen) // 4


def test_graph_builds_on_exploring_runs_count_against_exploring():
    """On a GPU a size meeting a buffer width for the first time traces its
    cycle (~100 ms on an H100 against ~3 ms a cycle): a rarely explored size
    meets a new width on most of its runs. Those builds are what exploring it
    costs, so where every run builds, runs come far more rarely."""

    def explored_runs(report_builds: bool) -> int:
        c = BlockChooser(4, 16)
        rng = random.Random(2)
        previous, runs = None, 0
        for _ in range(3000):
            b = c.choose()
            accepted = 0
            while accepted < b - 1 and rng.random() < 0.78:
                accepted += 1
            fresh = b != previous and c.cycles > 3 * BlockChooser.PROBE_RUN * 4  # (after the probes)
            runs += fresh and b != 16
            seconds = h100_pair(b)
            if fresh:
                c.record(b, accepted, None, built=0.1 + seconds if report_builds else None)
            else:
                c.record(b, accepted, seconds)
            previous = b
        return runs

    told, untold = explored_runs(True), explored_runs(False)
    assert untold >= 20 and told <= untold / 3, (told, untold)


def test_a_size_that_would_build_graphs_waits_for_a_width_where_it_has_them():
    """choose(would_build): exploring a size that would build new graphs now (its
    first cycle at this buffer width) is charged what recent builds took,
    before it runs, not after. Replies of 100 cycles whose first half runs at
    a width every reply shares (graphs kept) and whose second half at a width
    of its own: the sizes explored besides the best one build far less
    often, and are explored more, at the shared width."""

    def replies(tell: bool) -> tuple[int, int]:
        c = BlockChooser(4, 16)
        rng = random.Random(5)
        shapes, builds, runs, previous = set(), 0, 0, None
        for cycle in range(3000):
            width = 0 if cycle % 100 < 50 else cycle // 100 + 1
            b = c.choose((lambda s: (s, width) not in shapes) if tell else None)
            accepted = 0
            while accepted < b - 1 and rng.random() < 0.75:
                accepted += 1
            after_probes = c.cycles > 4 * BlockChooser.PROBE_RUN
            if (b, width) in shapes:
                c.record(b, accepted, h100_pair(b))
            else:
                shapes.add((b, width))
                c.record(b, accepted, None, built=0.03 + h100_pair(b))  # a trace
                builds += after_probes and b != 16
            runs += after_probes and b != previous and b != 16
            previous = b
        return builds, runs

    (told_builds, told_runs), (builds, runs) = replies(True), replies(False)
    assert builds >= 4 and told_builds <= builds / 3, (told_builds, builds)
    # exploring goes on where its graphs exist: more often than when builds
    # were charged only once paid (6 builds then held it to 10 runs here)
    assert told_runs >= 2 * runs, (told_runs, runs)


def test_a_build_charged_ahead_is_not_charged_again_once_paid():
    """The build charged when an exploring run is chosen is the run's
    expected build: the build it then pays counts only for what it took
    beyond that."""
    c = BlockChooser(4, 16, explore=1)
    for _ in range(4 * BlockChooser.PROBE_RUN + 40):  # probes, then block 16 settled
        b = c.choose()
        c.record(b, min(b - 1, 12) if b > 1 else 0, h100_pair(b))
        if b == 16 and len(c.build_seconds) < 3:
            c.record(16, 12, None, built=0.02)  # builds seen on the way (block 16 meeting new widths)
    c.EXPLORE_SHARE = 1.0  # (room for any exploring, so that the next choice explores)
    before = dict(c.exploring_loss)
    b = c.choose(lambda size: size != 16)
    assert b != 16 and c.trial is not None and c.prepaid == pytest.approx(0.02)
    charged = c.exploring_loss[b] - before[b]
    c.record(b, 0, None, built=0.025)  # the run's first cycle builds: 5 ms more than expected
    assert c.exploring_loss[b] - before[b] == pytest.approx(charged + 0.005)
    assert c.prepaid == 0.0


def test_before_a_change_of_size_the_cycle_is_waited_for_before_the_next_launch(agreeing_pair, monkeypatch):
    """``auto`` times a cycle by its launch and the wait for its result. Where
    the next cycle has another size its launch (a plain step's, uncompiled, far
    slower than a block's) must not run inside that wait: the cycle is settled
    first. Runs of one size stay pipelined."""
    from dflash_mlx.decode import loop
    from dflash_mlx.decode.cycle import Cycle

    model, draft = agreeing_pair
    events = []
    real_launch, real_settle = Cycle.launch, loop.settle
    monkeypatch.setattr(
        Cycle, "launch", lambda self, bs, *a: events.append(("launch", bs)) or real_launch(self, bs, *a)
    )
    monkeypatch.setattr(loop, "settle", lambda c, f: events.append(("settle", f.block_size)) or real_settle(c, f))
    chooser_for(fresh(draft), 4, 16)
    list(stream_generate(model, draft, make_tokenizer(24), [7, 8], max_tokens=60, block_size="auto"))
    at = [i for i, (kind, _) in enumerate(events) if kind == "launch"]
    assert len({events[i][1] for i in at}) > 1  # (the probes change size)
    for before, now in zip(at, at[1:]):
        previous, size = events[before][1], events[now][1]
        assert (events[now - 1] == ("settle", previous)) == (size != previous), events[: now + 1]


def test_every_plain_step_under_auto_reads_its_length_from_the_host(agreeing_pair, monkeypatch):
    """A plain step rounds as mlx-lm's only where its length is known on the
    host (cycle.py's exact step); after a block auto settles that block before
    the plain step, so its length is known then too."""
    from dflash_mlx.decode.cycle import Cycle

    model, draft = agreeing_pair
    launches = []
    real_launch = Cycle.launch

    def launch(self, size, last, length, bound, exact=False):
        flight = real_launch(self, size, last, length, bound, exact)
        launches.append((size, exact, bound, length))
        return flight

    monkeypatch.setattr(Cycle, "launch", launch)
    chooser_for(fresh(draft), 4, 16)
    list(stream_generate(model, draft, make_tokenizer(24), [7, 8], max_tokens=60, block_size="auto"))
    plain = [(exact, bound, length.item()) for size, exact, bound, length in launches if size == 1]
    assert plain and any(size > 1 for size, *_ in launches)
    assert all(exact and bound == length for exact, bound, length in plain), plain


def stand_in_clock(monkeypatch, clock):
    """The cycle clock's time: ``clock[0]``, moved by the test; a wait
    after ``clock[1:]`` is given lasts the seconds given (the device's)."""
    from types import SimpleNamespace

    from dflash_mlx.decode import clock as clock_module

    def perf_counter():
        t = clock[0]
        clock[0] += clock.pop() if len(clock) > 1 else 0.0
        return t

    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=perf_counter))


@pytest.mark.parametrize("launch_s, settle_s", [(0.15, 0.10), (0.05, 0.20)])
def test_a_settled_cycle_is_timed_as_a_run_of_its_size_would_pay(agreeing_pair, monkeypatch, launch_s, settle_s):
    """A cycle settled before a change of size ran alone: its launch, then its
    device time. In a run the next launch overlaps the device time, so the
    chooser is told the longer of the two, not their sum; an unsettled cycle
    its launch plus the wait for its result. (The loop's clock is a stand-in
    that only launches and settles move.)"""
    from dflash_mlx.decode import loop
    from dflash_mlx.decode.cycle import Cycle

    model, draft = agreeing_pair
    clock = [0.0]
    real_launch, real_settle, real_record = Cycle.launch, loop.settle, BlockChooser.record
    settled, recorded = [], []

    def slow_launch(self, *a):
        clock[0] += launch_s
        return real_launch(self, *a)

    def slow_settle(cycle_clock, flight):
        settled.append(flight)
        clock.append(settle_s)
        real_settle(cycle_clock, flight)

    def record(self, block, accepted, seconds, built=None):
        recorded.append(seconds)
        return real_record(self, block, accepted, seconds, built)

    stand_in_clock(monkeypatch, clock)
    monkeypatch.setattr(Cycle, "launch", slow_launch)
    monkeypatch.setattr(loop, "settle", slow_settle)
    monkeypatch.setattr(BlockChooser, "record", record)
    chooser_for(fresh(draft), 4, 16)
    list(stream_generate(model, draft, make_tokenizer(24), [7, 8], max_tokens=24, block_size="auto"))
    timed = [t for t in recorded if t is not None]
    assert settled and timed
    # an unsettled cycle: its launch (the reads wait no time on this clock); a settled one: the longer
    rounded = {round(t, 9) for t in timed}
    assert rounded <= {launch_s, max(launch_s, settle_s)} and max(launch_s, settle_s) in rounded, timed


@pytest.mark.parametrize("device_s", [0.0, 0.2])
def test_the_loops_own_work_is_charged_and_the_callers_only_where_the_device_was_busy(
    agreeing_pair, monkeypatch, device_s
):
    """Between two reads the loop does its own work (here, choosing the next
    size) besides launching. Where the host outruns the device a run pays
    the launch and that work, not the caller's time; where the read then
    waits, the device was busy with the cycle from one read to the next,
    the caller's time included. (Stand-in clock; cycles within runs.)"""
    from dflash_mlx.decode.clock import CycleClock
    from dflash_mlx.decode.cycle import Cycle

    model, draft = agreeing_pair
    clock = [0.0]
    launch_s, choose_s, caller_s = 0.01, 0.003, 0.05
    real_launch, real_choose, real_record = Cycle.launch, BlockChooser.choose, BlockChooser.record
    real_wait = CycleClock.wait
    recorded = []

    def slow_launch(self, *a):
        clock[0] += launch_s
        return real_launch(self, *a)

    def slow_choose(self, *a):
        clock[0] += choose_s
        return real_choose(self, *a)

    def wait(self, *arrays):
        if self.done_at is None:  # the first wait for a cycle waits for the device
            clock.append(device_s)
        real_wait(self, *arrays)

    def record(self, block, accepted, seconds, built=None):
        recorded.append((block, seconds, self.previous))
        return real_record(self, block, accepted, seconds, built)

    stand_in_clock(monkeypatch, clock)
    monkeypatch.setattr(CycleClock, "wait", wait)
    monkeypatch.setattr(Cycle, "launch", slow_launch)
    monkeypatch.setattr(BlockChooser, "choose", slow_choose)
    monkeypatch.setattr(BlockChooser, "record", record)
    chooser_for(fresh(draft), 4, 16)
    for _ in stream_generate(model, draft, make_tokenizer(24), [7, 8], max_tokens=40, block_size="auto"):
        clock[0] += caller_s
    in_runs = {round(s, 9) for block, s, previous in recorded[1:-1] if block == previous and s is not None}
    own = launch_s + choose_s
    # a run's cycle; one settled before a change of size (no launch between its reads); the
    # first and last cycles have no choice before them
    run = own if not device_s else choose_s + caller_s + launch_s + device_s
    settled = own if not device_s else choose_s + caller_s + device_s
    assert round(run, 9) in in_runs and in_runs <= {round(run, 9), round(settled, 9)}, in_runs
