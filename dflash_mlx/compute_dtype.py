"""The dtype a model pair computes in.

By default a pair runs in its weights' own dtype, as mlx-lm loads it, except
on a CPU whose matrix products run on a fast BLAS (fast_blas.py): there
bfloat16 and float16 products take MLX's own loops, and only float32 ones
reach the BLAS, where a 16-row product costs about what two 1-row ones do
(7x less than in bfloat16, BENCHMARKS.md), so that a verify costs few plain
steps. A pair whose float32 copy would take over a quarter of the memory
keeps its dtype, as does a quantized target (its products are MLX's own).

Float32 decodes its own text: DFlash's output equals the target's own
decoding in the dtype it computes in, so compare with mlx-lm in that dtype.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import fast_blas

CHOICES = ("auto", "float32", "bfloat16", "float16")
MEMORY_SHARE = 0.25  # of the machine's memory, the most a float32 copy of the pair may take


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
    """A ValueError naming the choices unless ``dtype`` is one of CHOICES
    (``flags``: name the command line's --dtype, else load's dtype=)."""
    if dtype not in CHOICES:
        raise ValueError(
            f"unknown dtype {dtype!r}; pass {'--dtype' if flags else 'dtype='} "
            f"{', '.join(CHOICES[:-1])} or {CHOICES[-1]}."
        )


def apply(model: nn.Module, draft: nn.Module, dtype: str = "auto", evaluate: bool = True) -> mx.Dtype:
    """Cast both models' floating weights to ``dtype`` (one of CHOICES) and
    return the dtype the pair now computes in; ``evaluate``: cast now (else
    lazily, with a lazy load)."""
    check(dtype)
    target = auto(model, draft) if dtype == "auto" else getattr(mx, dtype)
    if target is not None:
        for m in (model, draft):
            m.set_dtype(target)
        if evaluate:
            mx.eval(model.parameters(), draft.parameters())
    return computing(model)


def on_fast_blas(dtype: mx.Dtype) -> bool:
    """Whether a pair computing in ``dtype`` does so in float32 on a CPU
    whose products run on a fast BLAS (what ``auto`` picks there)."""
    cpu = mx.default_device().type == mx.DeviceType.cpu
    return cpu and fast_blas.active() and dtype == mx.float32


def name(model: nn.Module) -> str:
    """The dtype ``model`` computes in, as --dtype names it ("float32")."""
    return str(computing(model)).removeprefix("mlx.core.")


def computing(model: nn.Module) -> mx.Dtype:
    """The dtype of the target's products: its first floating weight's."""
    return next(a.dtype for a in _floating(model))
