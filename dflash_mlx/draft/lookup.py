"""Prompt lookup: drafts copied from where the last committed tokens occurred before.

The committed tokens live in a device buffer (``TokenHistory``) that each cycle
writes as it writes the KV buffers: positions 0..length hold the committed
tokens (``length``: the last one, not in the caches yet), positions past it are
scratch that a later cycle overwrites. ``find`` matches the last n tokens
against every earlier place with array ops, inside the cycle's graph, so the
next cycle is still queued before the host reads this one's tokens;
``find_believed`` also lets a drafter's logits choose among shorter matches.

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
    """Matches of the last n committed tokens, n from ``max_ngram`` down to 1.
    Beside a DFlash drafter a cycle drafts the longest match's continuation
    where n >= ``min_ngram``; else, with the drafter's logits at hand, the
    continuation of a shorter match that the drafter believes most, where it
    expects at least ``belief`` times the drafts accepted that it expects of
    its own first choices (``find_believed``)."""

    min_ngram: int = 3
    max_ngram: int = 8
    belief: float = 0.2


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


def match_lengths(history: mx.array, length, max_ngram: int) -> mx.array:
    """[capacity]: how many tokens (up to ``max_ngram``) ending at each
    earlier place match those ending at ``length``; 0 at ``length`` and past."""
    capacity = history.shape[0]
    levels = constant_arange(max_ngram)  # j: the token j back from the last
    ends = constant_arange(capacity)
    earlier = ends[None] - levels[:, None]  # [n, capacity]: q - j for a match ending at q
    back = length - levels
    same = mx.take(history, mx.maximum(earlier, 0)) == mx.take(history, mx.maximum(back, 0))[:, None]
    # a match ends before the last token (its next token is committed) and starts at 0 or later
    same = same & (earlier >= 0) & (back >= 0)[:, None] & (ends < length)[None]
    return mx.sum(mx.cumprod(same.astype(mx.int32), axis=0), axis=0)


def continuations(history: mx.array, length, ends: mx.array, k: int) -> mx.array:
    """[*ends.shape, k]: the ``k`` tokens after each place in ``ends``. One
    that runs past ``length`` repeats the span it copied, as a repeating
    sequence would go on."""
    at = ends[..., None] + 1 + constant_arange(k)
    period = mx.maximum(length - ends, 1)[..., None]
    past = at - length
    at = mx.where(past > 0, at - period * ((past + period - 1) // period), at)
    return mx.take(history, mx.clip(at, 0, history.shape[0] - 1))


def _longest(n: mx.array) -> tuple[mx.array, mx.array]:
    """(the most recent place of the longest match, its length; -1 and 0: none)."""
    best_n = mx.max(n)
    latest = mx.max(mx.where(n == best_n, constant_arange(n.shape[0]), -1))
    return mx.where(best_n > 0, latest, -1), best_n


def find(history: mx.array, length, k: int, params: LookupParams) -> tuple[mx.array, mx.array]:
    """The ``k`` tokens that followed the most recent earlier occurrence of
    the longest n-gram ending at ``length`` (n <= max_ngram), and that n (0:
    no match)."""
    end, n = _longest(match_lengths(history, length, params.max_ngram))
    return continuations(history, length, end, k), n


def find_believed(history: mx.array, length, logits: mx.array, params: LookupParams) -> tuple[mx.array, mx.array]:
    """Beside a drafter whose block gave ``logits`` [k, V]: (k drafts, whether
    the cycle drafts them). The longest match's continuation where n >=
    min_ngram; else, of every earlier place where the last token occurred,
    the continuation the drafter believes most: the drafts it expects
    accepted (the sum over depths of the product of its probabilities up to
    each), where that is at least ``belief`` times what it expects of its
    own first choices. Its probabilities undercount copies, which a match
    makes likely, so a copy it believes less than its own choices still wins."""
    k = logits.shape[0]
    n = match_lengths(history, length, params.max_ngram)
    end, longest = _longest(n)
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    copies = continuations(history, length, constant_arange(history.shape[0]), k)  # [capacity, k]
    flat = constant_arange(k) * logprobs.shape[-1] + copies
    expected = mx.sum(mx.cumprod(mx.exp(mx.take(logprobs.reshape(-1), flat)), axis=1), axis=1)
    expected = mx.where(n > 0, expected, -1.0)
    believed = mx.argmax(expected)
    own = mx.sum(mx.cumprod(mx.exp(mx.max(logprobs, axis=-1))))
    by_match = longest >= params.min_ngram
    by_belief = expected[believed] >= params.belief * own
    drafts = mx.where(by_match, continuations(history, length, end, k), copies[believed])
    return drafts, by_match | by_belief


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
