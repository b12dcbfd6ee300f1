"""Device time and DRAM bytes per kernel of a cycle, a verify or 36 attention calls, read from Nsight Compute.

Reported in BENCHMARKS.md: "GPU kernels" (block attention, block products),
the device-time table under "Qwen3-8B shapes, random weights", and the
built-in pair's kernels a cycle under "The built-in pair" / "H100".

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file ncu.csv \
        python benchmarks/gpu_time.py cycle --shape builtin --prompt-tokens 256 > cases.txt
    python benchmarks/gpu_time.py summarize ncu.csv cases.txt [--sequence]
    ncu ... python benchmarks/gpu_time.py attention --rows 16 --keys 1024,2048,4096,16384,32768 > cases.txt
    ncu ... python benchmarks/gpu_time.py verify --shape qwen3-8b --prompt-tokens 1024,16384 > cases.txt
    python benchmarks/gpu_time.py launches ncu.csv     # per distinct launch, any profiled run

Bytes a cycle moves, against a plain step's (what a Mac, bound by memory
bandwidth, pays; BENCHMARKS.md "Bytes per cycle"):

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        --csv --log-file ncu.csv python benchmarks/gpu_time.py cycle --shape qwen3-8b --quantize 4 \
        --prompt-tokens 1024 > cases.txt
    python benchmarks/gpu_time.py summarize ncu.csv cases.txt

The families' shapes (benchmarks/families.py) take the same commands: ``cycle --shape
qwen3.5-9b-like --quantize 4 --prompt-tokens 256``, ``cycle --shape gpt-oss-20b-like
--quantize mxfp4 --block 4``.

Wall-clock timings of a kernel on MLX's CUDA backend include the host's cost
of encoding it, which at these sizes is as large as the kernel itself. Here
only the profiled regions run under the profiler (``cudaProfilerStart``/
``Stop``), each case once after a warm-up, and ``summarize`` adds up the
kernels' device time per case and per kernel name.

- ``attention``: ``--rows`` query rows (``--query-heads``/8 heads, head dim
  128, bf16) over a full buffer of ``--keys`` keys, one distinct buffer per
  call as in a verify's 36 layers: the fused op with a mask, and the
  block-attention kernel at ``--chunks`` sizes (``0``: its own choice).
- ``verify``: one verify of a target at a model's shapes (random weights)
  after a prompt of each length.
- ``cycle``: one whole DFlash cycle as the loop queues it (``Cycle.launch``)
  after a prompt of each length, draft trees of ``--trees`` rows, our plain
  step (a block of 1, as ``auto`` runs it) and one plain mlx-lm step beside them.
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
from families import FAMILIES, QUANTIZATIONS, build

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
    from dflash_mlx.kernels import dispatch
    from dflash_mlx.kernels.attention import BlockAttentionKernel

    kernel = BlockAttentionKernel(dispatch.backend())
    for n in keys:  # one length's buffers at a time: they go when attention_at returns
        attention_at(kernel, n, rows, chunks, query_heads, stagings)


def attention_at(kernel, n: int, rows, chunks, query_heads: int, stagings) -> None:
    from dflash_mlx.kv.buffer import positions_mask

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
                mx.fast.scaled_dot_product_attention(q, ks[i], vs[i], scale=128**-0.5, mask=mask) for i in range(LAYERS)
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


def pair_for(shape: str, quantize: str | None, draft_bits: int | None = None):
    """Random weights at ``shape``: a Qwen3 size (cycle.py's SHAPES, affine
    ``quantize`` bits) or a family (families.py's, ``quantize`` one of its
    --bits), bf16 otherwise; ``draft_bits``: the drafter's, Qwen3 sizes only."""
    if shape in FAMILIES:
        if draft_bits:
            raise SystemExit("--draft-bits takes a Qwen3 --shape; leave it out with a family's.")
        return build(FAMILIES[shape](False), quantize, mx.bfloat16)
    if quantize == "mxfp4":
        raise SystemExit("--quantize mxfp4 takes a family's --shape (gpt-oss-20b-like); pass 4 or 8 here.")
    return random_pair(shape, int(quantize) if quantize else None, draft_bits=draft_bits)


