"""A verify's products through MLX and through dflash-mlx's kernels: the bf16
block-product kernel (CUDA), with ``--quantized`` the quantized verify product
and with ``--exact`` the exact dense verify product (both Metal or CUDA).

Reported in BENCHMARKS.md, "GPU kernels" ("Block products": the host's launch
cost here; device time from Nsight Compute through gpu_time.py).

    python benchmarks/block_products.py --rows 16,8 --repeat-rounds 1
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file ncu.csv \
        python benchmarks/block_products.py --rows 16 --repeat 4 --runs 1 --repeat-rounds 1
    python benchmarks/gpu_time.py launches ncu.csv

    python benchmarks/block_products.py --quantized --rows 16
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file ncu.csv \
        python benchmarks/block_products.py --quantized --rows 16 --repeat 4 --runs 1 --repeat-rounds 1
    python benchmarks/gpu_time.py launches ncu.csv

    python benchmarks/block_products.py --exact --rows 16
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file ncu.csv \
        python benchmarks/block_products.py --exact --skip-check --rows 16 --repeat 4 --runs 1 --repeat-rounds 1
    python benchmarks/gpu_time.py launches ncu.csv

``--exact``: Qwen3-8B bf16 products (q/k/v, o, gate/up, down, the output
head), as ``--quantized`` below: each product's self-check (``check``), then
the kernel's ``--rows`` rows, MLX's product of the same rows and MLX's
one-row product (``x[:1] @ w.T``, a plain step's), over ``--repeat``
distinct weights (fewer for the head: at most 8 GB of them), and whether each
side's rows equal the one-row products here (``exact``); ``--launches`` adds the
kernel at other launch shapes (outputs a lane group, steps a chunk, simdgroups), ``--products``
picks products.

``--quantized``: Qwen3-8B 4-bit products (affine, groups of 64: q/k/v, o,
gate/up, down, the output head) and gpt-oss-20b mxfp4 ones (q/k/v, o, the
output head), ``--models`` to pick. For each, first the kernel's self-check
for that product's variant (every row tile's rows bit for bit against MLX's
one-row product: ``check``), then, over ``--repeat`` distinct random weights,
three sides: the kernel's ``--rows`` rows, MLX's ``quantized_matmul`` of the
same rows, and MLX's one-row product (a plain step's), and whether the
kernel's rows equal the one-row products here (``exact``); ``--launches`` adds
the kernel at other tiles (x rows a threadgroup, outputs a simdgroup,
simdgroups), ``--products`` picks products. The kernel's goal: its 16 rows
within 1.25x the one-row product's device time.

For each of a qwen3 layer's four products (fused q/k/v, o, fused gate/up,
down), and the gate/up product with its SwiGLU (MLX: the product, then
mlx-lm's ``swiglu``; the kernel: its SwiGLU epilogue), it makes ``--repeat``
distinct weight matrices (one per layer, so the device reads each from memory
as a forward does), then times per product, in microseconds (median of
``--runs``):

- build: Python building the graph;
- launch: inside ``mx.async_eval`` (the backend encoding the kernel);
- total: build + launch + waiting for the device.

It also checks the kernel against MLX's product (largest difference over the
largest element). ``--shapes`` adds kernels of fixed launch shapes (tiles per
warp, warps per block over K, loads in flight) beside the shipped choice.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx


def measure(make, repeat: int, runs: int) -> dict:
    """Microseconds per call of ``make(i)`` over ``repeat`` distinct calls a
    graph, median of ``runs``: building, launching, and in all."""
    rows = []
    for _ in range(runs + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [make(i) for i in range(repeat)]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t0))
    rows = rows[1:]  # the first run builds kernels
    med = lambda k: 1e6 * sorted(r[k] for r in rows)[len(rows) // 2] / repeat  # noqa: E731
    return {"build_us": med(0), "launch_us": med(1), "total_us": med(2)}


def timed_rows(sides: dict, args, distinct: int, **fields) -> list[dict]:
    """A row per side and round (``args.repeat_rounds``) over ``distinct``
    weights: ``fields``, then the side's times."""
    return [
        {
            **fields,
            "side": side,
            "round": rnd,
            **{k: round(v, 1) for k, v in measure(make, distinct, args.runs).items()},
        }
        for rnd in range(args.repeat_rounds)
        for side, make in sides.items()
    ]


