"""The server's pool of prompt caches: least recently used out, bounded by
count and bytes; a conversation's next turn continues its own cache."""

from __future__ import annotations

import httpx
from test_server_fixtures import chat_pair, serving  # noqa: F401


def ask(url: str, messages: list[dict]) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 6}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def next_turn(messages: list[dict], reply: dict, text: str) -> list[dict]:
    return messages + [
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
        {"role": "user", "content": text},
    ]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def interleave(url: str) -> tuple[int, int]:
    """Two conversations, turn by turn: (A's first prompt length, tokens of
    A's second turn read from a cache)."""
    a = [{"role": "user", "content": "w11 w12 w13 w14 w15"}]
    b = [{"role": "user", "content": "w21 w22 w23 w24 w25"}]
    first_a = ask(url, a)
    ask(url, b)
    second_a = ask(url, next_turn(a, first_a, "w16"))
    return first_a["usage"]["prompt_tokens"], cached(second_a)


def test_each_conversation_continues_its_own_cache(chat_pair):
    with serving(*chat_pair, prompt_cache_size=2) as url:
        prompt, reused = interleave(url)
        assert reused >= prompt
        assert httpx.get(f"{url}/health").json()["prompt_caches"] == 2


def test_least_recently_used_cache_goes_first(chat_pair):
    with serving(*chat_pair, prompt_cache_size=1) as url:
        prompt, reused = interleave(url)
        assert reused < prompt  # B's turn pushed A's cache out; only the shared template start is reused, if that
        assert httpx.get(f"{url}/health").json()["prompt_caches"] == 1


def test_a_byte_bound_keeps_no_cache_larger_than_it(chat_pair):
    with serving(*chat_pair, prompt_cache_bytes=1) as url:
        prompt, reused = interleave(url)
        assert reused == 0
        assert httpx.get(f"{url}/health").json()["prompt_caches"] == 0


class Held:
    """A stand-in prompt cache: its tokens, and the bytes this rank's share holds."""

    def __init__(self, tokens: list[int], nbytes: int):
        self.tokens, self.nbytes = tokens, nbytes


def test_a_follower_rank_keeps_the_caches_rank_zero_keeps():
    """Across ranks each rank's share of a cache differs in bytes: the
    followers keep as many caches as rank 0, whose pool alone weighs them."""
    from dflash_mlx.server.cache_pool import PromptCachePool

    first = PromptCachePool(lambda: None, max_count=3, max_bytes=250)
    other = PromptCachePool(lambda: None, max_count=3)  # a follower's: max_bytes None
    for n, size in enumerate([100, 100, 100, 40, 200, 30]):
        other.keep_newest(len(first))  # as a job arrives from rank 0
        first.give_back(Held([n, n], size), 2)
        other.give_back(Held([n, n], 2 * size), 2)  # a larger share of the same cache
        assert len(other) >= len(first)
    other.keep_newest(len(first))
    assert [c.tokens for c, _ in other.entries] == [c.tokens for c, _ in first.entries] == [[4, 4], [5, 5]]
