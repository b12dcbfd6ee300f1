"""The drafter's training forward: many blocks of a batch of sequences in
one pass of the inference module ``DFlashDraft``.

In each sequence, anchor positions a are sampled in the response; each
anchor makes one block [token at a, MASK x (bs-1)] at positions a..a+bs-1,
exactly what the drafter sees at inference when a is the first uncommitted
position. The blocks go on the batch axis; each block sees the context
keys/values of its own sequence at positions < a only (plus the window of
sliding layers), through a boolean mask, and all of its own block.

These pieces belong beside the drafter's own forward and block mask in
dflash_mlx/draft.py; they live here until that file is free to take them.
"""

from __future__ import annotations

import mlx.core as mx

from ..draft.dflash import DFlashDraft


def training_mask(anchor: mx.array, length: mx.array, T: int, bs: int, causal: bool, window: int | None) -> mx.array:
    """Boolean [B, 1, bs, T + bs]: block b's query i (at position a_b + i) sees
    context key j iff j < a_b (and a_b + i - j < window on sliding layers), and
    the block's own first length_b keys (only those at or before it when
    causal): the same visibility as inference's ``block_mask`` for a block of
    length_b (the queries past length_b have no labels)."""
    a = anchor[:, None, None]
    q = a + mx.arange(bs)[None, :, None]
    j = mx.arange(T)[None, None, :]
    ctx = j < a
    if window is not None:
        ctx = ctx & (q - j < window)
    ctx = mx.broadcast_to(ctx, (anchor.shape[0], bs, T))
    k = mx.arange(bs)
    own = k[None, None, :] < length[:, None, None]  # [B, 1, bs]
    if causal:
        own = own & (k[None, None, :] <= k[None, :, None])
    own = mx.broadcast_to(own, (anchor.shape[0], bs, bs))
    return mx.concatenate([ctx, own], axis=-1)[:, None]


def target_taps(adapter, tokens: mx.array, taps: list[int]) -> mx.array:
    """Tapped hidden states [N, T, n*H] of the frozen target, no cache."""
    _, hidden = adapter(tokens, [None] * adapter.num_layers, taps, last_only=True)
    return mx.stop_gradient(hidden.astype(mx.float32))


def written_out_attention(queries, keys, values, *, scale, mask):
    """Attention spelled out (GQA, boolean mask), for the drafter's ``attend``
    hook: training passes a per-block mask of shape [B, 1, L, C+L], and
    written out its meaning cannot depend on a backend's fused kernel (the
    equality with inference is tested)."""
    B, H, L, hd = queries.shape
    kv = keys.shape[1]
    q = (queries * scale).reshape(B, kv, H // kv, L, hd)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # [B, kv, rep, L, K]
    scores = mx.where(mask[:, :, None], scores, mx.array(-1e30, dtype=scores.dtype))
    out = mx.softmax(scores, axis=-1, precise=True) @ values[:, :, None]
    return out.reshape(B, H, L, hd)


def draft_logits(draft: DFlashDraft, taps: mx.array, batch: dict[str, mx.array]) -> mx.array:
    """Logits [B, bs-1, V] of every block in the batch (see module docstring)."""
    ctx = draft.context(taps)  # [N, T, H]
    T = taps.shape[1]
    block, anchor, seq = batch["block"], batch["anchor"], batch["seq"]
    bs = block.shape[1]
    x = draft.embed(block).astype(mx.float32)
    masks: dict[tuple, mx.array] = {}
    for layer in draft.layers:
        attn = layer.self_attn
        key = (attn.causal, attn.window)
        if key not in masks:
            masks[key] = training_mask(anchor, batch["length"], T, bs, *key)
        keys, values = attn.keys_values(ctx, draft.rope, 0)  # [N, kv, T, hd]
        x = layer(x, keys[seq], values[seq], draft.rope, anchor, masks[key], attend=written_out_attention)
    return draft.logits(draft.norm(x[:, 1:]))
