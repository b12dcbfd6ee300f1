"""The prefix cache on disk (cache/store.py) and the server's pool over it:
entries found by the longest common token prefix, the directory bounded by
size with the least recently used file out, entries found again by a new
store (a restart), damaged, cut and foreign files refused with a warning,
and greedy output equal to mlx-lm's whichever tier served a request."""

from __future__ import annotations

import os
import time
import warnings

import httpx
import pytest
from family_models import family_config, make_family_target
from test_server_fixtures import chat_pair, kv_pair, serving  # noqa: F401
from tiny import draft_config, greedy_reference, make_draft, make_target, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cache import files
from dflash_mlx.cache.store import PrefixStore
from dflash_mlx.server.cache_pool import PromptCachePool

VOCAB = 24
TCFG = target_config("qwen3", vocab=VOCAB, layers=3, hidden=128)  # head dim 32: KV groups of 32
DCFG = draft_config(TCFG, layers=1, block_size=8, taps=[0, 2])
SHARED = [(i * 7) % 23 + 1 for i in range(150)]


@pytest.fixture(scope="module")
def pair():
    return make_target(TCFG, seed=41), make_draft(DCFG, random_draft_weights(DCFG, seed=42))


def run(pair, prompt, cache=None, max_tokens=10):
    from tiny import make_tokenizer

    rs = stream_generate(*pair, make_tokenizer(VOCAB), prompt, prompt_cache=cache, max_tokens=max_tokens, block_size=8)
    return [t for r in rs for t in r.tokens]


def store_over(pair, directory, max_bytes=10**9, **kv):
    return PrefixStore(directory, max_bytes, lambda: make_prompt_cache(*pair, **kv), min_tokens=32)


def saved(pair, store, prompt):
    """``prompt`` decoded into a fresh cache, handed to the store and written."""
    cache = make_prompt_cache(*pair, **dict(zip(("kv_bits", "kv_group_size", "quantized_kv_start"), store.kv)))
    run(pair, prompt, cache)
    assert store.save(cache)
    store.flush()
    return cache


def test_the_longest_common_prefix_is_found_and_a_short_one_misses(pair, tmp_path):
    store = store_over(pair, tmp_path)
    a = saved(pair, store, SHARED + [3, 4, 5])
    b = saved(pair, store, SHARED[:100] + [9] * 20)
    assert len(store) == 2
    entry, n = store.find(SHARED + [3, 4, 6])
    assert n == len(SHARED) + 2 and list(entry.tokens) == a.tokens
    entry, n = store.find(SHARED[:100] + [9] * 30)
    assert n == 120 and list(entry.tokens) == b.tokens
    assert store.find(SHARED[:20] + [1, 1, 1]) == (None, 0)  # under min_tokens
    assert store.find([2] * 60) == (None, 0)
    assert not store.save(a)  # already stored


def test_a_cache_from_either_tier_decodes_mlx_lms_greedy_tokens(pair, tmp_path):
    """Memory (a copy of a kept cache's prefix), disk (a restart's store),
    and a miss, each equal to mlx-lm's greedy decoding of the whole prompt."""
    first, second = SHARED + [3, 4, 5], SHARED + [6, 7]
    want = greedy_reference(pair[0], second, 10)
    pool = PromptCachePool(lambda: make_prompt_cache(*pair), store=store_over(pair, tmp_path), min_shared=32)
    cache, n = pool.take(first)
    assert n == 0 and pool.misses == 1
    assert run(pair, first, cache) == greedy_reference(pair[0], first, 10)
    pool.give_back(cache, len(first))
    pool.store.flush()
    cache, n = pool.take(second)
    assert (n, pool.memory_hits, pool.disk_hits) == (len(SHARED), 1, 0)
    assert run(pair, second, cache) == want
    assert len(pool) == 1  # the copy is out; the first conversation's cache stays kept
    pool.store.close()

    restarted = PromptCachePool(lambda: make_prompt_cache(*pair), store=store_over(pair, tmp_path), min_shared=32)
    cache, n = restarted.take(second)
    assert (n, restarted.memory_hits, restarted.disk_hits) == (len(SHARED), 0, 1)
    assert cache.tokens[:n] == SHARED
    assert run(pair, second, cache) == want
    assert restarted.reused_tokens == len(SHARED)


