"""Compile every Metal variant of dflash-mlx's kernels with clang, on a machine without a Mac.

    apt-get install -y clang        # any clang++ from 14 on
    python scripts/check_metal_kernels.py

A Metal kernel's source reaches Apple's compiler only when MLX first launches
it, on a Mac: a variant first built mid-decode (16 warps, a model's own
window, sinks) has no self-check to fall back on. This script gets there on
any machine. It builds each kernel object (block attention's two passes and
its merge, the q/k norm + RoPE) with a recording factory in place of
``mx.fast.metal_kernel``, drives it over every launch decoding can ask of it
(``record_all``: each dtype and head dim, every row count the dispatch table
sends to the kernel, causal or not, windowed or not, sinks or not, one key
chunk or many, a block or a draft tree (the norm + RoPE at one offset or at
each row's position), and the self-checks' own cases), and for each variant
MLX would compile (its kernel name: template values, dtypes, which inputs go
in the ``constant`` address space) rebuilds the source MLX would hand Apple's
compiler (mlx/backend/common/metal_kernel.cpp's ``write_signature``) and
compiles it with ``clang++ -fsyntax-only -std=c++17`` against
scripts/metal_stub.h, a stand-in for Metal's headers with real address spaces
and builtins of Metal's arities. It checks each launch's limits too:
threadgroup memory (as the compiler sizes it) within 32 KiB, at most 1024
threads a threadgroup, whole simdgroups, a grid of whole threadgroups.

What it does not show: results, speed, a pipeline's own thread limit, or what
only Apple's compiler knows. Exits non-zero naming each failing variant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Modules whose record_variants launches every variant of their kernel.
from dflash_mlx.kernels import RECORDED_MODULES as KERNEL_MODULES  # noqa: E402

STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal_stub.h")

# mlx/backend/common/compiled.cpp's get_type_string
METAL_TYPES = {
    mx.bfloat16: "bfloat16_t",
    mx.float16: "float16_t",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.bool_: "bool",
    mx.int64: "int64_t",
    mx.int8: "int8_t",
    mx.uint8: "uint8_t",
    mx.int16: "int16_t",
    mx.uint16: "uint16_t",
    mx.uint64: "uint64_t",
}
# Inputs of fewer elements are passed in the constant address space (MLX's max_constant_array_size).
MAX_CONSTANT_ARRAY_SIZE = 8
# The thread attributes MLX adds as parameters, in its order, where the source names them.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
# Apple GPUs' limits.
THREADGROUP_MEMORY = 32 * 1024
MOST_THREADS = 1024
SIMD_WIDTH = 32

# Headers a Metal source may include; each resolves to the stand-in.
METAL_HEADERS = (
    "metal_stdlib",
    "metal_math",
    "metal_simdgroup",
    "metal_simdgroup_matrix",
    "metal_compute",
    "metal_atomic",
    "metal_integer",
    "metal_common",
    "metal_relational",
    "metal_geometric",
)


class Variant:
    """One library MLX would compile: its source, and the launches that use it."""

    def __init__(self, kernel: str, source: str):
        self.kernel = kernel  # the name the kernel object was made with
        self.source = source  # as MLX builds it (header, signature, body, instantiation)
        self.launches: set = set()  # (grid, threadgroup) pairs


class Recorder:
    """A stand-in for mx.fast.metal_kernel: keeps the source MLX would
    compile for each launch, under MLX's own name for it; a launch returns
    zeros of the output shapes."""

    def __init__(self):
        self.variants: dict[str, Variant] = {}

    def factory(
        self,
        *,
        name,
        input_names,
        output_names,
        source,
        header="",
        ensure_row_contiguous=True,
        atomic_outputs=False,
        shared_memory=0,
        **_,
    ):
        attributes = [f"  {t} {a} [[{a}]]" for a, t in ATTRIBUTES if a in source]

        def launch(*, inputs, grid, threadgroup, output_shapes, output_dtypes, template=(), **_):
            full = kernel_name(name, inputs, template, output_dtypes)
            variant = self.variants.get(full)
            if variant is None:
                src = write_signature(
                    full,
                    header,
                    source,
                    input_names,
                    inputs,
                    output_names,
                    output_dtypes,
                    template,
                    attributes,
                    atomic_outputs,
                )
                variant = self.variants[full] = Variant(name, src)
            variant.launches.add((tuple(grid), tuple(threadgroup)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


def template_value(v) -> str:
    if isinstance(v, bool):
        return str(int(v))  # (an ostream's bool)
    if isinstance(v, int):
        return str(v)
    return METAL_TYPES[v]


def kernel_name(name, inputs, template, output_dtypes) -> str:
    """MLX's name for the library a launch compiles (metal_kernel's kernel_name)."""
    full = "custom_kernel_" + name
    if template:  # (make_template_hash of "<T, D, ...>": "_T_D_...", after one more "_")
        full += "__" + "_".join(template_value(v) for _, v in template)
    for a in inputs:
        full += "_" + METAL_TYPES[a.dtype] + ("s" if a.ndim == 0 else "c" if a.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for d in output_dtypes:
        full += "_" + METAL_TYPES[d]
    return full


def write_signature(
    full, header, source, input_names, inputs, output_names, output_dtypes, template, attributes, atomic_outputs=False
) -> str:
    """The source MLX compiles for this launch (write_signature and the explicit instantiation)."""
    out = header
    if template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in template]
        out += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    out += f"[[kernel]] void {full}(\n"
    index = 0
    for n, a in zip(input_names, inputs):
        where = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        out += f"  const {where} {METAL_TYPES[a.dtype]}{'&' if a.ndim == 0 else '*'} {n} [[buffer({index})]],\n"
        index += 1
        if a.ndim > 0:
            for suffix, kind in (
                ("_shape", "const constant int*"),
                ("_strides", "const constant int64_t*"),
                ("_ndim", "const constant int&"),
            ):
                if n + suffix in source:
                    out += f"  {kind} {n}{suffix} [[buffer({index})]],\n"
                    index += 1
    for n, d in zip(output_names, output_dtypes):
        t = f"atomic<{METAL_TYPES[d]}>" if atomic_outputs else METAL_TYPES[d]
        out += f"  device {t}* {n} [[buffer({index})]]"
        # (MLX's own test, buffer index against the count of arrays: with no attributes and
        # shapes passed, it closes the signature early; every kernel here names attributes)
        out += ",\n" if index < len(inputs) + len(output_names) - 1 or attributes else ") {\n"
        index += 1
    out += ",\n".join(attributes) + (") {\n" if attributes else "")
    out += source + "\n}\n"
    if template:
        args = full + "<" + ", ".join(template_value(v) for _, v in template) + ">"
        out += f'\ntemplate [[host_name("{full}")]] [[kernel]] decltype({args}) {args};\n'
    return out


# --- Metal to C++ ----------------------------------------------------------------------------------------

_ATTRIBUTE = re.compile(
    r"\[\[\s*(?:kernel|host_name\(\"[^\"]*\"\)|buffer\(\d+\)|" + "|".join(a for a, _ in ATTRIBUTES) + r")\s*\]\]"
)


def lower(source: str) -> tuple[str, list[str]]:
    """``source`` (as MLX builds it) as C++ that clang checks against the
    stand-in header, and the problems found on the way. Two rewrites, both
    of Metal syntax C++ lacks, none of the kernel's code: Metal's attributes
    go ([[kernel]], [[buffer(i)]], a thread attribute's, the instantiation's
    [[host_name]]); a kernel's threadgroup arrays become ``static`` (C++
    allows an address space on no automatic variable). After the last one, the
    threadgroup memory they take (each rounded up to 16 bytes, as Metal
    allocates it) is checked against Apple's 32 KiB, where the compiler sizes
    it with the template's values."""
    problems = []
    source = _ATTRIBUTE.sub("", source)
    # Words that mean `threadgroup`: itself and the header's macros for it.
    words = {"threadgroup"} | set(re.findall(r"^#define\s+(\w+)\s+threadgroup\s*$", source, re.M))
    lines = source.split("\n")
    start = next(i for i, line in enumerate(lines) if re.search(r"\bvoid\s+custom_kernel_\w+\($", line))
    body = next(i for i in range(start, len(lines)) if lines[i].endswith(") {")) + 1
    depth, names, last = 1, [], None
    for i in range(body, len(lines)):
        line = lines[i]
        stripped = line.strip()
        first = re.match(r"(?:const\s+)?(\w+)\b", stripped)
        bare = re.sub(r"\[[^\]]*\]", "[]", stripped)
        if (
            first
            and first.group(1) in words
            and not line.endswith("\\")
            and stripped.endswith(";")
            and not re.search(r"[*&=(]", bare)
        ):
            if depth != 1:
                problems.append(
                    f"a threadgroup declaration inside a nested block (line {i + 1}): "
                    "the check totals only those at the kernel's top level"
                )
            declared = [re.search(r"(\w+)\s*(?:\[\]\s*)*$", d).group(1) for d in bare.rstrip(";").split(",")]
            lines[i] = line.replace(stripped, "static " + stripped, 1)
            for n in declared:
                k = len(names)
                names.append(n)
                total = f"metal_stub_tg_bytes_{k - 1} + " if k else ""
                lines[i] += f" constexpr size_t metal_stub_tg_bytes_{k} = {total}(sizeof({n}) + 15) / 16 * 16;"
            last = i
        depth += line.count("{") - line.count("}")
    if last is not None:
        lines[last] += f" (void)sizeof(metal_stub_threadgroup_memory<metal_stub_tg_bytes_{len(names) - 1}>);"
    limit = (
        f"template <size_t BYTES> struct metal_stub_threadgroup_memory {{\n"
        f'  static_assert(BYTES <= {THREADGROUP_MEMORY}, "threadgroup memory over {THREADGROUP_MEMORY} bytes");\n'
        "};\n"
    )
    return '#include "metal_stub.h"\n' + limit + "\n".join(lines), problems


