"""A layer's attention over its cache: for a plain buffer, a verify's
causal rows (a block's, or a draft tree's nodes) through the exact verify
attention (each row as MLX's one-row call computes it), else the
block-attention kernel (over a block, or a draft tree's nodes while the
cache has one), each where it passed its check and
this machine measured it faster (both in ``prepare``, never inside a compiled
cycle); mlx-lm's attention everywhere else, a plain step's one row included."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from ..kernels import decisions, dispatch, exact_attention, norm_rope
from ..kernels.attention_source import TREE_NODES
from ..kv.window import is_buffer
from . import linear


def prepare(dtype, head_dim: int, windows, trees: bool = False) -> None:
    """Check and measure every kernel variant a target's layers will use
    (``trees``: the draft-tree variants too), outside compiled traces."""
    norm_rope.prepare(dtype, head_dim)
    linear.prepare(dtype)
    if None in set(windows):
        exact_attention.prepare(dtype, head_dim, trees=trees)
    where = dispatch.backend()
    if where == "cpu" or dtype not in dispatch.TOLERANCE or head_dim not in dispatch.HEAD_DIMS:
        return
    for window in sorted(set(windows), key=lambda w: -1 if w is None else w):
        dispatch.measure(where, dtype, head_dim, window)
        if trees:
            dispatch.measure(where, dtype, head_dim, window, tree=True)


def attention(queries, keys, values, **where) -> mx.array:
    """Attention of the rows written at ``start`` over the cache's buffers
    (``where``: ``attention_output``'s keywords); returns [B, heads, L, D]."""
    out, as_rows = attention_output(queries, keys, values, **where)
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
    exact: bool = True,
) -> tuple[mx.array, bool]:
    """Attention in its stored layout, which the output product reads without
    a copy: (rows [B, L, heads * D], True) where the kernel ran, else (heads
    [B, heads, L, D], False). ``mask`` is mlx-lm's path's, ``length`` the
    valid length (default: the cache's offset). A draft tree on the cache
    (kv/tree.py) takes the tree kernel, its nodes the rows written at ``start``.
    ``exact``: the target's rows, which round as mlx-lm's where exactness comes
    first (the drafter's need not)."""
    tree = getattr(cache, "tree", None)
    # A verify's rows (their offset on the device, a cycle's) as the plain step
    # computes each; a prompt's chunk as mlx-lm's prefill does.
    verify = exact and start is not None and not prompt_chunk(start)
    if is_buffer(cache) and verify and causal and window is None and sinks is None:
        # (the host's bound on the keys a row reads: on CUDA a buffer is read whole)
        at = dict(scale=scale, q_offset=start, filled=cache.bound)
        if tree is None:
            out = exact_attention.attention(queries, keys, values, **at)
        else:
            out = exact_attention.tree_attention(queries, keys, values, tree=tree, **at)
        if out is not None:
            return out, False
    if window is not None and causal and tree is None and is_buffer(cache):
        keys, values, mask = within_window(cache, window, keys, values, mask, queries.shape[2])
    where = dispatch.backend()
    takes_kernel = tree is None or takes_tree(tree, queries, causal)
    if exact and prompt_chunk(start) and decisions.current().exact_first(where):
        takes_kernel = False  # the target's cache then holds what mlx-lm's prefill writes
    if is_buffer(cache) and start is not None and takes_kernel and not one_row_step(queries, mask, where):
        rows = queries.shape[1] // keys.shape[1] * queries.shape[2]
        kernel = dispatch.serving_kernel(
            where,
            queries.dtype,
            queries.shape[3],
            window is not None,
            rows=rows,
            keys=keys.shape[2],
            tree=tree is not None,
        )
        if kernel is not None:
            # The whole buffers, not ``keys``' view of their filled part: the
            # kernel reads up to kv_length, and a view would be copied.
            out = kernel(
                queries,
                cache.keys,
                cache.values,
                scale=scale,
                q_offset=start,
                kv_length=cache.offset if length is None else length,
                causal=causal,
                window=window,
                sinks=sinks,
                **({} if tree is None else {"tree": tree}),
            )
            B, _, L, _ = out.shape
            return out.transpose(0, 2, 1, 3).reshape(B, L, -1), True
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks), False


def within_window(cache, window: int, keys, values, mask, rows: int):
    """A sliding-window layer's keys, values and mask cut to the keys its
    ``rows`` can see where the host knows where they are (a prompt chunk, a
    plain step), as mlx-lm's rotating cache holds them: the layer then reads
    the window, not the whole context."""
    start = cache.window_start(rows, window)
    if start == 0:
        return keys, values, mask
    keys, values = keys[..., start:, :], values[..., start:, :]
    if rows == 1 and keys.shape[2] == window:
        return keys, values, None  # one row over exactly its window: it sees every key
    return keys, values, mask[..., start:]


def prompt_chunk(start) -> bool:
    """Whether the rows are a prompt's chunk: read inside linear.prompt_products,
    or at a host offset (a cycle's verify has its offset on the device)."""
    return linear.in_prompt() or (start is not None and not isinstance(start, mx.array))


def one_row_step(queries, mask, where: str) -> bool:
    """Whether a plain step's one row takes MLX's one-row attention, as
    mlx-lm's step does: it reads a buffer's filled part through its strides
    (the block kernel would copy the view) and rounds as that step. Not on
    CUDA behind a mask, where MLX's attention is not one fused kernel."""
    return queries.shape[2] == 1 and (mask is None or where != "cuda")


def takes_tree(tree, queries, causal: bool) -> bool:
    """Whether the tree kernel can verify ``tree``: its nodes are the causal query rows, at most TREE_NODES."""
    return causal and tree.size == queries.shape[2] <= TREE_NODES
