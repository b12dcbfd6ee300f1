"""What attention costs inside a real verify, against the same calls in isolation.

    python benchmarks/verify_attention.py --shape qwen3-8b --prompt-tokens 1024,16384

First the layers' attention calls alone: 36 fused attention calls (16 query
rows, 32/8 heads, head dim 128) over cache-sized buffers, with the verify's
boolean mask and without, reading one buffer or one buffer per call
(``--buffers``): in a verify each layer reads its own, and the calls over one
buffer ran ~3x faster than the verify's own (BENCHMARKS.md, session 5). Then the target's verify of a 16-token
block at each prompt length (cache writes left out, so that only attention
differs between the rows), with attention

- as is: the fused op with the cache's mask;
- contiguous q: the same after copying the queries to a contiguous layout;
- no mask: the fused op without a mask (wrong output; a timing only);
- kernel: ``dflash_mlx.kernels.block_attention`` forced onto its kernel (GPU);
- skipped: attention replaced by its queries (what the rest of the verify costs).

Synced, median of 7, ms.
"""

from __future__ import annotations

import mlx.core as mx
from cycle import SHAPES, prefilled, random_pair, synced_ms, synthetic_prompt
from long_context import machine, parser

FUSED = mx.fast.scaled_dot_product_attention


def isolated(shape: str, capacity: int, block: int, buffers: int) -> dict:
    """The layers' attention calls alone, over ``buffers`` distinct key/value
    buffers in turn (1: every call reads the same one; the layers' count: a
    buffer per layer, as in a verify)."""
    from dflash_mlx.cache.buffer import positions_mask

    _, layers, heads, kv, hd, *_ = SHAPES[shape]
    ks = [mx.random.normal((1, kv, capacity, hd)).astype(mx.bfloat16) for _ in range(buffers)]
    vs = [mx.random.normal((1, kv, capacity, hd)).astype(mx.bfloat16) for _ in range(buffers)]
    q = mx.random.normal((1, heads, block, hd)).astype(mx.bfloat16)
    mask = positions_mask(block, mx.array(capacity - block), capacity)
    mx.eval(ks, vs, q, mask)
    return {
        f"isolated over {buffers} buffers, {name}": synced_ms(
            lambda m=m: [FUSED(q, ks[i % buffers], vs[i % buffers], scale=hd**-0.5, mask=m) for i in range(layers)]
        )
        for name, m in (("mask", mask), ("no mask", None))
    }


def in_verify(model, draft, P: int, block: int) -> dict:
    from dflash_mlx.cache import buffer as kv_cache
    from dflash_mlx.kernels import block_attention, dispatch

    target, cache = prefilled(model, draft, synthetic_prompt(draft.config.vocab_size, P))
    taps = list(draft.config.target_layer_ids)
    length = mx.array(P, mx.int32)
    real_write, real_table = kv_cache.BufferKVCache.write, dispatch.KERNEL_WINS

    def no_write(self, keys, values, start):
        self._grow(self.bound + keys.shape[2], keys, values)
        return self.keys, self.values

    def attention(variant):
        def attend(q, k, v, scale, mask=None, **kw):
            if variant == "skipped":
                return q
            if variant == "contiguous q":
                q = mx.contiguous(q)
            if variant == "no mask":
                mask = None
            if variant == "kernel":
                mx.fast.scaled_dot_product_attention = FUSED  # its fallback calls the fused op
                try:
                    return block_attention(
                        q, k, v, scale=scale, q_offset=length, kv_length=length + q.shape[2], causal=True
                    )
                finally:
                    mx.fast.scaled_dot_product_attention = attend
            return FUSED(q, k, v, scale=scale, mask=mask, **kw)

        return attend

    variants = ["as is", "contiguous q", "no mask", "skipped"]
    if mx.default_device() == mx.gpu:
        variants.insert(3, "kernel")
    out = {}
    kv_cache.BufferKVCache.write = no_write
    dispatch.KERNEL_WINS = ((10**6, 0),)  # the kernel for any rows
    try:
        for variant in variants:

            def run():
                for c in cache.target:
                    c.set_length(length, P)
                mx.fast.scaled_dot_product_attention = attention(variant)
                try:
                    return target(mx.array([[1] * block]), cache.target, taps)
                finally:
                    mx.fast.scaled_dot_product_attention = FUSED

            out[f"verify, {variant}"] = synced_ms(run)
    finally:
        kv_cache.BufferKVCache.write, dispatch.KERNEL_WINS = real_write, real_table
    out["capacity"] = cache.target[0].capacity
    return out


def main():
    ap = parser(__doc__)
    ap.add_argument(
        "--buffers",
        default="1,36",
        help="comma-separated counts of distinct buffers for the isolated calls (a verify has one a layer)",
    )
    args = ap.parse_args()
    print(machine(args))
    model, draft = random_pair(args.shape, None)
    for P in [int(p) for p in args.prompt_tokens.split(",")]:
        row = in_verify(model, draft, P, args.block)
        for n in [int(b) for b in args.buffers.split(",")]:
            row.update(isolated(args.shape, row["capacity"], args.block, n))
        print(
            f"prompt {P}: " + ", ".join(f"{k} {v:.2f}" if k != "capacity" else f"{k} {v}" for k, v in row.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