def launch_problems(variant: Variant) -> list[str]:
    """Each launch's limits: threads a threadgroup, whole simdgroups, a grid of whole threadgroups."""
    problems = []
    for grid, group in sorted(variant.launches):
        threads = group[0] * group[1] * group[2]
        if threads > MOST_THREADS:
            problems.append(f"threadgroup {group}: {threads} threads > {MOST_THREADS}")
        if threads % SIMD_WIDTH:
            problems.append(f"threadgroup {group}: {threads} threads, not whole simdgroups of {SIMD_WIDTH}")
        if any(g % t for g, t in zip(grid, group)):
            problems.append(f"grid {grid} is not whole threadgroups {group}")
    return problems


def find_clang() -> str | None:
    for name in ["clang++"] + [f"clang++-{v}" for v in range(30, 13, -1)]:
        path = shutil.which(name)
        if path:
            return path
    return None


class Compiler:
    """clang++ -fsyntax-only against the stand-in header (aarch64: half and __fp16 exist there)."""

    def __init__(self, clang: str, stub: str = STUB, std: str = "c++17"):
        self.clang = clang
        self.std = std
        self.dir = tempfile.mkdtemp(prefix="metal_stub_")
        shutil.copy(stub, os.path.join(self.dir, "metal_stub.h"))
        for h in METAL_HEADERS:
            with open(os.path.join(self.dir, h), "w") as f:
                f.write('#include "metal_stub.h"\n')

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def check(self, source: str) -> tuple[bool, str]:
        text, problems = lower(source)
        cmd = [
            self.clang,
            "--target=aarch64-linux-gnu",
            "-fsyntax-only",
            f"-std={self.std}",
            "-x",
            "c++",
            "-nostdinc",
            "-nostdinc++",
            "-fno-exceptions",
            "-fno-rtti",
            "-ferror-limit=10",
            "-fno-color-diagnostics",
            "-I",
            self.dir,
            "-",
        ]
        run = subprocess.run(cmd, input=text, capture_output=True, text=True)
        log = run.stderr.strip()
        return run.returncode == 0 and not problems, "\n".join(problems + ([log] if log else []))


