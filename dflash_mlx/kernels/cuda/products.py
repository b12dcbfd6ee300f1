"""A verify block's rows times a weight matrix in one kernel launch (CUDA).

MLX's CUDA backend sends a product of a few rows to cuBLASLt, whose launch
costs the host far more than a plain kernel's, and a verify's cycle is bound
by its launches. This kernel does 2-16 rows on the matrix units, optionally
with an RMSNorm prologue and a bias, residual or SwiGLU epilogue. Its sums run
over K in another order than cuBLAS's (last-bit differences, as between any
two products), so it takes only what the exact verify product
(kernels/exact_products.py) does not, where no order can match MLX's one-row
product anyway; each part is used only after matching MLX's ops here (in this
process or an earlier one: passed_checks.py)."""

from __future__ import annotations

import math
import struct

import mlx.core as mx
from mlx_lm.models.activations import swiglu

from .. import passed_checks
from ..attention import make_factory, unread_input
from ..attention_source import HEADER
from ..dispatch import CheckResult, backend, compare_with_ops
from ..launch_source import compacting
from ..serving import check_once
from .products_source import BODY, MMA_HEADER, VERSION

MOST_ROWS = 16  # one matrix-unit tile's rows
DTYPES = (mx.bfloat16, mx.float16)
MMA = {mx.bfloat16: "bf16", mx.float16: "f16"}
# Launch shapes: (8-column tiles per warp, warps per block over interleaved
# parts of K, steps of loads in flight per warp).
SHAPE = (1, 8, 8)
WIDE_SHAPE = (2, 8, 4)  # weights of WIDE elements or more
WIDE = 1 << 24
LONG_K_SHAPE = (2, 16, 4)  # where K >= LONG_K and K >= 2 N
LONG_K = 8192
# SwiGLU: a warp's two tiles are the same 8 columns of gate and of up
SWIGLU_SHAPE = (2, 8, 4)


class BlockProductKernel:
    """The CUDA kernel (products_source.py), one per dtype."""

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
        self.shape = shape
        self._none = {dtype: unread_input(1, dtype) for dtype in DTYPES}  # (an absent bias or residual)

    def __call__(
        self,
        x: mx.array,
        weight: mx.array,
        bias: mx.array | None = None,
        residual: mx.array | None = None,
        *,
        heads: bool = False,
        swiglu: bool = False,
        norm: tuple[mx.array, float] | None = None,
    ) -> mx.array:
        """residual + (x @ weight.T + bias) for x [..., K] of 2-16 rows.

        Args:
            heads: x is an attention's output [1, heads, rows, D], read as
                its rows [1, rows, heads * D].
            swiglu: weight is a fused gate/up [2 N, K]; returns silu(gate) * up.
            norm: (weight [K], eps) of an RMSNorm applied to x first.
        """
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
    """The launch shape for an [N, K] weight."""
    if k >= LONG_K and k >= 2 * n:
        return LONG_K_SHAPE
    return WIDE_SHAPE if n * k >= WIDE else SHAPE


def fits(lead: tuple, k: int, dtype, weight: mx.array, bias: mx.array | None, residual: mx.array | None) -> bool:
    """Whether the kernel takes this product of rows [*lead, k]."""
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
# (backend, dtype) -> the kernel, and the keys whose SwiGLU or norm also passed
_ready: dict[tuple, BlockProductKernel] = {}
_swiglu_passed: set[tuple] = set()
_norm_passed: set[tuple] = set()


def reset() -> None:
    _kernels.clear()
    _checks.clear()
    _ready.clear()
    _swiglu_passed.clear()
    _norm_passed.clear()


def prepare(dtype) -> None:
    """Check this backend's kernel for ``dtype`` once, outside compiled traces."""
    where = backend()
    if where not in BUILDERS or dtype not in DTYPES:
        return
    key = (where, dtype)
    result = check_once(
        _checks,
        key,
        lambda: self_check(where, dtype),
        lambda r: (
            f"dflash_mlx: the {where} {r.dtype} block-product kernel failed its self-check "
            f"({r.detail}); using MLX's matrix products instead."
        ),
        kernel="block product",
    )
    if result.ok:
        _ready[key] = _kernels[where]
    # where a part fails, the products keep the kernel and that part its own launch
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
    """Check a part of the kernel once for a ``key`` whose products passed."""
    if key not in _ready:
        return
    where, dtype = key
    # (named by the check's options: the norm's covers a fused SwiGLU only where that passed)
    kernel = " ".join(["block product", *sorted(option for option, on in check.items() if on)])
    result = check_once(
        _checks,
        key + (part,),
        lambda: self_check(where, dtype, **check),
        lambda r: (
            f"dflash_mlx: the {where} {r.dtype} block-product kernel's {name} failed its self-check "
            f"({r.detail}); {otherwise}."
        ),
        kernel=kernel,
    )
    if result.ok:
        passed_set.add(key)


