"""DFlash's greedy output against mlx-lm's own greedy decoding of the target,
prompt by prompt, for the built-in pair on this device, with dflash-mlx's GPU
kernels on and off.

    python benchmarks/greedy_equality.py                         # 8 code + 8 chat prompts, block 16
    python benchmarks/greedy_equality.py --products kernel,mlx --norm-rope kernel,ops --blocks 16,auto

On a CPU both are the same arithmetic and every prompt must match (the tests
assert it). On a GPU a 16-row verify and a one-row step are different
kernels (cuBLASLt or dflash-mlx's block products against MLX's matrix-vector
kernel; attention over 16 rows against one), so their results can differ in
the last bits, and where two tokens' logits tie that closely greedy can take
either: this counts how often that happens and where the first difference
falls, per setting.
"""

from __future__ import annotations

import argparse
import json
import platform

import mlx.core as mx
from bench_builtin import PROMPTS, prompt_sets
from kernel_switches import add_kernel_arguments, kernel_settings, use_kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", type=int, default=8, help="per set (code, chat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--blocks", default="16", help="comma-separated block sizes or 'auto'")
    add_kernel_arguments(ap, "one row each", products="kernel,mlx")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dflash_mlx import load, stream_generate
    from dflash_mlx.decode.traces import forget_traces
    from dflash_mlx.tiny import greedy_reference

    model, draft, tok = load(args.model, draft=args.draft)
    texts = json.loads(PROMPTS.read_text())
    sets = prompt_sets(tok, {k: texts[k] for k in ("code", "chat")}, args.prompts)
    eos = set(tok.eos_token_ids)
    prompts = [p for ps in sets.values() for p in ps]
    references = [greedy_reference(model, p, args.max_tokens, eos=eos) for p in prompts]
    rows = []
    for norm, products in kernel_settings(args):
        use_kernels(norm_rope=norm, products=products)
        forget_traces(draft)  # (compiled cycles hold what they were traced with)
        for block in [b if b == "auto" else int(b) for b in args.blocks.split(",")]:
            firsts = []
            for p, ref in zip(prompts, references):
                got = [
                    t
                    for r in stream_generate(model, draft, tok, p, max_tokens=args.max_tokens, block_size=block)
                    for t in r.tokens
                ]
                n = min(len(ref), len(got))
                first = next((i for i in range(n) if ref[i] != got[i]), None if len(ref) == len(got) else n)
                firsts.append(first)
            rows.append(
                {
                    "products": products,
                    "norm_rope": norm,
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
        print(
            f"products {r['products']:<6} norm/rope {r['norm_rope']:<6} block {str(r['block']):<4} "
            f"equal {r['equal']:>2}/{r['prompts']}  first difference: {firsts}"
        )


if __name__ == "__main__":
    main()
