"""A verify's expert products: 2-32 rows through a MoE layer's quantized
experts (mlx-lm's ``QuantizedSwitchLinear``), each (row, expert) product bit
for bit what MLX's one-row gather product computes (Metal, CUDA).

A plain step sends its one row to its top-k experts: MLX's ``gather_qmm``
takes its one-row ``gather_qmv``, which is ``qmv`` on the selected expert's
weight (on CUDA, mxfp4: ``fp_gather_qmv``, ``fp_qmv``'s order, not the dense
one-row product's). A verify's block has rows x top-k pairs, which mlx-lm sorts and MLX
multiplies by its tiled ``gather_qmm``: another summation order, so at a
near-tie greedy DFlash could pick another token than plain decoding. This
kernel (quantized_source.py's gather body) reduces each pair in the order
of the quantized verify product (quantized.py), on that pair's expert.

Checked once per variant, outside compiled traces (``prepare``): its rows
must equal ``mx.gather_qmm`` of each pair alone, bit for bit, on random
experts; then each layer's own weight at a verify's rows, and served by the
rule of the other exact products (decisions.serves_exact). The CPU never
runs it.
"""

from __future__ import annotations

import functools
import itertools

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..device import backend
from .quantized import (
    CHECK_N,
    CHECK_ROWS,
    CHECK_WIDE_N,
    DEQUANTIZATIONS,
    FEWEST_ROWS,
    MOST_ROWS,
    RECORDED_N,
    QuantizedCheck,
    QuantizedProductKernel,
    Variant,
    all_variants,
    block_k,
    compare_outputs,
    weight_format,
)
from .quantized_source import GATHER_INPUTS
from .serving import CheckedVariants, checked_here

CHECK_EXPERTS = 5
CHECK_TOP_K = 3  # experts a row in the self-check (some pairs share one, some rows repeat one)


class QuantizedGatherKernel(QuantizedProductKernel):
    """The gather kernel for one backend, compiled by MLX per (T, S, bits, group, mode, tile)."""

    NAME, INPUT_NAMES, GATHER = "dflash_quantized_gather", GATHER_INPUTS, True

    def __call__(
        self,
        x: mx.array,
        lhs: mx.array,
        rhs: mx.array,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array | None,
        *,
        bits: int,
        group: int,
        mode: str,
        fused: bool = False,
    ) -> mx.array:
        """Row p of the [P, N] result: x row ``lhs[p]`` (x [R, K]) times expert
        ``rhs[p]``'s [N, K] weight of the quantized [E, N, K] weights."""
        k = x.shape[-1]
        pairs, n = rhs.size, weight.shape[1]
        indices = [lhs.astype(mx.int32), rhs.astype(mx.int32)]
        inputs = [x.reshape(-1, k), *indices, weight, scales, self.biases(x.dtype, biases)]
        at = dict(rows=pairs, tile_rows=min(pairs, MOST_ROWS), n=n, k=k, bits=bits, group=group, mode=mode)
        return self.launch(inputs, x.dtype, scales.dtype, fused=fused, **at)


def variant_of(module: nn.Module, dtype) -> Variant | None:
    """The variant serving ``module``'s expert products of ``dtype`` rows, or None where the kernel never does."""
    if type(module) is not QuantizedSwitchLinear:
        return None
    return weight_format(module, dtype, ndim=3)


BUILDERS = {"metal": QuantizedGatherKernel, "cuda": QuantizedGatherKernel}
_kernels: dict[str, QuantizedGatherKernel] = {}
_variants = CheckedVariants("quantized expert verify product", "MLX's gather_qmm", "quantized expert verify")
_checks: dict[tuple[str, Variant], QuantizedCheck] = _variants.checks


def reset() -> None:
    _kernels.clear()
    _variants.clear()


def checked(where: str, variant: Variant) -> QuantizedCheck:
    """The variant's self-check on backend ``where``, run once (warning once where it fails)."""
    return _variants.checked(where, variant, lambda: self_check(where, variant))


