"""What one launch costs the host, by kind of kernel, in a chain as a forward makes them.

    python benchmarks/launch_cost.py
    MLX_MAX_OPS_PER_BUFFER=100 python benchmarks/launch_cost.py --compile on

benchmarks/host_cost.py times independent copies of an operation at real
model sizes; this script asks the narrower question that a cycle bound by
its launches raises (BENCHMARKS.md, session 14: a custom kernel costs the
host more than one of MLX's own): ``--chain`` operations, each reading the
one before (as a forward's layers do), built, then launched with
``mx.async_eval``, then waited for. Kinds:

- ``add``, ``rms_norm``: MLX's own elementwise and norm kernels;
- ``custom copy``: the smallest custom kernel (one input, one output);
- ``custom copy, 16 KB source``: the same with 16 KB of comments in its
  source (what hashing the source at every launch costs);
- ``custom 4 inputs``: a custom kernel with four inputs, their shapes and
  template constants, as the block-product kernel takes them;
- ``block product``: dflash-mlx's block-product kernel (16 rows, the built-in
  pair's 256 x 768 up product), where it checked out on this backend;
- ``cuBLAS product``: MLX's own product of the same shape;
- ``sdpa, masked``: MLX's attention of 16 rows over a ``--keys`` buffer with
  a position mask (cuDNN on CUDA), as a verify's layer takes it;
- ``block attention (2)``: dflash-mlx's block-attention kernel on the same,
  per call: two launches (partial, merge), where the products' rows are per
  launch.

``--compile on`` also times the chain through ``mx.compile`` (traced once,
replayed), as a cycle runs on a GPU. Microseconds per operation, the median
of ``--runs``. The CUDA backend's batching of launches into graphs is set by
MLX_MAX_OPS_PER_BUFFER (MLX's own variable, read once per process); run the
script once per value to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import mlx.core as mx

COPY = "  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);\n  if (i < x_shape[0] * x_shape[1]) y[i] = x[i];\n"
FOUR = (
    "  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);\n"
    "  if (i < x_shape[0] * x_shape[1]) y[i] = SCALE ? x[i] + a[0] + b[0] + c[0] : x[i];\n"
)


def kinds(rows: int, hidden: int, ffn: int, keys: int, dtype):
    """(name, step, x) triples: step(x) is one operation on x, same shape out
    (x [rows, hidden]; attention's: queries [1, hidden / 64, rows, 64])."""
    from dflash_mlx.cache.buffer import positions_mask
    from dflash_mlx.device import backend
    from dflash_mlx.kernels import dispatch
    from dflash_mlx.kernels.cuda import products as block_products

    where = backend()
    norm_w = mx.ones((hidden,), dtype)
    x = mx.random.normal((rows, hidden)).astype(dtype)
    yield "add", lambda x: x + 1, x
    yield "rms_norm", lambda x: mx.fast.rms_norm(x, norm_w, 1e-6), x
    factory = mx.fast.cuda_kernel if where == "cuda" else (mx.fast.metal_kernel if where == "metal" else None)
    if factory is not None:
        copy = factory(name="launch_cost_copy", input_names=["x"], output_names=["y"], source=COPY)
        four = factory(name="launch_cost_four", input_names=["x", "a", "b", "c"], output_names=["y"], source=FOUR)
        extra = [mx.zeros((1,), dtype) for _ in range(3)]
        size = rows * hidden
        launch = dict(grid=(size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(rows, hidden)], output_dtypes=[dtype])
        yield "custom copy", lambda x: copy(inputs=[x], **launch)[0], x
        # the same kernel with 16 KB of comments: MLX's CUDA backend hashes a
        # custom kernel's whole source at every launch (kernels.launch_source)
        padded = factory(
            name="launch_cost_copy_padded",
            input_names=["x"],
            output_names=["y"],
            source=COPY + ("// " + "x" * 77 + "\n") * 205,
        )
        yield "custom copy, 16 KB source", lambda x: padded(inputs=[x], **launch)[0], x
        yield (
            "custom 4 inputs",
            lambda x: four(inputs=[x, *extra], template=[("T", dtype), ("SCALE", 0)], **launch)[0],
            x,
        )
    up = (mx.random.normal((ffn, hidden)) * 0.02).astype(dtype)
    back = (mx.random.normal((hidden, ffn)) * 0.02).astype(dtype)
    mx.eval(norm_w, up, back)
    block_products.prepare(dtype)
    kernel = block_products.passed(dtype)
    if kernel is not None:
        # (two products a step, up then back down, so the chain keeps its shape: per operation, halved)
        yield "block product", lambda x: kernel(kernel(x, up), back), x
    yield "cuBLAS product", lambda x: (x @ up.T) @ back.T, x
    # a verify's attention over a buffer of ``keys`` positions, the last rows filled now (GQA 2)
    heads, d = hidden // 64, 64
    q = mx.random.normal((1, heads, rows, d)).astype(dtype)
    k, v = (mx.random.normal((1, max(heads // 2, 1), keys, d)).astype(dtype) for _ in range(2))
    start = mx.array(keys - rows - 8, mx.int32)
    mask = positions_mask(rows, start, keys)
    mx.eval(q, k, v, start, mask)
    yield "sdpa, masked", lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask), q
    attend = dispatch.checked_kernel(where, dtype, d, False) if where != "cpu" else None
    if attend is not None:
        yield (
            "block attention (2)",
            lambda q: attend(q, k, v, scale=d**-0.5, q_offset=start, kv_length=start + rows, causal=True),
            q,
        )


def measure(step, x: mx.array, chain: int, runs: int, compiled: bool) -> dict:
    def forward(x):
        for _ in range(chain):
            x = step(x)
        return x

    fn = mx.compile(forward) if compiled else forward
    rows = []
    for i in range(runs + 2):  # the first two build kernels and the trace
        x_i = x + i
        mx.eval(x_i)
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn(x_i)
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t0))
    rows = rows[2:]
    med = lambda k: 1e6 * sorted(r[k] for r in rows)[len(rows) // 2] / chain  # noqa: E731
    return {"build_us": med(0), "launch_us": med(1), "total_us": med(2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--keys", type=int, default=512, help="the attention's buffer")
    ap.add_argument("--chain", type=int, default=100, help="operations per graph")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--compile", choices=["off", "on"], default="on", help="on: also the chain through mx.compile")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    modes = [False, True] if args.compile == "on" else [False]
    results = []
    for name, step, x in kinds(args.rows, args.hidden, args.ffn, args.keys, dtype):
        for compiled in modes:
            m = measure(step, x, args.chain, args.runs, compiled)
            per = 2 if "product" in name else 1  # (the product steps launch two)
            results.append({"kind": name, "compiled": compiled, **{k: round(v / per, 2) for k, v in m.items()}})
    machine = f"{platform.platform()}, MLX {mx.__version__} on {mx.default_device()}"
    batching = os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default")
    if args.json:
        print(json.dumps({"machine": machine, "max_ops_per_buffer": batching, "args": vars(args), "rows": results}))
        return
    print(
        f"{machine}; MLX_MAX_OPS_PER_BUFFER={batching}; {args.chain} chained operations a graph, "
        f"{args.rows} rows; microseconds per operation (median of {args.runs})"
    )
    print(f"{'kind':<18} {'compiled':>8} {'build':>8} {'launch':>8} {'total':>8}")
    for r in results:
        print(
            f"{r['kind']:<18} {str(r['compiled']):>8} {r['build_us']:>8.2f} {r['launch_us']:>8.2f} {r['total_us']:>8.2f}"
        )


if __name__ == "__main__":
    main()
