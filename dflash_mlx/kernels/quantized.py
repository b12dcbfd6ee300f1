"""A verify's quantized products: 2-32 rows times an ``nn.QuantizedLinear``'s
weight, each row bit for bit what MLX's one-row product computes (Metal, CUDA).

A plain step multiplies one row by each weight; a verify multiplies its block
(2-16 rows, a draft tree up to 32). MLX's product of a few rows costs far more
than one row's on a Mac, and rounds differently, so a greedy verify could pick
another token than the plain step at a near-tie. This kernel
(quantized_source.py) reads each weight once for all the rows, dequantizes it
in registers, and reduces each row in the one-row kernel's own order.

Which (dtype, mode, bits, group, K, N class) a machine serves with it is
decided once, outside compiled traces (``prepare``): its rows must equal
``mx.quantized_matmul`` of each row alone, bit for bit, on random cases of
that K and N class and of every row tile; a failure keeps MLX's product for
that variant, with one warning. A variant that checked out serves a layer's
shape on Metal wherever it checked out (exactness first), elsewhere only
where this machine measured it faster than MLX's product at a verify's rows
(decisions.serves_exact); elsewhere MLX's few-row product runs, which
may round otherwise. Affine weights of 4 or 8 bits in groups of
32/64/128 and mxfp4 (gpt-oss), bf16 or fp16 activations, N a multiple of 8
and K whole groups (not 64 or 128, where Metal's one row takes ``qmv_quad``).
The CPU never runs it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..device import backend
from .attention import make_factory, unread_input
from .launch_source import compacting
from .quantized_source import HEADER, INPUTS, OUTPUTS, SIMD, VERSION, source
from .serving import CheckedVariants, checked_here, first_exact

DTYPES = (mx.bfloat16, mx.float16)
AFFINE_BITS = (4, 8)
GROUPS = (32, 64, 128)
FEWEST_ROWS, MOST_ROWS = 2, 32
# On sm90 MLX's one-row product takes its qmv kernel only up to this N and K.
WIDE = 16384
# Rows a self-check runs: one case of each row tile (tile()), over weights of N
# taking each tile's most outputs a simdgroup and each fewer (N of 32 k, 16 mod
# 32 and 8 mod 16: every tile a weight's N takes; past WIDE alike).
CHECK_ROWS = (3, 8, 13, 27)
CHECK_N = (64, 80, 72)
CHECK_WIDE_N = (WIDE + 32, WIDE + 16, WIDE + 24)
# N of the check scripts' launches: each tile's most outputs a simdgroup and every fewer one.
RECORDED_N = (32, 16, 8)


@dataclass(frozen=True)
class Variant:
    """What one self-check covers: a module's product at any 2-32 rows."""

    dtype: mx.Dtype
    mode: str
    bits: int
    group: int
    k: int
    wide: bool  # N or K past WIDE

    @property
    def case(self) -> str:
        dtype = str(self.dtype).split(".")[-1]
        quant = "mxfp4" if self.mode == "mxfp4" else f"affine {self.bits}-bit group {self.group}"
        return f"{dtype} {quant} K={self.k}" + (" wide" if self.wide else "")


@dataclass
class QuantizedCheck:
    backend: str
    variant: Variant
    ok: bool
    detail: str
    fused: bool = False  # the dequantization in one rounding matched (CUDA)

    @property
    def case(self) -> str:
        return f"{self.backend} {self.variant.case}"


def packs(k: int, bits: int, backend_name: str, fp_gather: bool = False) -> int:
    """uint32 words of weights a lane takes a step, as the backend's one-row
    kernel does: on CUDA 2 (qmv), 4 for an mxfp4 expert's row (``fp_gather``:
    fp_gather_qmv); on Metal 2 where K is whole blocks of them (qmv_fast), else 1 (qmv)."""
    if backend_name != "metal":
        return 4 if fp_gather else 2
    return 2 if k % block_k(bits, 2) == 0 else 1


def block_k(bits: int, words: int) -> int:
    """K a simdgroup covers in one step of ``words`` words a lane."""
    return 32 * words * 32 // bits


# (most rows, x rows a threadgroup, outputs a simdgroup, simdgroups a
# threadgroup) by backend. The simdgroups of a threadgroup share its staged x
# rows; a simdgroup shares them among its outputs. Its accumulators (rows x
# outputs) must stay in registers: one float each on Metal (at most 64), 16
# values each on CUDA (qmv's per-lane sums; at most 16 accumulators: a verify
# in tiles of 4 rows, whose weights come from the cache after the first).
TILES = {
    "metal": ((4, 4, 8, 4), (8, 8, 4, 4), (16, 16, 4, 4), (32, 32, 2, 4)),
    "cuda": ((32, 4, 4, 8),),
}
# Threadgroup memory for a step's staged x rows: rows past it are staged in turns.
STAGED_BYTES = 16384