def serves(module: nn.Module, rows: int, k: int, dtype) -> bool:
    """Whether the experts' products of 2-32 rows of ``k`` values take the
    kernel here: a checked variant that serves the layer's shape; never checks."""
    if not FEWEST_ROWS <= rows <= MOST_ROWS:
        return False
    where = backend()
    if where not in BUILDERS:
        return False
    variant = variant_of(module, dtype)
    return variant is not None and k == variant.k and _variants.serves(where, variant, module.output_dims, rows)


def product(module: nn.Module, x: mx.array, lhs: mx.array, rhs: mx.array) -> mx.array:
    """``module``'s products of the pairs (x row ``lhs[p]``, expert ``rhs[p]``),
    with the layer's bias, as [P, N]; only where ``serves`` said so (or measuring)."""
    variant = variant_of(module, x.dtype)
    where = backend()
    y = _kernels[where](
        x,
        lhs,
        rhs,
        module["weight"],
        module["scales"],
        module.get("biases"),
        bits=variant.bits,
        group=variant.group,
        mode=variant.mode,
        fused=_checks[(where, variant)].fused,
    )
    return y + module["bias"][rhs] if "bias" in module else y


def one_row_products(x, lhs, rhs, weight, scales, biases, *, bits: int, group: int, mode: str) -> mx.array:
    """Each pair through ``mx.gather_qmm`` alone (one row, its expert), as a plain step calls it."""
    return mx.concatenate(
        [
            mx.gather_qmm(
                x[lhs[p] : lhs[p] + 1][None],
                weight,
                scales,
                biases,
                rhs_indices=rhs[p : p + 1],
                transpose=True,
                group_size=group,
                bits=bits,
                mode=mode,
            )[0]
            for p in range(rhs.size)
        ]
    )


def one_row_layer(module: nn.Module, variant: Variant, x: mx.array, lhs: mx.array, rhs: mx.array) -> mx.array:
    y = one_row_products(
        x, lhs.tolist(), rhs, module["weight"], module["scales"], module.get("biases"), bits=variant.bits,
        group=variant.group, mode=variant.mode,
    )  # fmt: skip
    return y + module["bias"][rhs] if "bias" in module else y


def verify_pairs(rows: int, experts: int, top_k: int, seed: int) -> tuple[mx.array, mx.array]:
    """(lhs, rhs) of a verify's ``rows`` rows each sent to ``top_k`` distinct experts."""
    scores = mx.random.uniform(shape=(rows, experts), key=mx.random.key(seed))
    rhs = mx.argsort(scores, axis=-1)[:, :top_k].flatten().astype(mx.int32)
    lhs = mx.repeat(mx.arange(rows, dtype=mx.int32), top_k)
    return lhs, rhs


