"""The built-in pair's acceptance length and speedup over plain mlx-lm on held-out prompts.

Reported in BENCHMARKS.md, "The built-in pair" ("Acceptance on held-out prompts",
"H100", "CPU"), and README.md's built-in pair rows.

    python benchmarks/bench_builtin.py --prompts 8 --blocks 16,auto --temps 0
    python benchmarks/bench_builtin.py --prompts 16                  # acceptance at blocks 8, 16, temps 0, 0.7
    python benchmarks/bench_builtin.py --prompts 8 --blocks 16 --temps 0 --lookup auto   # with prompt lookup

Prompts come from standard-library files that the build held out of every
training stage (scripts/builtin_corpus.py: a fixed hash split of file paths):
code prefixes to continue, and chat requests to write a documented function.
They are read from benchmarks/prompts/held_out.json (made from Python 3.11.7's
stdlib with ``--write-prompts``), so that every machine measures the same
prompts whatever its Python; ``--from-stdlib`` draws them from this Python's
stdlib instead.
For each (prompt set, block size, temperature) it prints the mean acceptance
length (tokens committed per verify cycle, bonus included), DFlash decoding
speed and plain mlx-lm decoding speed of the same target, measured side by side
in one process (each prompt's plain decoding right before its DFlash decoding, for every row), and
their ratio. Prefill is excluded from both speeds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def machine() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    name = ""
    try:
        name = mx.device_info().get("device_name", "") if dev.type == mx.gpu else ""
    except Exception:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        import os

        cpu += f", {os.cpu_count()} cores"
    except Exception:
        pass
    return f"{platform.system()} {cpu}; MLX {mx.__version__} on {dev} {name}".strip()


PROMPTS = ROOT / "benchmarks" / "prompts" / "held_out.json"


def stdlib_prompts(n: int, seed: int) -> dict[str, list[str]]:
    """Code prefixes and chat requests (text) from this Python's held-out stdlib files."""
    import random

    from builtin_corpus import chat_request, code_prompts, functions, stdlib_files

    files = stdlib_files(held_out=True)
    fns = [f for _, t in files for f in functions(t)]
    random.Random(seed).shuffle(fns)
    return {"code": code_prompts(files, n, seed), "chat": [chat_request(sig, doc) for sig, doc, _ in fns[:n]]}


def prompt_sets(tokenizer, texts: dict[str, list[str]], n: int) -> dict[str, list[list[int]]]:
    if any(len(v) < n for v in texts.values()):
        raise SystemExit(f"--prompts {n}: the prompt file holds {min(len(v) for v in texts.values())} per set")
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        for t in texts["chat"][:n]
    ]
    return {"code": [tokenizer.encode(t) for t in texts["code"][:n]], "chat": [list(c) for c in chat]}


def decode_time(responses, gaps: list | None = None):
    """Tokens after the first and the seconds they took (prefill and the
    first token excluded, the same clock for both loops), and the last
    response; ``gaps`` gets the seconds between responses (a plain step's
    or a DFlash cycle's each)."""
    first = last = None
    mark = None
    for last in responses:
        now = time.perf_counter()
        if first is None:
            first = now
        elif gaps is not None:
            gaps.append(now - mark)
        mark = now
    return last.generation_tokens - 1, time.perf_counter() - first, last


def plain(model, tokenizer, prompt, max_tokens, temp, seed, gaps: list | None = None):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    n, seconds, _ = decode_time(
        stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=temp)), gaps
    )
    return n, seconds


def dflash(model, draft, tokenizer, prompt, max_tokens, temp, block, seed, used: Counter, gaps=None, lookup=False):
    """DFlash's decode; counts each cycle's block size into ``used`` (1: a plain step)."""
    from dflash_mlx import stream_generate

    def counted(responses):
        for r in responses:
            if r.accepted is not None:  # (not the first token's response)
                used[r.block_size] += 1
            yield r

    n, seconds, last = decode_time(
        counted(
            stream_generate(
                model,
                draft,
                tokenizer,
                prompt,
                max_tokens=max_tokens,
                temperature=temp,
                block_size=block,
                seed=seed,
                lookup=lookup,
            )
        ),
        gaps,
    )
    return n, seconds, last.acceptance_length


