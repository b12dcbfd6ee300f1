"""Attention reads a buffer cache up to its host bound, not its capacity,
except where shapes must stay fixed (a compiled trace, MLX's CUDA backend);
its mask always spans what it hands attention."""

import mlx.core as mx

from dflash_mlx.kernels import dispatch
from dflash_mlx.kv_cache import BufferKVCache


def written(cache: BufferKVCache, n: int):
    """Write ``n`` positions; returns (mask, keys, values) as a layer sees them."""
    kv = mx.ones((1, 2, n, 8))
    mask = cache.make_mask(n)
    keys, values = cache.update_and_fetch(kv, kv)
    return mask, keys, values


def filled(bound_slack: int = 0) -> BufferKVCache:
    """A cache holding 40 positions, its length on the device, its bound
    ``bound_slack`` past it (a verify's drafts that may be rolled back)."""
    cache = BufferKVCache()
    written(cache, 40)
    cache.set_length(mx.array(40, mx.int32), 40 + bound_slack)
    return cache


def test_attention_reads_up_to_the_bound():
    cache = filled(bound_slack=5)
    mask, keys, values = written(cache, 3)
    assert cache.capacity == 256
    assert keys.shape[2] == values.shape[2] == mask.shape[-1] == 48
    # the slack between the true length and the bound stays hidden
    assert mask.tolist()[0][:41] == [True] * 41 and not any(mask.tolist()[0][41:])


def test_compiled_traces_and_cuda_read_the_whole_buffer(monkeypatch):
    cache = filled()
    cache.fixed_width = True
    mask, keys, _ = written(cache, 3)
    assert keys.shape[2] == mask.shape[-1] == cache.capacity

    monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
    cache = filled()
    mask, keys, _ = written(cache, 3)
    assert keys.shape[2] == mask.shape[-1] == cache.capacity