def check_cases(variant: Variant):
    """(x, lhs, rhs, weight, scales, biases): experts of the variant's K and N
    class, pairs of every row tile (partial ones too), each row to several experts."""
    for n in CHECK_WIDE_N if variant.wide else CHECK_N:
        seed = variant.k + variant.bits + variant.group + n
        w = mx.random.normal((CHECK_EXPERTS, n, variant.k), key=mx.random.key(seed))
        w = (variant.k**-0.5 * w).astype(variant.dtype)
        quantized = mx.quantize(w, group_size=variant.group, bits=variant.bits, mode=variant.mode)
        weight, scales = quantized[0], quantized[1]
        biases = quantized[2] if variant.mode == "affine" else None
        for pairs in CHECK_ROWS:
            rows = -(-pairs // CHECK_TOP_K)
            lhs, rhs = verify_pairs(rows, CHECK_EXPERTS, CHECK_TOP_K, seed + pairs)
            x = mx.random.normal((rows, variant.k), key=mx.random.key(1000 * pairs + variant.k))
            yield x.astype(variant.dtype), lhs[:pairs], rhs[:pairs], weight, scales, biases


def self_check(where: str, variant: Variant) -> QuantizedCheck:
    """The kernel's pairs against MLX's one-row gather products, bit for bit."""

    def outputs(kernel, fused: bool):
        quant = dict(bits=variant.bits, group=variant.group, mode=variant.mode)
        for x, lhs, rhs, weight, scales, biases in check_cases(variant):
            got = kernel(x, lhs, rhs, weight, scales, biases, **quant, fused=fused)
            yield got, one_row_products(x, lhs.tolist(), rhs, weight, scales, biases, **quant), ""

    passed = "every pair equal to MLX's one-row gather product"
    return compare_outputs(where, variant, (_kernels, BUILDERS), outputs, passed)


def prepare(model: nn.Module, dtype) -> None:
    """Check the variant of every quantized expert layer in ``model`` once,
    then each layer's own weight at a verify's rows (timed against MLX's
    sorted gather_qmm); call it outside compiled traces."""
    where = backend()
    if where not in BUILDERS:
        return
    for _, module in model.named_modules():
        variant = variant_of(module, dtype)
        if variant is None or not checked(where, variant).ok:
            continue
        _prepare_layer(where, variant, module, dtype)


def _prepare_layer(where: str, variant: Variant, module: nn.Module, dtype) -> None:
    """The layer's own weight through the checked kernel at a verify's rows (each
    to up to 8 experts): exact here, then timed against MLX's product once a machine."""

    @functools.cache
    def pairs(rows: int) -> tuple[mx.array, mx.array]:
        """A verify's pairs, sorted by expert as layers/experts.py hands them to the kernel."""
        lhs, rhs = verify_pairs(rows, module.num_experts, min(8, module.num_experts), variant.k)
        order = mx.argsort(rhs)
        return lhs[order], rhs[order]

    runs = (
        lambda m, x: mlx_verify(m, x, *pairs(x.shape[0])),
        lambda m, x: product(m, x, *pairs(x.shape[0])),
        lambda m, x: one_row_layer(m, variant, x, *pairs(x.shape[0])),
    )
    _variants.shapes.prepare((where, variant, module.output_dims), module, runs, dtype)


def mlx_verify(module: nn.Module, x: mx.array, lhs: mx.array, rhs: mx.array) -> mx.array:
    """MLX's product of a verify's pairs as mlx-lm's SwitchGLU runs it (sorted by expert)."""
    order = mx.argsort(rhs)
    y = module(x[lhs[order]][:, None], rhs[order], sorted_indices=True)
    return y[mx.argsort(order), 0]


def self_check_all(report=None) -> list[QuantizedCheck]:
    """The variants checked here so far (for `dflash-mlx doctor`); [] where the kernel does not run."""
    return checked_here(_checks, backend(), report)


def record_variants(factory, backend_name: str) -> None:
    """Launch every variant the kernel can (each dtype, quantization and pair
    tile) through ``factory`` (scripts/check_metal_kernels.py, check_cuda_kernels.py)."""
    kernel = QuantizedGatherKernel(backend_name, factory=factory)
    for dtype, scales_dtype, bits, group, mode in all_variants():
        for k, n in itertools.product((block_k(bits, 2), block_k(bits, 2) + block_k(bits, 1)), RECORDED_N):
            weight = mx.zeros((3, n, k * bits // 32), mx.uint32)
            scales = mx.zeros((3, n, k // group), scales_dtype)
            biases = mx.zeros((3, n, k // group), dtype) if mode == "affine" else None
            for pairs in (*range(FEWEST_ROWS, MOST_ROWS + 1), 4 * MOST_ROWS):
                for fused in DEQUANTIZATIONS.get(backend_name, (False,)):
                    x = mx.zeros((pairs, k), dtype)
                    lhs = rhs = mx.zeros((pairs,), mx.int32)
                    kernel(x, lhs, rhs, weight, scales, biases, bits=bits, group=group, mode=mode, fused=fused)
