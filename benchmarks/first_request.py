"""A fresh process's reply: `dflash-mlx generate` with and without `auto`'s memory, beside mlx-lm.

Every reply runs in its own process, as a one-shot `dflash-mlx generate` (or a
new `chat`/`serve`'s first request) does, on the built-in pair:

- ``plain``: ``python -m mlx_lm generate`` on the built-in target;
- ``fresh``: ``dflash-mlx generate`` with ``DFLASH_MLX_AUTO_MEMORY=0``: `auto`
  starts knowing nothing and probes the block range;
- ``remembered``: ``dflash-mlx generate`` with a memory folder of its own,
  written first by one run on a prompt outside the measured ones and then
  by each measured run, as a user's folder is (dflash_mlx/block_memory.py).

Each CLI reports its own generation speed (tokens after the prompt over their
time); the total is the sum of tokens over the sum of their times.

    python benchmarks/first_request.py --prompts 8 --max-tokens 128 --sets code,chat
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_builtin import PROMPTS, machine  # noqa: E402

PATTERNS = {
    "plain": r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec",
    "dflash": r"generated (\d+) tokens, ([\d.]+) tok/s",
}


def run(mode: str, prompt: str, max_tokens: int, home: str) -> tuple[int, float]:
    """(tokens, seconds) of one reply in a fresh process."""
    env = dict(os.environ, DFLASH_MLX_HOME=home)
    if mode == "plain":
        from dflash_mlx import builtin

        cmd = [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(builtin.TARGET),
            "--prompt",
            prompt,
            "-m",
            str(max_tokens),
        ]
    else:
        cmd = [str(Path(sys.executable).with_name("dflash-mlx")), "generate", "--prompt", prompt, "-m", str(max_tokens)]
        env["DFLASH_MLX_AUTO_MEMORY"] = "0" if mode == "fresh" else "1"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    found = re.search(PATTERNS["plain" if mode == "plain" else "dflash"], out.stdout + out.stderr)
    if found is None:
        raise SystemExit(f"no speed line in the output of {' '.join(cmd[:4])}:\n{out.stdout[-500:]}{out.stderr[-500:]}")
    tokens, tps = int(found.group(1)), float(found.group(2))
    return tokens, tokens / tps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sets", default="code,chat")
    args = ap.parse_args()
    texts = json.loads(PROMPTS.read_text())
    print(machine())
    print(f"{'set':>5} {'mode':>11} {'tokens':>7} {'tok/s':>8} {'x plain':>8}")
    with tempfile.TemporaryDirectory() as fresh_home, tempfile.TemporaryDirectory() as home:
        for name in args.sets.split(","):
            prompts = texts[name][: args.prompts + 1]
            run("remembered", prompts[-1], args.max_tokens, home)  # the memory's first lesson, not measured
            totals = {}
            for mode in ("plain", "fresh", "remembered"):
                runs = [
                    run(mode, p, args.max_tokens, home if mode == "remembered" else fresh_home)
                    for p in prompts[: args.prompts]
                ]
                totals[mode] = (sum(n for n, _ in runs), sum(s for _, s in runs))
            base = totals["plain"][0] / totals["plain"][1]
            for mode, (n, s) in totals.items():
                print(f"{name:>5} {mode:>11} {n:>7} {n / s:>8.1f} {n / s / base:>7.2f}x")


if __name__ == "__main__":
    main()
