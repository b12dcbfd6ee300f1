"""Sliding-window layers hold their window, not the whole context
(kv/window.py): past ``margin`` positions beyond the window the buffer drops
the oldest, and decoding stays mlx-lm's greedy decoding through blocks,
draft trees and compiled cycles; a prompt cache continues a conversation
from where it can (the end, anywhere within its margin, or the last reply's
start) and reads afresh otherwise; files and the prefix store hold the
window with where it starts."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from family_models import run, scripted
from test_attention_routing_families import pair
from tiny import greedy_reference

from dflash_mlx import make_prompt_cache
from dflash_mlx.cache import files
from dflash_mlx.cache.store import PrefixStore
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.kv import window
from dflash_mlx.kv.buffer import BufferKVCache, align, set_lengths
from dflash_mlx.kv.window import WindowKVCache

WINDOW = 8  # the tiny configs' sliding window
MOST_ROWS = 12  # the largest verify below: trees of 12 rows (blocks of at most 8)
MARGIN = 2 * MOST_ROWS + 4  # more than two queued verifies' rows (their rollback), as the library's 256
FAMILIES = ["gemma3_text", "gemma4_text", "gpt_oss", "muse_glimmer"]
PROMPT = [random.Random(0).randrange(40) for _ in range(37)]


@pytest.fixture(autouse=True)
def small_margin(monkeypatch):
    monkeypatch.setattr(WindowKVCache, "margin", MARGIN)


@pytest.fixture(scope="module")
def pairs():
    made = {}

    def get(family):
        if family not in made:
            model, draft = pair(family, seed=23)
            made[family] = model, scripted(draft)
        return made[family]

    return get


def decoded(model, draft, prompt, max_tokens, **kw):
    vocab = model.args.vocab_size
    ref = greedy_reference(model, prompt, max_tokens)
    tokens, responses = run(model, draft, prompt, ref, vocab=vocab, max_tokens=max_tokens, prefill_step_size=16, **kw)
    return tokens, ref, responses


def sliding(cache) -> list[WindowKVCache]:
    return [c for c in cache.target if isinstance(c, WindowKVCache)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_reply_drops_what_the_window_passed_and_stays_mlx_lms(pairs, family):
    model, draft = pairs(family)
    for block in (3, 8):
        cache = make_prompt_cache(model, draft)
        tokens, ref, _ = decoded(model, draft, PROMPT, 120, block_size=block, prompt_cache=cache)
        assert tokens == ref, block
        layers = sliding(cache)
        assert layers and all(type(c) is BufferKVCache for c in cache.target if c not in layers)  # full layers
        # dropped: the window before the end stays, in a buffer of fixed length
        end = len(cache.tokens)
        assert {c.base for c in layers} == {layers[0].base} and 0 < layers[0].base <= end - (WINDOW - 1)
        assert {c.capacity for c in layers} == {layers[0].steady_capacity}
        assert all(c.capacity < c.step + end for c in layers)


def test_draft_trees_and_compiled_cycles_over_dropping_layers_stay_mlx_lms(pairs, monkeypatch):
    model, draft = pairs("gpt_oss")
    cache = make_prompt_cache(model, draft)
    tokens, ref, _ = decoded(model, draft, PROMPT, 100, block_size=8, tree_budget=MOST_ROWS, prompt_cache=cache)
    assert tokens == ref and sliding(cache)[0].base > 0
    monkeypatch.setattr(Cycle, "compile_graphs", True)
    cache = make_prompt_cache(model, draft)
    tokens, ref, _ = decoded(model, draft, PROMPT, 100, block_size=6, prompt_cache=cache)
    assert tokens == ref and sliding(cache)[0].base > 0


def test_a_windows_layers_count_their_rows_from_one_subtraction(pairs):
    """A length set on the device for every layer at once gives a window's
    layers one ``length - base`` and RoPE the absolute length itself: no
    operation of its own per sliding layer in every cycle."""
    model, draft = pairs("gemma3_text")
    cache = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT, 60, block_size=8, prompt_cache=cache)
    layers, end = sliding(cache), len(cache.tokens)
    assert len(layers) > 1 and layers[0].base > 0
    length = mx.array(end, mx.int32)
    set_lengths(cache.target, length, end)
    assert all(c.offset is layers[0].offset for c in layers)
    assert all(c.position is length for c in layers)
    assert all(c.row(length) is layers[0].offset for c in layers)  # (a tree's accepted path, kv/tree.py)
    assert layers[0].offset.item() == end - layers[0].base
    # a layer that dropped a position since counts its rows afresh
    layers[2].compact(layers[2].base + 1)
    assert layers[2].row(length).item() == end - layers[2].base
    full = [c for c in cache.target if c not in layers]
    assert all(c.offset is length and c.position is length for c in full)
    # a layer given its own length counts its own rows
    layers[1].set_length(mx.array(end - 1, mx.int32), end)
    assert layers[1].offset is not layers[0].offset and layers[1].position.item() == end - 1


def test_a_conversation_continues_from_the_end_the_last_reply_or_afresh(pairs):
    model, draft = pairs("gemma3_text")
    cache = make_prompt_cache(model, draft)
    reply, _, _ = decoded(model, draft, PROMPT, 100, block_size=5, prompt_cache=cache)
    assert window.earliest(cache.target) > len(PROMPT) + 50  # the reply's start has left the window
    # the next prompt extends the conversation: nothing is read again
    follow = cache.tokens + [3, 4, 5]
    assert cache.keeps(len(cache.tokens)) == len(cache.tokens)
    got, ref, _ = decoded(model, draft, follow, 12, block_size=5, prompt_cache=cache)
    assert got == ref
    # a template rewrote the reply: back to the reply's start, whose window was saved
    cache = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT, 100, block_size=5, prompt_cache=cache)
    rewritten = PROMPT + reply[:50] + [3, 4, 5]
    assert cache.keeps(len(PROMPT) + 50) == len(PROMPT)
    got, ref, _ = decoded(model, draft, rewritten, 16, block_size=5, prompt_cache=cache)
    assert got == ref
    # an edit early in the prompt: read afresh
    edited = PROMPT[:9] + [7] + PROMPT[10:] + reply[:60]
    assert cache.keeps(9) is None
    got, ref, _ = decoded(model, draft, edited, 16, block_size=5, prompt_cache=cache)
    assert got == ref


def test_a_layer_cut_back_past_what_it_holds_refuses():
    c = WindowKVCache(WINDOW)
    keys = mx.zeros((1, 2, 100, 4))
    c.hold(keys, keys, 40)
    assert (c.base, c.offset, c.earliest) == (40, 100, 40 + WINDOW - 1)
    c.set_length(140 - 1 - 50)  # within what it holds
    assert c.offset == 49
    with pytest.raises(LookupError, match="dropped"):
        c.set_length(40)


def test_layers_an_interrupt_left_apart_are_aligned():
    a, b = WindowKVCache(WINDOW), WindowKVCache(WINDOW)
    rows = mx.arange(100, dtype=mx.float32).reshape(1, 1, 100, 1)
    a.hold(rows, rows, 0)
    b.hold(rows, rows, 0)
    a.compact(60)  # b was not reached
    align([a, b])
    assert a.base == b.base == 60 and a.capacity == b.capacity
    assert mx.array_equal(a.keys[..., :40, :], b.keys[..., :40, :]).item()
    assert b.keys[0, 0, 0, 0].item() == 60


def test_a_file_and_the_prefix_store_hold_the_window_and_where_it_starts(pairs, tmp_path):
    model, draft = pairs("gpt_oss")
    cache = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT, 100, block_size=4, prompt_cache=cache)
    base, n = sliding(cache)[0].base, len(cache.tokens)
    files.save_prompt_cache(tmp_path / "c.safetensors", cache)
    # (before decoding again: the scripted drafter's script is part of the pair's fingerprint)
    loaded, _ = files.load_prompt_cache(tmp_path / "c.safetensors", model, draft)
    assert [c.base for c in sliding(loaded)] == [c.base for c in sliding(cache)] and loaded.tokens == cache.tokens

    # a sliding layer's tensors cut below its window: refused as damaged
    arrays, meta = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    layer = next(i for i, c in enumerate(cache.target) if isinstance(c, WindowKVCache))
    for name in ("keys", "values"):
        arrays[f"target.{layer}.{name}"] = arrays[f"target.{layer}.{name}"][..., -(WINDOW - 2) :, :]
    mx.save_safetensors(str(tmp_path / "cut.safetensors"), arrays, meta)
    with pytest.raises(ValueError, match="does not hold"):
        files.load_prompt_cache(tmp_path / "cut.safetensors", model, draft)

    follow = cache.tokens + [5, 6]
    got, ref, _ = decoded(model, draft, follow, 12, block_size=4, prompt_cache=loaded)
    assert got == ref

    # the store serves a prompt that shares at least what the entry can be cut back to
    store = PrefixStore(tmp_path / "store", 10**9, lambda: make_prompt_cache(model, draft), min_tokens=16)
    assert store.save(cache)
    store.flush()
    entry, shared = store.find(follow)
    assert entry is not None and shared == n and entry.earliest == base + WINDOW - 1
    assert store.find(cache.tokens[: base + 2] + [1, 2]) == (None, 0)
    store.close()


def test_an_interrupt_while_going_back_to_the_reply_start_leaves_a_fresh_cache(pairs, monkeypatch):
    model, draft = pairs("gemma3_text")
    cache = make_prompt_cache(model, draft)
    reply, _, _ = decoded(model, draft, PROMPT, 100, block_size=5, prompt_cache=cache)
    rewritten = PROMPT + reply[:50] + [3, 4, 5]
    real, calls = WindowKVCache.restore_pin, []

    def interrupted(self):
        calls.append(self)
        if len(calls) == 2:  # one layer went back, the next is stopped
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(WindowKVCache, "restore_pin", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.keep_prefix(rewritten)
    monkeypatch.setattr(WindowKVCache, "restore_pin", real)
    assert cache.tokens == [] and cache.consistent()
    got, ref, _ = decoded(model, draft, rewritten, 12, block_size=5, prompt_cache=cache)
    assert got == ref


def test_a_chat_takes_the_stored_cache_where_its_own_keeps_less(pairs, tmp_path):
    model, draft = pairs("gpt_oss")
    stored = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT[:30] + [5] * 10, 4, block_size=4, prompt_cache=stored)
    store = PrefixStore(tmp_path, 10**9, lambda: make_prompt_cache(model, draft), min_tokens=16)
    assert store.save(stored)
    store.flush()
    # the chat's own cache shares more of the edited prompt, but went on and dropped it
    own = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT + [1] * 90, 60, block_size=4, prompt_cache=own)
    edited = PROMPT + [9, 9]
    assert own.keeps(len(PROMPT)) is None
    loaded = store.load_longer(edited, own)
    assert loaded is not None and loaded.tokens == stored.tokens
    store.close()


def test_a_file_whose_sliding_layers_dropped_positions_is_a_format_earlier_releases_refuse(pairs, tmp_path):
    model, draft = pairs("gpt_oss")
    short = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT[:20], 4, block_size=4, prompt_cache=short)
    files.save_prompt_cache(tmp_path / "short.safetensors", short)
    long = make_prompt_cache(model, draft)
    decoded(model, draft, PROMPT, 100, block_size=4, prompt_cache=long)
    files.save_prompt_cache(tmp_path / "long.safetensors", long)
    assert files.read_metadata(tmp_path / "short.safetensors")["version"] == files.VERSION
    assert files.read_metadata(tmp_path / "long.safetensors")["version"] == files.WINDOWED_VERSION