def printed_json(args, machine: str, rows: list) -> bool:
    """With --json, the run as JSON (True); else the machine line, for the table below it (False)."""
    if args.json:
        print(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
        return True
    print(machine)
    return False


# (product, N, K) of each model's quantized linear layers, and its quantization (bits, group, mode).
QUANTIZED = {
    "qwen3-8b": (
        (4, 64, "affine"),
        [
            ("q/k/v", 6144, 4096),
            ("o", 4096, 4096),
            ("gate/up", 24576, 4096),
            ("gate", 12288, 4096),
            ("down", 4096, 12288),
            ("head", 151936, 4096),
        ],
    ),
    "gpt-oss-20b": ((4, 32, "mxfp4"), [("q/k/v", 5120, 2880), ("o", 2880, 4096), ("head", 201088, 2880)]),
}


def random_quantized(n: int, k: int, bits: int, group: int, mode: str, dtype, seed: int):
    """A quantized [n, k] weight of random codes and scales (what it holds does not change the time)."""
    key = mx.random.key(seed)
    words = mx.random.randint(0, 1 << 30, (n, k * bits // 32), key=key).astype(mx.uint32)
    if mode == "mxfp4":  # e8m0 scales near 2^-4
        return words, mx.random.randint(119, 124, (n, k // group), key=key).astype(mx.uint8), None
    scales = (0.01 * mx.random.uniform(shape=(n, k // group), key=key)).astype(dtype)
    return words, scales, (-0.1 * mx.random.uniform(shape=(n, k // group), key=key)).astype(dtype)


def launch_shapes(args) -> list[tuple[int, ...]]:
    """--launches: shapes of comma-separated integers, separated by ':'."""
    return [tuple(int(v) for v in shape.split(",")) for shape in args.launches.split(":") if shape]


def quantized_main(args) -> None:
    from dflash_mlx.kernels import quantized as qp

    where = qp.backend()
    if where not in qp.BUILDERS:
        raise SystemExit(f"the quantized verify product runs on Metal or CUDA; this device is {mx.default_device()}.")
    dtype = getattr(mx, args.dtype)
    kernel = qp.QuantizedProductKernel(where)
    launches = launch_shapes(args)
    rows = []
    for model in args.models.split(","):
        if model not in QUANTIZED:
            raise SystemExit(f"unknown model {model!r}; use one of {', '.join(QUANTIZED)}.")
        (bits, group, mode), products = QUANTIZED[model]
        quant = dict(bits=bits, group=group, mode=mode)
        for name, n, k in products:
            if args.products and name not in args.products.split(","):
                continue
            variant = qp.Variant(dtype, mode, bits, group, k, n > qp.WIDE or k > qp.WIDE)
            check = qp.self_check(where, variant)
            weights = [random_quantized(n, k, bits, group, mode, dtype, seed=i) for i in range(args.repeat)]
            mx.eval(weights)
            for m in [int(r) for r in args.rows.split(",")]:
                x = mx.random.normal((m, k)).astype(dtype)
                one = x[:1]
                mx.eval(x, one)
                w, sc, bi = weights[0]
                want = qp.one_row_products(x, w, sc, bi, **quant)
                fields = dict(model=model, product=name, n=n, k=k, rows=m)
                fields["check"] = "passed" if check.ok else f"FAILED: {check.detail}"
                mlx_sides = {
                    f"mlx {m} rows": lambda i: mx.quantized_matmul(
                        x + i, *weights[i], transpose=True, group_size=group, bits=bits, mode=mode
                    ),
                    "mlx 1 row": lambda i: mx.quantized_matmul(
                        one + i, *weights[i], transpose=True, group_size=group, bits=bits, mode=mode
                    ),
                }
                mlx_exact = mx.array_equal(mlx_sides[f"mlx {m} rows"](0), want).item()
                rows += timed_rows(mlx_sides, args, args.repeat, **fields, exact=mlx_exact)
                for at in [None, *launches]:  # the same order, other tiles: each row's exactness its own
                    run = lambda i, at=at: kernel(x + i, *weights[i], **quant, fused=check.fused, launch_tile=at)  # noqa: E731
                    exact = mx.array_equal(run(0), want, equal_nan=True).item()
                    side = f"kernel {m} rows" if at is None else "kernel {}x{}x{}".format(*at)
                    rows += timed_rows({side: run}, args, args.repeat, **fields, exact=exact)
            weights.clear()
    if printed_json(args, f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()} ({where})", rows):
        return
    print(
        f"{args.dtype} rows, {args.repeat} distinct weights per product; microseconds per product (median of {args.runs})"
    )
    print(f"{'model':<12} {'product':<11} {'N x K':>12} {'side':>15} {'total':>8} {'launch':>7}  exact  check")
    for r in rows:
        print(
            f"{r['model']:<12} {r['product']:<11} {str(r['n']) + 'x' + str(r['k']):>12} {r['side']:>15} "
            f"{r['total_us']:>8.1f} {r['launch_us']:>7.1f}  {str(r['exact']):<5}  {r['check']}"
        )


# (product, N, K) of Qwen3-8B's dense linear layers (q/k/v and gate/up fused, as the target runs them).
DENSE = [
    ("q/k/v", 6144, 4096),
    ("o", 4096, 4096),
    ("gate/up", 24576, 4096),
    ("down", 4096, 12288),
    ("head", 151936, 4096),
]
WEIGHT_BYTES = 8 << 30  # the most a product's distinct weights take


def launch_name(at) -> str:
    """A launch (exact_products.Launch) for the table: outputs a lane group, steps a chunk, simdgroups."""
    return f"{at.outputs} out {at.ahead} ahead {at.groups} sg"


def exact_main(args) -> None:
    from dflash_mlx.kernels import exact_products as ep

    where = ep.backend()
    if where not in ep.BUILDERS:
        raise SystemExit(f"the exact verify product runs on Metal or CUDA; this device is {mx.default_device()}.")
    dtype = getattr(mx, args.dtype)
    kernel = ep.ExactProductKernel(where)
    launches = launch_shapes(args)
    products = [p for p in DENSE if not args.products or p[0] in args.products.split(",")]
    rows = []
    for name, n, k in products:
        variant = ep.Variant(dtype, k, ep.one_row_order(where, k, n), False)
        if args.skip_check:  # (the backend's first form: what its check tries first)
            check = ep.ExactCheck(where, variant, True, "check skipped", ep.FORMS[where][0])
        else:
            check = ep.self_check(where, variant)
        repeat = max(1, min(args.repeat, WEIGHT_BYTES // (n * k * dtype.size)))
        weights = [(k**-0.5 * mx.random.normal((n, k), key=mx.random.key(i))).astype(dtype) for i in range(repeat)]
        mx.eval(weights)
        for m in [int(r) for r in args.rows.split(",")]:
            x = mx.random.normal((m, k)).astype(dtype)
            one = x[:1]
            mx.eval(x, one)
            want = ep.one_row_products(x, weights[0], None)
            fields = dict(product=name, n=n, k=k, rows=m, repeat=repeat)
            fields["check"] = check.detail if check.ok else f"FAILED: {check.detail}"
            mlx_exact = mx.array_equal(x @ weights[0].T, want).item()
            rows += timed_rows(
                {f"mlx {m} rows": lambda i: (x + i) @ weights[i].T}, args, repeat, **fields, exact=mlx_exact
            )
            rows += timed_rows({"mlx 1 row": lambda i: (one + i) @ weights[i].T}, args, repeat, **fields, exact=True)
            for launch in [None, *launches]:  # the same order, other launch shapes: each row's exactness its own
                ran = ep.launch_for(where, variant.order, m, launch)  # (the shape that runs: cut to fit)
                side = f"kernel {m} rows" if launch is None else "kernel " + launch_name(ran)
                exact = mx.array_equal(kernel(x, weights[0], None, form=check.form, launch=launch), want).item()
                product = lambda i, at=launch: kernel(x + i, weights[i], None, form=check.form, launch=at)  # noqa: E731
                rows += timed_rows({side: product}, args, repeat, **fields, exact=exact)
        weights.clear()
    if printed_json(args, f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()} ({where})", rows):
        return
    print(f"{args.dtype} rows; microseconds per product (median of {args.runs}) over distinct weights")
    print(f"{'product':<8} {'N x K':>12} {'weights':>7} {'side':>22} {'total':>8} {'launch':>7}  exact  check")
    for r in rows:
        print(
            f"{r['product']:<8} {str(r['n']) + 'x' + str(r['k']):>12} {r['repeat']:>7} {r['side']:>22} "
            f"{r['total_us']:>8.1f} {r['launch_us']:>7.1f}  {str(r['exact']):<5}  {r['check']}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", default="16,8,4", help="rows of the block or tree, comma-separated (2-32)")
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
    ap.add_argument("--quantized", action="store_true", help="time the quantized verify product (Metal or CUDA)")
    ap.add_argument("--models", default="qwen3-8b,gpt-oss-20b", help="with --quantized: " + ", ".join(QUANTIZED))
    ap.add_argument("--exact", action="store_true", help="time the exact dense verify product (Metal or CUDA)")
    ap.add_argument(
        "--launches",
        default="",
        help="launch shapes to add beside the shipped one, separated by ':'; with --exact outputs a lane "
        "group,steps a chunk[,simdgroups a threadgroup] (e.g. 2,1:4,2,8); with --quantized x rows a "
        "threadgroup,outputs a simdgroup,simdgroups a threadgroup (e.g. 16,1,8:8,2,4)",
    )
    ap.add_argument(
        "--products", default="", help="with --exact or --quantized: comma-separated products to time (default: all)"
    )
    ap.add_argument(
        "--skip-check",
        action="store_true",
        help="with --exact: no self-check first (the backend's first multiply-add form; fewer launches to profile)",
    )
    args = ap.parse_args()
    if args.quantized:
        return quantized_main(args)
    if args.exact:
        return exact_main(args)

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
            rows += timed_rows(sides, args, args.repeat, product=name, n=n, k=k, rows=m, rel_err=err)
        weights.clear()  # free this product's weights before the next one's
    if printed_json(args, f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}", rows):
        return
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
