"""How many prompts DFlash decodes greedily to exactly mlx-lm's greedy text, and where the rest part.

Reported in BENCHMARKS.md, "Greedy output against mlx-lm's", and README.md's
"greedy text equal to mlx-lm's" row.

    python benchmarks/greedy_equality.py --prompts 8 --max-tokens 128
    python benchmarks/greedy_equality.py --prompts 8 --blocks 8,16,auto
    python benchmarks/greedy_equality.py --shape qwen3-8b --quantize 4 --prompts 4 --blocks 4,16,auto
    python benchmarks/greedy_equality.py --prompts 8 --blocks 16,t16,t32

The built-in pair (or ``--model``/``--draft``) on the held-out prompts. On a
CPU both are the same arithmetic and every prompt must match (the tests assert
it). On a GPU a 16-row verify and a one-row step are different kernels, so
their results can differ in the last bits, and where two tokens' logits tie
that closely greedy can take either: this counts how often that happens and
where the first difference falls. ``--shape`` runs a pair of random weights at
a model's shapes instead (cycle.py's; ``--quantize``: the target's bits): no
text to speak of, but every product, attention and cache path a target of that
size and width takes. A block ``tN`` is a draft tree of N nodes from the drafter's block.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import mlx.core as mx
from bench_builtin import PROMPTS, prompt_sets


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--draft")
    ap.add_argument("--shape", help="a pair of random weights at a model's shapes (cycle.py's SHAPES)")
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="with --shape: the target's bits")
    ap.add_argument("--prompts", type=int, default=8, help="per set (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--blocks", default="16", help="comma-separated block sizes, 'auto', or tN (a tree of N nodes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quantize and not args.shape:
        ap.error("--quantize quantizes a --shape pair; name a --shape.")
    if args.shape and (args.model != "builtin" or args.draft):
        ap.error("--shape makes its own pair; leave out --model and --draft.")

    from cycle import decoding

    from dflash_mlx import load, stream_generate
    from dflash_mlx.tiny import greedy_reference

    if args.shape:
        from cycle import random_pair
        from mlx_lm.utils import load_tokenizer

        from dflash_mlx import builtin

        # the prompts' text through the built-in pair's template and tokenizer
        tok = load_tokenizer(Path(builtin.TARGET))
        model, draft = random_pair(args.shape, args.quantize)
        if draft.config.vocab_size < tok.vocab_size:
            ap.error(
                f"--shape {args.shape}'s vocabulary is smaller than the built-in tokenizer's; take a larger shape."
            )
        args.model = args.shape + (f" {args.quantize}-bit" if args.quantize else "")
    else:
        model, draft, tok = load(args.model, draft=args.draft)
    texts = json.loads(PROMPTS.read_text())
    sets = prompt_sets(tok, {k: texts[k] for k in ("code", "chat")}, args.prompts)
    eos = set(tok.eos_token_ids)
    prompts = [p for ps in sets.values() for p in ps]
    references = [greedy_reference(model, p, args.max_tokens, eos=eos) for p in prompts]
    rows = []
    for block in [b if b == "auto" or b.startswith("t") else int(b) for b in args.blocks.split(",")]:
        firsts = []
        for p, ref in zip(prompts, references):
            replies = stream_generate(model, draft, tok, p, max_tokens=args.max_tokens, **decoding(block))
            got = [t for r in replies for t in r.tokens]
            n = min(len(ref), len(got))
            first = next((i for i in range(n) if ref[i] != got[i]), None if len(ref) == len(got) else n)
            firsts.append(first)
        rows.append(
            {
                "block": block,
                "equal": sum(f is None for f in firsts),
                "prompts": len(firsts),
                "first_difference": firsts,
            }
        )
    machine = f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}"
    if args.json:
        print(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
        return
    print(machine)
    print(
        f"{args.model}: {len(prompts)} prompts, {args.max_tokens} new tokens; equal: DFlash's greedy tokens all "
        "equal to mlx-lm's; first difference: the token index where they part (- where equal)"
    )
    for r in rows:
        firsts = " ".join("-" if f is None else str(f) for f in r["first_difference"])
        print(f"block {str(r['block']):<4} equal {r['equal']:>2}/{r['prompts']}  first difference: {firsts}")


if __name__ == "__main__":
    main()
