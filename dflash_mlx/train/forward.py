"""The drafter's training forward: many blocks of a batch in one pass of
``DFlashDraft``. Each sampled anchor a makes a block [token at a, MASK ...]
at positions a..a+bs-1, as at inference; blocks go on the batch axis and see
their sequence's context before a only, through a boolean mask.
"""

from __future__ import annotations

import mlx.core as mx

from ..draft.dflash import DFlashDraft


def training_mask(anchor: mx.array, length: mx.array, T: int, bs: int, causal: bool, window: int | None) -> mx.array:
    """Boolean [B, 1, bs, T + bs]: the same visibility as inference's
    ``block_mask``: context keys before the anchor (within the window) and
    the block's own first length_b keys (causal where the layer is)."""
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
    """Attention spelled out (GQA, boolean mask [B, 1, L, C+L]), so its
    meaning cannot depend on a backend's fused kernel."""
    B, H, L, hd = queries.shape
    kv = keys.shape[1]
    q = (queries * scale).reshape(B, kv, H // kv, L, hd)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # [B, kv, rep, L, K]
    scores = mx.where(mask[:, :, None], scores, mx.array(-1e30, dtype=scores.dtype))
    out = mx.softmax(scores, axis=-1, precise=True) @ values[:, :, None]
    return out.reshape(B, H, L, hd)


def draft_logits(draft: DFlashDraft, taps: mx.array, batch: dict[str, mx.array]) -> mx.array:
    """Logits [B, bs-1, V] of every block in the batch."""
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
