"""A verify block's rows times a weight matrix in one kernel launch (CUDA).

A verify multiplies a few rows (the block, 2-16) by every weight matrix of
the target. MLX's CUDA backend sends such a product to cuBLASLt, and each one
costs the host 20-40 us to launch (descriptors made, an algorithm looked up,
the call captured into the graph: benchmarks/host_cost.py), against ~10 us
for a one-row product, which MLX's own matrix-vector kernel does. A cycle at
real model sizes is bound by the host, with four products a layer over 36
layers, so this kernel does a block's product as one plain kernel launch, on
the matrix units (m16n8k16, float32 accumulators): a warp computes one or
two 8-column tiles for all 16 rows over an interleaved part of K, and a
block's warps add their parts in a fixed order. H100, Qwen3-8B shapes, 16
rows, bf16: launch 15-22 us against 21-43 us (benchmarks/block_products.py);
device time 166 us a layer against cuBLASLt's 162 (Nsight Compute, see
SHAPE below).

Its sums run over K in another order than cuBLAS's, so the results differ in
the last bits, as any two products' do (the self-check's error is ~3e-3 of the
largest element in bf16, the same as cuBLAS's against MLX's one-row kernel).

bf16 and fp16 on CUDA; float32 (which matrix units would round), Metal
(whose products launch cheaply), the CPU, quantized layers, other row counts
and training (a custom kernel has no gradient: callers keep their modules
there) keep MLX's own product. The kernel is used after matching MLX's
product on random cases in this process (``prepare``, outside any compiled
trace).

    y = apply_linear(module, x)   # module(x) for an nn.Linear, x [..., K]
    a = apply_linear_swiglu(gate_up, x)  # swiglu(gate, up) of a fused gate/up product, one launch

A fused gate/up product can take mlx-lm's SwiGLU as its epilogue (version 8:
a launch a layer fewer), after a check of its own: where that fails, the
products keep the kernel and the SwiGLU its own launch. On an H100 (session
16) it checked out and reads a Qwen3-8B layer's 201 MB gate/up weight in
~78 us of device time; ``--products mlx`` in the benchmarks turns it off with
the products.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings

import mlx.core as mx
from mlx_lm.models.activations import swiglu

from ..attention import make_factory
from ..attention_source import HEADER
from ..dispatch import CheckResult, backend, compare_with_ops
from ..launch_source import compacting
from .products_source import BODY, MMA_HEADER, VERSION

MOST_ROWS = 16  # one matrix-unit tile's rows
DTYPES = (mx.bfloat16, mx.float16)
MMA = {mx.bfloat16: "bf16", mx.float16: "f16"}
# Launch shapes: (8-column tiles per warp, warps per block over interleaved parts
# of K, steps of loads in flight per warp). Device time on an H100, 16 rows,
# bf16, under Nsight Compute (BENCHMARKS.md, session 13), microseconds,
# cuBLASLt's in brackets: q/k/v 6144x4096 23.6 (23.1), o (measured at
# 4104x4096) 18.4 (21.3 with its split-K reduction), gate/up 24576x4096 79.6
# (74.6) with SHAPE; down 4096x12288 44.4 (42.8) with LONG_K_SHAPE, 47.7 with
# SHAPE. (The first shape tried, (2, 4, 1), ran down at ~150.)
SHAPE = (1, 8, 8)
# Weights of WIDE elements or more (Qwen3-8B's q/k/v and o): two tiles a warp, four
# loads ahead. Session 17 (H100, Nsight Compute, 16 rows): q/k/v 29.1 -> 25.5 us, o
# 19.3 -> 16.5; a Qwen3-8B block-16 cycle after 1k tokens 10.03 / 10.08 -> 9.76 / 9.77
# ms on the wall clock (cycle.py --products kernel,kernel@2x8x4). The built-in pair's
# products (under 1M elements) ran 1.70 -> 1.77 ms a cycle with it, so small ones keep
# SHAPE; sizes between were not measured.
WIDE_SHAPE = (2, 8, 4)
WIDE = 1 << 24
LONG_K_SHAPE = (2, 16, 4)  # where K >= LONG_K and K >= 2 N
LONG_K = 8192
# A gate/up product with SwiGLU as its epilogue: a warp's two tiles are the same 8
# columns of gate and of up (as many loads in flight a warp as SHAPE's; 76-78 us of device
# time for a Qwen3-8B gate/up on an H100, other shapes not yet compared on the device).
SWIGLU_SHAPE = (2, 8, 4)
NORMS_IN_PRODUCTS = True  # (benchmarks turn it off to measure what it saves)


class BlockProductKernel:
    """The CUDA kernel (block_products_source.py), compiled by MLX per
    dtype, launch shape, bias, residual, heads and SwiGLU."""

    def __init__(self, backend_name: str, factory=None, shape: tuple[int, int, int] | None = None):
        if backend_name != "cuda":
            raise ValueError("the block-product kernel is CUDA's (MLX's Metal products launch cheaply)")
        factory = compacting(factory or make_factory(backend_name), backend_name)
        self.kernels = {
            dtype: factory(
                name=f"dflash_block_product_{MMA[dtype]}_v{VERSION}",
                input_names=["x", "w", "b", "r", "nw"],
                output_names=["y"],
                source=BODY,
                header=HEADER[backend_name] + MMA_HEADER[MMA[dtype]],
            )
            for dtype in DTYPES
        }
        self.shape = shape  # None: launch_shape's choice per product (benchmarks fix one; SwiGLU keeps 2 tiles)
        self._none = {dtype: mx.zeros((1,), dtype) for dtype in DTYPES}  # (an absent bias or residual)

    def __call__(
        self,
        x: mx.array,
        weight: mx.array,
        bias: mx.array | None = None,
        residual: mx.array | None = None,
        heads: bool = False,
        swiglu: bool = False,
        norm: tuple[mx.array, float] | None = None,
    ) -> mx.array:
        """residual + (x @ weight.T + bias), x [..., K] with 2-16 rows; the
        bias and the residual [..., N] optional. ``heads``: x is an
        attention's output [1, heads, rows, D], multiplied as its rows
        [1, rows, heads * D] (the output [1, rows, N]). ``swiglu``: weight
        is a fused gate/up [2 N, K] (no bias, no residual) and the output
        [..., N] is silu(gate) * up. ``norm``: (weight [K], eps) of an
        RMSNorm that x goes through first (not with ``heads``)."""
        if heads:
            _, h, rows, d = x.shape
            lead, k, x = (1, rows), h * d, x.reshape(h, rows, d)
        else:
            *lead, k = x.shape
            rows = x.size // k
            x = x.reshape(rows, k)
        if swiglu and (bias is not None or residual is not None or heads or weight.shape[0] % 2):
            raise ValueError(
                "the SwiGLU epilogue takes a fused gate/up weight (an even number of rows) with no "
                "bias, residual or heads."
            )
        if norm is not None and (heads or norm[0].shape != (k,)):
            raise ValueError("a norm in the product's launch takes rows (not heads) and a weight of their length.")
        n = weight.shape[0] // 2 if swiglu else weight.shape[0]
        if swiglu:
            tiles, split, ahead = (2, *self.shape[1:]) if self.shape else SWIGLU_SHAPE
        else:
            tiles, split, ahead = self.shape or launch_shape(n, k)
        none = self._none[x.dtype]
        (y,) = self.kernels[x.dtype](
            inputs=[
                x,
                weight,
                none if bias is None else bias,
                none if residual is None else residual.reshape(rows, n),
                none if norm is None else norm[0],
            ],
            template=[
                ("T", x.dtype),
                ("NT", tiles),
                ("KW", split),
                ("U", ahead),
                ("HEADS", heads),
                ("HAS_BIAS", bias is not None),
                ("HAS_RESIDUAL", residual is not None),
                ("SWIGLU", swiglu),
                ("HAS_NORM", norm is not None),
                ("EPS_BITS", 0 if norm is None else float_bits(norm[1])),
            ],
            grid=(-(-n // (8 * (1 if swiglu else tiles))) * 32 * split, 1, 1),
            threadgroup=(32 * split, 1, 1),
            output_shapes=[(rows, n)],
            output_dtypes=[x.dtype],
        )
        return y.reshape(*lead, n)


def float_bits(value: float) -> int:
    """A float32's bits as a signed int (how a template constant carries it)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def launch_shape(n: int, k: int) -> tuple[int, int, int]:
    """The launch shape for an [N, K] weight: LONG_K_SHAPE for down-shaped
    ones, WIDE_SHAPE for large ones, else SHAPE."""
    if k >= LONG_K and k >= 2 * n:
        return LONG_K_SHAPE
    return WIDE_SHAPE if n * k >= WIDE else SHAPE


