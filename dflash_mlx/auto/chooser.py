"""Choosing the block size as decoding goes (``block_size="auto"``).

Before every cycle the chooser picks, among lo, hi, the multiples of 4
between and a plain target step (a block of 1), the block b with the most
expected tokens per second:

    tokens(b) = 1 + sum_{i=1}^{b-1} r_1 * ... * r_i,    seconds(b) = a + c * b,

r_i the faded acceptance rate of draft i given drafts 1..i-1 were accepted
(prior 1/2), and a, c a least-squares fit to recent cycle times at this
context (a cycle's cost grows with it), each size weighed by its times, the
slope taken down by its standard error. Plain steps win once they clearly do,
or at once where no block could pay even at a hopeful acceptance. The sizes not chosen are explored in short
runs while what exploring loses stays within EXPLORE_SHARE of the decoding
time. The block never changes the output (sampling.py).
"""

from __future__ import annotations

import math
import weakref

import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear


def median(values) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def weighted_line(points: list[tuple[float, float, float]]) -> tuple[float, float, float, float]:
    """The least-squares line through ``points`` (x, y, weight): (the mean x,
    the mean y, the weighted spread of x about its mean, the slope; 0 where
    every x is alike)."""
    total = sum(w for *_, w in points)
    mean_x = sum(w * x for x, _, w in points) / total
    mean_y = sum(w * y for _, y, w in points) / total
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread if spread else 0.0
    return mean_x, mean_y, spread, slope


