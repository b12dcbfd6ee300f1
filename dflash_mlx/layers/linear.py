"""A verify's products. 2-32 rows of a bf16/fp16/fp32 ``nn.Linear`` take the
exact verify product where its variant checked out (Metal, CUDA: each row bit
for bit MLX's one-row product; a norm, SwiGLU or residual around it stays
MLX's op, as in the plain step); 2-32 rows of an ``nn.QuantizedLinear`` take
the quantized verify product likewise. On CUDA, 2-16 rows the exact product
does not take (its check failed: no order can be matched there) go through
the block-product kernel where it checked out (with the RMSNorm, residual or
SwiGLU in its launch), which is no less exact than MLX's few-row product.
Everything else, a prompt's chunks (``prompt_products``) and the CPU among
it, runs MLX's own product."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from ..device import backend
from ..kernels import exact_products, quantized, quantized_gather

# Largest weight the kernel takes a norm into: each block reads the rows twice.
NORM_MOST = 1 << 24

# True while a prompt's chunks run (prompt_products).
_in_prompt = contextvars.ContextVar("dflash_mlx_in_prompt", default=False)


@contextlib.contextmanager
def prompt_products():
    """Within it, every product is MLX's own, unfused, as mlx-lm's prefill
    computes it: the cache then holds mlx-lm's bits. A verify's products keep
    a plain step's one-row order, which a prompt's chunk of 2-32 rows would
    otherwise take too. Attention (layers/attention.py) reads a prompt's chunk
    as mlx-lm's prefill does where exactness comes first (elsewhere the
    block-attention kernel may serve it where this machine measured it faster)."""
    token = _in_prompt.set(True)
    try:
        yield
    finally:
        _in_prompt.reset(token)


def in_prompt() -> bool:
    return _in_prompt.get()


def verify_rows(x: mx.array) -> bool:
    """Whether ``x`` holds several rows outside a prompt: a verify's, which
    the verify products may take."""
    return x.size // x.shape[-1] >= 2 and not in_prompt()


def _products():
    """The CUDA block-product kernel's module; None on Metal and the CPU."""
    return None if backend() in ("cpu", "metal") else _cuda_products()


@functools.cache
def _cuda_products():
    # imported once, on first use: every product of a verify asks
    from ..kernels.cuda import products

    return products


def apply_linear_swiglu(module: nn.Module, x: mx.array, norm: nn.Module | None = None) -> mx.array:
    """``swiglu(gate, up)`` of a fused gate/up product of ``norm(x)``."""
    if verify_rows(x) and module.weight.shape[0] % 2 == 0 and not exact_products.takes(module, x):
        taken = _taking(module, x.shape[:-1], x.shape[-1], x.dtype, None)
        if taken is not None and taken[1] is None and _products().swiglu_passed(x.dtype):
            folded = _norm_operands(norm, x, module)
            if norm is not None and folded is None:
                x = norm(x)
            return taken[0](x, module.weight, swiglu=True, norm=folded)
    gate, up = mx.split(apply_linear(module, x, norm=norm), 2, axis=-1)
    return swiglu(gate, up)


def apply_linear_output(module: nn.Module, out: mx.array, as_rows: bool, residual: mx.array | None = None) -> mx.array:
    """An attention's output product of ``out`` as rows (``as_rows``) or heads."""
    return apply_linear(module, out, residual) if as_rows else apply_linear_heads(module, out, residual)


def apply_linear_heads(module: nn.Module, heads: mx.array, residual: mx.array | None = None) -> mx.array:
    """``apply_linear`` on heads [B, heads, L, D] as rows, read in place by the kernel."""
    B, h, L, d = heads.shape
    if (
        B == 1
        and L >= 2
        and not in_prompt()
        and d % 8 == 0
        and not exact_products.serves(module, L, h * d, heads.dtype)
    ):
        taken = _taking(module, (1, L), h * d, heads.dtype, residual)
        if taken is not None:
            kernel, bias = taken
            return kernel(heads, module.weight, bias, residual, heads=True)
    return apply_linear(module, heads.transpose(0, 2, 1, 3).reshape(B, L, -1), residual)