def fits(lead: tuple, k: int, dtype, weight: mx.array, bias: mx.array | None, residual: mx.array | None) -> bool:
    """Whether the kernel takes the product of rows [*lead, k] of ``dtype``:
    2-16 rows of bf16 or fp16, a 2-D weight (and a bias, if any) of the same
    dtype, K a multiple of 32, a residual (if any) of the output's shape and
    dtype."""
    n = weight.shape[0]
    return (
        2 <= math.prod(lead) <= MOST_ROWS
        and dtype in DTYPES
        and weight.ndim == 2
        and weight.shape[1] == k
        and weight.dtype == dtype
        and k % 32 == 0
        and (bias is None or (bias.shape == (n,) and bias.dtype == dtype))
        and (residual is None or (residual.shape == (*lead, n) and residual.dtype == dtype))
    )


BUILDERS = {"cuda": BlockProductKernel}
_kernels: dict[str, BlockProductKernel] = {}
_checks: dict[tuple, CheckResult] = {}
_ready: dict[tuple, BlockProductKernel] = {}  # (backend, dtype) -> the kernel, where it passed its check
_swiglu_passed: set[tuple] = set()  # (backend, dtype) where the SwiGLU epilogue passed its own check too
_norm_passed: set[tuple] = set()  # (backend, dtype) where a norm in the products' launch passed its check too


