"""Where the host's time goes in a decode of the built-in pair, function by function.

    python benchmarks/host_profile.py --blocks 16,auto --prompts 4
    python benchmarks/host_profile.py --plain          # mlx-lm's own loop beside it

Where a cycle is bound by the host (the built-in pair on a GPU: a 1.7 ms
cycle of which the device is busy ~0.6 ms, BENCHMARKS.md session 17), every
microsecond of Python in the loop is on the critical path. This decodes the
held-out prompts (as bench_builtin.py does, after a warm-up) under cProfile
and prints, per loop, the functions with the most time of their own, in
microseconds per cycle (per step for plain decoding): building graphs,
``mx.async_eval`` (the backend encoding kernels), ``tolist`` (waiting for the
device), the chooser, the detokenizer, the statistics. cProfile's own
overhead inflates every row alike; compare rows, not totals against an
unprofiled run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def profile(run) -> tuple[float, int, list[tuple[str, float, float]]]:
    """Run ``run()`` (returning its seconds and the cycles it ran) under
    cProfile; returns (seconds, cycles, rows of (function, microseconds of
    its own time a cycle, calls a cycle)), most time first."""
    prof = cProfile.Profile()
    prof.enable()
    seconds, cycles = run()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, own, _, _) in stats.stats.items():
        where = f"{Path(path).name}:{line}({name})" if line else name
        rows.append((where, 1e6 * own / cycles, calls / cycles))
    rows.sort(key=lambda r: -r[1])
    return seconds, cycles, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="16,auto", help="block sizes, comma-separated ('auto' too)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plain", action="store_true", help="also profile mlx-lm's stream_generate")
    ap.add_argument("--top", type=int, default=25, help="rows printed per loop")
    args = ap.parse_args()

    from bench_builtin import PROMPTS, dflash, machine, plain, prompt_sets

    from dflash_mlx import load

    model, draft, tok = load("builtin")
    sets = prompt_sets(tok, {k: json.loads(PROMPTS.read_text())[k] for k in ("code", "chat")}, args.prompts)
    prompts = [p for ps in sets.values() for p in ps]
    print(f"machine: {machine()}; {len(prompts)} prompts, {args.max_tokens} new tokens")
    loops = [b if b == "auto" else int(b) for b in args.blocks.split(",")]
    if args.plain:
        loops.append("plain")
    for loop in loops:
        # warm-up: the first calls build kernels and trace graphs
        if loop == "plain":
            plain(model, tok, prompts[0], 16, 0.0, 0)
        else:
            dflash(model, draft, tok, prompts[0], 32, 0.0, loop, 0, Counter())

        def run() -> tuple[float, int]:
            seconds, cycles, used = 0.0, 0, Counter()
            for p in prompts:
                if loop == "plain":
                    n, took = plain(model, tok, p, args.max_tokens, 0.0, 0)  # (n: the steps after the first token)
                    seconds, cycles = seconds + took, cycles + n
                else:
                    seconds += dflash(model, draft, tok, p, args.max_tokens, 0.0, loop, 0, used)[1]
            return seconds, cycles + sum(used.values())

        seconds, cycles, rows = profile(run)
        unit = "step" if loop == "plain" else "cycle"
        print(
            f"\n{loop}: {cycles} {unit}s, {1e6 * seconds / cycles:.0f} us a {unit} profiled; us a {unit} of own time:"
        )
        for where, us, calls in rows[: args.top]:
            print(f"  {us:8.1f}  {calls:6.2f} calls  {where}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
