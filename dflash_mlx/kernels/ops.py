"""The portable block-attention path through mx.fast's fused op, and the input
checks every path shares. Nothing here reads a value back from the device."""

from __future__ import annotations

import mlx.core as mx

from ..kv.buffer import positions_mask

HEAD_DIMS = (64, 128, 256)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def check_inputs(queries, keys, values, q_offset, kv_length, *, window, sinks) -> None:
    """Raise ValueError (one sentence) for inputs outside the contract."""
    for name, a in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(a, mx.array) or a.ndim != 4:
            raise ValueError(f"block_attention: {name} must be a 4-d mx.array [batch, heads, length, head_dim].")
    (b, hq, _, d), (bk, hkv, n, dk) = queries.shape, keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"block_attention: values {values.shape} and keys {keys.shape} must have the same shape.")
    if d not in HEAD_DIMS or dk != d:
        raise ValueError(f"block_attention: head dims must match and be one of {HEAD_DIMS}, got {d} and {dk}.")
    if bk != b or hq % hkv:
        raise ValueError(
            f"block_attention: queries {queries.shape} and keys {keys.shape} need the same batch "
            "and query heads a multiple of key-value heads."
        )
    if n < 1:
        raise ValueError("block_attention: the key buffer is empty.")
    if queries.dtype not in DTYPES or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        raise ValueError(
            f"block_attention: queries, keys and values must share one dtype of bfloat16/float16/float32, "
            f"got {queries.dtype}, {keys.dtype}, {values.dtype}."
        )
    for name, x in (("q_offset", q_offset), ("kv_length", kv_length)):
        if isinstance(x, mx.array):
            if x.size != 1 or x.dtype not in (mx.int32, mx.int64, mx.uint32):
                raise ValueError(f"block_attention: {name} must be an int or a one-element integer mx.array.")
        elif isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"block_attention: {name} must be a non-negative int or an integer mx.array, got {x!r}.")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"block_attention: window must be a positive int or None, got {window!r}.")
    if sinks is not None and (not isinstance(sinks, mx.array) or sinks.shape != (hq,)):
        raise ValueError(f"block_attention: sinks must be an mx.array of shape ({hq},), one logit per query head.")


def visible(rows: int, keys: int, q_offset, kv_length, causal: bool, window: int | None) -> mx.array:
    """Boolean [rows, keys]: which keys each query row attends to (positions_mask's rule)."""
    return positions_mask(rows, _scalar(q_offset), keys, window, causal, limit=_scalar(kv_length))


def ops_attention(queries, keys, values, *, scale, q_offset, kv_length, causal, window=None, sinks=None):
    """mx.fast.scaled_dot_product_attention over the whole buffer with a mask (a fixed shape)."""
    mask = visible(queries.shape[2], keys.shape[2], q_offset, kv_length, causal, window)
    if sinks is not None:
        sinks = sinks.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _scalar(x):
    return x.reshape(()).astype(mx.int32) if isinstance(x, mx.array) else x