def reset() -> None:
    _kernels.clear()
    _checks.clear()
    _ready.clear()
    _swiglu_passed.clear()
    _norm_passed.clear()


def prepare(dtype) -> None:
    """Check this backend's kernel for ``dtype`` once, so that
    ``apply_linear`` may use it (call it outside compiled traces: the check
    reads results back; the traces then only read what it decided)."""
    where = backend()
    if where not in BUILDERS or dtype not in DTYPES:
        return
    key = (where, dtype)
    if key not in _checks:
        result = _checks[key] = self_check(where, dtype)
        if result.ok:
            _ready[key] = _kernels[where]
        else:
            warnings.warn(
                f"dflash_mlx: the {where} {result.dtype} block-product kernel failed its self-check "
                f"({result.detail}); using MLX's matrix products instead.",
                RuntimeWarning,
                stacklevel=3,
            )
    # the SwiGLU epilogue and the RMSNorm prologue, each checked on its own (the prologue with the
    # SwiGLU where that passed): where one fails, the products keep the kernel and it its own launch
    _check_part(
        key,
        "swiglu",
        "SwiGLU epilogue",
        "a gate/up product's SwiGLU stays a launch of its own",
        _swiglu_passed,
        swiglu=True,
    )
    _check_part(
        key,
        "norm",
        "RMSNorm prologue",
        "a layer's norms stay launches of their own",
        _norm_passed,
        norm=True,
        swiglu=key in _swiglu_passed,
    )


def _check_part(key: tuple, part: str, name: str, otherwise: str, passed_set: set, **check) -> None:
    """Check a part of the kernel (``self_check(..., **check)``) once for a
    (backend, dtype) ``key`` whose products passed, adding ``key`` to
    ``passed_set`` where it does, warning once (``name`` failed: ``otherwise``)
    where it does not."""
    if key not in _ready or key + (part,) in _checks:
        return
    where, dtype = key
    result = _checks[key + (part,)] = self_check(where, dtype, **check)
    if result.ok:
        passed_set.add(key)
    else:
        warnings.warn(
            f"dflash_mlx: the {where} {result.dtype} block-product kernel's {name} failed its self-check "
            f"({result.detail}); {otherwise}.",
            RuntimeWarning,
            stacklevel=4,
        )


def self_check_all(report=None) -> list[CheckResult]:
    """Check every dtype on this backend (for `dflash-mlx doctor`: the
    products', then their SwiGLU epilogue's, named "<dtype> + SwiGLU", then
    their RMSNorm prologue's, "<dtype> + RMSNorm"); []
    where the kernel does not run (Metal, the CPU). ``report(result)``, where
    given, hears each result as soon as it is known."""
    where = backend()
    results = []
    for dtype in DTYPES:
        prepare(dtype)
        for key in ((where, dtype), (where, dtype, "swiglu"), (where, dtype, "norm")):
            if key in _checks:
                result = _checks[key]
                if len(key) == 3:
                    part = {"swiglu": "SwiGLU", "norm": "RMSNorm"}[key[2]]
                    result = dataclasses.replace(result, dtype=f"{result.dtype} + {part}")
                results.append(result)
                if report is not None:
                    report(result)
    return results


