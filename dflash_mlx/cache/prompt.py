"""The caches of one conversation: what the target and the drafter have read.

A PromptCache outlives a call, so a follow-up prompt that extends an earlier
conversation re-reads only what is new. It stays exact at every moment a
caller can observe it:

- ``tokens`` lists the ids whose keys/values both caches hold at positions
  0..len(tokens)-1 (target and drafter alike: the drafter's context is the
  target's committed positions). Nothing ever writes below ``len(tokens)``:
  prefill chunks and verify blocks write past it, and ``tokens`` grows only
  once their writes are queued in full, so an exception at any point (a
  Ctrl-C mid-prefill or mid-cycle) leaves garbage only past the end.
- Lengths are settled from ``tokens`` whenever a generation takes the cache
  or lets it go, so a generation that died anywhere leaves nothing behind.
- One generation owns the cache at a time. A new call takes it over from a
  generator still alive: that one's committed tokens stay (they are in
  ``tokens``), its in-flight work is dropped, and it can neither continue
  nor change the cache afterwards.
- It belongs to one model pair and refuses another.

Its caches are plain buffers, or a quantized target cache (``kv_bits``,
kv_cache_quantized) or a bounded one (``max_kv_size``, kv_cache_rotating).
Under either, what a position holds depends on how it was read, as in mlx-lm,
so ``chunks`` reads a prompt as mlx-lm's generate_step does (all but the last
id in chunks, then the last one alone), and a continuation whose first id is
the previous reply's last token, which decoding committed but did not read,
reads that one alone first: mlx-lm decoded it one token at a time. A turn
then gives what mlx-lm gives when it reuses its own cache across turns (as
mlx_lm.chat does). A bounded cache that wrapped cannot be cut back: a prompt
that does not extend it is read afresh.
"""

from __future__ import annotations

from ..draft.dflash import DFlashDraft
from ..targets import DenseTarget, adapt
from .buffer import align, set_lengths
from .quantized import QuantizedBufferKVCache, check_settings
from .rotating import DraftWindowCache, RotatingBufferKVCache, check_max_kv_size


class StaleGenerationError(RuntimeError):
    """A generator resumed after a newer call took over its prompt cache."""


