"""The target adapter: runs mlx-lm's own modules (nothing patched) and returns
logits with the hidden states DFlash taps, plus rollback."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..kv.buffer import BufferKVCache, set_lengths
from ..layers.attention import prepare
from ..layers.fused import block, linear_like
from ..layers.linear import NORM_MOST, apply_linear, linear_head, prepare_exact, prepare_quantized, quantized_head


class DenseTarget:
    """Dense-attention decoder (``model.model.{embed_tokens, layers, norm}``),
    bf16 or quantized; a multimodal wrapper is served through its
    ``language_model``."""

    family = "dense"
    # Only for families whose layers are mlx-lm's plain qwen3/llama blocks.
    fuse_projections = False

    def __init__(self, model: nn.Module):
        self.model = model  # what mlx-lm loaded: the prompt cache's identity
        self.text = getattr(model, "language_model", model)
        self.inner = self.text.model
        args = self.text.args
        self.hidden_size = int(args.hidden_size)
        self.vocab_size = int(args.vocab_size)
        self.num_layers = len(self.inner.layers)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or "lm_head" not in self.text
        self.embed_scale = 1.0
        self.make_blocks()
        prepare_quantized(self.text, self.dtype)
        prepare_exact(self.text, self.dtype)

    def make_blocks(self) -> None:
        """Build the layers' forwards from their current projections."""
        windows = self.windows()
        self.blocks = [self.layer_block(layer, w) for layer, w in zip(self.inner.layers, windows)]
        prepare(self.dtype, self.head_dim, windows)

    def layer_block(self, layer: nn.Module, window: int | None):
        """One layer's forward (h, mask, cache) -> h."""
        return block(layer, window) if self.fuse_projections else layer

    @property
    def head_dim(self) -> int:
        args = self.text.args
        return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.inner.embed_tokens(tokens)
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def lm_head(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        """The output head's logits of ``norm(h)`` (``norm`` None: already normed)."""
        head = self._small_head()
        if head is not None:
            return apply_linear(head, h, norm=norm)
        h = h if norm is None else norm(h)
        if not self.tied:
            return apply_linear(self.text.lm_head, h)
        embedding = self.inner.embed_tokens
        # its verify rows through the exact products where they serve
        if type(embedding) is nn.QuantizedEmbedding:
            return apply_linear(quantized_head(embedding), h)
        return apply_linear(linear_head(embedding), h)

    def _small_head(self) -> nn.Linear | None:
        """The head as a plain nn.Linear below linear.NORM_MOST elements, so its
        norm can join its product; None if quantized or large."""
        if not self.tied:
            head = self.text.lm_head
            return head if type(head) is nn.Linear and head.weight.size < NORM_MOST else None
        embed = self.inner.embed_tokens
        if type(embed) is not nn.Embedding or embed.weight.size >= NORM_MOST:
            self._tied_head = None  # a kept wrapper would hold the old weight
            return None
        kept = getattr(self, "_tied_head", None)
        if kept is None or kept.weight is not embed.weight:
            kept = self._tied_head = linear_like(nn.Linear, {"weight": embed.weight})
        return kept

    @property
    def dtype(self):
        return self.inner.norm.weight.dtype

    def make_cache(self) -> list:
        """One buffer per layer; its length may live on the device."""
        return [BufferKVCache() for _ in self.inner.layers]

    def windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full attention."""
        return [None] * self.num_layers

    def masks(self, h: mx.array, cache: list) -> list:
        """Each layer's mask, made by its cache."""
        windows = self.windows()
        made = {w: create_attention_mask(h, cache[0], window_size=w, return_array=True) for w in set(windows)}
        return [made[w] for w in windows]

    def __call__(
        self,
        tokens: mx.array,
        cache: list,
        taps: Sequence[int],
        last_only: bool = False,
    ) -> tuple[mx.array, mx.array]:
        """tokens [1, L] -> (logits [1, L or 1, V], hidden [1, L, len(taps)*H]):
        the outputs of layers ``taps`` before the final norm, in that order."""
        h = self.first_input(tokens)
        order = {layer: i for i, layer in enumerate(taps)}
        tapped: list = [None] * len(taps)
        for i, (layer, c, mask) in enumerate(zip(self.blocks, cache, self.masks(h, cache))):
            h = layer(h, mask, c)
            if i in order:
                tapped[order[i]] = h
        if last_only:
            h = h[:, -1:]
        return self.logits(h, self.inner.norm), mx.concatenate(tapped, axis=-1)

    def first_input(self, tokens: mx.array) -> mx.array:
        """The first layer's input."""
        return self.embed(tokens)

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        """The target's own logits (``lm_head`` unless the family rescales)."""
        return self.lm_head(h, norm)

    def set_length(self, cache: list, length, bound: int | None = None, read: str = "bound") -> None:
        """Keep the first ``length`` cached positions (an int or device array,
        ``bound`` a host-side upper bound): a move of lengths, no copy.
        ``read``: how the next forward's attention spans its buffers."""
        set_lengths(cache, length, bound, read)