def test_a_chat_takes_a_stored_cache_only_when_it_holds_more(pair, tmp_path):
    store = store_over(pair, tmp_path)
    kept = saved(pair, store, SHARED + [3, 4])
    prompt = SHARED + [5, 6]
    own = make_prompt_cache(*pair)
    loaded = store.load_longer(prompt, own)
    assert loaded is not None and loaded.tokens == kept.tokens
    assert run(pair, prompt, loaded) == greedy_reference(pair[0], prompt, 10)
    assert store.load_longer(prompt, loaded) is None  # its own cache already holds as much


def test_a_quantized_cache_is_stored_under_its_settings_only(pair, tmp_path):
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=64)
    prompt = SHARED + [3, 4]
    store = store_over(pair, tmp_path, **kv)
    saved(pair, store, prompt)
    again = store_over(pair, tmp_path, **kv)
    entry, n = again.find(SHARED + [5, 6])
    cache = again.load(entry)
    assert n == len(SHARED) and cache.target[0].bits == 8
    assert run(pair, SHARED + [5, 6], cache) == run(pair, SHARED + [5, 6], make_prompt_cache(*pair, **kv))
    assert len(store_over(pair, tmp_path)) == 0  # unquantized: another folder, nothing found


def test_the_directory_is_bounded_least_recently_used_first(pair, tmp_path):
    store = store_over(pair, tmp_path)
    prompts = [[k] * 5 + SHARED[k:] for k in range(1, 4)]
    for prompt in prompts[:2]:
        saved(pair, store, prompt)
    one = max(e.size for e in store.entries.values())
    first = next(e for e in store.entries.values() if e.tokens[0] == 1)
    os.utime(first.path, (1, 1))  # the oldest ...
    store.close()
    small = store_over(pair, tmp_path, max_bytes=int(2.5 * one))
    store.load(small.find(prompts[0] + [0])[0])  # ... used again now: the other is oldest
    saved(pair, small, prompts[2])
    assert sorted(int(e.tokens[0]) for e in small.entries.values()) == [1, 3]
    assert small.disk_bytes <= 2.5 * one
    assert len(list(small.dir.glob("*.safetensors"))) == 2


def test_an_entry_a_newer_one_extends_is_removed(pair, tmp_path):
    store = store_over(pair, tmp_path)
    a = saved(pair, store, SHARED + [3])
    run(pair, a.tokens + [5, 6], a)  # the conversation's next turn, on the same cache
    assert store.save(a)
    store.flush()
    assert len(store) == 1 and list(next(iter(store.entries.values())).tokens) == a.tokens


def test_a_cache_changed_after_it_was_handed_in_is_written_as_it_was(pair, tmp_path):
    store = store_over(pair, tmp_path)
    cache = make_prompt_cache(*pair)
    run(pair, SHARED + [3], cache)
    at_save = list(cache.tokens)
    assert store.save(cache)
    run(pair, [5, 6] * 20, cache)  # another prompt rewinds and rewrites the cache meanwhile
    store.flush()
    entry = next(iter(store.entries.values()))
    assert list(entry.tokens) == at_save
    prompt = at_save + [7, 8]
    assert run(pair, prompt, store.load(entry)) == greedy_reference(pair[0], prompt, 10)


def test_settings_it_cannot_use_are_refused_in_one_sentence(pair, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"^the prefix cache directory .* cannot be made \(.*\); choose another\.$"):
        store_over(pair, tmp_path / "a-file" / "cache")
    with pytest.raises(ValueError, match=r"must be more than 0 \(--prefix-cache-gb\)"):
        store_over(pair, tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match=r"cannot hold bounded caches \(max_kv_size\)"):
        PrefixStore(tmp_path, 10**9, lambda: make_prompt_cache(*pair, max_kv_size=64))


def flip_a_tensor_byte(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))


def cut(path):
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("how", [flip_a_tensor_byte, cut])
def test_a_damaged_or_cut_entry_is_refused_with_a_warning_and_removed(pair, tmp_path, how):
    store = store_over(pair, tmp_path)
    saved(pair, store, SHARED + [3])
    path = next(iter(store.entries.values())).path
    how(path)
    with pytest.warns(UserWarning, match="the prefix cache skips an entry, removed: .*(damaged|cut short)"):
        again = store_over(pair, tmp_path)  # a cut file is seen from its header; a flipped byte on load
        entry, _ = again.find(SHARED + [4])
        assert entry is None or again.load(entry) is None
    assert not path.exists() and len(again) == 0 and again.refused == 1
    pool = PromptCachePool(lambda: make_prompt_cache(*pair), store=again)
    assert pool.take(SHARED + [4])[1] == 0  # served as a miss


