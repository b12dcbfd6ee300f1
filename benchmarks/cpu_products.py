"""What a matrix product of a few rows costs on this machine's CPU, per dtype.

    python benchmarks/cpu_products.py                 # [rows, 256] x [256, 768], rows 1, 4, 16
    python benchmarks/cpu_products.py --in 4096 --out 4096

A verify multiplies a block of rows where a plain step multiplies one, so
DFlash pays on a machine whose products amortize rows. MLX's Linux CPU wheel
carries the reference BLAS (float32 products) and its own loops (bfloat16,
float16); ``import dflash_mlx`` opens the system's OpenBLAS for MLX first
where there is one (dflash_mlx/fast_blas.py). Run it with
``DFLASH_MLX_BLAS=off`` for MLX's own. Prints the BLAS in use and the
milliseconds of one product evaluated alone (the median of ``--repeat``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx

import dflash_mlx  # noqa: F401  (first: it opens OpenBLAS before MLX loads)
from dflash_mlx import fast_blas


def product_ms(rows: int, n_in: int, n_out: int, dtype, repeat: int) -> float:
    w = mx.random.normal((n_out, n_in)).astype(dtype)
    x = mx.random.normal((rows, n_in)).astype(dtype)
    mx.eval(w, x)
    for _ in range(5):
        mx.eval(x @ w.T)
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="n_in", type=int, default=256)
    ap.add_argument("--out", dest="n_out", type=int, default=768)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{platform.platform()}, MLX {mx.__version__} on {mx.default_device()}; BLAS: {fast_blas.describe()}")
    print(f"ms of one [rows, {args.n_in}] x [{args.n_in}, {args.n_out}] product")
    print(f"{'dtype':>9} " + " ".join(f"{r:>8}" for r in rows) + f" {'last/1':>8}")
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        ms = [product_ms(r, args.n_in, args.n_out, dtype, args.repeat) for r in rows]
        print(
            f"{str(dtype).removeprefix('mlx.core.'):>9} "
            + " ".join(f"{m:>8.3f}" for m in ms)
            + f" {ms[-1] / ms[0]:>8.1f}"
        )


if __name__ == "__main__":
    main()