def apply_linear(
    module: nn.Module, x: mx.array, residual: mx.array | None = None, norm: nn.Module | None = None
) -> mx.array:
    """``residual + module(norm(x))`` (either optional), in one launch where the kernel takes it."""
    verifying = verify_rows(x)
    if verifying:  # (a plain step's row and a prompt's: at once)
        if exact_products.takes(module, x):
            # (the norm and the residual as the plain step runs them: MLX's ops)
            x = x if norm is None else norm(x)
            y = exact_products.product(module, x)
            y = module(x) if y is None else y  # (a norm whose output is of another dtype)
            return y if residual is None else residual + y
        taken = _taking(module, x.shape[:-1], x.shape[-1], x.dtype, residual)
        if taken is not None:
            kernel, bias = taken
            folded = _norm_operands(norm, x, module)
            if norm is None or folded is not None:
                return kernel(x, module.weight, bias, residual, norm=folded)
    if norm is not None:
        return apply_linear(module, norm(x), residual)
    y = quantized.product(module, x) if verifying else None
    if y is None:
        y = module(x)
    return y if residual is None else residual + y


def takes_norm(module: nn.Module, x: mx.array, norm: nn.Module) -> bool:
    """Whether ``apply_linear(module, x, norm=norm)`` takes the norm into the kernel's launch."""
    return (
        not exact_products.takes(module, x)
        and _taking(module, x.shape[:-1], x.shape[-1], x.dtype, None) is not None
        and _norm_operands(norm, x, module) is not None
    )


def _norm_operands(norm: nn.Module | None, x: mx.array, module: nn.Module) -> tuple[mx.array, float] | None:
    """(weight, eps) of ``norm`` where the kernel may take it into the product, else None."""
    if norm is None or type(norm) is not nn.RMSNorm or module.weight.size >= NORM_MOST:
        return None
    weight = norm.weight
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype or not _products().norm_passed(x.dtype):
        return None
    return weight, norm.eps


def _taking(module: nn.Module, lead: tuple, k: int, dtype, residual: mx.array | None):
    """(the kernel, the bias) where the kernel takes this product, else None."""
    if type(module) is not nn.Linear:
        return None
    bias = module["bias"] if "bias" in module else None
    products = _products()
    if products is None or not products.fits(lead, k, dtype, module.weight, bias, residual):
        return None
    kernel = products.passed(dtype)
    return None if kernel is None else (kernel, bias)


def prepare(dtype) -> None:
    """Check the block-product kernel for ``dtype``; call it outside compiled traces."""
    products = _products()
    if products is not None:
        products.prepare(dtype)


def quantized_head(embedding: nn.QuantizedEmbedding) -> nn.QuantizedLinear:
    """A tied quantized embedding as the output head's linear layer, holding its
    arrays: ``apply_linear(quantized_head(e), h)`` is ``e.as_linear(h)``, with a
    verify's rows through the quantized verify product where it checked out."""
    head = nn.QuantizedLinear.__new__(nn.QuantizedLinear)  # no weights of its own: the embedding's are
    nn.Module.__init__(head)
    head.group_size, head.bits, head.mode = embedding.group_size, embedding.bits, embedding.mode
    for name in ("weight", "scales", "biases"):
        if name in embedding:
            head[name] = embedding[name]
    head.freeze()
    return head


def prepare_exact(model: nn.Module, dtype) -> None:
    """Check the exact verify product for every ``nn.Linear`` layer of ``model``
    (and an ``nn.Embedding``, for a tied head) at ``dtype`` rows; call it
    outside compiled traces (unchecked layers keep MLX's product)."""
    exact_products.prepare(model, dtype)
    for _, module in model.named_modules():
        if type(module) is nn.Embedding:  # (a tied output head's)
            exact_products.prepare(linear_head(module), dtype)


def linear_head(embedding: nn.Embedding) -> nn.Linear:
    """A tied embedding as the output head's linear layer, holding its weight:
    ``apply_linear(linear_head(e), h)`` is ``e.as_linear(h)``."""
    head = nn.Linear.__new__(nn.Linear)  # no weights of its own: the embedding's are
    nn.Module.__init__(head)
    head["weight"] = embedding["weight"]
    return head


def prepare_quantized(model: nn.Module, dtype) -> None:
    """Check the quantized verify product for every quantized linear layer of
    ``model`` (and a quantized embedding, for a tied head) at ``dtype`` rows;
    call it outside compiled traces (unchecked layers keep MLX's product)."""
    quantized.prepare(model, dtype)
    quantized_gather.prepare(model, dtype)  # (a MoE layer's quantized experts)
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedEmbedding:  # (a tied output head's)
            quantized.prepare(quantized_head(module), dtype)


def prepare_products(model: nn.Module, dtype) -> None:
    """Check, at ``dtype`` rows, the exact verify products for every linear
    layer of ``model`` at its own shape (quantized and dense), and time them
    on this machine; call it outside compiled traces."""
    prepare_quantized(model, dtype)
    prepare_exact(model, dtype)
