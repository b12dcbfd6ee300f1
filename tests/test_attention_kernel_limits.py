"""The block-attention kernel at the edges of a long windowed context: what
reaches it and what it reads.

A sliding-window layer whose buffer holds the whole context (a plain
BufferKVCache) hands a prompt chunk's rows to MLX's attention, not the kernel:
KERNEL_WINS admits at most 128 rows per key-value head, however the variant was
checked and measured. And at a verify's rows over a 16k buffer, the kernel's
Metal source, run on this CPU, reads no key or value past the buffer's end
(it ends at an unreadable page here) and gives MLX's attention."""

import ctypes
import mmap

import mlx.core as mx
import numpy as np
import pytest
from test_kernels import build_tree_pass, metal_script, needs_clang, run_grid

from dflash_mlx.kernels import attention_source as source
from dflash_mlx.kernels import decisions, dispatch, ops_attention
from dflash_mlx.kernels.attention import BlockAttentionKernel
from dflash_mlx.kv.buffer import BufferKVCache
from dflash_mlx.layers.attention import attention_output

WINDOW = 1024


def whole_context_buffer(filled: int, d: int) -> BufferKVCache:
    """A sliding layer's buffer as it held the whole context: ``filled`` positions written."""
    cache = BufferKVCache()
    kv = mx.random.normal((1, 1, filled, d), key=mx.random.key(1))
    cache.update_and_fetch(kv, kv)
    return cache


@pytest.mark.parametrize("rows, served", [(2048, False), (128, True)])
def test_a_prompt_chunk_past_the_tables_rows_takes_mlxs_attention(monkeypatch, rows, served):
    """A windowed prompt chunk over a whole-context buffer on a GPU where the
    variant passed and every measured class chose it: 2048 rows (a prefill
    step's) go to MLX's attention; 128 (the table's most) to the kernel."""
    calls = []

    def kernel(q, k, v, **kw):
        calls.append(dict(kw, rows=q.shape[2], keys=k.shape[2]))
        return ops_attention(q, k, v, **kw)

    monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
    monkeypatch.setattr(dispatch, "passed_kernel", lambda *a, **kw: kernel)
    monkeypatch.setattr(decisions, "current", lambda: decisions.Decisions(None, "on", on={}))
    d, start = 64, 16384 - rows
    cache = whole_context_buffer(start, d)
    mask = cache.make_mask(rows, window_size=WINDOW)
    q, k = (mx.random.normal((1, 1, rows, d), key=mx.random.key(s)) for s in (2, 3))
    keys, values = cache.update_and_fetch(k, k)
    assert cache.capacity == 16384
    out, as_rows = attention_output(q, keys, values, cache=cache, scale=d**-0.5, mask=mask, start=start, window=WINDOW)
    assert as_rows == served and len(calls) == served
    if served:  # the whole buffer, the rows at their place, the window
        (call,) = calls
        assert (call["rows"], call["keys"], call["q_offset"], call["kv_length"]) == (rows, 16384, start, 16384)
        assert call["window"] == WINDOW and call["causal"]
    got = out.reshape(1, rows, 1, d).transpose(0, 2, 1, 3) if as_rows else out
    want = ops_attention(
        q, cache.keys, cache.values, scale=d**-0.5, q_offset=start, kv_length=16384, causal=True, window=WINDOW
    )
    assert mx.allclose(got, want, atol=1e-4).item()


def ending_at_a_fault(a: np.ndarray, keep: list) -> np.ndarray:
    """A copy of ``a`` whose last byte is followed by an unreadable page."""
    page = mmap.PAGESIZE
    pages = -(-a.nbytes // page) + 1
    m = mmap.mmap(-1, pages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0
    keep.append(m)
    out = np.frombuffer(m, dtype=a.dtype, count=a.size, offset=(pages - 1) * page - a.nbytes).reshape(a.shape)
    out[...] = a
    return out


@needs_clang
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("rows, start", [(16, 16384 - 16), (40, 14336)])
def test_the_metal_pass_over_a_long_windowed_buffer_reads_only_the_buffer(tmp_path, dtype, rows, start):
    """A verify's rows (GQA 4) at the end of a 16k buffer and in its middle,
    through a window of 1024: the partial pass (SIMT for float32, the matrix
    units' for 16-bit types, run with T = float), merged, is MLX's attention,
    with the keys and values ending at an unreadable page."""
    d, n = 128, 16384
    kq, kk, kv = mx.random.split(mx.random.key(rows), 3)
    q = mx.random.normal((1, rows, 4, d), key=kq).astype(dtype).transpose(0, 2, 1, 3)
    k = mx.random.normal((1, 1, n, d), key=kk).astype(dtype)
    v = mx.random.normal((1, 1, n, d), key=kv).astype(dtype)
    kw = dict(scale=d**-0.5, q_offset=mx.array(start), kv_length=mx.array(start + rows), causal=True, window=WINDOW)

    script = metal_script()
    recorder = script.Recorder()
    BlockAttentionKernel("metal", factory=recorder.factory)(q, k, v, **kw)
    (variant,) = [found for name, found in recorder.variants.items() if "partial" in name]
    ((grid, group),) = variant.launches
    b, hq, lq, _ = q.shape
    nch, f32, keep = grid[1], np.float32, []
    arrays = {
        "queries": np.ascontiguousarray(np.array(q.astype(mx.float32)).transpose(0, 2, 1, 3)),  # [B, L, Hq, D]
        "queries_shape": np.array(q.shape, np.int32),
        "queries_strides": np.array([lq * hq * d, d, hq * d, 1], np.int64),  # (the [B, Hq, L, D] view's)
        "keys": ending_at_a_fault(np.array(k.astype(mx.float32)), keep),
        "keys_shape": np.array(k.shape, np.int32),
        "values": ending_at_a_fault(np.array(v.astype(mx.float32)), keep),
        "q_offset": np.array([start], np.int32),
        "kv_length": np.array([start + rows], np.int32),
        "params": np.array([kw["scale"] * source.LOG2E, 0.0], f32),
        "o_part": np.zeros((b, hq, lq, nch, d), f32),
        "m_part": np.zeros((b, hq, lq, nch), f32),
        "l_part": np.zeros((b, hq, lq, nch), f32),
    }
    names = list(arrays)
    lib = build_tree_pass(script, variant.source.replace("float16_t", "float"), names, tmp_path)
    bufs = (ctypes.c_void_p * len(names))(*[arrays[name].ctypes.data for name in names])
    run_grid(lib, bufs, grid[0] // group[0], grid[1], grid[2], group[0])
    o, m, l = arrays["o_part"], arrays["m_part"], arrays["l_part"]
    w = np.where(m == -np.inf, 0.0, np.exp2(m - m.max(axis=-1, keepdims=True)))
    got = (o * w[..., None]).sum(axis=3) / (l * w).sum(axis=3, keepdims=True)
    want = np.array(ops_attention(*(a.astype(mx.float32) for a in (q, k, v)), **kw))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