def test_a_foreign_entry_is_refused_with_a_warning_and_left(pair, tmp_path):
    store = store_over(pair, tmp_path)
    other = make_target(TCFG, seed=99), pair[1]  # same shapes, other weights
    foreign = make_prompt_cache(*other)
    run(other, SHARED + [3], foreign)
    planted = store.dir / "planted.safetensors"
    files.save_prompt_cache(planted, foreign)
    with pytest.warns(UserWarning, match="left unused: .*another model pair"):
        again = store_over(pair, tmp_path)
    assert planted.exists() and len(again) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert again.find(SHARED + [3]) == (None, 0)


def test_a_dead_writers_partial_file_is_cleared_and_never_read(pair, tmp_path):
    store = store_over(pair, tmp_path)
    saved(pair, store, SHARED + [3])
    whole = next(iter(store.entries.values())).path
    partial = store.dir / f".{whole.name}.partial-999999999-x.safetensors"
    partial.write_bytes(whole.read_bytes()[:50])
    again = store_over(pair, tmp_path)
    assert not partial.exists() and len(again) == 1


def test_a_hybrid_targets_states_are_stored_and_extend_exactly():
    """A delta-net target's entry serves prompts that extend it (a state cut
    back would be re-read from the start), equal to mlx-lm's greedy."""
    import tempfile

    cfg = family_config("qwen3_5", vocab=VOCAB)
    model = make_family_target(cfg, seed=5)
    dcfg = draft_config(cfg, layers=1, block_size=8)
    hybrid = model, make_draft(dcfg, random_draft_weights(dcfg, seed=6))
    with tempfile.TemporaryDirectory() as d:
        store = store_over(hybrid, d)
        cache = saved(hybrid, store, SHARED[:60])
        again = store_over(hybrid, d)
        longer = cache.tokens + [4, 5]
        entry, n = again.find(longer)
        assert n == len(cache.tokens)
        assert again.find(cache.tokens[:50] + [1, 2])[0] is None
        loaded = again.load(entry)
        assert run(hybrid, longer, loaded) == greedy_reference(model, longer, 10)


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_the_server_reuses_a_prefix_across_a_restart_and_counts_it(chat_pair, tmp_path):
    prefix = " ".join(f"w{i % 9 + 3}" for i in range(200))
    config = dict(prefix_cache_dir=str(tmp_path), prefix_cache_min_tokens=64, temperature=0.0)

    def ask(url, text):
        body = {"prompt": text, "max_tokens": 8}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with serving(*chat_pair, **config) as url:
        first = ask(url, prefix + " a")
        second = ask(url, prefix + " b")
        deadline = time.monotonic() + 10
        # the writer starts once the server has not decoded for a moment (store.py)
        while metric(text := httpx.get(f"{url}/metrics").text, "dflash_prefix_cache_disk_bytes") == 0:
            assert time.monotonic() < deadline, "no prefix-cache file was written"
            time.sleep(0.05)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 190
    assert metric(text, 'dflash_prefix_cache_hits_total{tier="memory"}') == 1
    assert metric(text, "dflash_prefix_cache_misses_total") == 1
    with serving(*chat_pair, **config) as url:
        again = ask(url, prefix + " b")
        text = httpx.get(f"{url}/metrics").text
    assert metric(text, 'dflash_prefix_cache_hits_total{tier="disk"}') == 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 190
    assert again["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["text"]


def test_serve_refuses_prefix_cache_flags_it_cannot_use_in_one_sentence(kv_pair, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import dflash_mlx.server
    from dflash_mlx.cli.app import app

    def started(*args, **kwargs):  # a refusal that failed ends here, not in a server that waits
        raise RuntimeError("the server was started")

    monkeypatch.setattr(dflash_mlx.server, "run", started)
    target, draft, _ = kv_pair
    (tmp_path / "a-file").write_text("")
    for flags, words in [
        (["--prefix-cache-gb", "0"], "error: --prefix-cache-gb must be more than 0, got 0."),
        (["--max-kv-size", "32"], "cannot hold bounded caches (--max-kv-size); leave out one of the two."),
    ]:
        result = CliRunner().invoke(
            app,
            ["serve", "--model", str(target), "--draft-model", str(draft), "--prefix-cache-dir", str(tmp_path), *flags],
            prog_name="dflash-mlx",
            env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1"},
        )
        said = " ".join(result.stderr.split())
        assert result.exit_code == 1 and words in said and "Traceback" not in result.output, (flags, result.output)
    result = CliRunner().invoke(
        app,
        ["serve", "--model", str(target), "--draft-model", str(draft), "--prefix-cache-dir", str(tmp_path / "a-file")],
        prog_name="dflash-mlx",
        env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1"},
    )
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "cannot be made" in said and said.endswith("choose another."), result.output


def test_chat_reads_and_writes_the_prefix_cache_across_sessions(tmp_path):
    """Three chat sessions over one directory: the first writes its cache,
    the second starts from it, the third finds it damaged, says so, and
    prefills; all three reply with mlx-lm's greedy tokens."""
    from cli_fixtures import make_tiny_pair
    from typer.testing import CliRunner

    import dflash_mlx
    from dflash_mlx.cli.app import app

    pair = make_tiny_pair(tmp_path / "pair")
    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    text = " ".join(f"w{i % 50 + 5}" for i in range(300))
    want = dflash_mlx.generate(model, draft, tok, text, max_tokens=8)
    cache_dir = tmp_path / "prefix"

    def session():
        flags = ["--model", str(pair.target), "--draft-model", str(pair.draft), "-m", "8"]
        result = CliRunner().invoke(
            app,
            ["chat", *flags, "--prefix-cache-dir", str(cache_dir)],
            input=text + "\n",
            prog_name="dflash-mlx",
            env={"COLUMNS": "200"},
        )
        assert result.exit_code == 0, result.output
        assert want in result.stdout
        return result

    session()
    (entry,) = cache_dir.glob("*/*.safetensors")
    session()
    flip_a_tensor_byte(entry)
    with pytest.warns(UserWarning, match="the prefix cache skips an entry, removed"):
        session()
    assert len(list(cache_dir.glob("*/*.safetensors"))) == 1  # written again by the third


def test_a_copied_or_loaded_prefix_is_made_at_its_prompts_size(pair, tmp_path, buffer_copies):
    """A prefix taken from memory or disk comes in buffers that hold the new
    prompt and a first cycle, so its reply copies no buffer again."""
    shared = [(i * 5) % 23 + 1 for i in range(250)]
    first, second = shared + [3, 4, 5], shared + [(i * 3) % 17 + 2 for i in range(40)]
    want = greedy_reference(pair[0], second, 10)
    pool = PromptCachePool(lambda: make_prompt_cache(*pair), store=store_over(pair, tmp_path), min_shared=32)
    cache, _ = pool.take(first)
    run(pair, first, cache)
    pool.give_back(cache, len(first))
    pool.store.flush()
    for taken in (pool, PromptCachePool(lambda: make_prompt_cache(*pair), store=store_over(pair, tmp_path))):
        cache, n = taken.take(second)
        assert n == len(shared) and taken.hits == 1
        buffer_copies.clear()
        assert run(pair, second, cache) == want
        assert buffer_copies == []
    assert pool.memory_hits == 1


def test_a_snapshot_copies_no_buffer(pair):
    """Handing a cache to the store holds its arrays as they are: no copy of
    its keys and values on the caller's thread (a later write copies instead,
    and the file still holds what the snapshot saw: the test above)."""
    import mlx.core as mx

    cache = make_prompt_cache(*pair)
    run(pair, SHARED * 3 + [3], cache)
    mx.eval(cache.arrays())
    before = mx.get_active_memory()
    snap = files.snapshot(cache)
    assert snap.nbytes > 100_000
    assert mx.get_active_memory() - before < snap.nbytes / 10


def test_the_writer_lets_go_of_a_snapshot_once_it_is_written(pair, tmp_path, monkeypatch):
    """A snapshot held past its file would make the cache's next write copy
    every buffer, however long ago the file was written."""
    import gc
    import weakref

    taken = []
    snapshot = files.snapshot

    def recorded(*args, **kwargs):
        snap = snapshot(*args, **kwargs)
        taken.append(weakref.ref(snap))
        return snap

    monkeypatch.setattr(files, "snapshot", recorded)
    store = store_over(pair, tmp_path)
    saved(pair, store, SHARED + [3])
    gc.collect()
    assert len(taken) == 1 and taken[0]() is None
    store.close()
