"""A plain target step in the DFlash loop against mlx-lm's own, pipelined as
both loops run them (the next step queued before this one is read): the
host's time per step, how much of it is ``mx.async_eval`` (the backend
encoding kernels), and the wait for the result. `auto` decodes plainly when
no block pays, so this is what it is measured against.

    python benchmarks/plain_step.py                 # the built-in pair
    python benchmarks/plain_step.py --steps 400 --repeat 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

import dflash_mlx  # noqa: F401  (first: it opens OpenBLAS before MLX loads, as for a user)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class AsyncClock:
    """Seconds spent inside mx.async_eval."""

    def __init__(self):
        self.seconds, real = 0.0, mx.async_eval

        def timed(*arrays):
            tic = time.perf_counter()
            real(*arrays)
            self.seconds += time.perf_counter() - tic

        mx.async_eval = timed


def ours(model, draft, prompt, steps, clock):
    from dflash_mlx import make_prompt_cache
    from dflash_mlx.decode.cycle import Cycle
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.targets import adapt

    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prefill(target, draft, cache, prompt, 2048, None)
    cycle = Cycle(target, draft, cache, (0.0, 1.0, 0, 0.0), 0)
    P = len(prompt)
    with mx.stream(generation_stream):
        held = [cycle.launch(1, mx.array([1], mx.int32), mx.array(P, mx.int32), P, exact=True)]
        return timed_steps(
            steps,
            clock,
            lambda i: cycle.launch(1, held[0].last, held[0].length, P + i, exact=True),
            held,
            lambda flight: flight.result.tolist(),
        )


def theirs(model, prompt, steps, clock):
    cache = mlx_lm_cache(model)
    with mx.stream(generation_stream):
        mx.eval(model(mx.array(prompt)[None], cache=cache))

        def step(i):
            y = mx.argmax(model(held[0][None], cache=cache)[0, -1:], axis=-1)
            mx.async_eval(y)
            return y

        held = [mx.array([1])]
        held[0] = step(0)
        return timed_steps(steps, clock, step, held, lambda y: y.item())


def timed_steps(steps, clock, launch, held, read):
    """Queue step i (``launch(i)``), then read the one queued before it
    (``held[0]``), ``steps`` times; ms per step."""
    clock.seconds = 0.0
    launched = waited = 0.0
    start = time.perf_counter()
    for i in range(1, steps + 1):
        tic = time.perf_counter()
        following = launch(i)
        mid = time.perf_counter()
        read(held[0])
        waited += time.perf_counter() - mid
        launched += mid - tic
        held[0] = following
    n = steps / 1000
    return {
        "step_ms": (time.perf_counter() - start) / n,
        "host_ms": launched / n,
        "async_eval_ms": clock.seconds / n,
        "wait_ms": waited / n,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "dflash_mlx" / "builtin" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "dflash_mlx" / "builtin" / "draft"))
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--fuse",
        choices=["on", "off"],
        default="on",
        help="fused q/k/v and gate/up products in the target's layers (the default), or mlx-lm's own",
    )
    args = ap.parse_args()

    from bench_builtin import machine
    from kernel_switches import use_fused_projections

    from dflash_mlx import fast_blas, load

    use_fused_projections(args.fuse == "on")

    model, draft, _ = load(args.model, draft=args.draft)
    prompt = list(range(5, 5 + args.prompt_tokens))
    clock = AsyncClock()
    print(f"machine: {machine()}; BLAS: {fast_blas.describe()}; fused projections {args.fuse}")
    for _ in range(args.repeat):
        for name, run in (
            ("dflash-mlx", lambda: ours(model, draft, prompt, args.steps, clock)),
            ("mlx-lm", lambda: theirs(model, prompt, args.steps, clock)),
        ):
            r = run()
            print(f"{name:>10}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
