"""A verify's products: a block's rows times each weight matrix.

On CUDA a product of 2-16 rows goes through the block-product kernel
(kernels/cuda/products.py) where it has checked itself, with the RMSNorm
before it, the residual add or the SwiGLU after it in the same launch; on
every other backend, and for anything the kernel does not take, the modules
themselves compute it. The kernel's module is imported only on CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from ..device import backend

# Weights the kernel takes a norm into: every block reads its rows twice
# (their rsqrt first), free at a small K but not at a large one.
NORM_MOST = 1 << 24


def _products():
    """The CUDA block-product kernel's module; None on Metal and the CPU."""
    if backend() in ("cpu", "metal"):
        return None
    from ..kernels.cuda import products

    return products


def apply_linear_swiglu(module: nn.Module, x: mx.array, norm: nn.Module | None = None) -> mx.array:
    """mlx-lm's ``swiglu(gate, up)`` of a fused gate/up linear's product
    (gate's rows, then as many of up's) of ``norm(x)`` (``norm``: None, or
    the RMSNorm before it): in the product's own launch where the kernel
    takes it and its SwiGLU epilogue (and norm prologue) checked out, else
    the product (``apply_linear``), split, then ``swiglu``."""
    if x.size // x.shape[-1] >= 2 and module.weight.shape[0] % 2 == 0:
        taken = _taking(module, x.shape[:-1], x.shape[-1], x.dtype, None)
        if taken is not None and taken[1] is None and _products().swiglu_passed(x.dtype):
            folded = _norm_operands(norm, x, module)
            if norm is not None and folded is None:
                x = norm(x)
            return taken[0](x, module.weight, swiglu=True, norm=folded)
    gate, up = mx.split(apply_linear(module, x, norm=norm), 2, axis=-1)
    return swiglu(gate, up)


def apply_linear_output(module: nn.Module, out: mx.array, as_rows: bool, residual: mx.array | None = None) -> mx.array:
    """An attention's output product, ``out`` as attention_output gives it:
    rows [B, L, heads * D] (``as_rows``) or heads [B, heads, L, D]; neither
    is copied first where the kernel takes the product."""
    return apply_linear(module, out, residual) if as_rows else apply_linear_heads(module, out, residual)


def apply_linear_heads(module: nn.Module, heads: mx.array, residual: mx.array | None = None) -> mx.array:
    """``apply_linear`` on an attention's output [B, heads, L, D] taken as
    its rows [B, L, heads * D]: the kernel reads them in place where it
    takes the product (B = 1, D a multiple of 8), else the transpose is
    made and ``apply_linear`` does the rest."""
    B, h, L, d = heads.shape
    if B == 1 and L >= 2 and d % 8 == 0:
        taken = _taking(module, (1, L), h * d, heads.dtype, residual)
        if taken is not None:
            kernel, bias = taken
            return kernel(heads, module.weight, bias, residual, heads=True)
    return apply_linear(module, heads.transpose(0, 2, 1, 3).reshape(B, L, -1), residual)


def apply_linear(
    module: nn.Module, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None
) -> mx.array:
    """``module(norm(x))``, or ``residual + module(norm(x))`` (``norm``:
    None, or the RMSNorm before the product): for an nn.Linear through the
    kernel where it takes the product and has checked out (the residual
    added in the same launch, the norm taken into it where that checked out
    too), else the modules themselves."""
    if x.size // x.shape[-1] >= 2:  # (a plain step's row: at once)
        taken = _taking(module, x.shape[:-1], x.shape[-1], x.dtype, residual)
        if taken is not None:
            kernel, bias = taken
            folded = _norm_operands(norm, x, module)
            if norm is None or folded is not None:
                return kernel(x, module.weight, bias, residual, norm=folded)
    if norm is not None:
        return apply_linear(module, norm(x), residual)
    return module(x) if residual is None else residual + module(x)


def takes_norm(module: nn.Module, x: mx.array, norm: nn.Module) -> bool:
    """Whether ``apply_linear(module, x, norm=norm)`` takes the norm into the
    kernel's launch (a caller with several products of one normed input
    then hands each the norm instead of norming once)."""
    return (
        _taking(module, x.shape[:-1], x.shape[-1], x.dtype, None) is not None
        and _norm_operands(norm, x, module) is not None
    )


def _norm_operands(norm: nn.Module | None, x: mx.array, module: nn.Module) -> tuple[mx.array, float] | None:
    """(weight, eps) of ``norm`` where the kernel may take it into
    ``module``'s product of ``x``'s rows: an nn.RMSNorm of x's length and
    dtype, a weight of fewer than NORM_MOST elements, the prologue checked
    out for that dtype; else None."""
    if norm is None or type(norm) is not nn.RMSNorm or module.weight.size >= NORM_MOST:
        return None
    weight = norm.weight
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype or not _products().norm_passed(x.dtype):
        return None
    return weight, norm.eps


def _taking(module: nn.Module, lead: tuple, k: int, dtype, residual: mx.array | None):
    """(the kernel, the module's bias) where the kernel takes ``module``'s
    product of rows [*lead, k] and has checked out for ``dtype``, else None."""
    if type(module) is not nn.Linear:
        return None
    bias = module["bias"] if "bias" in module else None
    products = _products()
    if products is None or not products.fits(lead, k, dtype, module.weight, bias, residual):
        return None
    kernel = products.passed(dtype)
    return None if kernel is None else (kernel, bias)


def prepare(dtype) -> None:
    """Check the block-product kernel for ``dtype`` where it runs (CUDA), so
    that the functions above may use it; call it outside compiled traces."""
    products = _products()
    if products is not None:
        products.prepare(dtype)
