"""What ``block_size="auto"`` decides and why, prompt by prompt: the built-in
pair over held-out prompts (as bench_builtin.py runs them), printing each
prompt's blocks and, whenever the chooser turns to plain steps or back, what
it believed then (each size's median cycle time, the expected tokens of its
longest block, the best choice and its rate).

    python benchmarks/auto_log.py --sets code,chat --prompts 8

Run it with ``DFLASH_MLX_AUTO_MEMORY=0`` to watch a fresh process learn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "dflash_mlx" / "builtin" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "dflash_mlx" / "builtin" / "draft"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--sets", default="code,chat")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--plain-between",
        action="store_true",
        help="decode each prompt with plain mlx-lm first, as bench_builtin.py does",
    )
    ap.add_argument(
        "--against",
        type=int,
        default=0,
        help="also decode each prompt at this fixed block first, and print auto's rate over its",
    )
    ap.add_argument(
        "--cycles",
        metavar="PATH",
        help="write every cycle auto recorded as JSON lines: set, prompt, block, accepted, "
        "seconds (null: a change of size or a build), built (a build's seconds), "
        "and whether it ran in an exploring run or a probe",
    )
    args = ap.parse_args()

    from bench_builtin import PROMPTS, machine, plain, prompt_sets

    from dflash_mlx import load, stream_generate
    from dflash_mlx.auto import chooser as block_size

    model, draft, tok = load(args.model, draft=args.draft)
    texts = json.loads(PROMPTS.read_text())
    sets = prompt_sets(tok, {k: texts[k] for k in ("code", "chat")}, args.prompts)
    choose = block_size.BlockChooser.choose

    last = [None]  # the last choice made (cycles are chosen one ahead of being recorded)

    probes = []  # whether each choice not yet recorded was a probe (choices are recorded in order)

    def logged(self, would_build=None):
        probes.append(any(self.asked.get(b, 0) < self.PROBE_RUN for b in self.probe))  # (as _choose asks)
        b = choose(self, would_build)
        turned = last[0] is not None and (b == 1) != (last[0] == 1) and not self.run
        last[0] = b
        if turned:
            best, rate = self._best()
            times = {k: round(1000 * v, 2) for k, v in self._median_times().items()}
            print(
                f"  cycle {self.cycles}: -> {'plain' if b == 1 else b}; median ms {times}, "
                f"expected tokens at {self.hi} {self.expected_tokens(self.hi):.2f}, best {best} "
                f"({rate:.0f} tok/s)",
                flush=True,
            )
        return b

    block_size.BlockChooser.choose = logged
    where = {}  # the prompt under way, for --cycles
    sink = open(args.cycles, "w") if args.cycles else None
    if sink is not None:
        record = block_size.BlockChooser.record

        def recorded(self, block, accepted, seconds, built=None):
            probing = probes.pop(0) if probes else False
            exploring = self.trial is not None and self.trial[0] == block
            sink.write(
                json.dumps(
                    {
                        **where,
                        "block": block,
                        "accepted": accepted,
                        "seconds": seconds,
                        "built": built,
                        "probe": probing,
                        "explore": exploring,
                    }
                )
                + "\n"
            )
            record(self, block, accepted, seconds, built)

        block_size.BlockChooser.record = recorded
    print(f"machine: {machine()}")
    for name in args.sets.split(","):
        for i, prompt in enumerate(sets[name]):
            if args.plain_between:
                plain(model, tok, prompt, args.max_tokens, 0.0, 0)
            fixed = None
            if args.against:
                for fixed in stream_generate(
                    model, draft, tok, prompt, max_tokens=args.max_tokens, block_size=args.against
                ):
                    pass
            where.update(set=name, prompt=i)
            probes.clear()  # (a cycle queued past the last reply's end was chosen, never recorded)
            for r in stream_generate(model, draft, tok, prompt, max_tokens=args.max_tokens, block_size="auto"):
                pass
            versus = f" ({r.generation_tps / fixed.generation_tps:.2f}x block {args.against})" if fixed else ""
            print(f"{name} {i}: {r.generation_tps:.0f} tok/s{versus}, cycles by block {r.block_sizes}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
