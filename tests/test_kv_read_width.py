"""Attention reads a buffer cache up to its host bound, not its capacity,
except where shapes must stay fixed (a compiled trace, a cycle on MLX's CUDA
backend; a prompt chunk at a host length reads exactly its filled keys
everywhere: test_prefill_memory.py); its mask always spans what it hands
attention, and a one-row step whose bound is exact reads only the filled keys
with no mask at all."""

import mlx.core as mx
import pytest
from tiny import greedy_reference, make_tokenizer

import dflash_mlx.generation as speculative
from dflash_mlx import device, stream_generate
from dflash_mlx.auto.chooser import BlockChooser
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.kv.buffer import BufferKVCache


def written(cache: BufferKVCache, n: int):
    """Write ``n`` positions; returns (mask, keys, values) as a layer sees them."""
    kv = mx.ones((1, 2, n, 8))
    mask = cache.make_mask(n)
    keys, values = cache.update_and_fetch(kv, kv)
    return mask, keys, values


def filled(bound_slack: int = 0, read: str = "bound") -> BufferKVCache:
    """A cache holding 40 positions, its length on the device, its bound
    ``bound_slack`` past it (a verify's drafts that may be rolled back),
    ``read`` the way the next forward spans it."""
    cache = BufferKVCache()
    written(cache, 40)
    cache.set_length(mx.array(40, mx.int32), 40 + bound_slack, read)
    return cache


def test_attention_reads_up_to_the_bound():
    cache = filled(bound_slack=5)
    mask, keys, values = written(cache, 3)
    assert cache.capacity == 256
    assert keys.shape[2] == values.shape[2] == mask.shape[-1] == 48
    # the slack between the true length and the bound stays hidden
    assert mask.tolist()[0][:41] == [True] * 41 and not any(mask.tolist()[0][41:])


def test_compiled_traces_and_cuda_read_the_whole_buffer(monkeypatch):
    cache = filled(read="fixed")
    mask, keys, _ = written(cache, 3)
    assert keys.shape[2] == mask.shape[-1] == cache.capacity

    monkeypatch.setattr(device, "backend", lambda: "cuda")
    cache = filled()
    mask, keys, _ = written(cache, 3)
    assert keys.shape[2] == mask.shape[-1] == cache.capacity


def test_an_exact_one_row_step_reads_the_filled_keys_with_no_mask(monkeypatch):
    # A plain step after plain steps: the bound is the length itself.
    for where in ("cpu", "cuda"):
        monkeypatch.setattr(device, "backend", lambda: where)
        cache = filled(read="exact")
        mask, keys, _ = written(cache, 1)
        assert mask is None and keys.shape[2] == 41, where
    # a sliding window the row has passed still needs its mask
    cache = filled(read="exact")
    windowed = cache.make_mask(1, window_size=16)
    assert windowed.shape == (1, 41) and sum(windowed.tolist()[0]) == 16
    assert cache.make_mask(1, window_size=64) is None
    # a block of several rows keeps its mask (its drafts' rows are causal)
    cache = filled(read="exact")
    mask, keys, _ = written(cache, 4)
    assert mask is not None and mask.shape == (4, keys.shape[2])
    # only plain buffers take an exact read; a setting of the length resets it
    cache.set_length(mx.array(40, mx.int32), 40)
    assert cache.read == "bound"


def test_a_prompts_last_id_alone_reads_the_filled_keys_with_no_mask(monkeypatch):
    """The prompt's last id, read alone at a host length as mlx-lm's
    generate_step reads it, takes no mask either (a masked one-row attention
    is another kernel on CUDA, which rounds unlike mlx-lm's step)."""
    for where in ("cpu", "cuda"):
        monkeypatch.setattr(device, "backend", lambda: where)
        cache = BufferKVCache()
        written(cache, 40)
        mask, keys, _ = written(cache, 1)
        assert mask is None and keys.shape[2] == 41, where
    cache = BufferKVCache()
    written(cache, 40)
    assert sum(cache.make_mask(1, window_size=16).tolist()[0]) == 16  # a passed window keeps its mask


@pytest.mark.parametrize("compiled", [False, True])
def test_plain_steps_after_plain_steps_run_exact_and_stay_the_targets(monkeypatch, agreeing_pair, compiled):
    model, draft = agreeing_pair
    monkeypatch.setattr(Cycle, "compile_graphs", compiled)
    monkeypatch.setattr(speculative.block_memory, "chooser", lambda *a: PlainSteps(4, 16))
    unmasked = []
    make_mask = BufferKVCache.make_mask

    def spy(self, N, *a, **kw):
        mask = make_mask(self, N, *a, **kw)
        unmasked.append(mask is None)
        return mask

    monkeypatch.setattr(BufferKVCache, "make_mask", spy)
    prompt = [3, 1, 4, 1, 5, 9]
    out = stream_generate(model, draft, make_tokenizer(24), prompt, max_tokens=30, block_size="auto")
    assert [t for r in out for t in r.tokens] == greedy_reference(model, prompt, 30)
    # every step but the prefill's reads exactly the filled keys (one mask per forward)
    assert unmasked.count(True) >= 28 and unmasked.count(False) == 1


class PlainSteps(BlockChooser):
    def choose(self, would_build=None) -> int:
        return 1


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text", "qwen3_5"])
def test_exact_plain_steps_keep_every_family_exact(monkeypatch, family):
    # sliding windows (passed during the reply), sinks, a hybrid's delta-net
    # layers: plain steps between drafting cycles, greedy equal to mlx-lm's
    from test_deferred_feed import Scripted
    from test_families import VOCAB
    from test_families import make_pair as dense_pair
    from test_hybrid import make_pair as hybrid_pair

    model, draft = hybrid_pair(family) if family == "qwen3_5" else dense_pair(family)
    monkeypatch.setattr(speculative.block_memory, "chooser", lambda *a: Scripted())
    prompt = [5, 3, 9, 2, 7]
    want = greedy_reference(model, prompt, 40)
    draft.set_script(prompt + want)
    out = stream_generate(model, draft, make_tokenizer(VOCAB), prompt, max_tokens=40, block_size="auto")
    assert [t for r in out for t in r.tokens] == want
