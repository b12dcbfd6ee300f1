"""A small pool of prompt caches over an optional prefix store on disk:
each request continues the cache with the longest common prefix among
those of its conversation, or starts from a copy of the longest prefix any
kept cache or stored entry shares with it, so a chat or an agent loop
prefills only what is new; least recently used caches go first when the
pool is over its count or its bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from ..cache.prompt import common_prefix
from ..cache.store import PrefixStore, copy_prefix
from ..targets.recurrent import DeltaCache


def cache_bytes(cache) -> int:
    """Memory a prompt cache holds (its ``nbytes``: every buffer allocated,
    quantized ones with their scales and biases, a bounded one's whole ring;
    0 where it does not say)."""
    return int(getattr(cache, "nbytes", 0) or 0)


def can_copy(cache) -> bool:
    """Whether a prefix of the cache can be copied into a new one: plain or
    quantized attention caches, unbounded."""
    return getattr(cache, "max_kv_size", None) is None and not any(isinstance(c, DeltaCache) for c in cache.target)


class PromptCachePool:
    """``take`` lends the cache of the conversation a prompt continues (out
    of the pool while in use), ``give_back`` returns it as the most recently
    used, with the length of the prompt it last served, and hands it to the
    ``store`` to write.

    A prompt continues a cache when it agrees with all of that cache's last
    prompt (what follows may differ: templates that drop an earlier reply's
    thinking rewrite it). A prompt that leaves an earlier prompt sooner is
    another conversation, or an edited one: it gets a new cache, so that it
    does not rewind one that may still be continued; the new cache starts as
    a copy of the longest shared prefix (``min_shared`` ids or more) a kept
    cache or the store holds. A cache that cannot be cut back to where a
    prompt leaves it (PromptCache.keeps) is continued only as far as it can be."""

    def __init__(
        self,
        make_cache: Callable[[], object],
        max_count: int = 10,
        max_bytes: Optional[int] = None,
        store: Optional[PrefixStore] = None,
        min_shared: int = 64,
    ):
        self.make_cache = make_cache
        self.max_count, self.max_bytes = max_count, max_bytes
        self.store, self.min_shared = store, min_shared
        self.entries: list[tuple[object, int]] = []  # (cache, its last prompt's length), least recently used first
        self.hits = self.misses = 0  # takes that found a cache to continue or copy, and those that did not
        self.memory_hits = self.disk_hits = 0
        self.reused_tokens = 0

    def _best(self, prompt: list[int]) -> tuple[Optional[tuple[object, int]], int, Optional[object], int]:
        """(the entry to continue, its shared length, a cache to copy from, its shared length)."""
        best, best_len, source, source_len = None, 0, None, 0
        for entry in self.entries:
            cache, last_prompt = entry
            n = common_prefix(cache.tokens, prompt[:-1])
            kept = cache.keeps(n)  # (None: cut back there, it would be read afresh)
            if kept and kept > best_len and n >= last_prompt - 1:
                best, best_len = entry, kept
            elif n > source_len and n >= self.min_shared and can_copy(cache) and kept == n:
                source, source_len = cache, n
        return best, best_len, source, source_len

    def held(self, prompt: list[int]) -> int:
        """Prompt tokens ``take`` would find in a cache (none is taken)."""
        _, best_len, _, source_len = self._best(prompt)
        return max(best_len, source_len)

    def take(self, prompt: list[int]) -> tuple[object, int]:
        """(cache, prompt tokens it already holds). The decode loop reads the
        prompt's last token again, so at most len(prompt) - 1 count."""
        best, best_len, source, source_len = self._best(prompt)
        if self.store is not None:
            entry, stored = self.store.find(prompt)
            if stored > max(best_len, source_len):
                cache = self.store.load(entry, expect=len(prompt))
                if cache is not None:
                    return self._hit(cache, stored, disk=True)
        if source_len > best_len:
            fresh = self.make_cache()
            fresh.expect(len(prompt))
            return self._hit(copy_prefix(source, source_len, fresh), source_len)
        if best is None:
            self.misses += 1
            return self.make_cache(), 0
        self.entries.remove(best)
        return self._hit(best[0], best_len)

    def _hit(self, cache, n: int, disk: bool = False) -> tuple[object, int]:
        self.hits += 1
        self.disk_hits += disk
        self.memory_hits += not disk
        self.reused_tokens += n
        return cache, n

    def give_back(self, cache, prompt_length: int) -> None:
        if not cache.tokens:
            return
        if self.store is not None:
            self.store.save(cache)
        if self.max_count < 1:
            return
        self.entries.append((cache, prompt_length))
        while self.entries and (len(self.entries) > self.max_count or self._over_bytes()):
            self.entries.pop(0)

    def keep_newest(self, count: int) -> None:
        """Drop the least recently used caches past ``count``: a follower rank
        keeps as many as rank 0's pool (server/ranks.py), whose byte bound
        weighs rank 0's share of the caches, not this rank's."""
        del self.entries[: max(len(self.entries) - count, 0)]

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and sum(cache_bytes(c) for c, _ in self.entries) > self.max_bytes

    def __len__(self) -> int:
        return len(self.entries)
