"""Hybrid targets (``qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``): gated
delta-net layers (DeltaCache, exact rollback) mixed with attention layers
(plain buffers). A state no cache kept is rebuilt by re-reading tokens from
the nearest checkpoint; attention keys/values are read in place, as they are
never rewritten below the committed length."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import create_attention_mask

from .. import distributed
from ..kernels import gated_delta
from ..kv.buffer import BufferKVCache, positions_mask, set_lengths
from ..kv.tree import keep_path
from ..layers import experts
from ..layers.attention import prepare
from ..layers.blocks import attend
from ..layers.linear import in_prompt, prompt_products
from .base import DenseTarget
from .recurrent import DeltaCache, PathRows, _value, measure_rollback


class HybridCache(list):
    """The per-layer caches plus a log of (start, ids, in a prompt) per write,
    for re-reads."""

    def __init__(self, layers):
        super().__init__(layers)
        self.log: list[tuple[int | mx.array, mx.array, bool]] = []

    # A compiled cycle's write is logged by the host after each call (a replay
    # runs none of the adapter's code): as DeltaCache's, decode/cycle.py.
    traced_returns = 1

    def enter_trace(self, length: mx.array, bound: int) -> int:
        return len(self.log)

    def traced_inputs(self) -> list:
        return []

    def set_traced(self, given) -> None:
        pass

    def leave_trace(self, held: int) -> None:
        del self.log[held:]

    def traced_outputs(self) -> tuple:
        return (self.log[-1][1],)  # the ids the cycle wrote (a tree's: its kept path's)

    def take_outputs(self, outputs, start: mx.array) -> None:
        self.log.append((start, outputs[0], False))

    def ids(self, n: int) -> tuple[list[int], list[bool]]:
        """The ids at positions 0..n-1 as last written, and whether a prompt wrote each."""
        seq: list[int] = []
        prompt: list[bool] = []
        for start, ids, by_prompt in self.log:
            s = _value(start)
            if s >= n:
                continue
            written = ids.tolist()[: n - s]
            seq[s:] = written
            prompt[s:] = [by_prompt] * len(written)
        if len(seq) < n:
            raise LookupError(f"positions up to {n} were never written")
        self.log = [(s, mx.array(seq[s:e], mx.int32), p) for s, e, p in runs(prompt[:n])]
        return seq[:n], prompt[:n]


def runs(flags: list[bool]) -> list[tuple[int, int, bool]]:
    """(start, end, flag) of each stretch of equal ``flags``."""
    out, start = [], 0
    for flag, stretch in itertools.groupby(flags):
        end = start + sum(1 for _ in stretch)
        out.append((start, end, flag))
        start = end
    return out


class _Reading:
    """An attention layer's cache during a re-read: reads in place, writes nothing."""

    def __init__(self, kv: BufferKVCache, start: int):
        self.kv, self.offset = kv, start

    @property
    def position(self) -> int:
        return self.offset

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return self.kv.keys, self.kv.values

    def make_mask(self, N: int, window_size=None, return_array=False):
        return positions_mask(N, self.offset, self.kv.capacity, window_size)