class BlockChooser:
    MEMORY = 32  # drafting cycles over which acceptance counts fade by 1/e
    RECENT = 256  # cycles whose times the cost fit uses
    EVIDENCE = 64  # drafting cycles seen before plain steps may win on the counts' estimate
    ACCEPTANCE_DOUBT = 5.0  # standard errors the acceptance is taken up by before EVIDENCE
    SLOPE_DOUBT = 2.0  # standard errors the cost line's slope is taken down by
    SPIKE = 4.0  # a cycle this many times its size's median is a one-off, not its cost
    EXPLORE_SHARE = 0.03  # the most of the decoding time that exploring may lose
    EXPLORE_RUN = 3  # cycles in a row each time a size is explored
    PROBE_RUN = 4  # cycles in a row each size is probed first
    WARM_CYCLES = 2  # a size's first timed cycles in a process, left out of its cost
    CONTEXT_CHANGE = 0.25  # a reply's context this share away from the last one's makes times stale
    MAX_REPLY_GAP = 15  # the most replies started plainly between two drafting tries
    CLEAR_LOSS = 0.9  # a reply's drafting run below this share of plain steps' rate failed
    STEP = 4
    OWN_PRIOR = 2.0  # cycles' weight of the line through all tree sizes in one size's expected tokens

    def __init__(self, lo: int, hi: int, explore: int = 32, trees: bool = False):
        if not 2 <= lo <= hi:
            raise ValueError(f"block sizes must satisfy 2 <= lo <= hi, got {lo}..{hi}.")
        self.lo, self.hi, self.explore = lo, hi, explore
        # Sizes are draft trees' rows: a tree's depth-by-depth acceptance
        # grows with its rows, so counts pooled over sizes misjudge each. A
        # size is judged by its own committed tokens (faded) and a line
        # through every size's.
        self.trees = trees
        self.own: dict[int, tuple[float, float]] = {}  # size -> (faded cycles, faded tokens)
        self.sizes = sorted({lo, hi, *range(-(-lo // self.STEP) * self.STEP, hi, self.STEP)}, reverse=True)
        self.reached = [0] * hi  # [i]: cycles that proposed draft i with drafts 1..i-1 accepted
        self.hit = [0] * hi  # [i]: ... of which draft i was accepted too
        self.times: dict[int, list[tuple[int, float]]] = {}  # block size -> (cycle, seconds)
        self.warmed: dict[int, int] = {}
        self.asked: dict[int, int] = {}
        self.cycles = 0
        self.drafted = 0
        self.first = [0.0, 0.0]  # drafting cycles, and those whose first draft was accepted: unfaded
        self.seconds = 0.0
        self.exploring_loss = {lo: 0.0, hi: 0.0, 1: 0.0}
        self.explored = 0
        self.last_explored = 0
        self.run: list = []
        self.trial: list | None = None  # the exploring run's faded [size, cycles, tokens]
        self.reply_starts = False
        self.reply_trial = False
        self.replies_to_skip = 0
        self.reply_gap = 0
        self.previous = None
        self.prepaid = 0.0
        self.changes: list[float] = []
        self.build_seconds: list[float] = []
        probe = [hi, lo, self.sizes[len(self.sizes) // 2], 1]
        self.probe = list(dict.fromkeys(probe))
        self.memory_path = None
        self.ages: dict[int, int] = {}  # block size -> processes since its remembered time was measured
        self.sure = False  # whether plain steps may win on the counts' estimate
        self.context: int | None = None  # tokens before the current reply, where told
        self.stale_at = -1  # times taken at this cycle or before are another context's
        self.reply_plain = 0  # this reply's plain steps and drafting cycles, as recorded
        self.reply_drafting = 0
        self.reason = "probing block sizes"  # why the last choice, in a few words for users
        # Memoised between record() and restore(): both run on the cycle's critical path.
        self._memo: dict = {}
        self._stats: dict[int, tuple] = {}  # block size -> (valid below, (times, median, error))

    # processes a remembered time is passed on unmeasured, so that one taken
    # on a busy machine is not written back forever
    MEMORY_AGE = 3

    def state(self) -> dict:
        """What a later process's chooser may ``restore``: the counts and each
        size's median time, unless older than MEMORY_AGE processes."""
        seconds, ages = {}, {}
        for b, t in self._median_times().items():
            age = 0 if any(k > 0 for k, _ in self.times[b]) else self.ages.get(b, 0)
            if age <= self.MEMORY_AGE:
                seconds[str(b)], ages[str(b)] = t, age
        return {
            "range": [self.lo, self.hi],
            "reached": self.reached,
            "hit": self.hit,
            "seconds": seconds,
            "ages": ages,
            "drafted": self.drafted,
            "context": self.context,
        }

    def restore(self, state: dict, prior_cycles: int) -> bool:
        """Start from ``state``, its counts scaled to at most ``prior_cycles``
        cycles; returns False, changing nothing, for a state that does not fit."""
        try:
            fits = state["range"] == [self.lo, self.hi]
            reached = [float(x) for x in state["reached"]]
            hit = [float(x) for x in state["hit"]]
            seconds = {int(b): float(t) for b, t in state["seconds"].items()}
            ages = {int(b): int(a) for b, a in state.get("ages", {}).items()}
            drafted = int(state.get("drafted", round(reached[1]) if len(reached) > 1 else 0))
            context = state.get("context")
            context = None if context is None else int(context)
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        fits = fits and len(reached) == len(hit) == self.hi and all(0 <= h <= r for h, r in zip(hit, reached))
        fits = fits and all((b == 1 or b in self.sizes) and 0 < t < math.inf for b, t in seconds.items())
        fits = fits and all(a >= 0 for a in ages.values()) and (context is None or context >= 0)
        if not fits:
            return False
        scale = min(1.0, prior_cycles / reached[1]) if len(reached) > 1 and reached[1] > 0 else 1.0
        self.reached = [r * scale for r in reached]
        self.hit = [h * scale for h in hit]
        self.drafted = max(self.drafted, min(drafted, prior_cycles))
        self.first = [self.reached[1], self.hit[1]] if len(reached) > 1 else [0.0, 0.0]
        self.context = context
        self._memo.clear()
        for b, t in seconds.items():
            self.times[b] = [(0, t)]
            self._stats.pop(b, None)
            self.ages[b] = ages.get(b, 0) + 1
            self.asked[b] = max(self.asked.get(b, 0), self.PROBE_RUN)
        return True

    def record(self, block: int, accepted: int, seconds: float | None, built: float | None = None) -> None:
        """One cycle at ``block`` accepted ``accepted`` drafts in ``seconds``
        (None: not its size's cost). ``built``: the time of a cycle that built
        new graphs, charged to exploring when it was an exploring run's."""
        self.cycles += 1
        self._memo.clear()
        in_trial = self.trial is not None and self.trial[0] == block
        drafting_trial = self.trial is not None and self.trial[0] > 1 and block > 1
        if built is not None:
            self.seconds += built
            self.build_seconds = self.build_seconds[-15:] + [built]
            if in_trial and block in self.exploring_loss:
                self.exploring_loss[block] += max(0.0, built - self.prepaid)
                self.prepaid = 0.0
        if block > 1:
            self.first = [self.first[0] + 1, self.first[1] + (accepted > 0)]
        for i in range(1, min(block - 1, accepted + 1) + 1):
            self.reached[i] += 1
            self.hit[i] += i <= accepted
        keep = 1.0 - 1.0 / self.MEMORY
        if block == 1:
            self.reply_plain += 1
        else:
            self.reply_drafting += 1
            if self.trees:
                cycles, tokens = self.own.get(block, (0.0, 0.0))
                self.own[block] = (cycles * keep + 1, tokens * keep + accepted + 1)
            self.drafted += 1
            self.reached = [r * keep for r in self.reached]
            self.hit = [h * keep for h in self.hit]
        changed, self.previous = block != self.previous, block
        if in_trial or drafting_trial:
            self.trial[1:] = [self.trial[1] * keep + 1, self.trial[2] * keep + accepted + 1]
        if seconds is None:
            return
        self.seconds += seconds
        # A change of size costs more than either size: charged to exploring.
        if changed:
            usual = self._median_times().get(block)
            if usual is not None:
                self.changes = self.changes[-31:] + [max(0.0, seconds - usual)]
            return
        # A size's first cycles in a process pay its kernel builds: not its cost.
        warmed = self.warmed.get(block, 0)
        if warmed < self.WARM_CYCLES:
            self.warmed[block] = warmed + 1
            return
        ts = self.times.setdefault(block, [])
        if len(ts) >= 3 and seconds > self.SPIKE * median(t for _, t in ts):
            return
        ts.append((self.cycles, seconds))
        del ts[:-32]
        self._stats.pop(block, None)

    def expected_tokens(self, block: int) -> float:
        counted = self._expected()[block - 1]
        if block == 1 or not self.own:
            return counted
        cycles, tokens = self.own.get(block, (0.0, 0.0))
        return (tokens + self.OWN_PRIOR * self._fitted(block)) / (cycles + self.OWN_PRIOR)

    def _fitted(self, block: int) -> float:
        """Tokens a cycle of ``block`` rows on the line a + b ln(rows) through
        what the tree sizes committed, each weighed by its (faded) cycles."""
        if "fit" not in self._memo:
            mean_x, mean_y, _, slope = weighted_line([(math.log(b), t / n, n) for b, (n, t) in self.own.items()])
            self._memo["fit"] = (mean_y - slope * mean_x, slope)
        a, slope = self._memo["fit"]
        return min(max(a + slope * math.log(block), 1.0), float(block))

    def _expected(self) -> list[float]:
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
        return {b: stats[1] for b, stats in self._all_stats().items()}

    def _all_stats(self) -> dict[int, tuple[list[float], float, float]]:
        """Each timed size's (recent times, median, the median's standard
        error). Recent: since the context last changed, where it was timed
        since, and within RECENT cycles, as costs grow with the context; all
        such times if none is recent, else the size would never be chosen again."""
        floor = self.cycles - self.RECENT
        out = {}
        for b, ts in self.times.items():
            kept = self._stats.get(b)
            if kept is None or floor >= kept[0]:
                here = [(k, t) for k, t in ts if k > self.stale_at] or ts
                recent_at = [k for k, _ in here if k > floor]
                recent = [t for k, t in here if k > floor] or [t for _, t in here]
                mid = median(recent)
                spread = 1.4826 * median(abs(t - mid) for t in recent)
                error = 1.2533 * spread / math.sqrt(len(recent))
                kept = (min(recent_at, default=math.inf), (recent, mid, error))
                self._stats[b] = kept
            out[b] = kept[1]
        return out

    def cost(self) -> tuple[float, float]:
        """(a, c) of seconds(b) = a + c*b for drafting blocks. The slope is
        taken down by SLOPE_DOUBT standard errors, to no less than 0, so that
        jitter where every block costs alike does not favour short blocks."""
        if "cost" not in self._memo:
            self._memo["cost"] = self._fit()
        return self._memo["cost"]

    def _fit(self) -> tuple[float, float]:
        pts = [(b, mid, error, len(ts)) for b, (ts, mid, error) in self._all_stats().items() if b > 1]
        # sizes timed at this context only, where any is: another's times are no line
        pts = [p for p in pts if self.times[p[0]][-1][0] > self.stale_at] or pts
        if not pts:
            return 1.0, 0.0
        if len(pts) == 1:
            return pts[0][1], 0.0
        # each size weighed by its times: a size probed once does not move
        # the line as much as one timed every cycle
        mb, mt, var, c = weighted_line([(b, t, w) for b, t, _, w in pts])
        error = math.sqrt(sum((w * (b - mb) * se) ** 2 for b, _, se, w in pts)) / var if var else 0.0
        c = max(0.0, c - self.SLOPE_DOUBT * error)
        a = max(mt - c * mb, 1e-9)
        return a, c

    def new_reply(self, context: int | None = None) -> None:
        """A new reply begins, after ``context`` tokens (None: not told):
        where plain steps are the best choice it starts with a drafting run,
        as plain steps tell nothing of the drafter; each run that clearly
        loses doubles the replies skipped before the next, and what a run
        loses counts against the exploring share. A context CONTEXT_CHANGE
        away from the last reply's leaves the times taken before as each
        size's only until it is timed again, and starts with a drafting run."""
        self.reply_starts = True
        if context is not None:
            last = self.context
            if last is not None and abs(context - last) > self.CONTEXT_CHANGE * max(context, last):
                self.stale_at = self.cycles
                self.replies_to_skip = 0
                self._memo.clear()
                self._stats.clear()
            self.context = context
        self.reply_plain = self.reply_drafting = 0

    def choose(self, would_build=None) -> int:
        """The block size for the next cycle. ``would_build(b)``: whether a
        cycle of ``b`` now would build new graphs, which exploring b is charged for."""
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
        self.reason = "plain: blocks cost more than they commit" if best == 1 else f"drafting: block {best} pays"
        if self.trial is not None:
            # A drafting run from plain steps goes on while it beats them, for
            # at most 2 * MEMORY cycles: faded counts need cycles to follow. It
            # is kept while drafting wins meanwhile: a dip of the counts back to
            # plain steps does not end drafting that pays.
            b, cycles, tokens = self.trial
            times = self._median_times()
            seconds = self._seconds(b, times)
            plain_rate = best_rate if best == 1 else 1.0 / times[1] if times.get(1) else math.inf
            rate = tokens / (cycles * seconds) if cycles else plain_rate
            going = b > 1 and self.cycles - self.last_explored < 2 * self.MEMORY and rate > plain_rate
            if going and best == 1:
                self.run = [b] * (self.EXPLORE_RUN - 1)
                return b
        if self.trial is not None and not going:
            self.trial = None
            if self.reply_trial:
                # Only a clear loss skips replies: three cycles are few.
                self.reply_trial = False
                failed = best == 1 and rate < self.CLEAR_LOSS * best_rate
                self.reply_gap = min(2 * self.reply_gap + 1, self.MAX_REPLY_GAP) if failed else 0
                self.replies_to_skip = self.reply_gap
                if best == 1:
                    change = median(self.changes) if self.changes else 0.0
                    lost = cycles * seconds - tokens / best_rate + 2 * change
                    self.exploring_loss[self.hi] += max(0.0, lost)
        if reply_starts and best == 1:
            if self.replies_to_skip:
                self.replies_to_skip -= 1
            else:
                self.reply_trial = True
                return self._explore(self._best_block()[0])
        if self.explore and self.cycles - self.last_explored >= self.explore:
            # hi, lo and the plain step in turn, leaving out the best: late
            # positions, both ends of the cost line and plain steps stay measured
            turns = [b for b in dict.fromkeys((self.hi, self.lo, 1)) if b != best]
            times = self._median_times()
            change = median(self.changes) if self.changes else 0.0
            start = self.explored % len(turns)
            for b in turns[start:] + turns[:start]:
                seconds = self._seconds(b, times)
                # what exploring b loses against the best choice, with the two
                # changes of size and any build; each b has an equal part of the share
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
        self.last_explored = self.cycles
        self.run = [block] * (self.EXPLORE_RUN - 1)
        self.trial = [block, 0, 0]
        self.prepaid = 0.0
        return block

    def _seconds(self, block: int, times: dict[int, float]) -> float:
        if times.get(block):
            return times[block]
        a, c = self.cost()
        return a + c * block

    def _best_block(self) -> tuple[int, float]:
        a, c = self.cost()
        best, best_rate = self.hi, -math.inf
        for b in self.sizes:  # ties go to the longer block
            rate = self.expected_tokens(b) / (a + c * b)
            if rate > best_rate + 1e-12:
                best, best_rate = b, rate
        return best, best_rate

    def _best(self) -> tuple[int, float]:
        """The best choice and its rate: plain steps only once they clearly
        win, after EVIDENCE drafting cycles; before, only where no block could
        pay even at an acceptance taken up by ACCEPTANCE_DOUBT standard
        errors (a long context's dear blocks and a drafter never right: at once)."""
        best, best_rate = self._best_block()
        plain = self._median_times().get(1)
        if plain is None:
            return best, best_rate
        self.sure = self.sure or self.drafted >= self.EVIDENCE
        if 1.0 / plain > (best_rate if self.sure else self._hopeful_rate()) * 1.02:
            self.sure = True  # from here the counts' estimate decides, as after EVIDENCE
            return 1, 1.0 / plain
        return best, best_rate

    def _hopeful_rate(self) -> float:
        """The best block's rate were every draft accepted at the first
        draft's rate plus ACCEPTANCE_DOUBT of its standard errors. The first
        drafts are counted whole, not faded: faded counts hold some 32 cycles,
        too few to show that no block pays where one costs 1.2 plain steps."""
        n, hit = self.first
        p = (hit + 0.5) / (n + 1)
        q = min(1.0, p + self.ACCEPTANCE_DOUBT * math.sqrt(p * (1 - p) / (n + 1)))
        a, c = self.cost()
        return max(sum(q**i for i in range(b)) / (a + c * b) for b in self.sizes)


_choosers: dict[int, tuple[weakref.ref, dict]] = {}


def chooser_for(draft, lo: int, hi: int, trees: bool = False) -> BlockChooser:
    """The chooser kept for ``draft`` and this range of block sizes (or tree
    rows), so one call learns from the last; forgotten with the drafter or by ``forget``."""
    key = id(draft)
    entry = _choosers.get(key)
    if entry is None or entry[0]() is not draft:
        entry = (weakref.ref(draft, lambda _, key=key: _choosers.pop(key, None)), {})
        _choosers[key] = entry
    kept = entry[1]
    if (lo, hi, trees) not in kept:
        kept[(lo, hi, trees)] = BlockChooser(lo, hi, trees=trees)
    return kept[(lo, hi, trees)]


def forget(draft) -> None:
    _choosers.pop(id(draft), None)


# Z Lab advises blocks of at most 5 for a DFlash 2 drafter with a quantized
# model: quantization shifts the states it was trained on.
QUANTIZED_DFLASH2_RANGE = (2, 5)


def _quantized(module) -> bool:
    """Any layer of ``module`` holds quantized weights."""
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
        or ("scales" in m and "weight" in m)
        for _, m in module.named_modules()
    )


def auto_range(target, draft) -> tuple[int, int]:
    """The block range ``block_size="auto"`` chooses in: (2, 5) for a DFlash 2
    drafter with a quantized model, else (4, the trained block)."""
    hi = draft.config.block_size
    if draft.selects_candidates and (_quantized(getattr(target, "model", target)) or _quantized(draft)):
        lo, top = QUANTIZED_DFLASH2_RANGE
        return min(lo, hi), min(top, hi)
    return min(4, hi), hi


def tree_range(block_size: int) -> tuple[int, int]:
    """The rows ``tree_budget="auto"`` chooses among for trees over blocks of
    ``block_size``: from 4 up to two blocks' rows, at most 32."""
    return min(4, block_size), max(min(32, 2 * block_size), min(4, block_size))
