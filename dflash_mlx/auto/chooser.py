"""Choosing the block size as decoding goes (``block_size="auto"``).

The best block size trades what a longer block can gain against what it
costs (the candidates: lo, hi and the multiples of 4 between), and both depend on the machine and the text: on a GPU a verify of 16
tokens costs about what one of 4 does, so the longest block wins; on a CPU
the cost grows with the tokens, and a short block wins (BENCHMARKS.md). The
chooser measures both while decoding and picks, before every cycle, the
block b in [lo, hi] with the most expected tokens per second:

    tokens(b) = 1 + sum_{i=1}^{b-1} S_i,   S_i = r_1 * ... * r_i,
    seconds(b) = a + c * b,

with r_i the observed chance that draft i is accepted given that the drafts
before it were (a count with a prior of 1/2, so positions never tried are
neither trusted nor ruled out), and a, c fitted to the recent cycle times
(least squares over the block sizes tried, c >= 0, the slope taken down by
its standard error so that jitter does not make one; a cycle's time is the
host's time building and queuing it plus the time waited for its result, see
decode.py: the caller's time between responses is not in it). A plain
target step (a block of 1: no drafts) is a candidate too, with its own measured time: when no block pays (a drafter
that accepts little, a very long context) the loop decodes plainly and keeps
the drafter's context fed, so drafting resumes when it pays again.

The first cycles probe hi, lo, the middle and a plain step, PROBE_RUN cycles
each, so the fit has its points; afterwards hi, lo and the plain step
(whichever of them is not the best) are tried in turn, at most every
``explore``-th cycle and only while what exploring loses (its time less the
time the best choice would take for the same expected tokens) stays within
an equal part of EXPLORE_SHARE of the decoding time for each: the acceptance
of late positions, both ends of the cost line and the plain step's time stay
measured, and an expensive one (a block of 16 on a CPU costs ten plain
steps) does not tax a cheap best choice.

A cycle whose size differs from the one before it is not timed: changing
size costs the host more than either size costs in a run (other graphs to
launch, and a drafting cycle after plain steps feeds the drafter their
states: 1-6 ms over a 2.5-3.8 ms cycle of the built-in pair on an H100,
BENCHMARKS.md, session 10). Timing such cycles made every size but the one
in use look dear, so a chooser that once settled on plain steps saw drafting
at its worst and stayed there. So each size is tried for EXPLORE_RUN cycles
in a row, the first one untimed, and what the changes into and out of a run
cost (a change's time over its size's median) counts against the exploring
share, as does the time of a run's cycles that built new graphs (a size
meeting a buffer width for the first time traces its cycle, ~100 ms on an
H100: a rarely explored size meets new widths on most of its runs); and
before a size is explored, the graphs it would build at the current width
(the loop says, ``choose(would_build)``) are charged at what recent builds took,
so exploring waits for a width where that size's graphs exist (a new
reply's first widths) unless the share covers the build. An exploring run of drafting from plain steps goes on while it
commits more tokens a second than they do (the text has turned: the counts,
kept from a hard stretch, need cycles to follow). The loop tells the
chooser of each new reply (``new_reply``): prompts differ, and plain steps
say nothing of the drafter, so a reply where plain steps are the best choice
starts with such a run; replies whose run clearly loses space the next tries
out, doubling the gap each time.

One chooser is kept per drafter object and block range (``chooser_for``, a
registry that forgets a drafter once it is gone), so what a call learns, the
next call in the same process starts from.

Which block is used never changes the output: greedy or seeded sampling,
the target's token at each position is fixed (sampling.py).
"""

from __future__ import annotations

import math
import weakref

import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear


