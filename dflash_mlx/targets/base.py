"""The target adapter: runs mlx-lm's own modules (nothing patched) and returns
logits with the hidden states DFlash taps, plus rollback."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from .. import distributed
from ..kv.buffer import BufferKVCache, set_lengths
from ..kv.tree import TreeLayout, keep_path
from ..kv.window import WindowKVCache, drop_passed, is_buffer
from ..layers.attention import prepare
from ..layers.fused import block, linear_like
from ..layers.linear import NORM_MOST, apply_linear, linear_head, prepare_products, quantized_head


class DenseTarget:
    """Dense-attention decoder (``model.model.{embed_tokens, layers, norm}``),
    bf16 or quantized; a multimodal wrapper is served through its
    ``language_model``."""

    family = "dense"
    # Whether every layer's forward is ours, rotating each row at its draft
    # tree depth (mlx-lm's own modules take one offset); make_blocks says.
    rotates_rows = False
    # Whether the layers need boolean masks: a prompt chunk's may otherwise be
    # "causal", which MLX's attention handles without materialising one.
    array_masks = False
    # Only for families whose layers are mlx-lm's plain qwen3/llama blocks.
    fuse_projections = False

    def __init__(self, model: nn.Module):
        self.model = model  # what mlx-lm loaded: the prompt cache's identity
        self.text = getattr(model, "language_model", model)
        self.inner = self.text.model
        args = self.text.args
        self.hidden_size = int(args.hidden_size)
        self.vocab_size = int(args.vocab_size)
        # Split across ranks by mlx-lm: each rank runs layers ``here``; tap ids stay global.
        self.pipeline_rank, self.pipeline_size = distributed.pipeline_place(self.inner)
        self.tensor_group = distributed.tensor_group(self.text)
        if self.tensor_group is not None:  # fused products and shape routing assume whole weights
            self.fuse_projections = False
        # the ranks that run every call together (mlx-lm's pipeline uses the global group)
        self.group = self.tensor_group or (mx.distributed.init() if self.pipeline_size > 1 else None)
        if self.pipeline_size > 1:
            if not self.pipelines():
                raise ValueError(
                    f"the {self.family} adapter cannot run a pipelined slice of the layers yet; load the target "
                    "with split='tensor' (--split tensor) or on one machine."
                )
            self.num_layers = int(args.num_hidden_layers)
            self.here = range(self.inner.start_idx, self.inner.end_idx)
        else:
            self.num_layers = len(self.inner.layers)
            self.here = range(self.num_layers)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or "lm_head" not in self.text
        self.embed_scale = 1.0
        self.make_blocks()
        prepare_products(self.text, self.dtype)

    # Whether the adapter runs a pipeline stage's slice of the layers (``here``);
    # None: when it builds its layers, caches and masks through this class.
    runs_a_stage: bool | None = None

    @classmethod
    def pipelines(cls) -> bool:
        if cls.runs_a_stage is not None:
            return cls.runs_a_stage
        own = ("make_blocks", "make_cache", "masks", "windows", "__call__", "run_stage", "set_length")
        return all(getattr(cls, name) is getattr(DenseTarget, name) for name in own)

    def make_blocks(self) -> None:
        """Build the layers' forwards from their current projections (only
        this rank's under a pipeline)."""
        windows = self.windows()
        layers = self.inner.layers
        if self.tensor_group is not None:  # mlx-lm's own forwards all-reduce inside the split modules
            self.blocks = [layers[i] for i in self.here]
        else:
            self.blocks = [self.layer_block(layers[i], windows[i]) for i in self.here]
        self.rotates_rows = not any(b is layers[i] for b, i in zip(self.blocks, self.here))
        prepare(self.dtype, self.head_dim, [windows[i] for i in self.here])

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
        """One buffer per layer (per layer of this rank's stage); its length
        may live on the device."""
        windows = self.windows()
        return [self.kv_cache(windows[i]) for i in self.here]

    def kv_cache(self, window: int | None):
        """A layer's cache: a sliding-window layer holds its window only
        where our forwards rotate its rows (kv/window.py), since they are
        what reads a position past the dropped ones."""
        return WindowKVCache(window) if window is not None and self.rotates_rows else BufferKVCache()

    def windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full attention."""
        return [None] * self.num_layers

    def masks(self, h: mx.array, cache: list) -> list:
        """Each layer's mask, made by the first cache of its kind (a sliding
        layer's buffer holds other positions than a full layer's)."""
        windows = [self.windows()[i] for i in self.here]
        made = {}
        for w, c in zip(windows, cache):
            if w not in made:
                made[w] = create_attention_mask(h, c, window_size=w, return_array=self.array_masks)
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
        h, tapped = self.run_stage(self.first_input(tokens), cache, taps)
        if self.pipeline_size > 1:
            h, tapped = self.share(h, tapped, last_only)
        elif last_only:
            h = h[:, -1:]
        return self.logits(h, self.inner.norm), mx.concatenate(tapped, axis=-1)

    def run_stage(self, h: mx.array, cache: list, taps: Sequence[int]) -> tuple[mx.array, list]:
        """This rank's layers over ``h`` (under a pipeline, over the hidden
        state received from the stage before instead): their output, and
        the outputs of those of layers ``taps`` run here (None for the rest)."""
        rank, stages = self.pipeline_rank, self.pipeline_size
        if rank < stages - 1:  # mlx-lm's order: the last rank runs the first layers
            h = mx.distributed.recv_like(h, rank + 1)
        order = {layer: i for i, layer in enumerate(taps)}
        tapped: list = [None] * len(taps)
        drop_passed(cache)
        for i, layer, c, mask in zip(self.here, self.blocks, cache, self.masks(h, cache)):
            h = layer(h, mask, c)
            if i in order:
                tapped[order[i]] = h
        return h, tapped

    def pass_on(self, h: mx.array) -> mx.array | None:
        """Send this stage's output to the next stage (rank - 1); None on
        rank 0, which runs the last layers."""
        return mx.distributed.send(h, self.pipeline_rank - 1) if self.pipeline_rank != 0 else None

    def share(self, h: mx.array, tapped: list, last_only: bool) -> tuple[mx.array, list]:
        """Pass ``h`` on to the next stage, and bring every tap and the last
        stage's output to every rank: one all-sum of a buffer each rank fills
        only where it ran the layer (adding zeros is exact)."""
        rank = self.pipeline_rank
        last = h[:, -1:] if last_only else h
        zero = mx.zeros_like(h)
        parts = [zero if t is None else t for t in tapped] + [last if rank == 0 else mx.zeros_like(last)]
        flat = mx.concatenate([p.reshape(-1) for p in parts])
        sent = self.pass_on(h)
        if sent is not None:
            flat = mx.depends(flat, sent)
        flat = mx.distributed.all_sum(flat)
        rows = [p.size for p in parts]
        pieces = mx.split(flat, [sum(rows[: k + 1]) for k in range(len(rows) - 1)])
        shared = [p.reshape(q.shape) for p, q in zip(pieces, parts)]
        return shared[-1], shared[:-1]

    def first_input(self, tokens: mx.array) -> mx.array:
        """The first layer's input."""
        return self.embed(tokens)

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        """The target's own logits (``lm_head`` unless the family rescales)."""
        return self.lm_head(h, norm)

    def prepare_trees(self) -> None:
        """Check and measure the draft-tree attention variants this target's
        layers would use, before a decode that verifies trees."""
        windows = self.windows()
        prepare(self.dtype, self.head_dim, [windows[i] for i in self.here], trees=True)

    def takes_trees(self, cache: list) -> bool:
        """Whether a draft tree can be verified over ``cache``: every layer
        runs our forwards, which rotate each row at its depth, over plain
        buffers whose rows ``keep_path`` moves."""
        return self.rotates_rows and all(is_buffer(c) for c in cache)

    def set_tree(self, cache: list, tree: TreeLayout | None) -> None:
        """Lay the next forward's rows out as ``tree`` (None: a block)."""
        for c in cache:
            c.tree = tree

    def keep_path(self, cache: list, start, path: mx.array) -> None:
        """After a tree's verify, move the accepted path's rows to follow ``start``."""
        keep_path(cache, start, path)

    def set_length(self, cache: list, length, bound: int | None = None, read: str = "bound") -> None:
        """Keep the first ``length`` cached positions (an int or device array,
        ``bound`` a host-side upper bound): a move of lengths, no copy.
        ``read``: how the next forward's attention spans its buffers."""
        set_lengths(cache, length, bound, read)