def tile(rows: int, backend_name: str, n: int = 0) -> tuple[int, int, int]:
    """(x rows a threadgroup, outputs a simdgroup, simdgroups a threadgroup) for
    ``rows`` rows of a weight of ``n`` outputs, whole threadgroups of them:
    fewer outputs a simdgroup, then fewer simdgroups, where ``n`` needs it (any
    n, 0, takes the most)."""
    tiles = TILES["metal" if backend_name == "metal" else "cuda"]
    mr, rs, groups = next((mr, rs, groups) for most, mr, rs, groups in tiles if rows <= most)
    while n % (groups * rs):
        rs, groups = (rs // 2, groups) if rs > 1 else (rs, groups // 2)
    return mr, rs, groups


def staged_rows(mr: int, k: int, bits: int, backend_name: str, fp_gather: bool = False) -> int:
    """x rows a threadgroup stages at a time: its tile's, or as many as STAGED_BYTES holds."""
    step = block_k(bits, packs(k, bits, backend_name, fp_gather))
    return min(mr, STAGED_BYTES // (2 * step))


class QuantizedProductKernel:
    """The kernel for one backend, compiled by MLX per (T, S, bits, group, mode, tile)."""

    NAME, INPUT_NAMES, GATHER = "dflash_quantized_product", INPUTS, False

    def __init__(self, backend_name: str, factory=None):
        self.backend = backend_name
        factory = compacting(factory or make_factory(backend_name), backend_name)
        # (the version in the name: MLX caches built kernels on disk by name, not by source)
        self.kernel = factory(
            name=f"{self.NAME}_v{VERSION}",
            input_names=self.INPUT_NAMES,
            output_names=OUTPUTS,
            source=source(backend_name, gather=self.GATHER),
            header=HEADER[backend_name],
        )
        self._no_biases = {dtype: unread_input(8, dtype) for dtype in DTYPES}  # (mxfp4's)

    def __call__(
        self,
        x: mx.array,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array | None,
        *,
        bits: int,
        group: int,
        mode: str,
        fused: bool = False,
        launch_tile: tuple[int, int, int] | None = None,
    ) -> mx.array:
        """x [..., K] of 2-32 rows times the quantized [N, K] weight: [..., N].
        ``fused``: CUDA's affine dequantization in one rounding (see quantized_source);
        ``launch_tile``: a tile other than tile()'s (benchmarks)."""
        *lead, k = x.shape
        rows = x.size // k
        n = weight.shape[0]
        inputs = [x.reshape(rows, k), weight, scales, self.biases(x.dtype, biases)]
        shape = dict(rows=rows, tile_rows=rows, n=n, k=k, bits=bits, group=group, mode=mode, fused=fused)
        return self.launch(inputs, x.dtype, scales.dtype, **shape, launch_tile=launch_tile).reshape(*lead, n)

    def biases(self, dtype, biases: mx.array | None) -> mx.array:
        return self._no_biases[dtype] if biases is None else biases

    def launch(
        self, inputs: list, dtype, scales_dtype, *, rows, tile_rows, n, k, bits, group, mode, fused, launch_tile=None
    ) -> mx.array:
        """The kernel over ``inputs`` for a [rows, n] result in ``dtype``, its
        tile chosen for ``tile_rows`` rows (``launch_tile``: another, for benchmarks)."""
        mr, rs, groups = launch_tile or tile(tile_rows, self.backend, n)
        # (on CUDA MLX's one-row gather of mxfp4 experts is fp_gather_qmv, not qmv: its own lanes)
        fp_gather = self.GATHER and mode == "mxfp4"
        sr = staged_rows(mr, k, bits, self.backend, fp_gather)
        if mr % sr or n % (groups * rs):
            raise ValueError(f"tile {mr}x{rs}x{groups} does not cover {n} outputs in whole turns of {sr} rows")
        (y,) = self.kernel(
            inputs=inputs,
            template=[
                ("T", dtype),
                ("S", scales_dtype),
                ("BITS", bits),
                ("GROUP", group),
                ("MXFP4", mode == "mxfp4"),
                ("PACKS", packs(k, bits, self.backend, fp_gather)),
                ("FUSED", fused and self.backend == "cuda" and mode == "affine"),
                ("MR", mr),
                ("RS", rs),
                ("GROUPS", groups),
                ("SR", sr),
            ],
            grid=(n // (groups * rs) * groups * SIMD, -(-rows // mr), 1),
            threadgroup=(groups * SIMD, 1, 1),
            output_shapes=[(rows, n)],
            output_dtypes=[dtype],
        )
        return y


def weight_format(module: nn.Module, dtype, ndim: int) -> Variant | None:
    """The variant a quantized module's weight (``ndim`` dims: [N, K] packed,
    or [experts, N, K]) takes for ``dtype`` rows, or None where its format,
    dtypes or sizes are none the kernel reads."""
    if dtype not in DTYPES or module.get("global_scale") is not None:
        return None
    weight, scales = module["weight"], module["scales"]
    biases = module.get("biases")
    mode, bits, group = module.mode, module.bits, module.group_size
    if weight.ndim != ndim or weight.dtype != mx.uint32 or scales.ndim != ndim:
        return None
    if mode == "affine":
        if bits not in AFFINE_BITS or group not in GROUPS or biases is None:
            return None
        if scales.dtype != dtype or biases.dtype != dtype or biases.shape != scales.shape:
            return None
    elif mode == "mxfp4":
        if bits != 4 or group != 32 or biases is not None or scales.dtype != mx.uint8:
            return None
    else:
        return None
    n, k = weight.shape[-2], weight.shape[-1] * 32 // bits
    if n % 8 or k % group or scales.shape != (*weight.shape[:-1], k // group):
        return None
    return Variant(dtype, mode, bits, group, k, n > WIDE or k > WIDE)


def variant_of(module: nn.Module, dtype) -> Variant | None:
    """The variant serving ``module``'s products of ``dtype`` rows, or None where the kernel never does."""
    if type(module) is not nn.QuantizedLinear:
        return None
    variant = weight_format(module, dtype, ndim=2)
    # Metal's one row takes qmv_quad at K 64 and 128, an order the kernel does not follow
    return None if variant is None or variant.k in (64, 128) else variant


BUILDERS = {"metal": QuantizedProductKernel, "cuda": QuantizedProductKernel}
_kernels: dict[str, QuantizedProductKernel] = {}
_variants = CheckedVariants("quantized verify product", "MLX's quantized_matmul", "quantized verify")
_checks: dict[tuple[str, Variant], QuantizedCheck] = _variants.checks
_shapes = _variants.shapes


def reset() -> None:
    _kernels.clear()
    _variants.clear()


def prepare(model: nn.Module, dtype) -> None:
    """Check the variant of every quantized linear layer in ``model`` once, and
    time each checked (variant, N) against MLX's product; call it outside compiled traces."""
    where = backend()
    if where not in BUILDERS:
        return
    for _, module in model.named_modules():
        variant = variant_of(module, dtype)
        if variant is None or not checked(where, variant).ok:
            continue
        runs = (
            lambda m, x: m(x),
            lambda m, x: product(m, x, measuring=True),
            lambda m, x, v=variant: one_row_layer(m, v, x),
        )
        _shapes.prepare((where, variant, module["weight"].shape[0]), module, runs, dtype)


def one_row_layer(module: nn.Module, variant: Variant, x: mx.array) -> mx.array:
    """``module(x)`` a row at a time through MLX's one-row product: a plain step's."""
    y = one_row_products(
        x, module["weight"], module["scales"], module.get("biases"), bits=variant.bits, group=variant.group,
        mode=variant.mode,
    )  # fmt: skip
    return y + module["bias"] if "bias" in module else y


def checked(where: str, variant: Variant) -> QuantizedCheck:
    """The variant's self-check on backend ``where``, run once (warning once where it fails)."""
    return _variants.checked(where, variant, lambda: self_check(where, variant))


def use_quantized_kernel(where: str, variant: Variant, n: int, rows: int) -> bool:
    """Whether ``rows`` rows of ``variant`` with ``n`` outputs take the kernel on
    backend ``where``: where it passed its self-check and serves that shape here."""
    return _variants.serves(where, variant, n, rows)


# The dequantizations a backend's check tries, in order (quantized_source: FUSED).
DEQUANTIZATIONS = {"cuda": (False, True)}


def product(module: nn.Module, x: mx.array, measuring: bool = False) -> mx.array | None:
    """``module(x)`` through the kernel for 2-32 rows of a checked variant that
    serves here (``measuring``: not asking), else None (the caller runs MLX's
    product); never checks."""
    if type(module) is not nn.QuantizedLinear or not FEWEST_ROWS <= x.size // x.shape[-1] <= MOST_ROWS:
        return None
    where = backend()
    if where not in BUILDERS:
        return None
    variant = variant_of(module, x.dtype)
    if variant is None or x.shape[-1] != variant.k:
        return None
    if not (measuring or use_quantized_kernel(where, variant, module["weight"].shape[0], x.size // x.shape[-1])):
        return None
    y = _kernels[where](
        x,
        module["weight"],
        module["scales"],
        module.get("biases"),
        bits=variant.bits,
        group=variant.group,
        mode=variant.mode,
        fused=_checks[(where, variant)].fused,
    )
    return y + module["bias"] if "bias" in module else y


def one_row_products(x: mx.array, weight, scales, biases, *, bits: int, group: int, mode: str) -> mx.array:
    """Each row of x [rows, K] through ``mx.quantized_matmul`` alone: what a plain step computes."""
    return mx.concatenate(
        [
            mx.quantized_matmul(
                x[i : i + 1], weight, scales, biases, transpose=True, group_size=group, bits=bits, mode=mode
            )
            for i in range(x.shape[0])
        ]
    )


def check_cases(variant: Variant):
    """(x, weight, scales, biases): a weight of the variant's K and N class, and
    rows of every tile (partial ones too)."""
    for n in CHECK_WIDE_N if variant.wide else CHECK_N:
        w = mx.random.normal((n, variant.k), key=mx.random.key(variant.k + variant.bits + variant.group + n))
        w = (variant.k**-0.5 * w).astype(variant.dtype)
        quantized = mx.quantize(w, group_size=variant.group, bits=variant.bits, mode=variant.mode)
        weight, scales = quantized[0], quantized[1]
        biases = quantized[2] if variant.mode == "affine" else None
        for rows in CHECK_ROWS:
            x = mx.random.normal((rows, variant.k), key=mx.random.key(1000 * rows + variant.k)).astype(variant.dtype)
            yield x, weight, scales, biases


def self_check(where: str, variant: Variant) -> QuantizedCheck:
    """The kernel's rows against MLX's one-row products of the same rows, bit for bit."""

    def outputs(kernel, fused: bool):
        quant = dict(bits=variant.bits, group=variant.group, mode=variant.mode)
        for x, weight, scales, biases in check_cases(variant):
            got = kernel(x, weight, scales, biases, **quant, fused=fused)
            yield got, one_row_products(x, weight, scales, biases, **quant), ""

    return compare_outputs(where, variant, (_kernels, BUILDERS), outputs, "every row equal to MLX's one-row product")


def compare_outputs(where: str, variant: Variant, kernels: tuple, outputs, passed: str) -> QuantizedCheck:
    """A quantized kernel's check (serving.first_exact): ``outputs(kernel,
    fused)`` yields (the kernel's, MLX's one-row, "") outputs, the kernel
    built once a backend from ``kernels`` (made, builders); on CUDA (affine)
    each dequantization in turn, keeping the first that matches."""
    tries = DEQUANTIZATIONS.get(where, (False,)) if variant.mode == "affine" else (False,)
    return first_exact(
        where,
        tries,
        kernels,
        outputs,
        lambda ok, detail, fused=False: QuantizedCheck(where, variant, ok, detail, fused),
        passed=passed,
    )


def self_check_all(report=None) -> list[QuantizedCheck]:
    """The variants checked here so far (for `dflash-mlx doctor`); [] where the kernel does not run."""
    return checked_here(_checks, backend(), report)


def all_variants():
    """(dtype, scales dtype, bits, group, mode) of every variant the kernel serves."""
    for dtype in DTYPES:
        for bits in AFFINE_BITS:
            for group in GROUPS:
                yield dtype, dtype, bits, group, "affine"
        yield dtype, mx.uint8, 4, 32, "mxfp4"


def record_variants(factory, backend_name: str) -> None:
    """Launch every variant the kernel can (each dtype, quantization and row
    tile) through ``factory``, a stand-in for MLX's kernel factory that
    records them (scripts/check_metal_kernels.py, check_cuda_kernels.py)."""
    kernel = QuantizedProductKernel(backend_name, factory=factory)
    for dtype, scales_dtype, bits, group, mode in all_variants():
        # K of whole two-word blocks, and one past them (Metal's one-word steps)
        # (every step order, and N of most outputs a simdgroup and of each fewer)
        for k, n in itertools.product((block_k(bits, 2), block_k(bits, 2) + block_k(bits, 1)), RECORDED_N):
            weight = mx.zeros((n, k * bits // 32), mx.uint32)
            scales = mx.zeros((n, k // group), scales_dtype)
            biases = mx.zeros((n, k // group), dtype) if mode == "affine" else None
            for rows in range(FEWEST_ROWS, MOST_ROWS + 1):
                for fused in DEQUANTIZATIONS.get(backend_name, (False,)):
                    x = mx.zeros((1, rows, k), dtype)
                    kernel(x, weight, scales, biases, bits=bits, group=group, mode=mode, fused=fused)
