"""The caches of one conversation, kept across calls so a follow-up prompt
re-reads only what is new.

``tokens`` lists the ids both caches hold at 0..len(tokens)-1. Nothing writes
below ``len(tokens)`` and it grows only once writes are queued in full, so an
exception anywhere leaves garbage only past the end; lengths are settled from
it whenever a generation takes or releases the cache. One generation owns the
cache at a time; a newer call takes it over and the older one goes stale.

A cache's bits depend on how its positions were read (a product of one row
rounds unlike a row of many), so ``chunks`` reads a prompt as mlx-lm's
generate_step does (the last id alone), and the previous reply's uncached
last token is read alone first, as mlx-lm decoded it. A bounded cache that
wrapped cannot be cut back: it is read afresh. Nor can a sliding-window
layer be cut back past what it holds (kv/window.py), except to the start of
the last reply, whose window it keeps: the rest is read again from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..draft.dflash import DFlashDraft
from ..draft.lookup import lookup_drafter
from ..kv import window
from ..kv.buffer import DeviceLengthCache, align, set_lengths
from ..kv.quantized import QuantizedBufferKVCache, check_settings
from ..kv.rotating import DraftWindowCache, RotatingBufferKVCache, check_max_kv_size
from ..targets import DenseTarget, adapt
from .decoding import decoding

# Positions past a prompt that its buffers are given with it: a first cycle
# then writes without growing (a copy of every buffer) right after the prompt.
REPLY_ROOM = 64

# Ids compared a slice at a time (in C) before the one slice that differs is walked.
_SPAN = 512


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids ``a`` and ``b`` (lists, or 1-D numpy arrays) share from their start."""
    m = min(len(a), len(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        differ = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
        return int(differ[0]) if differ.size else m
    a, b = (x if type(x) is list else list(x) for x in (a, b))  # (a list never equals a tuple)
    n = 0
    while n < m:
        end = min(n + _SPAN, m)
        if a[n:end] != b[n:end]:
            while a[n] == b[n]:
                n += 1
            return n
        n = end
    return m


class StaleGenerationError(RuntimeError):
    """A generator resumed after a newer call took over its prompt cache."""


class PromptCache:
    """A cache to pass to ``stream_generate`` across turns; only the uncached
    part of each prompt is read. ``kv_bits`` etc. quantize as mlx-lm's
    QuantizedKVCache; ``max_kv_size`` bounds it as mlx-lm's RotatingKVCache.
    ``draft`` None: for drafting by prompt lookup alone (lookup_drafter)."""

    def __init__(
        self,
        model,
        draft: DFlashDraft | None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 0,
        max_kv_size: int | None = None,
    ):
        target = adapt(model)
        if draft is None:
            draft = lookup_drafter(target.model)
        check_max_kv_size(target, max_kv_size, kv_bits)
        check_settings(target, kv_bits, kv_group_size, quantized_kv_start)
        self.max_kv_size = max_kv_size
        self.kv_bits, self.kv_group_size, self.quantized_kv_start = kv_bits, kv_group_size, quantized_kv_start
        draft.bind(target)
        self.model, self.draft_model = target.model, draft
        self.adapter = target
        self.target, self.draft = self._new_caches()
        self.tokens: list[int] = []
        self.owner: object | None = None
        self.reply_from: int | None = None  # the position of the last prefill's reply
        self.reply_next = False  # the next id is the last reply's uncached last token

    def _new_caches(self) -> tuple[list, list]:
        if self.max_kv_size is None:
            return self.adapter.make_cache(), self.draft_model.make_cache()
        block = self.draft_model.config.block_size  # the largest verify block
        target = [RotatingBufferKVCache(self.max_kv_size, block) for _ in range(self.adapter.num_layers)]
        # the drafter drops positions only once the target's ring has wrapped
        window = target[0].slots
        return target, [DraftWindowCache(window, self.draft_model.rope) for _ in self.draft_model.layers]

    def check_pair(self, target: DenseTarget, draft: DFlashDraft) -> None:
        if target.model is not self.model or draft is not self.draft_model:
            raise ValueError(
                "this prompt cache was made for another model pair; make one for this pair "
                "with make_prompt_cache(model, draft)."
            )

    def settle(self) -> None:
        """Set every layer's length to ``len(tokens)``, dropping anything past it."""
        n = len(self.tokens)
        self.adapter.set_length(self.target, n)
        set_lengths(self.draft, n)
        align(self.target)
        align(self.draft)

    def expect(self, n: int) -> None:
        """Let the layers that hold every position grow once, to ``n`` ids and
        REPLY_ROOM more, rather than a step at a time: a long prompt's chunks
        then copy no buffer, and a cache made to continue from a prefix is
        made at the size the prompt needs. Not a target layer still to be
        quantized: it would hold the prompt at full precision first."""
        layers = self.draft if self.quantization_pending else self.target + self.draft
        for c in layers:
            if isinstance(c, DeviceLengthCache) and getattr(c, "window", None) is None:
                c.floor = max(c.floor, c.rounded(n + REPLY_ROOM))

    def claim(self, owner: object) -> None:
        """Make ``owner`` the only generation allowed to change the cache."""
        if self.owner is None:  # a takeover keeps the older generation's place in the gate
            decoding.enter()
        self.owner = owner
        self.settle()

    def release(self, owner: object) -> None:
        """Settle the lengths unless a newer generation has taken the cache."""
        if self.owner is owner:
            try:
                self.settle()
            finally:
                self.owner = None
                decoding.leave()

    def check_owner(self, owner: object) -> None:
        if self.owner is not owner:
            raise StaleGenerationError(
                "a newer call took over this generation's prompt cache; what it had produced "
                "stays in the cache, so start a new generation to continue."
            )

    def consistent(self) -> bool:
        """Every layer holds exactly ``len(tokens)`` positions."""
        n = len(self.tokens)

        def holds(c) -> bool:
            if isinstance(c, RotatingBufferKVCache):
                return c.offset == n and c.capacity == (c.slots if n else c.capacity)
            m = n - getattr(c, "base", 0)  # (a DraftWindowCache dropped ``base`` positions)
            return isinstance(c.offset, int) and c.offset == m and c.capacity >= m

        return all(holds(c) for c in self.target + self.draft)

    def keep_prefix(self, ids: list[int]) -> int:
        """Forget everything after the common prefix of ``tokens`` and
        ``ids[:-1]`` (the last id is re-read for its logits); return its length."""
        n = common_prefix(self.tokens, ids[:-1])
        extends = n == len(self.tokens)
        kept = self.keeps(n)
        if kept is None:
            self.target, self.draft = self._new_caches()  # positions it needs are gone: read afresh
            n = 0
        elif kept < n:
            try:
                window.restore_pins(self.target)
            except BaseException:  # an interrupt part-way: layers at two lengths, so none is kept
                self.target, self.draft = self._new_caches()
                self.tokens.clear()
                raise
            n = kept
        self.reply_next = extends and self.reply_from is not None and n >= self.reply_from
        del self.tokens[n:]
        self.settle()
        return n

    def keeps(self, n: int) -> int | None:
        """How many positions cutting back to ``n`` (keep_prefix) keeps: ``n``,
        fewer (a reply's start, where sliding layers kept their window), or
        None: the cache must be read afresh."""
        if n == len(self.tokens):
            return n
        if self.max_kv_size is not None and self.target[0].wrapped:
            return None
        if n >= window.earliest(self.target):
            return n
        pin = window.saved_pin(self.target)
        return pin if pin is not None and pin <= n else None

    def chunks(self, new: list[int], step: int) -> list[list[int]]:
        """Split ``new`` into forwards of at most ``step`` ids (see the module docstring)."""
        self.reply_from = len(self.tokens) + len(new)
        window.pin(self.target, self.reply_from)
        first = []
        if self.reply_next:
            first, new = [new[:1]], new[1:]
        body = new[:-1]
        return first + [body[i : i + step] for i in range(0, len(body), step)] + ([new[-1:]] if new else [])

    # No verify block may straddle quantized_kv_start.
    @property
    def quantization_pending(self) -> bool:
        """Quantization is asked for and the target cache is not quantized yet."""
        return self.kv_bits is not None and not isinstance(self.target[0], QuantizedBufferKVCache)

    def maybe_quantize(self) -> None:
        """mlx-lm's maybe_quantize_kv_cache: convert at ``quantized_kv_start``."""
        n = len(self.tokens)
        if self.quantization_pending and n > 0 and n >= self.quantized_kv_start:
            self.target[:] = [
                QuantizedBufferKVCache.from_buffer(c, self.kv_group_size, self.kv_bits) for c in self.target
            ]

    def may_queue(self, bound: int, block_size: int) -> bool:
        """Whether a block may be queued before the length is known: not if
        it might reach the quantization start first."""
        return not self.quantization_pending or bound + block_size <= self.quantized_kv_start

    def block_from_here(self, block_size: int) -> int:
        """Quantize if it is time, else cut the block to end at the start."""
        self.maybe_quantize()
        if self.quantization_pending:
            return max(1, min(block_size, self.quantized_kv_start - len(self.tokens)))
        return block_size

    def arrays(self) -> list:
        """Every buffer both caches hold (what a queued cycle writes)."""
        return [a for c in self.target + self.draft for a in c.state if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.target + self.draft)


# mlx-lm's name for what a conversation keeps across calls
make_prompt_cache = PromptCache
