"""What the q/k norm + RoPE kernel saves a cycle, alternating with MLX's ops every cycle.

    python benchmarks/norm_rope_host.py --shape qwen3-8b --prompt-tokens 1024 --cycles 200

A GPU host's speed drifts more between runs than one kernel's worth of
launches (BENCHMARKS.md, session 12), so one process holds two drafters of
the same weights over one target: the first's cycles are traced with the
kernel (kernels/norm_rope.py), the second's with MLX's rms_norm and rope,
and the loop alternates them cycle by cycle, each launched while the device
is idle and then waited for. Prints the median of each: launch ms (the host
building and queuing the cycle) and total ms (until its result is read).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from cycle import SHAPES, configs, prefilled, random_pair, synthetic_prompt
from kernel_switches import use_kernels

from dflash_mlx import DFlashDraft, DraftConfig
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.targets import adapt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=200)
    args = ap.parse_args()
    model, draft = random_pair(args.shape, None)
    twin = DFlashDraft(DraftConfig.from_dict(configs(args.shape)[1]))
    twin.update(draft.parameters())
    twin.bind(adapt(model))
    prompt = synthetic_prompt(draft.config.vocab_size, args.prompt_tokens)
    runs = {}
    for name, d in (("kernel", draft), ("ops", twin)):
        use_kernels(norm_rope=name)
        target, cache = prefilled(model, d, prompt)
        cycle = Cycle(target, d, cache, (0.0, 1.0, 0, 0.0), 0)
        runs[name] = cycle
        for _ in range(4):  # traces and kernel builds, with this setting
            mx.eval(launch(cycle, args).result)
    times = {name: ([], []) for name in runs}
    for _ in range(args.cycles):
        for name, cycle in runs.items():
            use_kernels(norm_rope=name)  # (traced already: only an untraced shape would read it)
            mx.synchronize()
            tic = time.perf_counter()
            flight = launch(cycle, args)
            launched = time.perf_counter()
            flight.result.tolist()
            done = time.perf_counter()
            times[name][0].append(1e3 * (launched - tic))
            times[name][1].append(1e3 * (done - tic))
    print(
        f"{args.shape}, prompt {args.prompt_tokens}, block {args.block}, {args.cycles} cycles each, "
        f"alternating; MLX {mx.__version__} on {mx.default_device()}"
    )
    for name, (launch_ms, total_ms) in times.items():
        print(f"{name:>7}: launch {statistics.median(launch_ms):.2f} ms, total {statistics.median(total_ms):.2f} ms")


def launch(cycle: Cycle, args):
    """One cycle at the end of the prompt (each overwrites the last one's positions)."""
    n = args.prompt_tokens
    with mx.stream(mx.default_stream(mx.default_device())):
        flight = cycle.launch(args.block, mx.array([1], mx.int32), mx.array(n, mx.int32), n)
    cycle.deferred = []
    return flight


if __name__ == "__main__":
    main()