def self_check_all(report=None) -> list[CheckResult]:
    """Check every dtype and part here (for `dflash-mlx doctor`); [] where it does not run."""
    where = backend()
    results = []
    for dtype in DTYPES:
        prepare(dtype)
        for key in ((where, dtype), (where, dtype, "swiglu"), (where, dtype, "norm")):
            if key in _checks:
                result = _checks[key]
                if len(key) == 3:
                    part = {"swiglu": "SwiGLU", "norm": "RMSNorm"}[key[2]]
                    result = passed_checks.replaced(result, dtype=f"{result.dtype} + {part}")
                results.append(result)
                if report is not None:
                    report(result)
    return results


def swiglu_passed(dtype) -> bool:
    """Whether the SwiGLU epilogue passed its check for ``dtype`` here."""
    return (backend(), dtype) in _swiglu_passed


def norm_passed(dtype) -> bool:
    """Whether the RMSNorm prologue passed its check for ``dtype`` here."""
    return (backend(), dtype) in _norm_passed


def passed(dtype) -> BlockProductKernel | None:
    """The kernel if ``dtype``'s variant passed its check here; never checks."""
    return _ready.get((backend(), dtype))


def self_check(where: str, dtype, swiglu: bool = False, norm: bool = False) -> CheckResult:
    """The kernel against MLX's ops: its products, SwiGLU epilogue or RMSNorm prologue."""

    def outputs(kernel):
        for x, w, bias, residual, heads in check_cases(dtype):
            yield kernel(x, w, bias, residual, heads=heads), reference(x, w, bias, residual, heads)

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
    return compare_with_ops(where, dtype, 0, False, kernels=_kernels, builders=BUILDERS, outputs=chosen)


def norm_check_cases(dtype, swiglu: bool):
    """RMSNorm prologue cases: rows of different scales, short and long K, an unaligned norm weight."""
    n = 100
    for k, eps in ((96, 1e-6), (256, 1e-6), (4096, 1e-5)):
        # (K ** -0.5: gate and up O(1), where the sigmoid is not saturated)
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
    """What the SwiGLU epilogue computes, by MLX's ops."""
    gate, up = mx.split(reference(x, weight), 2, axis=-1)
    return swiglu(gate, up)


def swiglu_check_cases(dtype):
    """(x, a fused gate/up weight): partial last tiles, weights off a 16-byte
    boundary. x is scaled by K ** -0.5 so that gate and up are O(1), where a
    wrong activation would fail the check (a saturated sigmoid would hide it)."""
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
    """What the kernel computes, by MLX's ops: the product in float32, rounded
    once, then the residual added and rounded. (float32 copies: cuBLASLt
    fails on bf16/fp16 views off a 16-byte boundary, as some cases are.)"""
    if heads:
        x = x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
    y = x.astype(mx.float32) @ weight.astype(mx.float32).T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    y = y.astype(x.dtype)
    return y if residual is None else residual + y


def check_cases(dtype):
    """(x, weight, bias, residual, heads) over every launch shape, unaligned views and heads."""
    # K: most warps idle, one pass, two passes, LONG_K_SHAPE; N = 100: the last tile half full
    n = 100
    for k in (96, 512, 4096, LONG_K):
        whole = mx.random.normal((3 * n, k), key=mx.random.key(k)).astype(dtype)
        w = whole[n : 2 * n]
        for rows in (2, 3, 8, 13, 16):
            yield mx.random.normal((1, rows, k), key=mx.random.key(100 + rows)).astype(dtype), w, None, None, False
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
    # [1, heads, rows, D]: with a residual and an unaligned weight, then aligned
    aligned = mx.random.normal((n, k), key=mx.random.key(10)).astype(dtype)
    for h, d in ((8, 64), (4, 128)):
        for rows in (3, 16):
            out = mx.random.normal((1, h, rows, d), key=mx.random.key(200 + h + rows)).astype(dtype)
            if rows == 3:
                yield out, w, None, (8 * mx.random.normal((1, rows, n), key=mx.random.key(11))).astype(dtype), True
            else:
                yield out, aligned, None, None, True