class PromptCache:
    def __init__(
        self,
        model,
        draft: DFlashDraft,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 0,
        max_kv_size: int | None = None,
    ):
        target = adapt(model)
        check_max_kv_size(target, max_kv_size, kv_bits)
        check_settings(target, kv_bits, kv_group_size, quantized_kv_start)
        self.max_kv_size = max_kv_size
        # a quantized target cache (kv_cache_quantized): the token loop converts
        # the target's layers once the cache holds quantized_kv_start positions
        self.kv_bits, self.kv_group_size, self.quantized_kv_start = kv_bits, kv_group_size, quantized_kv_start
        draft.bind(target)
        self.model, self.draft_model = target.model, draft
        self.adapter = target
        self.target, self.draft = self._new_caches()
        self.tokens: list[int] = []
        self.owner: object | None = None
        self.reply_from: int | None = None  # where the last prefill's reply began (its first token's position)
        self.reply_next = False  # the position after ``tokens`` holds the last reply's uncached last token

    def _new_caches(self) -> tuple[list, list]:
        if self.max_kv_size is None:
            return self.adapter.make_cache(), self.draft_model.make_cache()
        block = self.draft_model.config.block_size  # the largest verify block
        target = [RotatingBufferKVCache(self.max_kv_size, block) for _ in range(self.adapter.num_layers)]
        # the drafter keeps at least what the target's ring holds: it drops
        # positions only once the target's ring has wrapped
        window = target[0].slots
        return target, [DraftWindowCache(window, self.draft_model.rope) for _ in self.draft_model.layers]

    def check_pair(self, target: DenseTarget, draft: DFlashDraft) -> None:
        if target.model is not self.model or draft is not self.draft_model:
            raise ValueError(
                "this prompt cache was made for another model pair; make one for this pair "
                "with make_prompt_cache(model, draft)."
            )

    def settle(self) -> None:
        """Set every layer's length to ``len(tokens)``: whatever was written
        past it (an unfinished prefill chunk, a cycle still in flight) is
        dropped."""
        n = len(self.tokens)
        self.adapter.set_length(self.target, n)
        set_lengths(self.draft, n)
        align(self.target)
        align(self.draft)

    def claim(self, owner: object) -> None:
        """Make ``owner`` the only generation allowed to change the cache."""
        self.owner = owner
        self.settle()

    def release(self, owner: object) -> None:
        """``owner`` is done: settle the lengths unless a newer generation
        has taken the cache meanwhile (then it is not ours to touch)."""
        if self.owner is owner:
            self.settle()
            self.owner = None

    def check_owner(self, owner: object) -> None:
        if self.owner is not owner:
            raise StaleGenerationError(
                "a newer call took over this generation's prompt cache; what it had produced "
                "stays in the cache, so start a new generation to continue."
            )

    def consistent(self) -> bool:
        """Every layer of both caches holds exactly ``len(tokens)`` positions
        (true whenever no generation owns the cache)."""
        n = len(self.tokens)

        def holds(c) -> bool:
            if isinstance(c, RotatingBufferKVCache):
                return c.offset == n and c.capacity == (c.slots if n else c.capacity)
            m = n - getattr(c, "base", 0)  # (a DraftWindowCache dropped ``base`` positions)
            return isinstance(c.offset, int) and c.offset == m and c.capacity >= m

        return all(holds(c) for c in self.target + self.draft)

    def keep_prefix(self, ids: list[int]) -> int:
        """Forget everything after the longest common prefix of ``tokens``
        and ``ids`` (at most all of ``ids`` but its last id, which must be
        read again for its logits); returns that prefix's length."""
        n = 0
        for a, b in zip(self.tokens, ids[:-1]):
            if a != b:
                break
            n += 1
        extends = n == len(self.tokens)
        if not extends and self.max_kv_size is not None and self.target[0].wrapped:
            self.target, self.draft = self._new_caches()  # positions it needs are overwritten: read afresh
            n = 0
        self.reply_next = extends and self.reply_from is not None and n >= self.reply_from
        del self.tokens[n:]
        self.settle()
        return n

    def chunks(self, new: list[int], step: int) -> list[list[int]]:
        """How to read ``new`` (the ids after ``tokens``) in forwards of at
        most ``step``: see the module's docstring."""
        self.reply_from = len(self.tokens) + len(new)
        first = []
        if self.reply_next and (self.max_kv_size is not None or self.quantization_pending):
            first, new = [new[:1]], new[1:]

        def pieces(ids: list[int]) -> list[list[int]]:
            return [ids[i : i + step] for i in range(0, len(ids), step)]

        if self.max_kv_size is None and not self.quantization_pending:
            return first + pieces(new)
        return first + pieces(new[:-1]) + ([new[-1:]] if new else [])

    # -- KV quantization: the target's layers convert once the cache holds
    # quantized_kv_start positions, and no verify block straddles that start.
    @property
    def quantization_pending(self) -> bool:
        """Quantization is asked for and the target cache is not quantized yet."""
        return self.kv_bits is not None and not isinstance(self.target[0], QuantizedBufferKVCache)

    def maybe_quantize(self) -> None:
        """mlx-lm's maybe_quantize_kv_cache: convert once the cache holds
        ``quantized_kv_start`` positions (and at least one)."""
        n = len(self.tokens)
        if self.quantization_pending and n > 0 and n >= self.quantized_kv_start:
            self.target[:] = [
                QuantizedBufferKVCache.from_buffer(c, self.kv_group_size, self.kv_bits) for c in self.target
            ]

    def may_queue(self, bound: int, block_size: int) -> bool:
        """Whether a block may be queued before the length is known: not if its
        positions (up to ``bound`` + block_size - 1) might reach the start
        while the cache is not yet quantized."""
        return not self.quantization_pending or bound + block_size <= self.quantized_kv_start

    def block_from_here(self, block_size: int) -> int:
        """Before a block queued from the exact length ``len(tokens)``:
        quantize if it is time, else cut the block to end at the start."""
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


def make_prompt_cache(
    model,
    draft: DFlashDraft,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: int | None = None,
) -> PromptCache:
    """A cache to pass to ``stream_generate`` across calls (multi-turn chat):
    give the whole conversation as the prompt each turn and only the part
    not already cached is read. ``kv_bits`` etc.: quantize the target's
    keys/values as mlx-lm's QuantizedKVCache does, once the cache holds
    ``quantized_kv_start`` positions (same spellings and semantics).
    ``max_kv_size``: bound the target's cache as mlx-lm's RotatingKVCache
    (max_size=max_kv_size, keep=4) does, and the drafter's context to match;
    generation then runs past the target's context length."""
    return PromptCache(model, draft, kv_bits, kv_group_size, quantized_kv_start, max_kv_size)
