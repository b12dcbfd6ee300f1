"""The prefix store's writer yields to decoding (cache/store.py, decoding.py's
gate): nothing of a file is made while a generation in the process decodes,
nor within ``quiet`` seconds of one's end; it is written after, or once
``patience`` runs out when decoding never stops; flush writes at once; the
gate counts generations through takeovers and ends."""

from __future__ import annotations

import gc
import time

import pytest
from test_prefix_store import DCFG, SHARED, TCFG, VOCAB, run
from tiny import greedy_reference, make_draft, make_target, make_tokenizer, random_draft_weights

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cache.decoding import decoding
from dflash_mlx.cache.store import PrefixStore


@pytest.fixture(scope="module")
def pair():
    return make_target(TCFG, seed=41), make_draft(DCFG, random_draft_weights(DCFG, seed=42))


@pytest.fixture(autouse=True)
def idle():
    gc.collect()  # generators other tests left suspended end here
    assert decoding.running == 0
    yield
    gc.collect()


def store_over(pair, directory, patience: float, quiet: float = 0.25) -> PrefixStore:
    new = lambda: make_prompt_cache(*pair)  # noqa: E731
    return PrefixStore(directory, 10**9, new, min_tokens=32, patience=patience, quiet=quiet)


def decoding_now(pair, prompt=SHARED[:40]):
    """A generation that has claimed its cache and is suspended mid-reply."""
    steps = stream_generate(*pair, make_tokenizer(VOCAB), prompt, prompt_cache=make_prompt_cache(*pair), max_tokens=64)
    next(steps)
    return steps


def decoded(pair, prompt=SHARED + [3, 4]):
    cache = make_prompt_cache(*pair)
    run(pair, prompt, cache)
    return cache


def written(store, within: float) -> float:
    """Seconds until the store has written one file (fails after ``within``)."""
    tic = time.monotonic()
    while store.writes == 0:
        assert time.monotonic() - tic < within, "the writer did not write"
        time.sleep(0.01)
    return time.monotonic() - tic


def test_nothing_is_written_while_a_generation_decodes_and_the_file_follows_its_end(pair, tmp_path):
    store = store_over(pair, tmp_path, 60)
    cache = decoded(pair)
    steps = decoding_now(pair)
    assert decoding.running == 1
    assert store.save(cache)
    time.sleep(0.5)
    assert store.writes == 0 and list(store.dir.iterdir()) == []  # not even a partial file
    steps.close()
    assert decoding.running == 0
    written(store, within=10)
    entry, n = store.find(SHARED + [5, 6])
    assert n == len(SHARED) and list(entry.tokens) == cache.tokens
    assert run(pair, SHARED + [5, 6], store.load(entry)) == greedy_reference(pair[0], SHARED + [5, 6], 10)
    store.close()


def test_a_file_waits_for_a_quiet_spell_after_a_generation_ends(pair, tmp_path):
    store = store_over(pair, tmp_path, 60, quiet=1.0)
    cache = decoded(pair)  # a generation that has just ended, as a server's reply before the next request
    ended = time.monotonic()
    assert store.save(cache)
    time.sleep(0.5)
    assert store.writes == 0 and list(store.dir.iterdir()) == []
    written(store, within=10)
    assert time.monotonic() - ended >= 0.95
    store.close()


@pytest.fixture
def saved_while_decoding(pair, tmp_path):
    """``(patience) -> store``: a store of that patience handed a decoded
    cache while another generation decodes; both end after the test."""
    opened = []

    def save(patience: float) -> PrefixStore:
        store = store_over(pair, tmp_path, patience)
        cache = decoded(pair)
        opened.append((decoding_now(pair), store))
        assert store.save(cache)
        return store

    yield save
    for steps, store in opened:
        steps.close()
        store.close()


def test_a_file_kept_waiting_past_its_patience_is_written_while_decoding_goes_on(saved_while_decoding):
    store = saved_while_decoding(patience=0.5)
    waited = written(store, within=10)
    assert waited >= 0.45 and decoding.running == 1
    assert len(store) == 1


def test_flush_writes_at_once_while_a_generation_decodes(saved_while_decoding):
    store = saved_while_decoding(patience=60)
    tic = time.monotonic()
    store.flush()
    assert time.monotonic() - tic < 10 and store.writes == 1 and decoding.running == 1


def test_the_gate_counts_generations_through_takeovers_and_ends(pair):
    cache = make_prompt_cache(*pair)
    older = stream_generate(*pair, make_tokenizer(VOCAB), SHARED[:40], prompt_cache=cache, max_tokens=64)
    next(older)
    newer = stream_generate(*pair, make_tokenizer(VOCAB), SHARED[:50], prompt_cache=cache, max_tokens=64)
    next(newer)  # takes the cache over: still one generation decoding
    other = decoding_now(pair)
    assert decoding.running == 2
    older.close()  # stale: its end leaves the newer one's place
    assert decoding.running == 2
    newer.close()
    other.close()
    assert decoding.running == 0
    run(pair, SHARED[:40], cache)  # a generation run to its end
    assert decoding.running == 0
