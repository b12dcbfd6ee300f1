"""The target adapter: a forward pass over mlx-lm's own layer modules that
returns logits together with the hidden states DFlash taps, plus rollback.

Nothing in mlx-lm is patched: the adapter runs the family's decoder loop
itself, calling the model's embedding, layers, norm and head."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..cache.buffer import BufferKVCache, set_lengths
from ..layers.attention import prepare
from ..layers.fused import block, linear_like
from ..layers.linear import NORM_MOST, apply_linear


class DenseTarget:
    """Dense-attention decoder (``model.model.{embed_tokens, layers, norm}`` and
    ``lm_head`` or tied embeddings), bf16 or mlx-lm-quantized alike. A
    multimodal wrapper (mlx-lm's ``gemma3``, ``gemma4``, ``qwen3_5``: the text
    model as ``model.language_model``, the vision tower dropped at load) is
    served through its text model."""

    family = "dense"
    # Run each layer with its q/k/v and gate/up products fused (fused.py):
    # families whose layers are mlx-lm's plain qwen3/llama blocks.
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

    def make_blocks(self) -> None:
        """The layers' forwards (``layer_block``, made from their projections
        as they are now), and the kernel variants they reach, checked."""
        windows = self.windows()
        self.blocks = [self.layer_block(layer, w) for layer, w in zip(self.inner.layers, windows)]
        prepare(self.dtype, self.head_dim, windows)

    def layer_block(self, layer: nn.Module, window: int | None):
        """One layer's forward (h, mask, cache) -> h, its attention through
        ``attention.attention``: here fused products where the layer allows
        (fused.py), else the layer itself; families with layers of their
        own shape override it."""
        return block(layer, window) if self.fuse_projections else layer

    @property
    def head_dim(self) -> int:
        args = self.text.args
        return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)

    # -- pieces the drafter shares -----------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        h = self.inner.embed_tokens(tokens)
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def lm_head(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        """The output head's logits of ``norm(h)`` (``norm``: None, or the
        RMSNorm before the head: in the head's product launch where a small
        head takes the block-product kernel)."""
        head = self._small_head()
        if head is not None:
            return apply_linear(head, h, norm=norm)
        h = h if norm is None else norm(h)
        if self.tied:
            return self.inner.embed_tokens.as_linear(h)
        return self.text.lm_head(h)

    def _small_head(self) -> nn.Linear | None:
        """The output head as an nn.Linear (a tied embedding's weight held
        by one, no copy; kept while that weight is the embedding's) where it
        is a plain linear layer whose final norm can go into its product's
        launch (fewer than linear.NORM_MOST elements: a small pair,
        whose cycle is bound by launches), else None (quantized, or large:
        Qwen3-8B's 622M-element head keeps MLX's product)."""
        if not self.tied:
            head = self.text.lm_head
            return head if type(head) is nn.Linear and head.weight.size < NORM_MOST else None
        embed = self.inner.embed_tokens
        if type(embed) is not nn.Embedding or embed.weight.size >= NORM_MOST:
            self._tied_head = None  # (a wrapper kept from before would hold the old weight)
            return None
        kept = getattr(self, "_tied_head", None)
        if kept is None or kept.weight is not embed.weight:
            kept = self._tied_head = linear_like(nn.Linear, {"weight": embed.weight})
        return kept

    @property
    def dtype(self):
        return self.inner.norm.weight.dtype

    # -- forward and cache ---------------------------------------------------
    def make_cache(self) -> list:
        """One cache per layer: fixed-capacity buffers whose length may live
        on the device (see kv_cache), so a verify's rollback is decided there."""
        return [BufferKVCache() for _ in self.inner.layers]

    def windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full attention."""
        return [None] * self.num_layers

    def masks(self, h: mx.array, cache: list) -> list:
        """Each layer's mask, made by its cache (mlx-lm's protocol)."""
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
        """tokens: [1, L]. Returns (logits [1, L or 1, V], hidden [1, L, len(taps)*H]),
        hidden being the outputs of decoder layers ``taps`` (0-based, before
        the final norm), concatenated in the order given."""
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
        """The first layer's input; ``embed`` unless the family transforms it
        further than what the drafter shares."""
        return self.embed(tokens)

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        """The target's logits from its final states through ``norm`` (None:
        already normed); ``lm_head`` unless the family scales them past what
        the drafter shares."""
        return self.lm_head(h, norm)

    def set_length(self, cache: list, length, bound: int | None = None) -> None:
        """Keep the first ``length`` cached positions (an int, or an array the
        host does not read, with ``bound`` a host-side upper bound on it):
        rollback moves the caches' lengths, no copy."""
        set_lengths(cache, length, bound)
