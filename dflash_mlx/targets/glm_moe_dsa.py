"""GLM-5 (and DeepSeek V3.2): mlx-lm's ``glm_moe_dsa`` / ``deepseek_v32``
models, DeepSeek V3's latent attention plus DeepSeek sparse attention (DSA):
an indexer scores every cached position for each query and the query attends
only to the ``index_topk`` best it may see.

mlx-lm keeps the indexer's keys in a second cache per layer; here they ride
in the layer's one buffer after the rotary key (values: [rotary key | index
key]), so a rollback is still one move of the length. Each row of a block
selects over exactly the positions its own decode step would see (the causal
mask hides the rest before the top-k), so a verify selects as mlx-lm's
decoding does, row for row."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kernels.norm_rope import rotate
from ..layers import linear
from ..layers.blocks import rope_positions
from .deepseek_v3 import DeepseekV3Target, mla_block


class GlmMoeDsaTarget(DeepseekV3Target):
    family = "glm_moe_dsa"

    def make_blocks(self) -> None:
        layers = [self.inner.layers[i] for i in self.here]
        self.blocks = [mla_block(layer, sparse_selection(layer.self_attn)) for layer in layers]
        linear.prepare(self.dtype)


class DeepseekV32Target(GlmMoeDsaTarget):
    family = "deepseek_v32"


def sparse_selection(attn: nn.Module) -> Callable:
    """The layer's cache write and DSA's selection, as ``mla_attention`` takes
    it: (x, q_low, latent, k_pe, mask, cache) -> (latent, k_pe, mask), the
    mask now also hiding every position the indexer did not choose."""
    indexer = attn.indexer
    heads, dim, top = indexer.n_heads, indexer.head_dim, indexer.index_topk

    def select(x, q_low, latent, k_pe, mask, cache):
        B, L, _ = x.shape
        offset = rope_positions(cache) if cache is not None else 0
        q = indexer.wq_b(q_low).reshape(B, L, heads, dim).swapaxes(1, 2)
        k = indexer.k_norm(indexer.wk(x)).reshape(B, 1, L, dim)
        q, k = rotate(indexer.rope, q, offset), rotate(indexer.rope, k, offset)
        if cache is not None:
            latent, both = cache.update_and_fetch(latent, mx.concatenate([k_pe, k], axis=-1))
            k_pe, k = mx.split(both, [attn.qk_rope_head_dim], axis=-1)
        if k.shape[2] <= top:  # every row sees at most ``top`` positions
            return latent, k_pe, mask
        scores = mx.maximum(q @ k.swapaxes(-1, -2), 0)
        weights = indexer.weights_proj(x) * (heads**-0.5 * indexer.softmax_scale)
        scores = scores * weights.swapaxes(-1, -2)[..., None]
        # mlx-lm's sums over the heads: a slice at a time for several rows
        if L > 1:
            scores = sum(scores[:, h : h + 1] for h in range(heads))
        else:
            scores = scores.sum(axis=1, keepdims=True)
        if mask is not None:
            scores = mx.where(mask, scores, -float("inf"))
        chosen = mx.argpartition(scores, kth=-top, axis=-1)[..., -top:]
        selected = mx.put_along_axis(mx.zeros(scores.shape, mx.bool_), chosen, mx.array(True), axis=-1)
        return latent, k_pe, selected if mask is None else selected & mask

    return select
