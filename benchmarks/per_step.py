"""The hybrid's per-step recurrence (the per-step rollback's verify) against
calling mlx-lm's ``gated_delta_update`` once per step.

    python benchmarks/per_step.py                       # tiny heads: the launch cost shows
    python benchmarks/per_step.py --heads 16,32 --dim 128   # Qwen3.5-9B's delta-net shape

Both run T recurrence steps keeping every state, for ``--layers`` layers;
``per_step_update`` makes the gates and the key heads' repeat once per block
(dflash_mlx/targets/recurrent.py), the other once per step. Prints ms per
verify (median of 30) and whether both give the same bits.
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update

from dflash_mlx.targets.recurrent import per_step_update


class Gates(nn.Module):
    def __init__(self, heads: int):
        super().__init__()
        self.A_log = mx.random.normal((heads,)) * 0.1
        self.dt_bias = mx.random.normal((heads,)) * 0.1


def call_per_step(q, k, v, a, b, layer, state):
    states, ys = [state], []
    for t in range(q.shape[1]):
        one = slice(t, t + 1)
        y, state = gated_delta_update(
            q[:, one],
            k[:, one],
            v[:, one],
            a[:, one],
            b[:, one],
            layer.A_log,
            layer.dt_bias,
            state,
            use_kernel=not layer.training,
        )
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states), state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--heads", default="2,4", help="key heads, value heads")
    ap.add_argument("--dim", type=int, default=32, help="key and value head dim")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    hk, hv = (int(h) for h in args.heads.split(","))
    T, D = args.steps, args.dim
    q, k = (mx.random.normal((1, T, hk, D)) for _ in range(2))
    v = mx.random.normal((1, T, hv, D))
    a, b = mx.random.normal((1, T, hv)), mx.random.normal((1, T, hv))
    state, layer = mx.zeros((1, hv, D, D)), Gates(hv)
    print(
        f"{platform.platform()}, mlx {mx.__version__}, device {mx.default_device()}; "
        f"{T} steps, {hk}/{hv} heads of {D}, {args.layers} layers"
    )
    want = call_per_step(q, k, v, a, b, layer, state)
    for name, fn in (("gated_delta_update per step", call_per_step), ("per_step_update", per_step_update)):
        times = []
        for _ in range(30):
            tic = time.perf_counter()
            mx.eval([fn(q, k, v, a, b, layer, state) for _ in range(args.layers)])
            times.append(time.perf_counter() - tic)
        same = all(mx.array_equal(x, y).item() for x, y in zip(fn(q, k, v, a, b, layer, state), want))
        print(f"{name:>28}: {1000 * sorted(times)[15]:8.2f} ms, same bits: {same}")


if __name__ == "__main__":
    main()
