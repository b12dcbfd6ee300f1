"""Prompt lookup: drafts copied from where the last committed tokens occurred before.

The committed tokens live in a device buffer (``TokenHistory``) that each cycle
writes as it writes the KV buffers: positions 0..length hold the committed
tokens (``length``: the last one, not in the caches yet), positions past it are
scratch that a later cycle overwrites. ``find`` matches the last n tokens
against every earlier place with array ops, inside the cycle's graph, so the
next cycle is still queued before the host reads this one's tokens.

``LookupDraft`` is the drafter of a target with no DFlash drafter: it has no
module, and every block's drafts are looked up.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..device import constant_arange


@dataclass(frozen=True)
class LookupParams:
    """Matches of the last n committed tokens, n from ``max_ngram`` down to 1;
    beside a DFlash drafter a cycle drafts from one of at least ``min_ngram``."""

    min_ngram: int = 3
    max_ngram: int = 8


class TokenHistory:
    """The committed tokens in a device buffer grown by the host ahead of writes."""

    step = 256

    def __init__(self, tokens: list[int]):
        self.tokens = mx.zeros((self.room(len(tokens)),), mx.int32)
        self.tokens[: len(tokens)] = mx.array(tokens, mx.int32)
        self.bound = len(tokens)  # a host-side upper bound on the positions written

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    def room(self, n: int) -> int:
        """The capacity needed to hold ``n`` positions."""
        return -(-max(n, 1) // self.step) * self.step

    def reserve(self, n: int) -> None:
        """Grow to hold ``n`` positions (outside a compiled graph: its shapes are fixed)."""
        cap = self.room(n)
        if cap > self.capacity:
            self.tokens = mx.concatenate([self.tokens, mx.zeros((cap - self.capacity,), mx.int32)])

    def write(self, tokens: mx.array, start) -> None:
        """Store ``tokens`` [n] at start..start+n-1 (``start`` an int or a device scalar)."""
        positions = constant_arange(tokens.shape[0]) + start
        self.tokens = mx.put_along_axis(self.tokens, positions, tokens.astype(mx.int32), axis=0)


def find(history: mx.array, length, k: int, params: LookupParams) -> tuple[mx.array, mx.array]:
    """The ``k`` tokens that followed the most recent earlier occurrence of
    the longest n-gram ending at ``length`` (n <= max_ngram), and that n (0:
    no match). A continuation that runs past ``length`` repeats the span it
    copied, as a repeating sequence would go on."""
    capacity = history.shape[0]
    levels = constant_arange(params.max_ngram)  # j: the token j back from the last
    ends = constant_arange(capacity)
    earlier = ends[None] - levels[:, None]  # [n, capacity]: q - j for a match ending at q
    back = length - levels
    same = mx.take(history, mx.maximum(earlier, 0)) == mx.take(history, mx.maximum(back, 0))[:, None]
    # a match ends before the last token (its next token is committed) and starts at 0 or later
    same = same & (earlier >= 0) & (back >= 0)[:, None] & (ends < length)[None]
    matched = mx.cumprod(same.astype(mx.int32), axis=0)  # row j: the last j + 1 tokens all match
    latest = mx.max(mx.where(matched > 0, ends[None], -1), axis=1)  # [n]: the most recent end per length
    best_n = mx.max(mx.where(latest >= 0, levels + 1, 0))
    best_end = mx.where(best_n > 0, mx.take(latest, mx.maximum(best_n - 1, 0)), -1)
    at = best_end + 1 + constant_arange(k)
    period = mx.maximum(length - best_end, 1)
    past = at - length
    at = mx.where(past > 0, at - period * ((past + period - 1) // period), at)
    return mx.take(history, mx.clip(at, 0, capacity - 1)), best_n


def agreeing(drafts: mx.array, tokens: mx.array) -> mx.array:
    """How many leading ``drafts`` [k] equal ``tokens`` [>= k]."""
    return mx.sum(mx.cumprod((drafts == tokens[: drafts.shape[0]]).astype(mx.int32)))


@dataclass
class LookupGate:
    """``lookup="auto"`` for one reply: on the cycles where a match was found,
    the drafts each way would have had accepted (the chain verified, exactly;
    the other, up to one past where the verified chain broke off, a lower
    bound); lookup stays on while its count is at least the drafter's."""

    lookup_accepted: int = 0
    drafter_accepted: int = 0

    def record(self, matched: bool, hit: bool, accepted: int, other: int) -> None:
        if not matched or other < 0:
            return
        self.lookup_accepted += accepted if hit else other
        self.drafter_accepted += other if hit else accepted

    @property
    def enabled(self) -> bool:
        return self.lookup_accepted >= self.drafter_accepted


@dataclass
class LookupConfig:
    """What the loop and the cache read of a drafter's config."""

    block_size: int
    vocab_size: int = 0
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)


class LookupDraft(nn.Module):
    """A drafter with no module, for a target that has no DFlash drafter: its
    drafts are looked up. Holds no context, so its cache has no layers."""

    selects_candidates = False
    fuse_projections = False
    rope = None

    def __init__(self, block_size: int = 16):
        super().__init__()
        self.config = LookupConfig(block_size)
        self.layers = []

    def bind(self, target) -> LookupDraft:
        self.config.vocab_size = target.vocab_size
        # the target returns tapped states whatever it is asked; one layer's, never read
        self.config.target_layer_ids = [target.num_layers - 1]
        return self

    def make_cache(self) -> list:
        return []

    def extend(self, taps: mx.array, cache: list, fused: list | None = None) -> None:
        pass

    def fused_projections(self) -> list:
        return []


_drafters: dict[int, tuple[weakref.ref, LookupDraft]] = {}


def lookup_drafter(model: nn.Module) -> LookupDraft:
    """The lookup-only drafter kept for ``model``: one per model, so its
    compiled cycles and its prompt caches' pairing last across calls."""
    key = id(model)
    entry = _drafters.get(key)
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model, lambda _, key=key: _drafters.pop(key, None)), LookupDraft())
        _drafters[key] = entry
    return entry[1]
