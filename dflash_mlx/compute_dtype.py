"""The dtype a model pair computes in: the weights' own, except float32 on a
CPU with a fast BLAS (only float32 products reach it), unless the copy would
be too large or the target is quantized. Output equals the target's own
decoding in the dtype it computes in.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import fast_blas

CHOICES = ("auto", "float32", "bfloat16", "float16")
MEMORY_SHARE = 0.25  # the most of the memory a float32 copy of the pair may take


def _floating(module: nn.Module) -> list[mx.array]:
    return [a for _, a in tree_flatten(module.parameters()) if mx.issubdtype(a.dtype, mx.floating)]


def quantized(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in module.named_modules())


def memory_bytes() -> int | None:
    """The machine's memory, or a container's limit (cgroup v2) where lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except (OSError, ValueError):
        return total


def auto(model: nn.Module, draft: nn.Module) -> mx.Dtype | None:
    """float32 where the rule above picks it, else None (the weights' own)."""
    if mx.default_device().type != mx.DeviceType.cpu or not fast_blas.active() or quantized(model):
        return None
    params = _floating(model) + _floating(draft)
    if all(a.dtype == mx.float32 for a in params):
        return None
    memory = memory_bytes()
    if memory is None or 4 * sum(a.size for a in params) > MEMORY_SHARE * memory:
        return None
    return mx.float32


def check(dtype: str, flags: bool = False) -> None:
    """Raise ValueError unless ``dtype`` is one of CHOICES."""
    if dtype not in CHOICES:
        raise ValueError(
            f"unknown dtype {dtype!r}; pass {'--dtype' if flags else 'dtype='} "
            f"{', '.join(CHOICES[:-1])} or {CHOICES[-1]}."
        )


def apply(model: nn.Module, draft: nn.Module, dtype: str = "auto", evaluate: bool = True) -> mx.Dtype:
    """Cast both models' floating weights to ``dtype``; returns the dtype the
    pair now computes in."""
    check(dtype)
    target = auto(model, draft) if dtype == "auto" else getattr(mx, dtype)
    if target is not None:
        for m in (model, draft):
            m.set_dtype(target)
        if evaluate:
            mx.eval(model.parameters(), draft.parameters())
    return computing(model)


def on_fast_blas(dtype: mx.Dtype) -> bool:
    """Whether ``dtype`` is float32 on a CPU with a fast BLAS."""
    cpu = mx.default_device().type == mx.DeviceType.cpu
    return cpu and fast_blas.active() and dtype == mx.float32


def name(model: nn.Module) -> str:
    """The dtype ``model`` computes in, as --dtype names it ("float32")."""
    return str(computing(model)).removeprefix("mlx.core.")


def computing(model: nn.Module) -> mx.Dtype:
    """The dtype of the target's products: its first floating weight's."""
    return next(a.dtype for a in _floating(model))
