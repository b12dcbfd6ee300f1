"""A layer's attention over its cache, a target's or a drafter's: the
block-attention kernel where it pays, mlx-lm's attention everywhere else.

The kernel (dflash_mlx.kernels) takes the valid length instead of a mask, so
it reads only the filled part of a buffer and needs no mask array. It is used
for a plain buffer cache (``BufferKVCache``; quantized and rotating caches
keep mlx-lm's path), on a GPU, where the measured table says it wins for the
call's rows and keys, and only once its variant has passed its self-check.
The check reads results back to the host, so it runs when a target's layers
are made (``prepare``), never inside a compiled cycle: a variant not checked
by then takes mlx-lm's path.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from ..cache.buffer import BufferKVCache
from ..kernels import dispatch, norm_rope
from . import linear


def prepare(dtype, head_dim: int, windows) -> None:
    """Check the kernel variants a target's layers will ask for (its dtype,
    head dim, full and/or sliding layers), so that ``attention`` can use them,
    the q/k norm + RoPE kernel's (layers.dense_block, the drafter) and the
    block-product kernel's (a verify's products: the fused projections, a
    dense layer's o_proj, the drafter's inference products)."""
    norm_rope.prepare(dtype, head_dim)
    linear.prepare(dtype)
    where = dispatch.backend()
    if where == "cpu" or dtype not in dispatch.TOLERANCE or head_dim not in dispatch.HEAD_DIMS:
        return
    for windowed in sorted({w is not None for w in windows}):
        dispatch.checked_kernel(where, dtype, head_dim, windowed)


def attention(
    queries,
    keys,
    values,
    *,
    cache,
    scale: float,
    mask,
    start,
    length=None,
    causal: bool = True,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of the rows written at ``start`` (an int or a device scalar)
    over the cache's buffers ``keys``/``values``; ``mask`` is what mlx-lm's
    path needs for the same thing. ``length``: the valid length with those
    rows (default: the cache's offset, which its ``update_and_fetch`` has
    moved past them). Causal or not (the drafter's block), within ``window``
    when given, with per-head sink logits ``sinks`` (gpt-oss) when given.
    Returns [B, heads, L, D]."""
    out, as_rows = attention_output(
        queries,
        keys,
        values,
        cache=cache,
        scale=scale,
        mask=mask,
        start=start,
        length=length,
        causal=causal,
        window=window,
        sinks=sinks,
    )
    if as_rows:
        B, L, _ = out.shape
        return out.reshape(B, L, queries.shape[1], -1).transpose(0, 2, 1, 3)
    return out


def attention_output(
    queries,
    keys,
    values,
    *,
    cache,
    scale: float,
    mask,
    start,
    length=None,
    causal: bool = True,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> tuple[mx.array, bool]:
    """``attention`` in the layout its result is stored in, so that the
    output product reads it without a copy (linear.apply_linear_output):
    (rows [B, L, heads * D], True) where the block-attention kernel ran (it
    writes each row's heads side by side), else (heads [B, heads, L, D], False)."""
    if type(cache) is BufferKVCache and start is not None:
        where = dispatch.backend()
        rows = queries.shape[1] // keys.shape[1] * queries.shape[2]
        if where != "cpu" and dispatch.kernel_wins(rows, keys.shape[2], where):
            kernel = dispatch.passed_kernel(where, queries.dtype, queries.shape[3], window is not None)
            if kernel is not None:
                out = kernel(
                    queries,
                    keys,
                    values,
                    scale=scale,
                    q_offset=start,
                    kv_length=cache.offset if length is None else length,
                    causal=causal,
                    window=window,
                    sinks=sinks,
                )
                B, _, L, _ = out.shape
                return out.transpose(0, 2, 1, 3).reshape(B, L, -1), True
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks), False
