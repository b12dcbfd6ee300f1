"""Decode tok/s of plain mlx-lm, dflash-mlx and the official Z Lab loop on the same weights.

Reported in BENCHMARKS.md, "Against the official Z Lab loop" (under "The built-in
pair" and under "Qwen3-8B shapes, random weights"), and README.md's "vs the official
Z Lab loop" row.

    python benchmarks/speed.py --shape qwen3-8b --max-tokens 96 --block-size 16,auto --repeat 2
    python benchmarks/speed.py --model dflash_mlx/builtin/target --draft dflash_mlx/builtin/draft \
        --prompt @benchmarks/prompts/held_out_code.txt --max-tokens 256

All three run in one process, each round in turn; the official loop
(``dflash.model_mlx``, ``pip install --no-deps dflash==0.1.0``) is skipped where
it is not installed. With random weights (``--shape``) the drafter accepts almost
nothing, so the figure is a cycle's cost against a plain step; with a trained pair
it is the real speedup.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from cycle import SHAPES, configs, random_target, synthetic_prompt
from mlx_lm.generate import generate_step


def random_pair(shape: str, tmp: Path):
    """The pair at a model's shapes written as checkpoints (the official loop loads from disk)."""
    from dflash_mlx.tiny import make_tokenizer, random_draft_weights, write_target, write_zlab_draft

    tcfg, dcfg = configs(shape)
    target_dir = write_target(tmp / "target", tcfg, random_target(shape), make_tokenizer(64))
    draft_dir = write_zlab_draft(tmp / "draft", dcfg, random_draft_weights(dcfg))
    return str(target_dir), str(draft_dir)


def timed(label, stream, n_tokens):
    """Run a token stream to the end; decode tok/s after the first token."""
    tic = time.perf_counter()
    first = None
    count = 0
    for count_now in stream:
        if first is None:
            first = time.perf_counter()
        count = count_now
    end = time.perf_counter()
    return {
        "mode": label,
        "tokens": count,
        "ttft_s": round(first - tic, 4),
        "decode_tps": round((count - 1) / max(end - first, 1e-9), 2),
    }


def plain(model, prompt, n):
    k = 0
    for _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        k += 1
        yield k


def ours(model, draft, tok, prompt, n, bs, stats):
    from dflash_mlx import stream_generate

    k = 0
    for r in stream_generate(model, draft, tok, prompt, max_tokens=n, block_size=bs):
        k += len(r.tokens)
        stats["acceptance_length"] = round(r.acceptance_length, 3)
        yield k


def official_draft(path: str):
    """The official loop's drafter from a local directory. Its ``load_draft``
    takes a Hub id only (``snapshot_download``), so that name is pointed at
    the directory: the one way in without a download."""
    import dflash.model_mlx as official_mod

    official_mod.snapshot_download = lambda *a, **k: path
    return official_mod.load_draft(path)


def official(model, draft, tok, prompt, n, bs):
    from dflash.model_mlx import stream_generate as official_stream

    k = 0
    for r in official_stream(model, draft, tok, prompt, block_size=bs, max_tokens=n):
        k += len(r.tokens)
        if r.tokens:
            yield k


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="length of the synthetic prompt (token ids)")
    ap.add_argument(
        "--prompt",
        help="a text prompt instead (a trained pair accepts little on synthetic ids); '@FILE' reads it from FILE",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--block-size",
        default="16,auto",
        help="comma-separated block sizes for dflash-mlx (ints or 'auto'); "
        "the official loop runs the first integer one",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--cold",
        action="store_true",
        help="one round and no warm-up: includes the kernel and graph builds a first request pays "
        "(kernel builds, graph builds on CUDA)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dflash_mlx import load

    tmp = tempfile.TemporaryDirectory()
    if args.model:
        target_dir, draft_dir = args.model, args.draft
    else:
        target_dir, draft_dir = random_pair(args.shape, Path(tmp.name))
    model, draft, tok = load(target_dir, draft=draft_dir)
    blocks = [b if b == "auto" else int(b) for b in args.block_size.split(",")]
    bs = next((b for b in blocks if b != "auto"), draft.config.block_size)
    vocab = draft.config.vocab_size
    if args.prompt:
        text = Path(args.prompt[1:]).read_text() if args.prompt.startswith("@") else args.prompt
        prompt = tok.encode(text)
        args.prompt_tokens = len(prompt)
    else:
        prompt = synthetic_prompt(vocab, args.prompt_tokens)

    have_official = True
    try:
        from mlx_lm import load as mlx_lm_load

        their_model, _ = mlx_lm_load(target_dir)
        their_draft = official_draft(draft_dir)
    except Exception as e:  # the oracle is optional here
        print(f"official loop skipped: {e}", file=sys.stderr)
        have_official = False

    rows = []
    for rep in range(1 if args.cold else args.repeat + 1):  # the first round warms up, unless --cold
        stats: dict = {}
        round_rows = [timed("plain mlx-lm", plain(model, prompt, args.max_tokens), args.max_tokens)]
        for block in blocks:
            run = ours(model, draft, tok, prompt, args.max_tokens, block, stats)
            round_rows.append({**timed(f"dflash-mlx {block}", run, args.max_tokens), **stats})
        if have_official:
            round_rows.append(
                timed(
                    "official dflash",
                    official(their_model, their_draft, tok, prompt, args.max_tokens, bs),
                    args.max_tokens,
                )
            )
        if rep or args.cold:
            rows.extend(round_rows)

    def median(mode, key):
        vals = sorted(r[key] for r in rows if r["mode"] == mode and key in r)
        return vals[len(vals) // 2] if vals else None

    base = median("plain mlx-lm", "decode_tps")
    summary = {
        "machine": f"{platform.platform()} {platform.processor() or platform.machine()}, mlx {mx.__version__}, device {mx.default_device()}",
        "target": target_dir if args.model else f"random {args.shape}",
        "block_size": bs,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "results": [
            {
                "mode": m,
                "decode_tps": median(m, "decode_tps"),
                "speedup_vs_plain": round(median(m, "decode_tps") / base, 3),
                "acceptance_length": median(m, "acceptance_length"),
            }
            for m in dict.fromkeys(r["mode"] for r in rows)
        ],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(summary["machine"])
    print(
        f"target {summary['target']}, block {bs}, prompt {args.prompt_tokens}, new tokens {args.max_tokens}, "
        + ("one cold round (no warm-up)" if args.cold else f"median of {args.repeat}")
    )
    for r in summary["results"]:
        tau = f"  tau {r['acceptance_length']}" if r["acceptance_length"] is not None else ""
        print(f"{r['mode']:>18}: {r['decode_tps']:8.1f} tok/s  x{r['speedup_vs_plain']:.2f}{tau}")


if __name__ == "__main__":
    main()