def swiglu_passed(dtype) -> bool:
    """Whether the SwiGLU epilogue passed its check for ``dtype`` here."""
    return (backend(), dtype) in _swiglu_passed


def norm_passed(dtype) -> bool:
    """Whether the RMSNorm prologue passed its check for ``dtype`` here."""
    return NORMS_IN_PRODUCTS and (backend(), dtype) in _norm_passed


def passed(dtype) -> BlockProductKernel | None:
    """The kernel if ``dtype``'s variant passed its check on the backend MLX
    computes on now; never checks (it runs for every product: ~0.4 us)."""
    return _ready.get((backend(), dtype))


def self_check(where: str, dtype, swiglu: bool = False, norm: bool = False) -> CheckResult:
    """The kernel against ``reference`` on ``check_cases`` (``swiglu``: its
    SwiGLU epilogue against ``reference_swiglu`` on ``swiglu_check_cases``;
    ``norm``: its RMSNorm prologue on ``norm_check_cases``, with the SwiGLU's
    cases too where ``swiglu``)."""

    def outputs(kernel):
        for x, w, bias, residual, heads in check_cases(dtype):
            yield kernel(x, w, bias, residual, heads), reference(x, w, bias, residual, heads)

    def swiglu_outputs(kernel):
        for x, w in swiglu_check_cases(dtype):
            yield kernel(x, w, swiglu=True), reference_swiglu(x, w)

    def norm_outputs(kernel):
        for x, w, bias, residual, (nw, eps), fused_swiglu in norm_check_cases(dtype, swiglu):
            normed = mx.fast.rms_norm(x, nw, eps)
            if fused_swiglu:
                yield kernel(x, w, swiglu=True, norm=(nw, eps)), reference_swiglu(normed, w)
            else:
                yield kernel(x, w, bias, residual, norm=(nw, eps)), reference(normed, w, bias, residual)

    chosen = norm_outputs if norm else swiglu_outputs if swiglu else outputs
    return compare_with_ops(where, dtype, 0, False, _kernels, BUILDERS, chosen)


def norm_check_cases(dtype, swiglu: bool):
    """(x, weight, bias, residual, (norm weight, eps), as a SwiGLU): rows of
    a hidden state's spread (rows of different scales: the rsqrt is per row)
    through an RMSNorm with weights around 1, for 2-16 rows, K under one pass
    and over several, a bias and a residual, the norm weight off a 16-byte
    boundary (and so read as 2-byte elements), and the SwiGLU epilogue."""
    n = 100
    for k, eps in ((96, 1e-6), (256, 1e-6), (4096, 1e-5)):  # (96: lanes with no part of a row)
        # (K ** -0.5: gate and up of normed rows O(1), where the sigmoid is not saturated)
        whole = (k**-0.5 * mx.random.normal((4 * n, k), key=mx.random.key(30 + k))).astype(dtype)
        nw = (1 + 0.5 * mx.random.normal((k,), key=mx.random.key(31 + k))).astype(dtype)
        for rows in (2, 9, 16):
            scales = mx.exp(2 * mx.random.normal((1, rows, 1), key=mx.random.key(400 + rows)))
            x = (scales * mx.random.normal((1, rows, k), key=mx.random.key(410 + rows))).astype(dtype)
            yield x, whole[n : 2 * n], None, None, (nw, eps), False
            if swiglu:
                yield x, whole[2 * n : 4 * n], None, None, (nw, eps), True
    k = 512
    flat = (1 + 0.5 * mx.random.normal((k + 8,), key=mx.random.key(32))).astype(dtype)
    x = (8 * mx.random.normal((1, 5, k), key=mx.random.key(33))).astype(dtype)
    w = mx.random.normal((n, k), key=mx.random.key(34)).astype(dtype)
    bias = mx.random.normal((n,), key=mx.random.key(35)).astype(dtype)
    residual = (8 * mx.random.normal((1, 5, n), key=mx.random.key(36))).astype(dtype)
    yield x, w, bias, residual, (flat[3 : 3 + k], 1e-6), False


def reference_swiglu(x: mx.array, weight: mx.array) -> mx.array:
    """What the SwiGLU epilogue computes: ``reference``'s product of a fused
    gate/up weight, split, then mlx-lm's ``swiglu`` by MLX's ops."""
    gate, up = mx.split(reference(x, weight), 2, axis=-1)
    return swiglu(gate, up)


