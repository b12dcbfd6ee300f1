"""A prompt chunk (its length known on the host) reads exactly the filled
keys under MLX's own causal mask, on every backend, as mlx-lm's prefill does:
no [chunk, capacity] array, no scores over a buffer's unfilled tail, however
large the buffer grew for an earlier, longer prompt."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as lm_cache
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import device, make_prompt_cache, stream_generate
from dflash_mlx.kv.buffer import BufferKVCache, positions_mask
from dflash_mlx.targets import adapt

VOCAB = 32


@pytest.fixture(scope="module")
def pair():
    tcfg = target_config("qwen3", vocab=VOCAB, layers=2)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 1])
    return make_target(tcfg, seed=5), make_draft(dcfg, random_draft_weights(dcfg, seed=6))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def grown_then_cut(capacity: int, length: int) -> BufferKVCache:
    """A cache that held ``capacity`` positions, cut back to ``length`` (a new prompt sharing that prefix)."""
    cache = BufferKVCache()
    kv = mx.ones((1, 2, capacity, 8))
    cache.update_and_fetch(kv, kv)
    cache.set_length(length)
    return cache


@pytest.mark.parametrize("where", ["cpu", "metal", "cuda"])
def test_a_prompt_chunk_reads_the_filled_keys_under_the_causal_mask(monkeypatch, where):
    monkeypatch.setattr(device, "backend", lambda: where)
    cache = grown_then_cut(1024, 40)
    kv = mx.ones((1, 2, 7, 8))
    assert cache.make_mask(7) == "causal"
    keys, values = cache.update_and_fetch(kv, kv)
    assert keys.shape[2] == values.shape[2] == 47 and cache.capacity == 1024
    # asked for an array (mlx-lm's MLA models), it spans the same keys
    cache = grown_then_cut(1024, 40)
    mask = cache.make_mask(7, return_array=True)
    assert mask.shape == (7, 47) and mx.array_equal(mask, positions_mask(7, 40, 47)).item()
    # a window that hides keys needs its array
    assert cache.make_mask(7, window_size=16).shape == (7, 47)
    assert cache.make_mask(7, window_size=64) == "causal"


def test_a_cycle_keeps_its_widths(monkeypatch):
    # A length on the device: a compiled trace, and the CUDA backend, span the whole buffer.
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    cache = grown_then_cut(1024, 40)
    cache.set_length(mx.array(40, mx.int32), 40)
    mask = cache.make_mask(4)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    assert keys.shape[2] == mask.shape[-1] == 1024
    cache = grown_then_cut(1024, 40)
    cache.set_length(40, read="fixed")
    assert cache.make_mask(4).shape == (4, 1024) and cache.read_width(4) == 1024


def test_the_causal_mask_gives_mlx_lms_logits(pair):
    # mlx-lm's own forward asks for no array: chunks over our caches give its logits
    model, _ = pair
    prompt = mx.array(ids(300, seed=1))[None]
    ours, theirs = [BufferKVCache() for _ in model.layers], lm_cache(model)
    for start, end in ((0, 128), (128, 233), (233, 300)):
        a = model(prompt[:, start:end], cache=ours)
        b = model(prompt[:, start:end], cache=theirs)
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_prefill_spans_only_the_filled_keys(monkeypatch, pair, where):
    model, draft = pair
    monkeypatch.setattr(device, "backend", lambda: where)
    spans = []
    update_and_fetch = BufferKVCache.update_and_fetch

    def spy(self, keys, values):
        start = self.offset
        out = update_and_fetch(self, keys, values)
        if isinstance(start, int) and keys.shape[2] > 1:
            spans.append((start + keys.shape[2], out[0].shape[2]))
        return out

    monkeypatch.setattr(BufferKVCache, "update_and_fetch", spy)
    prompt = ids(700, seed=2)
    out = stream_generate(
        model, draft, make_tokenizer(VOCAB), prompt, max_tokens=8, block_size=8, prefill_step_size=300
    )
    tokens = [t for r in out for t in r.tokens]
    assert tokens == [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
    assert spans and all(filled == read for filled, read in spans)


def peak_bytes(run):
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    out = run()
    mx.synchronize()
    return mx.get_peak_memory() - resident, out


def test_a_short_prompt_after_a_long_one_peaks_as_mlx_lm(monkeypatch, pair):
    # CUDA's read rule, which spans whole buffers in a cycle: the prompt cache
    # grew for a long prompt, and a new unrelated one is read into it.
    model, draft = pair
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    tok = make_tokenizer(VOCAB)
    cache = make_prompt_cache(model, draft)
    list(stream_generate(model, draft, tok, ids(2048, seed=3), max_tokens=2, block_size=8, prompt_cache=cache))
    short = ids(256, seed=4)
    ours, tokens = peak_bytes(
        lambda: [
            t
            for r in stream_generate(model, draft, tok, short, max_tokens=8, block_size=8, prompt_cache=cache)
            for t in r.tokens
        ]
    )
    theirs, reference = peak_bytes(lambda: [t for t, _ in generate_step(mx.array(short), model, max_tokens=8)])
    assert tokens == reference
    assert cache.target[0].capacity > 2048
    assert ours <= 1.5 * theirs, (ours, theirs)


def test_a_long_prompt_chunk_peaks_as_mlx_lms():
    # fused q/k/v and gate/up outputs, split and copied, would cost more than
    # mlx-lm's three and two products: a chunk runs the layers' own
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=2, hidden=256), seed=7)
    target = adapt(model)
    tokens = mx.array([ids(1024, seed=8)])
    ours, _ = peak_bytes(lambda: mx.eval(target(tokens, target.make_cache(), [0, 1], last_only=True)))
    theirs, _ = peak_bytes(lambda: mx.eval(model(tokens, cache=lm_cache(model))[:, -1]))
    assert ours <= 1.02 * theirs, (ours, theirs)
