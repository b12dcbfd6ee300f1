"""Device time per kernel, under Nsight Compute: what the GPU itself spends.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file ncu.csv \\
        python benchmarks/gpu_time.py attention > cases.txt
    ncu ... python benchmarks/gpu_time.py verify --shape qwen3-8b --prompt-tokens 1024,16384 > cases.txt
    python benchmarks/gpu_time.py summarize ncu.csv cases.txt [--sequence]
    python benchmarks/gpu_time.py launches ncu.csv     # per distinct launch, any profiled run
    ncu ... python benchmarks/gpu_time.py cycle --shape builtin --prompt-tokens 256 > cases.txt
    ncu ... python benchmarks/gpu_time.py scalars > cases.txt

Wall-clock timings of a kernel on MLX's CUDA backend include the host's cost of
encoding it (tens of microseconds for a custom kernel), which at these sizes is
as large as the kernel itself; benchmarks/bench_attention.py therefore times
the launch as much as the work. Here only the profiled regions run under the
profiler (``cudaProfilerStart``/``Stop``), each case once after a warm-up, and
``summarize`` adds up the kernels' device time per case and per kernel name.

- ``attention``: ``--rows`` query rows (``--query-heads``/8 heads, head dim 128, bf16) over
  a full buffer of ``--keys`` keys, one distinct buffer per call as in a
  verify's 36 layers: the fused op with a shared mask, and the block-attention
  kernel at ``--chunks`` sizes (``0``: its own choice).
- ``verify``: one 16-token verify of a target at a model's shapes (random
  weights) after a prompt of each length, attention through the kernel and
  through the fused op.
- ``scalars``: the q/k norm + RoPE kernel (36 launches at a verify's shapes)
  with its small inputs in managed memory (host-made weights and
  parameters, a 4-byte offset) or in device memory, the host touching
  small arrays between launches or not, and MLX's ops beside it: whether
  managed memory costs the kernels that read it (session 16: this kernel
  took 19-36 us a launch in the cycle, MLX's rms_norm of the same rows ~5).
- ``cycle``: one whole DFlash cycle as the loop queues it (``Cycle.launch``:
  draft, verify, acceptance, cache moves; compiled on a GPU) after a prompt of
  each length, with how many kernels it launches: the device's share of a
  cycle, to hold against its wall time (benchmarks/cycle.py) and the host's.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import math
import os
import sys
from collections import defaultdict

import mlx.core as mx
from cycle import SHAPES, prefilled, random_pair, synthetic_prompt

LAYERS = 36


def cudart():
    """The CUDA runtime, for cudaProfilerStart/Stop."""
    for d in sys.path + ["/usr/local/cuda/lib64"]:
        for path in sorted(glob.glob(os.path.join(d, "**", "libcudart.so*"), recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return ctypes.CDLL("libcudart.so")


_marker = None


def marker() -> mx.array:
    """A one-thread kernel with a name of its own that opens each profiled case."""
    global _marker
    if _marker is None:
        _marker = mx.fast.cuda_kernel(
            name="dflash_case_marker", input_names=["x"], output_names=["y"], source="y[0] = x[0];"
        )
    return _marker(
        inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32]
    )[0]


def profiled(name: str, fn) -> None:
    """Run ``fn`` once unprofiled (building its graphs), then once profiled
    after a marker kernel, naming the case on stdout."""
    mx.eval(fn())
    mx.synchronize()
    print(f"case {name}", flush=True)
    rt = cudart()
    rt.cudaProfilerStart()
    mx.eval(marker())
    mx.eval(fn())
    mx.synchronize()
    rt.cudaProfilerStop()


def attention_cases(
    keys: list[int],
    rows: list[int],
    chunks: list[int | None],
    query_heads: int = 32,
    stagings: list[tuple[int | None, int | None]] = ((None, None),),
) -> None:
    from dflash_mlx.cache.buffer import positions_mask
    from dflash_mlx.kernels import dispatch
    from dflash_mlx.kernels.attention import BlockAttentionKernel

    kernel = BlockAttentionKernel(dispatch.backend())
    for n in keys:
        ks = [mx.random.normal((1, 8, n, 128)).astype(mx.bfloat16) for _ in range(LAYERS)]
        vs = [mx.random.normal((1, 8, n, 128)).astype(mx.bfloat16) for _ in range(LAYERS)]
        for L in rows:
            # a transposed view, as a layer's rotated query is
            q = mx.random.normal((1, L, query_heads, 128)).astype(mx.bfloat16).transpose(0, 2, 1, 3)
            start = mx.array(n - L, mx.int32)
            mask = positions_mask(L, start, n)
            mx.eval(ks, vs, q, mask)
            profiled(
                f"fused+mask {L} rows {query_heads}/8 heads {n}",
                lambda: [
                    mx.fast.scaled_dot_product_attention(q, ks[i], vs[i], scale=128**-0.5, mask=mask)
                    for i in range(LAYERS)
                ],
            )
            for chunk in chunks:
                for kt, st in stagings:
                    staged = f" KT={kt} ST={st}" if kt or st else ""
                    profiled(
                        f"kernel C={chunk or 'default'}{staged} {L} rows {query_heads}/8 heads {n}",
                        lambda c=chunk, kt=kt, st=st: [
                            kernel(
                                q,
                                ks[i],
                                vs[i],
                                scale=128**-0.5,
                                q_offset=start,
                                kv_length=start + L,
                                causal=True,
                                chunk=c,
                                tile_keys=kt,
                                stages=st,
                            )
                            for i in range(LAYERS)
                        ],
                    )
        del ks, vs


def verify_cases(shape: str, prompts: list[int], block: int) -> None:
    from dflash_mlx.kernels import dispatch

    model, draft = random_pair(shape, None)
    taps = list(draft.config.target_layer_ids)
    table = dispatch.KERNEL_WINS
    for P in prompts:
        target, cache = prefilled(model, draft, synthetic_prompt(draft.config.vocab_size, P))
        length = mx.array(P, mx.int32)

        def verify():
            for c in cache.target:
                c.set_length(length, P)
            return target(mx.array([[1] * block]), cache.target, taps)

        for name, wins in (("kernel", ((256, 0),)), ("fused", ())):
            dispatch.KERNEL_WINS = wins
            profiled(f"verify {name} {P}", verify)
        dispatch.KERNEL_WINS = table
        del target, cache


def cycle_cases(shape: str, prompts: list[int], block: int) -> None:
    """A DFlash cycle and, beside it, one plain mlx-lm decoding step
    (``shape`` "builtin": the shipped pair, bf16)."""
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx.decode.cycle import Cycle

    model, draft = random_pair(shape, None)
    for P in prompts:
        target, cache = prefilled(model, draft, synthetic_prompt(draft.config.vocab_size, P))
        cycle = Cycle(target, draft, cache, SamplingParams(), 0)
        last, length = mx.array([1], mx.int32), mx.array(P, mx.int32)

        def one_cycle():
            # the same length each time: the cycle writes the same positions again
            flight = cycle.launch(block, last, length, P)
            return [flight.result, flight.last, flight.length, *cache.arrays()]

        profiled(f"cycle block {block} after {P}", one_cycle)
        del target, cache, cycle
        plain = make_prompt_cache(model)
        mx.eval(model(mx.array(synthetic_prompt(draft.config.vocab_size, P))[None], cache=plain))
        profiled(
            f"plain mlx-lm step after {P}",
            lambda: [model(mx.array([[1]]), cache=plain), *[a for c in plain for a in c.state]],
        )
        del plain


def scalar_cases(block: int) -> None:
    """The q/k norm + RoPE kernel at a verify's shapes (one launch a layer,
    each waited for) reading its small inputs from memory that MLX's CUDA
    allocator places differently: arrays the host makes (a model's loaded
    norm weights, the kernel's own parameters) and arrays of 8 bytes or less
    (a cycle's length) live in managed memory, which the host's own small
    arrays share; larger arrays a kernel writes live in device memory. If
    the host's touching managed memory between launches makes the kernel's
    reads fault, the cases differ:

    - device-made weights and parameters, a 4-byte offset, the host idle;
    - the same, the host making a scalar and reading one back between
      launches (as the loop does each cycle);
    - a 16-byte offset the device made (the kernel reads its first element),
      the host touching;
    - host-made weights and parameters (as a loaded model's and the kernel's
      own are), the host touching;

    then MLX's own ops for the same work (copies, rms_norm, rope), whose
    kernels read the same offset and weights."""
    import mlx.nn as nn
    import numpy as np

    from dflash_mlx.kernels import norm_rope as nr

    nr.prepare(mx.bfloat16, 128)
    kernel = nr.passed(mx.bfloat16, 128)
    if kernel is None:
        raise SystemExit("the q/k norm + RoPE kernel did not check out here (bf16, head dim 128).")
    fused = [mx.random.normal((1, block, 48 * 128)).astype(mx.bfloat16) for _ in range(LAYERS)]
    qs = [f[..., : 32 * 128].reshape(1, block, 32, 128) for f in fused]
    ks = [f[..., 32 * 128 : 40 * 128].reshape(1, block, 8, 128) for f in fused]
    made_here = mx.ones((128,), mx.bfloat16)  # computed on the device
    loaded = mx.array(np.ones(128, np.float32), dtype=mx.bfloat16)  # written by the host, as loaded weights are
    narrow = mx.array(1000, mx.int32) + mx.array(24, mx.int32)  # 4 bytes, computed on the device
    wide = mx.full((4,), 1000, mx.int32) + 24  # 16 bytes, computed on the device
    key = (1e-6, 1.0, 1e6)
    kernel(qs[0], ks[0], made_here, made_here, eps=key[0], scale=key[1], base=key[2], offset=narrow)
    host_params = kernel._params[key]  # made by the host, as the kernel makes it
    device_params = host_params * 1  # the same values, made by the device (12 bytes: device memory)
    mx.eval(fused, narrow, wide, made_here, loaded, device_params)

    def run_layers(offset, weight, params, host_touches: bool):
        kernel._params[key] = params
        outs = []
        for i in range(LAYERS):
            if host_touches:
                (narrow + i).item()  # a scalar the device wrote, read back
                mx.array(i, mx.int32)  # a scalar the host writes
            out = kernel(qs[i], ks[i], weight, weight, eps=key[0], scale=key[1], base=key[2], offset=offset)
            mx.eval(out)
            outs.extend(out)
        kernel._params[key] = host_params
        return outs

    name = f"norm+rope {block} rows"
    profiled(f"{name}, device-made inputs, 4-byte offset", lambda: run_layers(narrow, made_here, device_params, False))
    profiled(
        f"{name}, device-made inputs, 4-byte offset, host touching",
        lambda: run_layers(narrow, made_here, device_params, True),
    )
    profiled(
        f"{name}, device-made inputs, 16-byte offset, host touching",
        lambda: run_layers(wide, made_here, device_params, True),
    )
    profiled(
        f"{name}, host-made weights and parameters, 16-byte offset, host touching",
        lambda: run_layers(wide, loaded, host_params, True),
    )
    qn, kn = nn.RMSNorm(128, eps=1e-6), nn.RMSNorm(128, eps=1e-6)
    qn.weight = kn.weight = loaded
    rope = nn.RoPE(128, base=1e6)
    profiled(
        f"MLX's ops (copies, rms_norm, rope) {block} rows, host-made weights, 4-byte offset",
        lambda: [a for i in range(LAYERS) for a in nr.ops_norm_rope(qs[i], ks[i], qn, kn, rope, narrow)],
    )


def kernel_rows(path: str):
    """(ncu's CSV row, the kernel's device microseconds) per profiled launch,
    in launch order."""
    with open(path) as f:
        lines = f.read().splitlines()
    header = None
    for line in lines:
        if line.startswith('"ID"'):
            header = next(csv.reader([line]))
            continue
        if header is None or not line.startswith('"'):
            continue
        row = dict(zip(header, next(csv.reader([line]))))
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[row["Metric Unit"]]
        yield row, float(row["Metric Value"].replace(",", "")) * scale


def launches(path: str) -> None:
    """Device time per distinct launch (kernel name with its template
    constants, grid and block) from ncu's CSV of any run: how many, median,
    least and most microseconds. A kernel's shape variants, and one product's
    launches from another's (their grids differ), come apart, so a launch-
    shape sweep (benchmarks/block_products.py --shapes) reads off here."""
    times: dict[tuple, list[float]] = defaultdict(list)
    for row, us in kernel_rows(path):
        name = row["Kernel Name"].split("(")[0]
        if "dflash_case_marker" not in name:
            times[(name, row.get("Grid Size", ""), row.get("Block Size", ""))].append(us)

    def blocks(grid: str) -> int:  # (x, y, z) -> x * y * z, for the order
        return math.prod(int(v) for v in grid.strip("()").split(",")) if grid.strip("()") else 0

    print(f"{'count':>5} {'median us':>10} {'least':>8} {'most':>8}  kernel  grid  block")
    for (name, grid, block), ts in sorted(times.items(), key=lambda kv: (blocks(kv[0][1]), kv[0][0])):
        ts.sort()
        print(f"{len(ts):>5} {ts[len(ts) // 2]:>10.1f} {ts[0]:>8.1f} {ts[-1]:>8.1f}  {name}  {grid}  {block}")


def summarize(path: str, names_path: str, sequence: bool = False) -> None:
    """Device time per case, and per kernel name within it, from ncu's CSV
    (cases split at the marker kernel) and the case names the run printed;
    ``sequence``: also each case's kernels in launch order, repeats of a
    name in a row counted (what a layer launches, read off the list)."""
    with open(names_path) as f:
        names = iter([line[5:].strip() for line in f if line.startswith("case ")])
    cases: dict[str, dict[str, float]] = {}
    order: dict[str, list[str]] = defaultdict(list)
    current = None
    for row, us in kernel_rows(path):
        name = row["Kernel Name"].split("(")[0][:60]
        if "dflash_case_marker" in name:
            current = next(names, f"case {len(cases)}")
            cases[current] = defaultdict(float)
            continue
        if current is None:
            continue
        order[current].append(name)
        cases[current][name] += us
    for case, kernels in cases.items():
        total = sum(kernels.values())
        print(f"{case}: {total / 1000:.3f} ms device time, {len(order[case])} kernels")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {us / 1000:8.3f} ms  {name}")
        if sequence:
            runs: list[list] = []
            for name in order[case]:
                if runs and runs[-1][0] == name:
                    runs[-1][1] += 1
                else:
                    runs.append([name, 1])
            print("  in launch order:")
            for name, count in runs:
                print(f"    {count:3d} x {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attention", "verify", "cycle", "scalars", "summarize", "launches"])
    ap.add_argument(
        "paths",
        nargs="*",
        help="summarize: ncu's CSV log, then the run's stdout (its case names); launches: ncu's CSV log",
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES) + ["builtin"],
        default="qwen3-8b",
        help="a model's shapes (random weights); cycle: also builtin, the shipped pair",
    )
    ap.add_argument("--sequence", action="store_true", help="summarize: each case's kernels in launch order")
    ap.add_argument("--prompt-tokens", default="1024,16384")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--keys", default="4096,16384,32768", help="attention: comma-separated key counts")
    ap.add_argument("--rows", default="16", help="attention: comma-separated query rows (block sizes)")
    ap.add_argument("--query-heads", type=int, default=32, help="attention: query heads over 8 kv heads")
    ap.add_argument("--chunks", default="0,256,512,1024,4096", help="attention: chunk sizes, 0 = the kernel's choice")
    ap.add_argument(
        "--staging",
        default="0x0",
        help="attention: keys per staged tile x staging buffers, comma-separated (0x0: the kernel's choice)",
    )
    from kernel_switches import add_scalars_argument, use_scalars

    add_scalars_argument(ap, "one for the run")
    args = ap.parse_intermixed_args()
    use_scalars(args.scalars)
    if args.what == "summarize":
        summarize(*args.paths, sequence=args.sequence)
    elif args.what == "launches":
        launches(*args.paths)
    elif args.what == "attention":
        ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
        stagings = [tuple(int(x) or None for x in pair.split("x")) for pair in args.staging.split(",")]
        attention_cases(
            ints(args.keys), ints(args.rows), [c or None for c in ints(args.chunks)], args.query_heads, stagings
        )
    elif args.what == "scalars":
        scalar_cases(args.block)
    elif args.what == "cycle":
        cycle_cases(args.shape, [int(p) for p in args.prompt_tokens.split(",")], args.block)
    else:
        verify_cases(args.shape, [int(p) for p in args.prompt_tokens.split(",")], args.block)


if __name__ == "__main__":
    main()
