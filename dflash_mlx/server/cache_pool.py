"""A small pool of prompt caches: each request continues the cache that
shares the longest prefix with its prompt, so a chat or an agent loop
prefills only its new turn; least recently used caches go first when the
pool is over its count or its bytes."""

from __future__ import annotations

from typing import Callable, Optional


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cache_bytes(cache) -> int:
    """Memory a prompt cache holds (its ``nbytes``; 0 where it does not say)."""
    return int(getattr(cache, "nbytes", 0) or 0)


class PromptCachePool:
    """``take`` lends the best cache for a prompt (out of the pool while in
    use), ``give_back`` returns it as the most recently used."""

    def __init__(self, make_cache: Callable[[], object], max_count: int = 10, max_bytes: Optional[int] = None):
        self.make_cache = make_cache
        self.max_count, self.max_bytes = max_count, max_bytes
        self.caches: list = []  # least recently used first

    def take(self, prompt: list[int]) -> tuple[object, int]:
        """(cache, prompt tokens it already holds). The decode loop always
        recomputes the prompt's last token, so at most len(prompt) - 1 count."""
        best, best_len = None, 0
        for cache in self.caches:
            n = common_prefix(cache.tokens, prompt[:-1])
            if n > best_len:
                best, best_len = cache, n
        if best is None:
            return self.make_cache(), 0
        self.caches.remove(best)
        return best, best_len

    def give_back(self, cache) -> None:
        if self.max_count < 1:
            return
        self.caches.append(cache)
        while self.caches and (len(self.caches) > self.max_count or self._over_bytes()):
            self.caches.pop(0)

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and sum(cache_bytes(c) for c in self.caches) > self.max_bytes

    def __len__(self) -> int:
        return len(self.caches)
