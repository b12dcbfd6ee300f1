"""A verify's time as the context grows, and the pieces that grow with it.

Reported in BENCHMARKS.md, "Long contexts".

    python benchmarks/long_context.py --shape qwen3-8b --prompt-tokens 1024,16384 --block 16

At each prompt length, on a target at a model's shapes (random weights),
synced (built, evaluated alone, waited for), median of 7:

- verify: the target's forward over one block, as the loop runs it;
- attention: ``layers`` fused attention calls over the cache buffer with the
  verify's mask;
- kernel attention: the same through ``dflash_mlx.kernels.block_attention``
  (GPU only);
- cache writes: every layer's key and value written at a device offset, as
  the cache writes them (``put_positions``);
- plain step: mlx-lm's one-token forward at the same context.

What grows between two lengths is what a long-context cycle pays for; the
rest of the verify (products, norms) does not depend on the context.
"""

from __future__ import annotations

import argparse
import platform

import mlx.core as mx
from cycle import SHAPES, prefilled, random_pair, synced_ms, synthetic_prompt


def pieces(model, draft, shape: str, P: int, block: int) -> dict:
    from dflash_mlx.kernels import block_attention
    from dflash_mlx.kv.buffer import positions_mask, put_positions

    _, layers, heads, kv, hd, *_ = SHAPES[shape]
    prompt = synthetic_prompt(draft.config.vocab_size, P)
    target, cache = prefilled(model, draft, prompt)
    taps = list(draft.config.target_layer_ids)
    length = mx.array(P, mx.int32)

    def verify():
        cache.settle()
        for c in cache.target + cache.draft:
            c.set_length(length, P)
        logits, hidden = target(mx.array([[1] * block]), cache.target, taps)
        return [logits, hidden]

    out = {"prompt_tokens": P, "verify_ms": synced_ms(verify)}
    cache.settle()
    first = cache.target[0]
    cap = first.width_after(block)
    k_buf = mx.random.normal((1, kv, cap, hd)).astype(mx.bfloat16)
    v_buf = mx.random.normal((1, kv, cap, hd)).astype(mx.bfloat16)
    q = mx.random.normal((1, heads, block, hd)).astype(mx.bfloat16)
    mx.eval(k_buf, v_buf, q)
    scale = hd**-0.5

    def attention():
        mask = positions_mask(block, length, cap)
        return [mx.fast.scaled_dot_product_attention(q, k_buf, v_buf, scale=scale, mask=mask) for _ in range(layers)]

    out["attention_ms"] = synced_ms(attention)
    if mx.default_device() == mx.gpu:
        out["kernel_attention_ms"] = synced_ms(
            lambda: [
                block_attention(q, k_buf, v_buf, scale=scale, q_offset=length, kv_length=length + block, causal=True)
                for _ in range(layers)
            ]
        )
    new_k = mx.random.normal((1, kv, block, hd)).astype(mx.bfloat16)
    bufs = [[mx.zeros((1, kv, cap, hd), mx.bfloat16) for _ in range(2)] for _ in range(layers)]
    mx.eval(new_k, bufs)
    at = length + mx.arange(block)

    def writes():  # as the cache writes at a device offset
        for pair in bufs:
            pair[0] = put_positions(pair[0], new_k, at)
            pair[1] = put_positions(pair[1], new_k, at)
        return bufs

    out["cache_writes_ms"] = synced_ms(writes)
    bufs.clear()
    from mlx_lm.models.cache import make_prompt_cache as lm_cache

    lm = lm_cache(model)
    mx.eval(model(mx.array([prompt]), cache=lm))

    def plain():
        for c in lm:  # back to the prompt: each step writes position P again
            c.trim(c.offset - P)
        return model(mx.array([[1]]), cache=lm)

    out["plain_step_ms"] = synced_ms(plain)
    out["capacity"] = cap
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--prompt-tokens", default="1024,16384")
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    model, draft = random_pair(args.shape, None)
    print(
        f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}; "
        f"{args.shape} bf16, block {args.block}"
    )
    cols = [
        "prompt_tokens",
        "capacity",
        "plain_step_ms",
        "verify_ms",
        "attention_ms",
        "kernel_attention_ms",
        "cache_writes_ms",
    ]
    print(" ".join(f"{c:>20}" for c in cols))
    for P in [int(p) for p in args.prompt_tokens.split(",")]:
        row = pieces(model, draft, args.shape, P, args.block)
        print(
            " ".join(
                f"{row.get(c, float('nan')):>20.2f}" if c != "prompt_tokens" and c != "capacity" else f"{row[c]:>20}"
                for c in cols
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