class HybridTarget(DenseTarget):
    """Under a pipeline, each rank's caches, masks and re-reads are its
    stage's (``here``); every stage must hold a delta-net layer."""

    family = "qwen3_5"
    runs_a_stage = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.linear = [self.inner.layers[i].is_linear for i in self.here]
        # mlx-lm's fa_idx: the stage's first attention layer, whose cache makes the mask
        self.first_attention = next((e for e, linear in enumerate(self.linear) if not linear), None)
        if self.pipeline_size > 1:
            check_stages(self.text.args, self.pipeline_size)

    def make_blocks(self) -> None:
        layers = [self.inner.layers[i] for i in self.here]
        self.blocks = [delta_block(layer) if layer.is_linear else attention_block(layer) for layer in layers]
        prepare(self.dtype, self.head_dim, [None])
        delta = next((layer.linear_attn for layer in layers if layer.is_linear), None)
        if delta is not None:  # (None: a stage check_stages refuses)
            gated_delta.prepare(self.dtype, delta.head_k_dim, delta.head_v_dim)
            measure_rollback(delta, self.dtype)

    def make_cache(self) -> HybridCache:
        return HybridCache(DeltaCache() if linear else BufferKVCache() for linear in self.linear)

    def masks(self, h, cache):
        """The attention layers' one mask (none on a stage without them); a
        delta-net layer takes none, its cache holding its whole past."""
        at = self.first_attention
        mask = None if at is None else create_attention_mask(h, cache[at], return_array=False)
        return [None if linear else mask for linear in self.linear]

    def __call__(self, tokens: mx.array, cache: list, taps: Sequence[int], last_only: bool = False):
        if isinstance(cache, HybridCache):
            # (every layer's cache holds one length)
            cache.log.append((cache[0].offset, tokens[0], in_prompt()))
        return super().__call__(tokens, cache, taps, last_only)

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        # the final norm on its own, then the head, as this adapter has always run them
        return self.lm_head(h if norm is None else norm(h))

    def takes_trees(self, cache: list) -> bool:
        """Every layer runs our forwards: attention rotating each row at its
        depth over plain buffers, delta-net layers running each node from its
        ancestors' inputs and its parent's state (recurrent.py)."""
        return all(type(c) in (BufferKVCache, DeltaCache) for c in cache)

    def keep_path(self, cache: list, start, path: mx.array) -> None:
        """After a tree's verify: the attention rows move as the base's, each
        delta-net layer keeps the path's write for the cut, and the log holds
        the path's ids, so that a re-read sees the tokens kept."""
        keep_path([c for c in cache if isinstance(c, BufferKVCache)], start, path)
        rows = PathRows(path)
        for c in cache:
            if isinstance(c, DeltaCache):
                c.keep_path(rows)
        if isinstance(cache, HybridCache) and cache.log:
            at, ids, prompt = cache.log[-1]  # (the tree's nodes, written last)
            cache.log[-1] = (at, mx.take(ids, path), prompt)

    def set_length(self, cache: list, length, bound: int | None = None, read: str = "bound") -> None:
        """An array length: a verify's rollback, on the device. An int: the
        exact state after ``length`` positions (a sync)."""
        if not isinstance(length, int):
            set_lengths([c for c in cache if isinstance(c, BufferKVCache)], length, bound, read)
            for c in cache:
                if not isinstance(c, BufferKVCache):
                    c.set_length(length, bound)
            return
        delta = [c for c in cache if isinstance(c, DeltaCache)]
        for c in cache:
            if isinstance(c, BufferKVCache):
                c.set_length(length, read=read)
        written = cache.ids(length) if isinstance(cache, HybridCache) else None
        if not all(c.restore(length) for c in delta):
            if written is None:
                raise LookupError(f"no state kept at length {length}")
            self._reread(cache, *written)

    def _reread(self, cache: HybridCache, ids: list[int], prompt: list[bool]) -> None:
        """Bring every delta-net layer to exactly ``len(ids)`` positions from
        the nearest checkpoint all of them hold, re-reading the ids between,
        each stretch as it was written (a prompt's through MLX's own products,
        linear.prompt_products; a verify's through its products)."""
        n = len(ids)
        delta = [c for c in cache if isinstance(c, DeltaCache)]
        m = min(c.restorable(n) for c in delta)
        for c in delta:
            c.restore(m)
        reading = [c if isinstance(c, DeltaCache) else _Reading(c, m) for c in cache]
        sent = []
        # Under a pipeline every rank re-reads from the same m (checkpoints at the same
        # lengths); on the decode loop's stream, after its exchanges, which share the connection.
        with mx.stream(generation_stream):
            for start, end, by_prompt in runs(prompt[m:]):
                with prompt_products() if by_prompt else contextlib.nullcontext():
                    h, _ = self.run_stage(self.embed(mx.array(ids[m + start : m + end], mx.int32)[None]), reading, ())
                sent.append(self.pass_on(h))
        for c in delta:
            c.restore(n)
        mx.eval([a for c in delta for a in c.state if a is not None] + [s for s in sent if s is not None])


def check_stages(args, ranks: int) -> None:
    """Refuse, on every rank alike, a pipeline of mlx-lm's even split over
    ``ranks`` where a stage holds no delta-net layer: a re-read (``set_length``)
    runs on every stage when a delta-net layer's cut-back state was not kept,
    which only a stage holding one can tell."""
    count = args.num_hidden_layers

    def delta_everywhere(n: int) -> bool:
        sizes = distributed.even_stages(count, n)
        ends = [count - sum(sizes[:r]) for r in range(n)]
        # mlx-lm's layer types: attention every full_attention_interval-th layer
        stages = [range(end - size, end) for end, size in zip(ends, sizes)]
        return all(any((i + 1) % args.full_attention_interval for i in stage) for stage in stages)

    if not delta_everywhere(ranks):
        most = max(n for n in range(1, ranks) if delta_everywhere(n))
        raise ValueError(
            f"this target's {count} layers cannot be pipelined over {ranks} ranks so that "
            f"every rank holds a gated delta-net layer; run it on {most} ranks or with split='tensor'."
        )


def delta_block(layer: nn.Module) -> Callable:
    """A gated delta-net layer's forward (h, mask, cache) -> h, its recurrence
    through the layer's DeltaCache (the mask unused)."""
    mlp = experts.mlp(layer.mlp)

    def forward(h: mx.array, mask, cache) -> mx.array:
        h = h + cache.forward(layer.linear_attn, layer.input_layernorm(h))
        return h + mlp(layer.post_attention_layernorm(h))

    return forward


def attention_block(layer: nn.Module) -> Callable:
    """mlx-lm's Qwen3NextAttention layer forward (h, mask, cache) -> h."""
    attn = layer.self_attn
    mlp = experts.mlp(layer.mlp)

    def forward(h: mx.array, mask, cache) -> mx.array:
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q, gate = mx.split(attn.q_proj(x).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        k, v = attn.k_proj(x), attn.v_proj(x)
        q = attn.q_norm(q).transpose(0, 2, 1, 3)
        k = attn.k_norm(k.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        out = attend(attn.rope, q, k, v, cache=cache, scale=attn.scale, mask=mask)
        h = h + attn.o_proj(out * mx.sigmoid(gate))
        return h + mlp(layer.post_attention_layernorm(h))

    return forward


class Qwen3_5MoeTarget(HybridTarget):
    family = "qwen3_5_moe"


class Qwen3NextTarget(HybridTarget):
    family = "qwen3_next"
