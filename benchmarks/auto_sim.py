"""`auto`'s decoding rate as a share of an oracle's, per simulated machine and text.

Reported in BENCHMARKS.md, "`auto`'s chooser, simulated".

    python benchmarks/auto_sim.py                  # every scenario, 5 seeds each
    python benchmarks/auto_sim.py --seeds 20 --cycles 4000

No model and no device, in seconds. Each scenario is a cost model measured on
a real machine and an acceptance pattern; the chooser is the real one
(``dflash_mlx.auto.chooser.BlockChooser``), fed what the decode loop would
feed it: each cycle's block, accepted drafts and time, plus what a change of
block size costs the host, and each reply's context (its cost grows with the
context: the long-prompt scenarios). The oracle knows each cycle's acceptance
and takes the best block size or plain steps. A change to the chooser should keep every
row near 1.0; where one falls, the cycles-by-choice column says what it did.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_mlx.auto.chooser import BlockChooser  # noqa: E402


@dataclass
class Scenario:
    name: str
    seconds: Callable[..., float]  # a cycle's time by block size (1: a plain step) and context
    acceptance: Callable[[int], float]  # chance each draft is accepted given the ones before, by cycle index
    change: float = 0.0  # what a cycle that changes block size costs the host on top
    noise: float = 0.0  # each cycle's time times exp(N(0, noise)): the host's jitter
    drift: float = 0.0  # and times a factor whose log walks N(0, drift) a cycle (kept within +-0.5)
    reply: int = 0  # cycles per reply (the chooser told of each new one), 0: one long text
    # a new process at this cycle (0: none), starting from what the first one
    # learned (block_memory.py), on a host this much slower (an H100's varies
    # up to 2x from one process to the next)
    restart: int = 0
    slower: float = 1.0
    cold: float = 1.0  # each reply's first 3 cycles cost this much more (the host ran other work in between)
    prompt: Callable[[int], int] = lambda reply: 0  # the prompt's tokens, by reply: the context a reply starts at
    # replies in all where set, the first one not scored (speed.py: a warm-up
    # round, then 2); else --cycles cycles, the first tenth not scored
    rounds: int = 0
    # a plain step's time times this, by reply (a host-bound plain step on a
    # host whose speed changes between replies; a compiled cycle's launch is short)
    host: Callable[[int], float] = lambda reply: 1.0


def gpu(b: int, context: int = 0) -> float:
    """The built-in pair on an H100 (ms): plain 1.3, any block 2.8."""
    return 0.0013 if b == 1 else 0.0028


def cpu(b: int, context: int = 0) -> float:
    """The built-in pair on the 2-core CPU: plain 9 ms, a block costs 4.8 plain steps at 4, more beyond."""
    return 0.009 if b == 1 else 0.024 + 0.0045 * b


def cpu_near(b: int, context: int = 0) -> float:
    """The built-in pair on the 2-core CPU as bench_builtin.py measured it: plain 9.6 ms,
    a block of 4 34 ms (at its acceptance, 0.72-0.78x plain decoding), 4.5 ms more a position."""
    return 0.0096 if b == 1 else 0.034 + 0.0045 * (b - 4)


def cpu_fast(b: int, context: int = 0) -> float:
    """A CPU whose verify grows slowly with the block (plain 9 ms, a block 12 + 2 b ms): 8 is best at 0.9."""
    return 0.009 if b == 1 else 0.012 + 0.002 * b


def h100_8b(b: int, context: int = 0) -> float:
    """Qwen3-8B shapes on an H100, random weights (benchmarks/speed.py): a plain
    step 10.5 ms + 0.05 a 1k context, any block 9.9 + 0.40: a block-16 cycle is
    0.98, 1.2, 1.44, 1.88 plain steps at 1k, 8k, 16k, 32k (measured: 0.93, 1.37,
    1.5, 1.9)."""
    k = context / 1000
    return (10.5 + 0.05 * k) / 1000 if b == 1 else (9.9 + 0.40 * k) / 1000


def h100_8b_measured(b: int, context: int = 0) -> float:
    """Qwen3-8B shapes on an H100 as long_context.py measures them (random
    weights, MLX 0.32.4 CUDA, a plain step mlx-lm's): a plain step 11.8 ms,
    any block 11.4 + 0.0925 a 1k context: a block-16 cycle is 1.09 and 1.22
    plain steps at 16k and 32k (measured: 1.09, 1.23)."""
    return 0.0118 if b == 1 else (11.4 + 0.0925 * context / 1024) / 1000


def h200_8b_16k(b: int, context: int = 0) -> float:
    """Qwen3-8B shapes at 16k on an H200 (long_context.py, nothing accepted):
    a plain step 6.2 ms on a fast host (11.0 on a slow one, ``flipping``),
    a compiled block-16 cycle 10.7 ms either way."""
    return 0.0062 if b == 1 else (8.0 + 0.17 * b) / 1000


def flipping(reply: int) -> float:
    """The H200's host: a plain step 1.8x slower in about half the replies."""
    return 1.8 if random.Random(1000 + reply).random() < 0.5 else 1.0


def one_in_four(reply: int) -> bool:
    """A fixed quarter of the replies (a hard prompt now and then)."""
    return random.Random(reply).random() < 0.25


SCENARIOS = [
    Scenario("GPU, good acceptance, changes 4 ms", gpu, lambda i: 0.78, 0.004),
    Scenario("GPU, hard first 40 cycles, changes 4 ms", gpu, lambda i: 0.35 if i < 40 else 0.78, 0.004),
    Scenario("GPU, hard first 100 cycles, changes 4 ms", gpu, lambda i: 0.35 if i < 100 else 0.78, 0.004),
    Scenario("GPU, good acceptance, noisy and drifting times", gpu, lambda i: 0.78, 0.004, 0.25, 0.03),
    Scenario("GPU, nothing accepted (random weights)", gpu, lambda i: 0.0, 0.004),
    Scenario(
        "GPU, replies of 30 cycles, one in four hard",
        gpu,
        lambda i: 0.3 if one_in_four(i // 30) else 0.78,
        0.004,
        reply=30,
    ),
    Scenario("GPU, replies of 30 cycles, nothing accepted", gpu, lambda i: 0.0, 0.004, reply=30),
    Scenario("GPU, plain best by ~17%, changes 10 ms", gpu, lambda i: 0.3, 0.010),
    Scenario(
        "GPU, replies, next process 1.6x slower host",
        gpu,
        lambda i: 0.78,
        0.004,
        0.25,
        0.03,
        reply=30,
        restart=1500,
        slower=1.6,
    ),
    Scenario(
        "GPU, replies, next process 1.6x faster host",
        gpu,
        lambda i: 0.78,
        0.004,
        0.25,
        0.03,
        reply=30,
        restart=1500,
        slower=1 / 1.6,
    ),
    Scenario(
        "GPU, replies after other work, cold starts",
        gpu,
        lambda i: 0.78,
        0.004,
        0.25,
        0.03,
        reply=30,
        restart=1500,
        slower=1.3,
        cold=2.0,
    ),
    Scenario("CPU, no block pays", cpu, lambda i: 0.6, 0.0005),
    Scenario("CPU, replies of 30 cycles, no block pays", cpu, lambda i: 0.6, 0.0005, reply=30),
    Scenario("CPU, replies of 30 cycles, block 4 at 0.75x plain", cpu_near, lambda i: 0.72, 0.0005, reply=30),
    Scenario("CPU, the text turns predictable", cpu, lambda i: 0.6 if i < 1000 else 0.97, 0.0005),
    Scenario("CPU, a block of 8 best, noisy and drifting", cpu_fast, lambda i: 0.9, 0.0005, 0.25, 0.03),
    # Long prompts: replies of 64 cycles, as speed.py --max-tokens 64 with random weights
    *[
        Scenario(
            f"H100 8B, {k}k prompt, nothing accepted",
            h100_8b,
            lambda i: 0.0,
            0.002,
            reply=64,
            prompt=lambda r, k=k: k * 1024,
        )
        for k in (8, 16, 32)
    ],
    *[
        Scenario(
            f"H100 8B, {k}k prompt, nothing accepted, speed.py",
            h100_8b,
            lambda i: 0.0,
            0.002,
            reply=64,
            prompt=lambda r, k=k: k * 1024,
            rounds=3,
        )
        for k in (8, 16, 32)
    ],
    Scenario(
        "H100 8B, 32k prompt, a drafter at 0.2", h100_8b, lambda i: 0.2, 0.002, 0.1, reply=64, prompt=lambda r: 32768
    ),
    Scenario(
        "H100 8B, 32k prompt, good acceptance", h100_8b, lambda i: 0.78, 0.002, 0.1, reply=64, prompt=lambda r: 32768
    ),
    # as long_context.py --repeat 1 runs: a new chooser, a warm-up reply then one scored; times jitter
    *[
        Scenario(
            f"H100 8B measured, {k}k, nothing accepted, 2 rounds",
            h100_8b_measured,
            lambda i: 0.0,
            0.002,
            0.05,
            reply=64,
            prompt=lambda r, k=k: k * 1024,
            rounds=2,
        )
        for k in (16, 32)
    ],
    *[
        Scenario(
            f"H100 8B measured, {k}k, nothing accepted",
            h100_8b_measured,
            lambda i: 0.0,
            0.002,
            0.05,
            reply=64,
            prompt=lambda r, k=k: k * 1024,
        )
        for k in (16, 32)
    ],
    Scenario(
        "H100 8B measured, 32k, accepted at 0.7",
        h100_8b_measured,
        lambda i: 0.7,
        0.002,
        0.05,
        reply=64,
        prompt=lambda r: 32768,
    ),
    Scenario(
        "H200 8B, 16k, nothing accepted, host speed flips by reply",
        h200_8b_16k,
        lambda i: 0.0,
        0.002,
        0.05,
        reply=64,
        prompt=lambda r: 16384,
        host=flipping,
    ),
    Scenario(
        "H100 8B, prompts of 1k and 32k in turn, at 0.4",
        h100_8b,
        lambda i: 0.4,
        0.002,
        0.1,
        reply=64,
        prompt=lambda r: 1024 if r % 2 else 32768,
    ),
]


def run(scenario: Scenario, cycles: int, seed: int) -> tuple[float, Counter]:
    """The time the best choice for each cycle's text would have taken for the
    tokens the chooser committed after the first tenth of the cycles, as a
    share of the time the chooser took for them (1.0: as fast as an oracle
    that knows the acceptance), and the choices it made."""
    from dflash_mlx.auto.memory import PRIOR_CYCLES

    chooser = BlockChooser(4, 16)
    rng = random.Random(seed)
    speed = 1.0
    ideal = spent = 0.0
    used: Counter = Counter()
    last = None
    level = 0.0  # the drift's log factor
    start = cycles // 10
    if scenario.rounds:
        cycles, start = scenario.rounds * scenario.reply, scenario.reply
    context, host = 0, 1.0
    for i in range(cycles):
        if scenario.restart and i == scenario.restart:
            state, chooser, speed, last = chooser.state(), BlockChooser(4, 16), scenario.slower, None
            chooser.restore(state, PRIOR_CYCLES)
        if scenario.reply and i % scenario.reply == 0:
            context, host = scenario.prompt(i // scenario.reply), scenario.host(i // scenario.reply)
            chooser.new_reply(context)
        b = chooser.choose()
        p = scenario.acceptance(i)
        accepted = 0
        while accepted < b - 1 and rng.random() < p:
            accepted += 1
        level = max(-0.5, min(0.5, level + rng.gauss(0.0, scenario.drift))) if scenario.drift else 0.0
        jitter = speed * math.exp(level + (rng.gauss(0.0, scenario.noise) if scenario.noise else 0.0))
        if scenario.reply and i % scenario.reply < 3:
            jitter *= scenario.cold

        def cost(k: int) -> float:
            return scenario.seconds(k, context) * (host if k == 1 else 1.0)

        t = cost(b) * jitter + (scenario.change if last not in (None, b) else 0.0)
        chooser.record(b, accepted, t)
        last = b
        if i >= start:
            rates = [sum(p**j for j in range(k)) / cost(k) for k in [1, *chooser.sizes]]
            best_rate = max(rates)
            ideal, spent = ideal + jitter * (accepted + 1) / best_rate, spent + t
            used[b] += 1
        context += accepted + 1
    return ideal / spent, used


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    print(f"{'scenario':<50} {'rate / oracle (min, median)':>28}  cycles by choice (last seed)")
    for s in SCENARIOS:
        results = [run(s, args.cycles, seed) for seed in range(args.seeds)]
        shares = [r for r, _ in results]
        used = " ".join(f"{'plain' if b == 1 else b}:{n}" for b, n in results[-1][1].most_common(4))
        print(f"{s.name:<50} {min(shares):>14.3f} {statistics.median(shares):>13.3f}  {used}")


if __name__ == "__main__":
    main()