# --- What decoding launches ------------------------------------------------------------------------------


# The windows a variant is built for (WINDOW, a template constant): the self-check's own (45,
# dispatch._check_cases) and one a model brings (gpt-oss's 128, the one with sinks).
MODEL_WINDOWS = (128,)
# Key buffers: one key chunk (256 keys, the self-check's) and many.
KEY_BUFFERS = (256, 4096)


def record_modules(recorder, backend: str, modules=KERNEL_MODULES) -> None:
    """Every variant of each module in ``modules``, recorded through its ``record_variants`` hook."""
    for name in modules:
        importlib.import_module(name).record_variants(recorder.factory, backend)


def record_all(
    recorder: Recorder, dtypes=None, head_dims=None, rows=None, decoding: bool = True, modules=KERNEL_MODULES
) -> None:
    """Every Metal variant decoding can launch, recorded: each kernel's
    self-check cases, then (``decoding``) for each dtype and head dim every
    row count per key-value head the dispatch table can send to the kernel
    (1 to its largest, KERNEL_WINS: every warps count either pass picks),
    one query head and eight (sinks in constant or in device memory, MLX's
    rule), causal or not, windowed or not, sinks or not, one key chunk or
    many (the merge's partials in constant memory or device memory), a block
    or a draft tree of those rows (``record_tree``). The
    template values come from the kernels' own code. Then every variant of
    the kernel modules in ``modules`` (their ``record_variants`` hooks:
    each variant they can launch, all of them checked on first use).
    ``dtypes``, ``head_dims``, ``rows``: a subset (tests)."""
    from dflash_mlx.kernels import dispatch, norm_rope
    from dflash_mlx.kernels.attention import BlockAttentionKernel
    from dflash_mlx.kernels.attention_source import TREE_NODES
    from dflash_mlx.kernels.ops import DTYPES, HEAD_DIMS

    dtypes = DTYPES if dtypes is None else dtypes
    head_dims = HEAD_DIMS if head_dims is None else head_dims
    most_rows = max(r for r, keys in dispatch.KERNEL_WINS if keys is not None)
    row_counts = range(1, most_rows + 1) if rows is None else rows
    attention = BlockAttentionKernel("metal", factory=recorder.factory)
    rope = norm_rope.NormRopeKernel("metal", factory=recorder.factory)
    record_modules(recorder, "metal", modules)
    for dtype in dtypes:
        for d in head_dims:
            for windowed in (False, True):
                for q, k, v, kw in dispatch._check_cases(dtype, d, windowed):
                    attention(q, k, v, **kw)
                for q, k, v, kw in dispatch._tree_check_cases(dtype, d, windowed):
                    attention(q, k, v, causal=True, **kw)
            for q, k, qn, kn, rp, offset in norm_rope._check_cases(dtype, d):
                rope(q, k, qn.weight, kn.weight, eps=qn.eps, scale=rp.scale, base=rp.base, offset=offset)
            if not decoding:
                continue
            # a decode step's keys alone (norm_rope_keys: k as the queries too), one token
            k1 = mx.zeros((1, 1, 1, d), dtype)
            rope(
                k1,
                k1,
                mx.ones((d,), dtype),
                mx.ones((d,), dtype),
                eps=1e-6,
                scale=1.0,
                base=10_000.0,
                offset=mx.array(7, mx.int32),
            )
            # a draft tree's verify, each node at its own position (MLX passes fewer than 8 in constant memory)
            for nodes in (2, TREE_NODES):
                positions = 7 + mx.arange(nodes, dtype=mx.int32)
                q, k = mx.zeros((1, nodes, 8, d), dtype), mx.zeros((1, nodes, 1, d), dtype)
                weight = mx.ones((d,), dtype)
                rope(q, k, weight, weight, eps=1e-6, scale=1.0, base=10_000.0, offset=positions)
            for heads in (1, 8):
                for r in row_counts:
                    if r % heads:
                        continue
                    q = mx.zeros((1, heads, r // heads, d), dtype)
                    sinks = mx.zeros((heads,), mx.float32)
                    for n in KEY_BUFFERS:
                        kv = mx.zeros((1, 1, n, d), dtype)
                        for causal in (True, False):
                            for window in (None,) + MODEL_WINDOWS:
                                for s in (None, sinks):
                                    attention(
                                        q,
                                        kv,
                                        kv,
                                        scale=d**-0.5,
                                        q_offset=mx.array([n // 2], mx.int32),
                                        kv_length=mx.array([n // 2 + r], mx.int32),
                                        causal=causal,
                                        window=window,
                                        sinks=s,
                                    )
                    if r // heads <= TREE_NODES:
                        record_tree(attention, q, sinks)


def record_tree(attention, queries, sinks) -> None:
    """A draft tree of the queries' length over each key buffer, windowed or
    not, sinks or not (a tree's verify is causal; its ancestors and depths in
    constant memory for trees of 1 or 2 nodes, MLX's rule, else device)."""
    from dflash_mlx.kv.tree import chain

    b, heads, nodes, d = queries.shape
    tree = chain(nodes)
    for n in KEY_BUFFERS:
        kv = mx.zeros((1, 1, n, d), queries.dtype)
        for window in (None,) + MODEL_WINDOWS:
            for s in (None, sinks):
                attention(
                    queries,
                    kv,
                    kv,
                    scale=d**-0.5,
                    q_offset=mx.array([n // 2], mx.int32),
                    kv_length=mx.array([n // 2 + nodes], mx.int32),
                    causal=True,
                    window=window,
                    sinks=s,
                    tree=tree,
                )


def check_all(recorder: Recorder, compiler: Compiler, jobs: int = os.cpu_count() or 1, report=print) -> list[str]:
    """Compile and check every recorded variant; the names of those that failed."""
    names = sorted(recorder.variants)

    def one(name):
        variant = recorder.variants[name]
        ok, log = compiler.check(variant.source)
        limits = launch_problems(variant)
        return name, ok and not limits, "\n".join(limits + ([log] if log else []))

    failed = []
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for name, ok, log in pool.map(one, names):
            if not ok:
                failed.append(name)
                report(f"FAILED {name}")
                report("\n".join("    " + line for line in log.splitlines()[:40]))
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clang", default=None, help="the clang++ to use (default: clang++ or clang++-N on PATH)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilers run at once")
    ap.add_argument("--only", default=None, help="a regular expression: check only variants whose name matches")
    ap.add_argument("--list", action="store_true", help="print every variant's name (those --only picks) and stop")
    ap.add_argument(
        "--std",
        default="c++17",
        help="the C++ standard (Metal 4 is C++17; Metal 3.1-3.2, which MLX uses on macOS 14-15, is C++14)",
    )
    ap.add_argument("--dump", default=None, help="a directory: write each variant's lowered C++ there")
    args = ap.parse_args()
    clang = args.clang or find_clang()
    if not clang:
        raise SystemExit("no clang++ on PATH: install clang (apt-get install -y clang) or pass --clang.")
    recorder = Recorder()
    record_all(recorder)
    if args.only:
        recorder.variants = {n: v for n, v in recorder.variants.items() if re.search(args.only, n)}
    checked = Recorder()  # what the self-checks build: the rest is first built mid-decode
    record_all(checked, decoding=False)
    beyond = set(recorder.variants) - set(checked.variants)
    if args.list:
        for name, v in sorted(recorder.variants.items()):
            print(name, f"{len(v.launches)} launch shapes", "(decoding only)" if name in beyond else "(self-check)")
        return
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for name, v in recorder.variants.items():
            with open(os.path.join(args.dump, name + ".cpp"), "w") as f:
                f.write(lower(v.source)[0])
    compiler = Compiler(clang, std=args.std)
    try:
        failed = check_all(recorder, compiler, args.jobs)
    finally:
        compiler.close()
    n = len(recorder.variants)
    launches = sum(len(v.launches) for v in recorder.variants.values())
    if failed:
        print(f"{len(failed)} of {n} Metal variants failed: {', '.join(failed)}")
        sys.exit(1)
    print(
        f"{n} Metal variants compiled ({len(beyond & set(recorder.variants))} of them beyond the self-checks' "
        f"cases; {launches} launch shapes), all within limits ({os.path.basename(clang)} -std={args.std}, "
        "scripts/metal_stub.h)"
    )


if __name__ == "__main__":
    main()
