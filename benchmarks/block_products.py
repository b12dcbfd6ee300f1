"""A verify's products through MLX (cuBLASLt on CUDA) and through dflash-mlx's
block-product kernel (kernels/block_products.py), side by side in one process.

    python benchmarks/block_products.py                    # Qwen3-8B shapes, bf16, 16/8/4 rows
    python benchmarks/block_products.py --rows 16 --repeat-rounds 3 --json

For each of a qwen3 layer's four products (fused q/k/v, o, fused gate/up,
down), and the gate/up product with its SwiGLU (MLX: the product, then
mlx-lm's ``swiglu``; the kernel: its SwiGLU epilogue), it makes ``--repeat`` distinct weight matrices (one per layer, so the
device reads each from memory as a forward does), then times, per product,
microseconds (median of ``--runs``, as benchmarks/host_cost.py does):

- build: Python building the graph;
- launch: inside ``mx.async_eval`` (the backend encoding the kernel);
- total: build + launch + waiting for the device (the device's time where it
  is the longer).

It also checks the kernel against MLX's product (largest difference over
the largest element). CUDA only: elsewhere the kernel is not used.

``--shapes`` puts kernels of fixed launch shapes (tiles per warp, warps per
block over K, steps of loads in flight; a SwiGLU launch keeps its two tiles)
beside the default choice. With ``--repeat 36`` the device is the longer
side for every product at Qwen3-8B sizes, so the totals compare shapes. Their
device time, which wall-clock totals hide where launching is the longer, comes
from Nsight Compute, each kernel's name carrying its shape:

    ncu --metrics gpu__time_duration.sum --csv python benchmarks/block_products.py \
        --rows 16 --repeat 8 --runs 1 --repeat-rounds 2 --shapes 1,8,8:2,16,4:2,4,1 > ncu.csv
"""

from __future__ import annotations

import argparse
import json
import platform

import mlx.core as mx
from host_cost import add_shape_arguments, measure


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", default="16,8,4", help="rows of the block, comma-separated (2-16)")
    ap.add_argument("--repeat", type=int, default=36, help="distinct weights per product (one per layer)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeat-rounds", type=int, default=2, help="rounds of the two sides, alternating")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument(
        "--shapes",
        default="",
        help="launch shapes to add, tiles,warps,ahead separated by ':' "
        "(e.g. 1,8,8:2,16,4); the default choice always runs",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dflash_mlx.kernels.cuda import products as bp

    if bp.backend() != "cuda":
        raise SystemExit(
            "the block-product kernel runs on MLX's CUDA backend; this device is "
            f"{mx.default_device()} ({bp.backend()})."
        )
    dtype = getattr(mx, args.dtype)
    kernel = bp.BlockProductKernel("cuda")
    fixed = {
        f"kernel {s}": bp.BlockProductKernel("cuda", shape=tuple(int(v) for v in s.split(",")))
        for s in args.shapes.split(":")
        if s
    }
    H, F, D = args.hidden, args.ffn, args.head_dim
    shapes = [
        ("q/k/v", (args.heads + 2 * args.kv_heads) * D, H),
        ("o", H, args.heads * D),
        ("gate/up", 2 * F, H),
        ("swiglu", 2 * F, H),
        ("down", H, F),
    ]
    rows = []
    for name, n, k in shapes:
        glu = name == "swiglu"
        weights = [(mx.random.normal((n, k)) * 0.02).astype(dtype) for _ in range(args.repeat)]
        mx.eval(weights)
        for m in [int(r) for r in args.rows.split(",")]:
            x = mx.random.normal((1, m, k)).astype(dtype)
            mx.eval(x)
            want = (bp.reference_swiglu(x, weights[0]) if glu else x @ weights[0].T).astype(mx.float32)
            got = kernel(x, weights[0], swiglu=glu).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            sides = {
                "mlx": (lambda i: bp.reference_swiglu(x + i, weights[i]))
                if glu
                else (lambda i: (x + i) @ weights[i].T),
                "kernel": lambda i: kernel(x + i, weights[i], swiglu=glu),
            }
            for k in fixed.values():
                # (a SwiGLU launch keeps its two tiles: the side names the shape it runs, once)
                side = "kernel " + ",".join(map(str, (2, *k.shape[1:]) if glu else k.shape))
                sides.setdefault(side, (lambda k: lambda i: k(x + i, weights[i], swiglu=glu))(k))
            for rnd in range(args.repeat_rounds):
                for side, make in sides.items():
                    r = measure(make, args.repeat, args.runs)
                    rows.append(
                        {
                            "product": name,
                            "n": n,
                            "k": k,
                            "rows": m,
                            "side": side,
                            "round": rnd,
                            "rel_err": err,
                            **{key: round(v, 1) for key, v in r.items()},
                        }
                    )
        del weights
    machine = f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}"
    if args.json:
        print(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
        return
    print(machine)
    print(f"{args.dtype}, {args.repeat} distinct weights per product; microseconds per product (median of {args.runs})")
    print(
        f"{'product':<8} {'N x K':>12} {'rows':>4} {'side':>14} {'build':>7} {'launch':>7} {'total':>7} {'kernel err':>10}"
    )
    for r in rows:
        print(
            f"{r['product']:<8} {str(r['n']) + 'x' + str(r['k']):>12} {r['rows']:>4} {r['side']:>14} {r['build_us']:>7.1f} "
            f"{r['launch_us']:>7.1f} {r['total_us']:>7.1f} {r['rel_err']:>10.1e}"
        )


if __name__ == "__main__":
    main()
