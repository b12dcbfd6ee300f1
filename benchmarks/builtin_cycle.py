"""One cycle of the built-in pair per block size, built and evaluated alone, against mlx-lm's step.

    python benchmarks/builtin_cycle.py                        # the defaults of this machine
    python benchmarks/builtin_cycle.py --compile on,off --dtype float32

Milliseconds (median of ``--repeat``) of a DFlash cycle at blocks 1 (a plain
step at an exact length, as ``auto`` runs them), 4, 8 and 16 after a
prompt, each launched and waited for on its own (no pipelining), and of
mlx-lm's own one-token step on the same prompt. ``--compile`` sets
``Cycle.compile_graphs`` per column (``default``: a GPU, or a CPU with a fast
BLAS and g++); ``--dtype`` is load's. Prints the BLAS MLX's CPU products run
on (dflash_mlx/fast_blas.py).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx  # noqa: F401  (first: it opens OpenBLAS before MLX loads)
from dflash_mlx import compute_dtype, fast_blas, load
from dflash_mlx.cache.prompt import PromptCache
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.loop import prefill
from dflash_mlx.targets import adapt

PROMPT = "import os\nimport sys\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 6


def median_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def cycle_ms(model, draft, ids, block: int, repeat: int) -> float:
    cache = PromptCache(model, draft)
    prefill(adapt(model), draft, cache, ids, 2048, None)
    cycle = Cycle(adapt(model), draft, cache, (0.0, 1.0, 0, 0.0), 0)
    last, length, n = mx.array([ids[-1]], mx.int32), mx.array(len(ids), mx.int32), len(ids)

    def run():  # the same positions every time: each cycle overwrites the last one's
        flight = cycle.launch(block, last, length, n, exact=block == 1)
        mx.eval(flight.result)
        cycle.deferred = []

    return median_ms(run, repeat)


def plain_ms(model, ids, repeat: int) -> float:
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    mx.eval([c.keys for c in cache])

    def step():
        mx.eval(mx.argmax(model(mx.array([[ids[-1]]]), cache=cache)[:, -1], axis=-1))
        for c in cache:
            c.trim(1)

    return median_ms(step, repeat)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="1,4,8,16")
    ap.add_argument("--compile", default="default", help="comma-separated: default, on, off (a column each)")
    ap.add_argument("--dtype", default="auto", choices=compute_dtype.CHOICES)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    model, draft, tok = load("builtin", dtype=args.dtype)
    ids = tok.encode(PROMPT)
    settings = args.compile.split(",")
    print(
        f"{platform.platform()}, MLX {mx.__version__} on {mx.default_device()}; BLAS: {fast_blas.describe()}; "
        f"{compute_dtype.computing(model)}; a {len(ids)}-token prompt"
    )
    print(f"{'block':>6} " + " ".join(f"{'compile ' + s:>16}" for s in settings))
    for block in [int(b) for b in args.blocks.split(",")]:
        row = []
        for setting in settings:
            Cycle.compile_graphs = {"default": None, "on": True, "off": False}[setting]
            row.append(cycle_ms(model, draft, ids, block, args.repeat))
        print(f"{block:>6} " + " ".join(f"{ms:>16.2f}" for ms in row))
    print(f"mlx-lm's step: {plain_ms(model, ids, args.repeat):.2f} ms")


if __name__ == "__main__":
    main()
