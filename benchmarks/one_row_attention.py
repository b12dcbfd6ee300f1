"""One query row per head over a cache buffer, as a plain decode step attends:
mlx-lm's fused attention with no mask (the keys cut to the filled length),
with a boolean mask over the whole buffer, and the block-attention kernel.

    PYTHONPATH=$PWD python benchmarks/one_row_attention.py [--keys 256,1024,4096,16384]

Wall time of 36 calls over distinct buffers (a Qwen3-8B step's layers: 32 query
and 8 key-value heads, head dim 128, bf16), evaluated and waited for: what a
step costs the host and the device together. On MLX's CUDA backend a mask
takes the one-row attention off its fused kernel (BENCHMARKS.md, session 8),
which is why a plain step at an exact length runs with none (kv_cache.py).
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx

from dflash_mlx.kernels import backend
from dflash_mlx.kernels.dispatch import checked_kernel

LAYERS = 36


def wall_ms(fn, repeat: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    tic = time.perf_counter()
    for _ in range(repeat):
        mx.eval(fn())
    return 1000 * (time.perf_counter() - tic) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="256,1024,4096,16384", help="buffer widths, comma-separated (half filled)")
    args = ap.parse_args()
    where = backend()
    kernel = checked_kernel(where, mx.bfloat16, 128, False) if where != "cpu" else None
    print(f"{platform.platform()}, mlx {mx.__version__}, {mx.default_device()}; {LAYERS} calls, ms")
    print("| keys | no mask, filled keys | mask, whole buffer | kernel |\n|---:|---:|---:|---:|")
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    for width in [int(k) for k in args.keys.split(",")]:
        filled = width // 2
        ks = [mx.random.normal((1, 8, width, 128)).astype(mx.bfloat16) for _ in range(LAYERS)]
        vs = [mx.random.normal((1, 8, width, 128)).astype(mx.bfloat16) for _ in range(LAYERS)]
        mask = mx.arange(width)[None] < filled
        mx.eval(ks, vs, mask)
        exact = wall_ms(
            lambda: [
                mx.fast.scaled_dot_product_attention(q, k[:, :, :filled], v[:, :, :filled], scale=0.088)
                for k, v in zip(ks, vs)
            ]
        )
        masked = wall_ms(
            lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask) for k, v in zip(ks, vs)]
        )
        own = (
            "-"
            if kernel is None
            else f"{wall_ms(lambda: [kernel(q, k, v, scale=0.088, q_offset=filled - 1, kv_length=filled, causal=True) for k, v in zip(ks, vs)]):.3f}"
        )
        print(f"| {width} | {exact:.3f} | {masked:.3f} | {own} |")


if __name__ == "__main__":
    main()