def verify_cases(shape: str, prompts: list[int], block: int, quantize: str | None = None) -> None:
    model, draft = pair_for(shape, quantize)
    for P in prompts:
        verify_at(model, draft, P, block)


def verify_at(model, draft, P: int, block: int) -> None:
    """One verify of ``block`` rows after a prompt of ``P`` tokens."""
    target, cache = prefilled(model, draft, synthetic_prompt(draft.config.vocab_size, P))
    taps = list(draft.config.target_layer_ids)
    length = mx.array(P, mx.int32)

    def verify():
        for c in cache.target:
            c.set_length(length, P)
        return target(mx.array([[1] * block]), cache.target, taps)

    profiled(f"verify {block} rows after {P}", verify)


# cycle's cases: the block's cycle (and --trees' trees), our plain step, one plain mlx-lm step.
CYCLE_CASES = ("cycle", "ours", "plain")


def cycle_cases(
    shape: str,
    prompts: list[int],
    block: int,
    quantize: str | None = None,
    draft_bits: int | None = None,
    trees: tuple[int, ...] = (),
    cases: tuple[str, ...] = CYCLE_CASES,
) -> None:
    """A DFlash cycle, draft trees of each of ``trees`` rows and, beside
    them, one plain mlx-lm decoding step (``shape`` "builtin": the shipped
    pair, bf16; ``quantize``: the target's weights; ``draft_bits``: the
    drafter's); only those of ``cases`` (CYCLE_CASES)."""
    model, draft = pair_for(shape, quantize, draft_bits)
    for P in prompts:
        if "cycle" in cases:
            cycle_at(model, draft, P, block)
            for rows in trees:
                cycle_at(model, draft, P, rows, tree=True)
        if "ours" in cases:
            cycle_at(model, draft, P, 1)
        if "plain" in cases:
            plain_at(model, draft, P)


def cycle_at(model, draft, P: int, block: int, tree: bool = False) -> None:
    from dflash_mlx.decode.cycle import Cycle
    from dflash_mlx.decode.sampling import SamplingParams
    from dflash_mlx.draft.tree import TreeParams

    target, cache = prefilled(model, draft, synthetic_prompt(draft.config.vocab_size, P))
    trees = TreeParams(draft.config.block_size) if tree else None
    cycle = Cycle(target, draft, cache, SamplingParams(), 0, tree=trees)
    last, length = mx.array([1], mx.int32), mx.array(P, mx.int32)

    def one_cycle():
        # the same length each time: the cycle writes the same positions again;
        # a block of 1 is the plain step `auto` runs, the length known (exact)
        flight = cycle.launch(block, last, length, P, exact=block == 1)
        return [flight.result, flight.last, flight.length, *cache.arrays()]

    name = f"cycle tree {block} rows" if tree else f"cycle block {block}" if block > 1 else "our plain step"
    profiled(f"{name} after {P}", one_cycle)


def plain_at(model, draft, P: int) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    plain = make_prompt_cache(model)
    mx.eval(model(mx.array(synthetic_prompt(draft.config.vocab_size, P))[None], cache=plain))
    profiled(
        f"plain mlx-lm step after {P}",
        lambda: [model(mx.array([[1]]), cache=plain), *[a for c in plain for a in c.state]],
    )


TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
BYTE_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def launch_metrics(path: str):
    """(ncu's CSV row, the kernel's device microseconds, its DRAM bytes or
    None where not profiled) per profiled launch, in launch order."""
    with open(path) as f:
        lines = f.read().splitlines()
    header, launches, order = None, {}, []
    for line in lines:
        if line.startswith('"ID"'):
            header = next(csv.reader([line]))
            continue
        if header is None or not line.startswith('"'):
            continue
        row = dict(zip(header, next(csv.reader([line]))))
        key = row["ID"]
        if key not in launches:
            launches[key] = [row, None, None]
            order.append(key)
        value = float(row["Metric Value"].replace(",", ""))
        if row.get("Metric Name") == "gpu__time_duration.sum":
            launches[key][1] = value * TIME_UNITS[row["Metric Unit"]]
        elif row.get("Metric Name") in BYTE_METRICS:
            launches[key][2] = (launches[key][2] or 0.0) + value * BYTE_UNITS[row["Metric Unit"]]
    for key in order:
        row, us, moved = launches[key]
        if us is not None:
            yield row, us, moved


