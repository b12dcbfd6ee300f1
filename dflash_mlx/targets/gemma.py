"""Gemma 3 and Gemma 4 (``gemma3_text``, ``gemma4_text`` and their multimodal
wrappers): scaled embeddings, sliding layers with the window in the mask, and
for Gemma 4 per-layer inputs and layers reusing an earlier layer's keys/values.
The softcap is in the target's ``logits``, not the shared ``lm_head``: the
drafter applies its own config's cap, so logits are never capped twice."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.gemma3_text import clip_residual

from ..kernels.norm_rope import rotate
from ..kv.window import drop_passed, is_buffer
from ..layers.attention import attention, prepare
from ..layers.blocks import attend, own_projections, rope_positions
from .base import DenseTarget


class Gemma3Target(DenseTarget):
    family = "gemma3_text"
    runs_a_stage = True  # its layers over this rank's slice, as the base class runs them

    def __init__(self, model):
        super().__init__(model)
        self.tied = bool(getattr(self.text, "tie_word_embeddings", False)) or "lm_head" not in self.text

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.inner.embed_tokens(tokens)
        # As mlx-lm: the scale rounded to bfloat16 first.
        return h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def windows(self):
        p, w = self.inner.sliding_window_pattern, self.inner.window_size
        return [None if i % p == p - 1 else w for i in range(self.num_layers)]

    def layer_block(self, layer: nn.Module, window: int | None) -> Callable:
        return gemma3_block(layer, window)


def gemma3_block(layer: nn.Module, window: int | None) -> Callable:
    """mlx-lm's gemma3_text TransformerBlock forward (h, mask, cache) -> h."""
    attn = layer.self_attn
    qkv = own_projections(attn)

    def forward(h: mx.array, mask, cache) -> mx.array:
        B, L, _ = h.shape
        q, k, v = (p.reshape(B, L, -1, attn.head_dim).swapaxes(1, 2) for p in qkv(h, layer.input_layernorm))
        q, k = attn.q_norm(q), attn.k_norm(k)
        out = attend(attn.rope, q, k, v, cache=cache, scale=attn.scale, mask=mask, window=window)
        h = clip_residual(h, layer.post_attention_layernorm(attn.o_proj(out)))
        r = layer.mlp(layer.pre_feedforward_layernorm(h))
        return clip_residual(h, layer.post_feedforward_layernorm(r))

    return forward


class Gemma4Target(DenseTarget):
    """Under a pipeline, a layer reusing another's keys/values is on that
    layer's stage (distributed.stage_sizes)."""

    family = "gemma4_text"
    runs_a_stage = True

    def __init__(self, model):
        super().__init__(model)
        self.tied = bool(self.text.tie_word_embeddings)
        self.softcap = self.text.final_logit_softcapping

    @property
    def types(self) -> list[str]:
        return self.text.args.layer_types

    @property
    def kv_layers(self) -> list[int]:
        """This stage's layers that keep keys/values (the others reuse an earlier layer's)."""
        args = self.text.args
        return [i for i in self.here if i < args.num_hidden_layers - args.num_kv_shared_layers]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens) * self.inner.embed_scale

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        logits = self.lm_head(h, norm)
        if self.softcap is not None:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits

    def make_cache(self) -> list:
        windows = self.windows()
        return [self.kv_cache(windows[i]) for i in self.kv_layers]

    def windows(self):
        w = self.inner.window_size
        return [w if t == "sliding_attention" else None for t in self.types]

    def make_blocks(self) -> None:
        windows = self.windows()
        self.blocks = [gemma4_block(self.inner.layers[i], windows[i]) for i in self.here]
        self.rotates_rows = True
        self.prepare_attention(trees=False)

    def prepare_trees(self) -> None:
        self.prepare_attention(trees=True)

    def prepare_attention(self, trees: bool) -> None:
        """Check and measure the attention variants of this stage's layers
        (``trees``: the draft-tree ones too)."""
        windows = self.windows()
        dims = {i: self.inner.layers[i].self_attn.head_dim for i in self.here}
        for d in set(dims.values()):  # full layers may have a head dim of their own
            prepare(self.dtype, d, [windows[i] for i, e in dims.items() if e == d], trees=trees)

    def masks(self, h, cache):
        # One mask per layer type; layers sharing keys/values see their source's buffers.
        made = {}
        for i, c in zip(self.kv_layers, cache):
            t = self.types[i]
            if t not in made:
                window = self.inner.window_size if t == "sliding_attention" else None
                made[t] = create_attention_mask(h, c, window_size=window, return_array=False)
        return [made[self.types[i]] for i in self.here]

    def __call__(self, tokens: mx.array, cache: list, taps: Sequence[int], last_only: bool = False):
        inner = self.inner
        h = self.embed(tokens)
        per_layer = {}
        if inner.hidden_size_per_layer_input:  # every stage makes its layers' inputs from the tokens
            inputs = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens))
            per_layer = {i: inputs[:, :, i, :] for i in self.here}
        rank, stages = self.pipeline_rank, self.pipeline_size
        if rank < stages - 1:  # mlx-lm's order: the last rank runs the first layers
            h = mx.distributed.recv_like(h, rank + 1)
        caches = dict(zip(self.kv_layers, cache))
        drop_passed(cache)
        order = {layer: i for i, layer in enumerate(taps)}
        tapped: list = [None] * len(taps)
        shared: dict = {}
        for i, block, mask in zip(self.here, self.blocks, self.masks(h, cache)):
            source = inner.previous_kvs[i]
            h, shared[i] = block(h, mask, caches.get(i), per_layer.get(i), shared.get(source) if source != i else None)
            if i in order:
                tapped[order[i]] = h
        if stages > 1:
            h, tapped = self.share(h, tapped, last_only)
        elif last_only:
            h = h[:, -1:]
        return self.logits(inner.norm(h)), mx.concatenate(tapped, axis=-1)