def median_ms(gaps: list) -> float:
    return 1000 * sorted(gaps)[len(gaps) // 2] if gaps else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "dflash_mlx" / "builtin" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "dflash_mlx" / "builtin" / "draft"))
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--blocks", default="8,16", help="block sizes, comma-separated; 'auto' lets dflash-mlx choose")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--sets", default="code,chat")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--lookup",
        choices=["off", "on", "auto"],
        default="off",
        help="prompt lookup beside the drafter (docs/lookup.md)",
    )
    ap.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="what both models compute in (dflash_mlx.load's dtype; the weights are stored in bf16, and "
        "auto takes float32 on a CPU whose products run on OpenBLAS, see BENCHMARKS.md)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--from-stdlib", action="store_true", help="draw the prompts from this Python's stdlib")
    ap.add_argument(
        "--write-prompts",
        action="store_true",
        help=f"write 32 prompts per set from this Python's stdlib to {PROMPTS.relative_to(ROOT)} and stop",
    )
    args = ap.parse_args()
    from dflash_mlx import use_fast_blas

    use_fast_blas()  # before anything imports MLX, or its CPU products keep the reference BLAS
    if args.write_prompts:
        PROMPTS.write_text(
            json.dumps({"python": platform.python_version(), **stdlib_prompts(32, args.seed)}, indent=1) + "\n"
        )
        print(f"wrote {PROMPTS}")
        return

    from dflash_mlx import compute_dtype, fast_blas, load

    model, draft, tok = load(args.model, draft=args.draft, dtype=args.dtype)
    dtype = compute_dtype.name(model)
    texts = stdlib_prompts(args.prompts, args.seed) if args.from_stdlib else json.loads(PROMPTS.read_text())
    sets = prompt_sets(tok, {k: texts[k] for k in ("code", "chat")}, args.prompts)
    blocks = [b if b == "auto" else int(b) for b in args.blocks.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    print(f"machine: {machine()}")
    source = (
        f"Python {platform.python_version()}'s stdlib"
        if args.from_stdlib
        else f"{PROMPTS.name} (Python {texts['python']})"
    )
    print(
        f"pair: {args.model} + {args.draft} ({dtype}, --dtype {args.dtype}; BLAS: {fast_blas.describe()}); {args.prompts} held-out prompts per set from {source}, {args.max_tokens} new tokens, lookup {args.lookup}"
    )
    rows = table(args, model, draft, tok, sets, blocks, temps)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2)
        )


def table(args, model, draft, tok, sets, blocks, temps) -> list[dict]:
    lookup = {"off": False, "on": True, "auto": "auto"}[args.lookup]
    # Warm-up: first calls build kernels and graphs.
    warm = sets["code"][0]
    plain(model, tok, warm, 16, 0.0, 0)
    for b in blocks:
        for t in temps:  # sampling builds its own kernels
            dflash(model, draft, tok, warm, 32, t, b, 0, Counter(), lookup=lookup)

    rows = []
    print(
        "\n| prompts | block | temp | acceptance length | DFlash tok/s | plain tok/s | speedup | cycle ms median / mean "
        "| plain step ms median / mean | cycles by block |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sets.split(","):
        for temp in temps:
            for b in blocks:
                # Plain decoding of each prompt right before DFlash's, so that
                # a machine whose speed drifts (a shared host) times both alike.
                base_tok = base_s = tok_n = sec = 0.0
                accs = []
                used = Counter()
                steps, cycles = [], []  # seconds between responses: plain steps, DFlash cycles
                for i, p in enumerate(sets[name]):
                    n, s = plain(model, tok, p, args.max_tokens, temp, args.seed + i, steps)
                    base_tok, base_s = base_tok + n, base_s + s
                    n, s, acc = dflash(
                        model, draft, tok, p, args.max_tokens, temp, b, args.seed + i, used, cycles, lookup
                    )
                    tok_n, sec = tok_n + n, sec + s
                    accs.append(acc)
                row = {
                    "set": name,
                    "block": b,
                    "temp": temp,
                    "acceptance": sum(accs) / len(accs),
                    "dflash_tps": tok_n / sec,
                    "plain_tps": base_tok / base_s,
                    "cycles_by_block": dict(sorted(used.items(), reverse=True)),
                    # (a median against a mean: one-off costs, such as graphs built, show in the mean only)
                    "cycle_ms_median": median_ms(cycles),
                    "cycle_ms_mean": 1000 * sec / max(len(cycles), 1),
                    "plain_step_ms_median": median_ms(steps),
                    "plain_step_ms_mean": 1000 * base_s / max(len(steps), 1),
                }
                row["speedup"] = row["dflash_tps"] / row["plain_tps"]
                rows.append(row)
                blocks_used = " ".join(f"{k if k > 1 else 'plain'}:{v}" for k, v in row["cycles_by_block"].items())
                print(
                    f"| {name} | {b} | {temp:g} | {row['acceptance']:.2f} | {row['dflash_tps']:.1f} | "
                    f"{row['plain_tps']:.1f} | {row['speedup']:.2f}x | {row['cycle_ms_median']:.2f} / "
                    f"{row['cycle_ms_mean']:.2f} | {row['plain_step_ms_median']:.2f} / {row['plain_step_ms_mean']:.2f} "
                    f"| {blocks_used} |",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