def kernel_rows(path: str):
    """(ncu's CSV row, the kernel's device microseconds) per profiled launch, in launch order."""
    for row, us, _ in launch_metrics(path):
        yield row, us


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
    moved: dict[str, float] = defaultdict(float)
    order: dict[str, list[str]] = defaultdict(list)
    current = None
    for row, us, launch_bytes in launch_metrics(path):
        name = row["Kernel Name"].split("(")[0][:60]
        if "dflash_case_marker" in name:
            current = next(names, f"case {len(cases)}")
            cases[current] = defaultdict(float)
            continue
        if current is None:
            continue
        order[current].append(name)
        cases[current][name] += us
        if launch_bytes is not None:
            moved[current] += launch_bytes
    plain = {case.rsplit(" ", 1)[-1]: moved[case] for case in cases if case.startswith("plain") and moved[case]}
    for case, kernels in cases.items():
        total = sum(kernels.values())
        line = f"{case}: {total / 1000:.3f} ms device time, {len(order[case])} kernels"
        if moved[case]:
            line += f", {moved[case] / 1e9:.3f} GB DRAM"
            step = plain.get(case.rsplit(" ", 1)[-1])
            if step and not case.startswith("plain"):
                line += f" ({moved[case] / step:.2f}x a plain step's)"
        print(line)
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
    ap.add_argument("what", choices=["attention", "verify", "cycle", "summarize", "launches"])
    ap.add_argument(
        "paths",
        nargs="*",
        help="summarize: ncu's CSV log, then the run's stdout (its case names); launches: ncu's CSV log",
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES) + sorted(FAMILIES) + ["builtin"],
        default="qwen3-8b",
        help="a model's shapes (random weights; the families: families.py's); cycle: also builtin, the shipped pair",
    )
    ap.add_argument("--sequence", action="store_true", help="summarize: each case's kernels in launch order")
    ap.add_argument("--prompt-tokens", default="1024,16384")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--trees", default="", help="cycle: also draft trees of these comma-separated row counts")
    ap.add_argument(
        "--cases",
        default=",".join(CYCLE_CASES),
        help="cycle: which run, comma-separated: cycle (the block's, and --trees'), ours (our plain step), "
        "plain (mlx-lm's step; a case's bytes are given against it); under ncu, a long run in parts",
    )
    ap.add_argument(
        "--quantize",
        choices=sorted(QUANTIZATIONS),
        default=None,
        help="verify, cycle: the target's weights (mlx-lm affine bits, group 64; mxfp4 for a family's shape)",
    )
    ap.add_argument("--draft-bits", type=int, choices=[4, 8], help="cycle: the drafter's bits (--draft-bits)")
    ap.add_argument("--keys", default="4096,16384,32768", help="attention: comma-separated key counts")
    ap.add_argument("--rows", default="16", help="attention: comma-separated query rows (block sizes)")
    ap.add_argument("--query-heads", type=int, default=32, help="attention: query heads over 8 kv heads")
    ap.add_argument("--chunks", default="0,256,512,1024,4096", help="attention: chunk sizes, 0 = the kernel's choice")
    ap.add_argument(
        "--staging",
        default="0x0",
        help="attention: keys per staged tile x staging buffers, comma-separated (0x0: the kernel's choice)",
    )
    args = ap.parse_intermixed_args()
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
    elif args.what == "cycle":
        prompts = [int(p) for p in args.prompt_tokens.split(",")]
        trees = tuple(int(t) for t in args.trees.split(",") if t)
        cases = tuple(c for c in args.cases.split(",") if c)
        if not cases or set(cases) - set(CYCLE_CASES):
            raise SystemExit(f"--cases takes some of {','.join(CYCLE_CASES)}, comma-separated.")
        cycle_cases(args.shape, prompts, args.block, args.quantize, args.draft_bits, trees, cases)
    else:
        verify_cases(args.shape, [int(p) for p in args.prompt_tokens.split(",")], args.block, args.quantize)


if __name__ == "__main__":
    main()