def gemma4_block(layer: nn.Module, window: int | None) -> Callable:
    """mlx-lm's gemma4_text DecoderLayer forward (h, mask, cache,
    per_layer_input, shared) -> (h, shared): ``shared`` the (keys, values,
    offset, rotation positions, cache) a layer reusing keys/values gets (its
    ``cache`` is None), taken before its source's cache grew."""
    attn = layer.self_attn

    def forward(h: mx.array, mask, cache, per_layer_input=None, shared=None):
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q = attn.q_norm(attn.q_proj(x).reshape(B, L, attn.n_heads, attn.head_dim))
        if shared is not None:
            k, v, offset, at, source = shared
        else:
            k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, attn.head_dim)
            v = k if attn.use_k_eq_v else attn.v_proj(x).reshape(B, L, attn.n_kv_heads, attn.head_dim)
            offset = (
                0 if cache is None else (cache.offset if isinstance(cache.offset, mx.array) else mx.array(cache.offset))
            )
            at = offset if cache is None else rope_positions(cache)
            k = rotate(attn.rope, attn.k_norm(k).transpose(0, 2, 1, 3), at)
            v = attn.v_norm(v).transpose(0, 2, 1, 3)
            source = cache
        q = rotate(attn.rope, q.transpose(0, 2, 1, 3), at)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        # A reusing layer attends over its source's buffer from the source's
        # offset: the same attention as mlx-lm's cacheless call.
        over = source if cache is not None or is_buffer(source) else None
        out = attention(q, k, v, cache=over, scale=attn.scale, mask=mask, start=offset, window=window)
        out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        h = h + layer.post_attention_layernorm(out)
        h = h + layer.post_feedforward_layernorm(feed_forward(layer, h))
        if (
            layer.per_layer_input_gate is not None
            and layer.per_layer_projection is not None
            and layer.post_per_layer_input_norm is not None
            and per_layer_input is not None
        ):
            gate = mx.multiply(nn.gelu_approx(layer.per_layer_input_gate(h)), per_layer_input)
            h = h + layer.post_per_layer_input_norm(layer.per_layer_projection(gate))
        if layer.layer_scalar is not None:
            h = h * layer.layer_scalar
        return h, (k, v, offset, at, source)

    return forward


def feed_forward(layer: nn.Module, h: mx.array) -> mx.array:
    """A gemma4_text layer's MLP plus experts, before the post-feed-forward norm."""
    if not layer.enable_moe:
        return layer.mlp(layer.pre_feedforward_layernorm(h))
    dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(h)))
    experts = layer.experts(layer.pre_feedforward_layernorm_2(h), *layer.router(h))
    return dense + layer.post_feedforward_layernorm_2(experts)