def median(values) -> float:
    """The upper median (a list's middle element once sorted)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class BlockChooser:
    # drafting cycles over which acceptance counts fade (by 1/e): a few
    # exploring runs after a hard stretch move the estimate, where counts
    # kept for 2,000 cycles held a chooser on plain steps for thousands
    # (benchmarks/auto_sim.py, "hard first 100 cycles": 0.68 -> 0.85)
    MEMORY = 32
    RECENT = 256  # cycles whose times the cost fit uses
    # drafting cycles seen before plain steps may win: a fresh process's first
    # reply often starts where the drafter accepts little, and 16 let the
    # built-in pair give drafting up for a thousand cycles on an H100
    EVIDENCE = 64
    SLOPE_DOUBT = 2.0  # standard errors the cost line's slope is taken down by (cost)
    SPIKE = 4.0  # a cycle this many times its size's median is a one-off, not its cost
    EXPLORE_SHARE = 0.03  # the most of the decoding time that exploring may lose (shared equally)
    EXPLORE_RUN = 3  # cycles in a row each time a size is explored (the first is a change of size: untimed)
    PROBE_RUN = 4  # cycles in a row each size is probed first (the change and the first WARM_CYCLES untimed)
    WARM_CYCLES = 2  # a size's first timed cycles in a process, left out of its cost
    MAX_REPLY_GAP = 15  # the most replies started plainly between two that start with a drafting run (new_reply)
    CLEAR_LOSS = 0.9  # a reply's drafting run at under this share of plain steps' rate failed (new_reply)

    STEP = 4  # candidate blocks: lo, hi and the multiples of STEP between

    def __init__(self, lo: int, hi: int, explore: int = 32):
        if not 2 <= lo <= hi:
            raise ValueError(f"block sizes must satisfy 2 <= lo <= hi, got {lo}..{hi}.")
        self.lo, self.hi, self.explore = lo, hi, explore
        # A few sizes, not every one: each size is a graph of its own to build
        # (and to trace, where cycles are compiled), while the rate varies
        # smoothly with the block.
        self.sizes = sorted({lo, hi, *range(-(-lo // self.STEP) * self.STEP, hi, self.STEP)}, reverse=True)
        self.reached = [0] * hi  # [i]: cycles that proposed draft i with drafts 1..i-1 accepted
        self.hit = [0] * hi  # [i]: ... of which draft i was accepted too
        self.times: dict[int, list[tuple[int, float]]] = {}  # block size -> (cycle, seconds)
        self.warmed: dict[int, int] = {}  # block size -> its cycles left out as warming up (record)
        self.asked: dict[int, int] = {}  # block size -> cycles it was chosen for
        self.cycles = 0
        self.drafted = 0  # drafting cycles recorded (the counts above fade; this does not)
        self.seconds = 0.0  # the timed cycles' total
        self.exploring_loss = {lo: 0.0, hi: 0.0, 1: 0.0}  # per size explored: the time it is expected to lose (_choose)
        self.explored = 0  # turns taken (hi's first, then lo's, then the plain step's, ...)
        self.last_explored = 0  # the cycle count when the last was chosen
        self.run: list = []  # the sizes still to use in the exploring run under way
        self.trial: list | None = None  # the exploring run's [size, cycles, tokens], faded (_choose extends it)
        self.reply_starts = False  # a reply begins (new_reply): it may start with a drafting run
        self.reply_trial = False  # the run under way is a reply's first
        self.replies_to_skip = 0  # replies left to start plainly, after such runs kept failing
        self.reply_gap = 0  # ... how many the last failure set (doubling)
        self.previous = None  # the last cycle's block size
        self.prepaid = 0.0  # the build charged ahead for the exploring run under way (_choose)
        self.changes: list[float] = []  # what recent changes of size cost over the new size's median
        self.build_seconds: list[float] = []  # what recent cycles that built new graphs took (record's ``built``)
        probe = [hi, lo, self.sizes[len(self.sizes) // 2], 1]
        self.probe = list(dict.fromkeys(probe))
        self.memory_path = None  # where block_memory keeps this chooser's state between processes
        self.ages: dict[int, int] = {}  # block size -> processes since its remembered time was measured (restore)
        # What record() and restore() change, worked out once between them,
        # and each size's statistics until its times change: choose() and
        # record() run on the critical path of a cycle bound by the host.
        self._memo: dict = {}
        self._versions: dict[int, int] = {}  # block size -> changes of its times
        self._stats: dict[int, tuple] = {}  # block size -> (version, valid below, (times, median, error))

    # processes a remembered time is passed on without being measured again:
    # a time taken while the machine was busy could otherwise make a size look
    # too dear to explore, and be written back by every process after
    MEMORY_AGE = 3

    def state(self) -> dict:
        """What a later process's chooser may start from (restore): each
        size's median time and its age (processes since it was measured; a
        size not measured for MEMORY_AGE processes is left out, so the next
        one probes it again)."""
        seconds, ages = {}, {}
        for b, t in self._median_times().items():
            age = 0 if any(k > 0 for k, _ in self.times[b]) else self.ages.get(b, 0)  # (restored times are cycle 0's)
            if age <= self.MEMORY_AGE:
                seconds[str(b)], ages[str(b)] = t, age
        return {
            "range": [self.lo, self.hi],
            "reached": self.reached,
            "hit": self.hit,
            "seconds": seconds,
            "ages": ages,
            "drafted": self.drafted,
        }

    def restore(self, state: dict, prior_cycles: int) -> bool:
        """Start from an earlier chooser's ``state``: its acceptance counts,
        scaled to at most ``prior_cycles`` cycles, and each size's median time
        as one measurement (sizes with one are not probed). A state that does
        not fit this chooser changes nothing; returns whether it was used."""
        try:
            fits = state["range"] == [self.lo, self.hi]
            reached = [float(x) for x in state["reached"]]
            hit = [float(x) for x in state["hit"]]
            seconds = {int(b): float(t) for b, t in state["seconds"].items()}
            ages = {int(b): int(a) for b, a in state.get("ages", {}).items()}
            drafted = int(state.get("drafted", round(reached[1]) if len(reached) > 1 else 0))
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        fits = fits and len(reached) == len(hit) == self.hi and all(0 <= h <= r for h, r in zip(hit, reached))
        fits = fits and all((b == 1 or b in self.sizes) and 0 < t < math.inf for b, t in seconds.items())
        fits = fits and all(a >= 0 for a in ages.values())
        if not fits:
            return False
        scale = min(1.0, prior_cycles / reached[1]) if len(reached) > 1 and reached[1] > 0 else 1.0
        self.reached = [r * scale for r in reached]
        self.hit = [h * scale for h in hit]
        self.drafted = max(self.drafted, min(drafted, prior_cycles))
        self._memo.clear()
        for b, t in seconds.items():
            self.times[b] = [(0, t)]
            self._versions[b] = self._versions.get(b, 0) + 1
            self.ages[b] = ages.get(b, 0) + 1
            self.asked[b] = max(self.asked.get(b, 0), self.PROBE_RUN)  # known: not probed
        return True

    def record(self, block: int, accepted: int, seconds: float | None, built: float | None = None) -> None:
        """One verify cycle at ``block`` accepted ``accepted`` drafts in
        ``seconds`` (None: not a measure of its size's cost); ``built``: the
        time of a cycle that built new graphs (a trace, where compiled, for a
        size meeting a buffer width for the first time). Builds in an
        exploring run are what exploring that size cost: ~100 ms a trace on an
        H100 against ~3 ms a cycle, so a rarely tried size meeting every new
        width on its runs cost more than the whole exploring share
        (BENCHMARKS.md, session 12)."""
        self.cycles += 1
        self._memo.clear()
        if built is not None:
            self.seconds += built
            self.build_seconds = self.build_seconds[-15:] + [built]
            if self.trial is not None and self.trial[0] == block and block in self.exploring_loss:
                # (less what choosing the run charged for it ahead, _choose)
                self.exploring_loss[block] += max(0.0, built - self.prepaid)
                self.prepaid = 0.0
        for i in range(1, min(block - 1, accepted + 1) + 1):  # (none for a plain step)
            self.reached[i] += 1
            self.hit[i] += i <= accepted
        keep = 1.0 - 1.0 / self.MEMORY  # recent text weighs more
        if block > 1:
            self.drafted += 1
            self.reached = [r * keep for r in self.reached]
            self.hit = [h * keep for h in self.hit]
        changed, self.previous = block != self.previous, block
        if self.trial is not None and self.trial[0] == block:  # (faded as the counts are)
            self.trial[1:] = [self.trial[1] * keep + 1, self.trial[2] * keep + accepted + 1]
        if seconds is None:
            return
        self.seconds += seconds
        if changed:  # a change of size, not its cost (the module docstring), but what changing costs
            usual = self._median_times().get(block)
            if usual is not None:
                self.changes = self.changes[-31:] + [max(0.0, seconds - usual)]
            return
        # A size's first cycles in a process pay its kernel builds and run
        # slow (the built-in pair's second block-16 cycle 4.4 ms on an H100
        # against 2.5 steady): not its cost.
        warmed = self.warmed.get(block, 0)
        if warmed < self.WARM_CYCLES:
            self.warmed[block] = warmed + 1
            return
        ts = self.times.setdefault(block, [])
        if len(ts) >= 3 and seconds > self.SPIKE * median(t for _, t in ts):
            return  # a one-off build (a grown cache's new shapes, a trace), not the size's cost
        ts.append((self.cycles, seconds))
        del ts[:-32]
        self._versions[block] = self._versions.get(block, 0) + 1

    def expected_tokens(self, block: int) -> float:
        return self._expected()[block - 1]

    def _expected(self) -> list[float]:
        """[b - 1]: the expected tokens of a cycle of block b, for b in 1..hi."""
        if "expected" not in self._memo:
            totals, total, s, prior = [1.0], 1.0, 1.0, 0.5
            for i in range(1, self.hi):
                prior = (self.hit[i] + 2 * prior) / (self.reached[i] + 2)
                s *= prior
                total += s
                totals.append(total)
            self._memo["expected"] = totals
        return self._memo["expected"]

    def _median_times(self) -> dict[int, float]:
        """The median of each size's recent times (_all_stats)."""
        return {b: stats[1] for b, stats in self._all_stats().items()}

    def _all_stats(self) -> dict[int, tuple[list[float], float, float]]:
        """Each timed size's (recent times, their median, the median's
        standard error). Recent: its times over the last RECENT cycles (costs
        grow with the context, so old times of one size must not be set
        against new times of another), or all its times if it was not tried
        lately (a size left out would never be chosen or explored again).
        Worked out again only once its times change or one of them leaves the
        RECENT window."""
        floor = self.cycles - self.RECENT
        out = {}
        for b, ts in self.times.items():
            if not ts:
                continue
            kept = self._stats.get(b)
            if kept is None or kept[0] != self._versions.get(b, 0) or floor >= kept[1]:
                recent_at = [k for k, _ in ts if k > floor]
                recent = [t for k, t in ts if k > floor] or [t for _, t in ts]
                mid = median(recent)
                spread = 1.4826 * median(abs(t - mid) for t in recent)  # a robust standard deviation
                error = 1.2533 * spread / math.sqrt(len(recent))  # the median's
                # (valid until the oldest recent time leaves the window; all old: until a new one)
                kept = (self._versions.get(b, 0), min(recent_at) if recent_at else math.inf, (recent, mid, error))
                self._stats[b] = kept
            out[b] = kept[2]
        return out

    def cost(self) -> tuple[float, float]:
        """(a, c) of seconds(b) = a + c*b for drafting blocks (b >= 2).

        The slope c is fitted to the sizes' median times and then taken
        down by SLOPE_DOUBT standard errors (each median's from its times'
        spread), to no less than 0: where every block costs alike (a GPU),
        jitter between the few times of a rarely tried size would otherwise
        make a slope, and a slope only ever favours shorter blocks (the fit
        cannot go below 0); where the cost truly grows (a CPU), it stands far
        above its error."""
        if "cost" not in self._memo:
            self._memo["cost"] = self._fit()
        return self._memo["cost"]

    def _fit(self) -> tuple[float, float]:
        pts = [(b, mid, error) for b, (_, mid, error) in self._all_stats().items() if b > 1]
        if not pts:
            return 1.0, 0.0
        if len(pts) == 1:
            return pts[0][1], 0.0
        n = len(pts)
        mb = sum(b for b, _, _ in pts) / n
        mt = sum(t for _, t, _ in pts) / n
        var = sum((b - mb) ** 2 for b, _, _ in pts)
        c = sum((b - mb) * (t - mt) for b, t, _ in pts) / var if var else 0.0
        error = math.sqrt(sum(((b - mb) * se) ** 2 for b, _, se in pts)) / var if var else 0.0
        c = max(0.0, c - self.SLOPE_DOUBT * error)
        a = max(mt - c * mb, 1e-9)
        return a, c

    def new_reply(self) -> None:
        """A new reply begins: its text may suit drafting where the last one's
        did not (prompts differ), while plain steps tell nothing of the
        drafter's acceptance. Where plain steps are the best choice, the
        reply starts with an exploring run of the best drafting block (hi on a
        GPU, a short one on a CPU), which goes on while it pays
        (_choose); each reply whose run clearly loses (CLEAR_LOSS) doubles
        the replies that start plainly before the next try (at most
        MAX_REPLY_GAP), so a drafter that never pays costs few runs."""
        self.reply_starts = True

    def choose(self, would_build=None) -> int:
        """The block size for the next cycle. ``would_build(b)``, where
        given: whether a cycle of size ``b`` now would build new graphs (a
        trace at a buffer width it has not met): exploring such a size is
        charged what recent builds took before it is tried (and the build,
        once paid, only for what it took beyond that)."""
        b = self._choose(would_build)
        self.asked[b] = self.asked.get(b, 0) + 1
        return b

    def _choose(self, would_build=None) -> int:
        reply_starts, self.reply_starts = self.reply_starts, False
        for b in self.probe:
            if self.asked.get(b, 0) < self.PROBE_RUN:
                return b
        if self.run:
            return self.run.pop()
        best, best_rate = self._best()
        if self.trial is not None:
            # An exploring run of drafting from plain steps goes on while it
            # commits more tokens a second than they do (its recent cycles
            # weighing more), for at most 2 * MEMORY cycles: counts kept over
            # a long hard stretch would otherwise take many runs, each paid
            # from the exploring share, to let a size that pays again win.
            # (Not between drafting sizes: there the counts are fresh, and the
            # best size's time, not refreshed during the run, may be a slow
            # moment's: a GPU's host drifts, and a block of 4 ran on.)
            b, cycles, tokens = self.trial
            seconds = self._seconds(b, self._median_times())
            rate = tokens / (cycles * seconds) if cycles else best_rate
            if best == 1 and b > 1 and self.cycles - self.last_explored < 2 * self.MEMORY and rate > best_rate:
                self.run = [b] * (self.EXPLORE_RUN - 1)
                return b
            self.trial = None
            if self.reply_trial:
                # A reply's run that clearly lost to plain steps: the next
                # replies start plainly; one that drafting won, or a near miss
                # (three cycles are few: an unlucky run of a good drafter),
                # leaves the next reply to try again.
                self.reply_trial = False
                failed = best == 1 and rate < self.CLEAR_LOSS * best_rate
                self.reply_gap = min(2 * self.reply_gap + 1, self.MAX_REPLY_GAP) if failed else 0
                self.replies_to_skip = self.reply_gap
        if reply_starts and best == 1:
            if self.replies_to_skip:
                self.replies_to_skip -= 1
            else:
                self.reply_trial = True
                return self._explore(self._best_block()[0])
        if self.explore and self.cycles - self.last_explored >= self.explore:
            # the longest block, the shortest and the plain step in turn (the
            # next one when the turn's is too dear), leaving out the best: late
            # positions stay measured, both ends of the cost line and the plain
            # step's time stay fresh
            turns = [b for b in dict.fromkeys((self.hi, self.lo, 1)) if b != best]
            times = self._median_times()
            change = median(self.changes) if self.changes else 0.0
            start = self.explored % len(turns)
            for b in turns[start:] + turns[:start]:
                seconds = self._seconds(b, times)
                # what exploring b loses: its time, less the time the best
                # choice would take for the tokens b is expected to give; each
                # has an equal part of the share, so a cheap one never starves
                # a dear one
                # (and the two changes of size, into the run and out of it,
                # and the graphs it would build at this width)
                build = 0.0
                if self.build_seconds and would_build is not None and would_build(b):
                    build = median(self.build_seconds)
                loss = self.EXPLORE_RUN * max(0.0, seconds - self.expected_tokens(b) / best_rate) + 2 * change + build
                spent = self.seconds + self.EXPLORE_RUN * seconds + 2 * change + build
                if self.exploring_loss[b] + loss <= self.EXPLORE_SHARE / len(self.exploring_loss) * spent:
                    self.explored += 1
                    self.exploring_loss[b] += loss
                    self._explore(b)
                    self.prepaid = build
                    return b
        return best

    def _explore(self, block: int) -> int:
        """Start an exploring run of ``block`` (EXPLORE_RUN cycles, more while
        a drafting run from plain steps pays); returns it."""
        self.last_explored = self.cycles
        self.run = [block] * (self.EXPLORE_RUN - 1)
        self.trial = [block, 0, 0]
        self.prepaid = 0.0
        return block

    def _seconds(self, block: int, times: dict[int, float]) -> float:
        """A cycle's time at ``block``: its median in ``times``
        (_median_times), else the cost line's."""
        if times.get(block):
            return times[block]
        a, c = self.cost()
        return a + c * block

    def _best_block(self) -> tuple[int, float]:
        """The drafting block with the most expected tokens per second, and that rate."""
        a, c = self.cost()
        best, best_rate = self.hi, -math.inf
        for b in self.sizes:  # longest first: ties go to the longer block
            rate = self.expected_tokens(b) / (a + c * b)
            if rate > best_rate + 1e-12:
                best, best_rate = b, rate
        return best, best_rate

    def _best(self) -> tuple[int, float]:
        """The choice with the most expected tokens per second (a drafting
        block, or plain steps once they clearly win), and that rate."""
        best, best_rate = self._best_block()
        plain = self._median_times().get(1)
        sure = self.drafted >= self.EVIDENCE  # enough drafting seen to give it up
        if plain is not None and sure and 1.0 / plain > best_rate * 1.02:  # a clear win only
            return 1, 1.0 / plain
        return best, best_rate


_choosers: dict[int, tuple[weakref.ref, dict]] = {}


def chooser_for(draft, lo: int, hi: int) -> BlockChooser:
    """The chooser kept for ``draft`` and this block range: what one call
    learned (acceptance, cycle costs) the next one starts from. The registry
    forgets a drafter when it is garbage collected; ``forget(draft)`` starts
    it afresh."""
    key = id(draft)
    entry = _choosers.get(key)
    if entry is None or entry[0]() is not draft:
        entry = (weakref.ref(draft, lambda _, key=key: _choosers.pop(key, None)), {})
        _choosers[key] = entry
    kept = entry[1]
    if (lo, hi) not in kept:
        kept[(lo, hi)] = BlockChooser(lo, hi)
    return kept[(lo, hi)]


def forget(draft) -> None:
    """Drop what was learned with ``draft``."""
    _choosers.pop(id(draft), None)


# Z Lab advises blocks of at most 5 when a DFlash 2 drafter runs with a
# quantized target or drafter: quantization shifts the target's states and
# logits away from those the drafter was trained on, and its late positions
# are rarely accepted. The range starts at 2 so that the chooser may still go
# short (its candidates are then 2, 4, 5 and a plain step).
QUANTIZED_DFLASH2_RANGE = (2, 5)


def _quantized(module) -> bool:
    """Any layer of ``module`` holds quantized weights: nn's QuantizedLinear
    and QuantizedEmbedding, mlx-lm's QuantizedSwitchLinear (a MoE's experts)
    and any other layer packing its weight with ``scales`` beside it."""
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
        or ("scales" in m and "weight" in m)
        for _, m in module.named_modules()
    )


def auto_range(target, draft) -> tuple[int, int]:
    """The block range ``block_size="auto"`` chooses in for this pair
    (``target``: the adapter or the mlx-lm model): (2, 5) for a DFlash 2
    drafter (``selects_candidates``) when the target or the drafter is
    quantized, else (4, the drafter's trained block); never past the trained
    block."""
    hi = draft.config.block_size
    if draft.selects_candidates and (_quantized(getattr(target, "model", target)) or _quantized(draft)):
        lo, top = QUANTIZED_DFLASH2_RANGE
        return min(lo, hi), min(top, hi)
    return min(4, hi), hi