def swiglu_check_cases(dtype):
    """(x, a fused gate/up weight) for 2-16 rows, K under one pass of the
    loop and over several, 100 columns a half (the last tile half full; 37
    once: odd), the weight rows of a larger matrix and off a 16-byte
    boundary. x is scaled by K ** -0.5 so that gate and up are O(1), where
    the sigmoid is not saturated: a wrong activation (relu, another slope)
    fails the check there, where it passed at products of spread sqrt(K)."""
    n = 100
    for k in (96, 4096):
        whole = mx.random.normal((5 * n, k), key=mx.random.key(20 + k)).astype(dtype)
        w = whole[n : 3 * n]
        for rows in (2, 9, 16):
            yield (k**-0.5 * mx.random.normal((1, rows, k), key=mx.random.key(300 + rows))).astype(dtype), w
    k = 512
    flat = mx.random.normal((2 * n * k + 8,), key=mx.random.key(21)).astype(dtype)
    x = (k**-0.5 * mx.random.normal((1, 5, k), key=mx.random.key(22))).astype(dtype)
    yield x, flat[3 : 3 + 2 * n * k].reshape(2 * n, k)
    yield x, flat[3 : 3 + 2 * 37 * k].reshape(2 * 37, k)


def reference(
    x: mx.array, weight: mx.array, bias: mx.array | None = None, residual: mx.array | None = None, heads: bool = False
) -> mx.array:
    """What the kernel computes, by MLX's ops: the product in float32 (on
    float32 copies: MLX's CUDA backend hands a bf16/fp16 product to cuBLASLt,
    which fails on a view off a 16-byte boundary, as some check cases are),
    rounded to the dtype once, then the residual added and rounded."""
    if heads:
        x = x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
    y = x.astype(mx.float32) @ weight.astype(mx.float32).T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    y = y.astype(x.dtype)
    return y if residual is None else residual + y


def check_cases(dtype):
    """(x, weight, bias, residual, heads) for 2-16 rows over the K and N its
    loops and launch shapes split differently, views off a 16-byte boundary,
    a bias, a residual, and an attention's output read by heads."""
    # K: 96 (3 steps, most warps idle), 512 (under one pass of SHAPE's loop), 4096
    # (two passes), LONG_K (LONG_K_SHAPE); N = 100 (the last 8-column tile half full)
    n = 100
    for k in (96, 512, 4096, LONG_K):
        whole = mx.random.normal((3 * n, k), key=mx.random.key(k)).astype(dtype)
        w = whole[n : 2 * n]  # (rows of a larger matrix, as fused projections are)
        for rows in (2, 3, 8, 13, 16):
            yield mx.random.normal((1, rows, k), key=mx.random.key(100 + rows)).astype(dtype), w, None, None, False
    # a weight of WIDE elements and more (WIDE_SHAPE), the second tile of its last two half full
    wide = mx.random.normal((WIDE // 4096 + 12, 4096), key=mx.random.key(12)).astype(dtype)
    for rows in (3, 16):
        yield mx.random.normal((1, rows, 4096), key=mx.random.key(120 + rows)).astype(dtype), wide, None, None, False
    k = 512
    flat = mx.random.normal((17 * k + 2 * n * k,), key=mx.random.key(7)).astype(dtype)
    x = flat[3 : 3 + 9 * k].reshape(1, 9, k)
    w = flat[5 + 9 * k : 5 + 9 * k + n * k].reshape(n, k)
    bias = mx.random.normal((n,), key=mx.random.key(8)).astype(dtype)
    residual = (8 * mx.random.normal((1, 9, n), key=mx.random.key(9))).astype(dtype)
    yield x, w, None, None, False
    yield x, w, bias, None, False
    yield x, w, None, residual, False
    yield x, w, bias, residual, False
    # [1, heads, rows, D]: 8 heads of 64 and 4 of 128 (K 512), 3 rows (a residual, the weight off
    # a 16-byte boundary as above) and 16 rows (an aligned weight)
    aligned = mx.random.normal((n, k), key=mx.random.key(10)).astype(dtype)
    for h, d in ((8, 64), (4, 128)):
        for rows in (3, 16):
            out = mx.random.normal((1, h, rows, d), key=mx.random.key(200 + h + rows)).astype(dtype)
            if rows == 3:
                yield out, w, None, (8 * mx.random.normal((1, rows, n), key=mx.random.key(11))).astype(dtype), True
            else:
                yield out, aligned, None, None, True
