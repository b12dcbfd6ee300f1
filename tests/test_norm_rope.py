"""The q/k norm + RoPE kernel (kernels/norm_rope.py): its arithmetic, written
out in numpy, against MLX's ops; dispatch on a pretend GPU (a kernel that
checks out is used by the layers, one that does not never is); rotations it
does not do; the two dialects from one body."""

import math
import re
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import test_kernels
from metal_on_cpu import run_grid
from repo_files import repo_module

from dflash_mlx.kernels import launch_source
from dflash_mlx.kernels import norm_rope as nr
from dflash_mlx.kernels.attention_source import HEADER
from dflash_mlx.kernels.dispatch import TOLERANCE


def kernel_arithmetic(q, k, q_weight, k_weight, *, eps, scale, base, offset):
    """What BODY computes, row by row: the norm in float32 rounded to the
    dtype, then the rotation of pair (i, i + D/2) by scale * position *
    2^(-(i / (D/2)) * log2(base)), rounded again, row l's position offset + l
    or offset[l] (an array [L]); [B, heads, L, D] out."""
    dtype = q.dtype
    L = q.shape[1]
    if isinstance(offset, mx.array) and offset.size > 1:  # row l at offset[l]
        rows = np.array(offset, dtype=np.float32)
    else:
        rows = int(np.array(offset).reshape(())) + np.arange(L, dtype=np.float32)

    def one(x, w):
        x = np.array(x.astype(mx.float32), dtype=np.float32)
        w = np.array(w.astype(mx.float32), dtype=np.float32)
        D = x.shape[-1]
        inv = 1.0 / np.sqrt((x * x).sum(-1, keepdims=True) / np.float32(D) + np.float32(eps))
        y = np.array(mx.array(w * (x * inv)).astype(dtype).astype(mx.float32))
        half = D // 2
        position = np.float32(scale) * rows
        theta = position[:, None] * np.exp2(-(np.arange(half, dtype=np.float32) / half) * np.float32(math.log2(base)))
        c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
        a, z = y[..., :half], y[..., half:]
        out = np.concatenate([a * c - z * s, a * s + z * c], axis=-1)
        return mx.array(out).astype(dtype).transpose(0, 2, 1, 3)

    return one(q, q_weight), one(k, k_weight)


class Recorder:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.fn(*args, **kw)


@pytest.fixture
def fake_gpu(monkeypatch):
    """norm_rope as if MLX ran on a GPU backend named 'fake' with a kernel of our choosing."""
    nr.reset()
    monkeypatch.setattr(nr, "backend", lambda: "fake")

    def install(kernel):
        monkeypatch.setitem(nr.BUILDERS, "fake", lambda where: kernel)

    yield install
    nr.reset()


def rel_err(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-6)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_kernels_arithmetic_is_mlxs_norm_then_rope(dtype, head_dim):
    for q, k, qn, kn, rope, offset in nr._check_cases(dtype, head_dim):
        got = kernel_arithmetic(q, k, qn.weight, kn.weight, eps=qn.eps, scale=rope.scale, base=rope.base, offset=offset)
        want = nr.ops_norm_rope(q, k, qn, kn, rope, offset)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            # (float32: angles near 4,000 radians carry ~1e-4 of rounding, which differs with how the
            # frequencies are computed; a wrong pairing or frequency is off by O(1))
            assert rel_err(g, w) <= (1e-3 if dtype == mx.float32 else TOLERANCE[dtype])


def tiny_qwen3_layer(dtype=mx.float32):
    from mlx_lm.models.qwen3 import ModelArgs, TransformerBlock

    args = ModelArgs(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=1,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=32,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        head_dim=64,
        tie_word_embeddings=True,
    )
    mx.random.seed(5)
    layer = TransformerBlock(args)
    layer.set_dtype(dtype)
    mx.eval(layer.parameters())
    return layer


def run_layer(layer, h, offset: int):
    from dflash_mlx.kv.buffer import BufferKVCache
    from dflash_mlx.layers.fused import block

    cache = BufferKVCache()
    cache.set_length(offset)
    cache.write(mx.zeros((1, 2, offset, 64), h.dtype), mx.zeros((1, 2, offset, 64), h.dtype), 0)
    cache.set_length(mx.array(offset, mx.int32), offset)
    return block(layer)(h, cache.make_mask(h.shape[1]), cache)


def test_a_kernel_that_checks_out_is_what_a_qwen3_layer_runs(fake_gpu):
    layer = tiny_qwen3_layer()
    h = mx.random.normal((1, 5, 128), key=mx.random.key(1))
    want = run_layer(layer, h, 40)  # (the CPU: the ops path)
    good = Recorder(kernel_arithmetic)
    fake_gpu(good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nr.prepare(mx.float32, 64)
        checked = good.calls
        got = run_layer(layer, h, 40)
    assert checked == len(list(nr._check_cases(mx.float32, 64))) and good.calls == checked + 1
    assert rel_err(got, want) < 1e-5
    (result,) = nr._checks.values()
    assert result.ok


def as_the_ops(q, k, qw, kw, *, eps, scale, base, offset):
    """A kernel computing exactly what MLX's norm and rope ops do."""
    qn, kn = nn.RMSNorm(q.shape[-1], eps=eps), nn.RMSNorm(k.shape[-1], eps=eps)
    qn.weight, kn.weight = qw, kw
    return nr.ops_norm_rope(q, k, qn, kn, nn.RoPE(q.shape[-1], base=base, scale=scale), offset)


def nudged(q, k, qw, kw, **kwargs):
    """The ops' result with q's first element one unit in the last place off:
    within the check's tolerance, not bit for bit."""
    qo, ko = as_the_ops(q, k, qw, kw, **kwargs)
    first = qo.reshape(-1)[:1]
    step = mx.abs(first.astype(mx.float32)) * 2.0**-20 + 1e-30
    return mx.concatenate([(first.astype(mx.float32) + step).astype(qo.dtype), qo.reshape(-1)[1:]]).reshape(
        qo.shape
    ), ko


@pytest.mark.parametrize("exact_first", [True, False])
def test_where_exactness_comes_first_only_a_bit_equal_kernel_serves(fake_gpu, monkeypatch, exact_first):
    """On a Mac (decisions.EXACT_FIRST) a kernel that rounds one element
    otherwise than MLX's norm and rope passes its check but never serves, so a
    verify row rounds as the one-row step's; elsewhere it serves."""
    from dflash_mlx.kernels import decisions

    monkeypatch.setattr(decisions, "EXACT_FIRST", ("fake",) if exact_first else ())
    monkeypatch.setattr(decisions, "_current", decisions.Decisions(None, "measure", on={}), raising=False)
    layer = tiny_qwen3_layer()
    h = mx.random.normal((1, 5, 128), key=mx.random.key(1))
    for fn, bit_equal in ((nudged, False), (as_the_ops, True)):
        nr.reset()
        kernel = Recorder(fn)
        fake_gpu(kernel)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            nr.prepare(mx.float32, 64)
        assert nr._checks[("fake", mx.float32, 64)].ok
        checked = kernel.calls
        run_layer(layer, h, 40)
        assert kernel.calls == checked + (1 if bit_equal or not exact_first else 0)


def test_a_kernel_that_does_not_check_out_warns_once_and_is_never_used(fake_gpu):
    def swapped(q, k, qw, kw, **kwargs):  # the pairs rotated the wrong way
        qo, ko = kernel_arithmetic(q, k, qw, kw, **kwargs)
        return -qo, ko

    wrong = Recorder(swapped)
    fake_gpu(wrong)
    with pytest.warns(RuntimeWarning, match=r"fake float32 head_dim=64 q/k norm \+ RoPE kernel failed its self-check"):
        nr.prepare(mx.float32, 64)
    layer = tiny_qwen3_layer()
    h = mx.random.normal((1, 5, 128), key=mx.random.key(1))
    calls = wrong.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nr.prepare(mx.float32, 64)  # checked once
        got = run_layer(layer, h, 40)
    assert wrong.calls == calls
    nr.reset()
    assert mx.array_equal(got, run_layer(layer, h, 40))


def test_a_kernel_that_does_not_build_is_named_and_not_used(fake_gpu, monkeypatch):
    def broken(where):
        raise RuntimeError("Failed to compile kernel: error: expected ';'")

    nr.reset()
    monkeypatch.setitem(nr.BUILDERS, "fake", broken)
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: Failed to compile kernel"):
        nr.prepare(mx.bfloat16, 128)
    assert nr.passed(mx.bfloat16, 128) is None


@pytest.mark.parametrize("rope", [nn.RoPE(64, traditional=True), nn.RoPE(32), "llama3"])
def test_rotations_the_kernel_does_not_do_take_the_ops_path(fake_gpu, rope):
    if rope == "llama3":
        from mlx_lm.models.rope_utils import initialize_rope

        rope = initialize_rope(
            64,
            500_000.0,
            False,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            131072,
        )
    good = Recorder(kernel_arithmetic)
    fake_gpu(good)
    nr.prepare(mx.float32, 64)
    calls = good.calls
    q, k, qn, kn, _, offset = next(nr._check_cases(mx.float32, 64))
    got = nr.norm_rope(q, k, qn, kn, rope, offset)
    assert good.calls == calls
    for g, w in zip(got, nr.ops_norm_rope(q, k, qn, kn, rope, offset)):
        assert mx.array_equal(g, w)


def test_both_dialects_come_from_one_body():
    calls = []
    for where in ("metal", "cuda"):
        nr.NormRopeKernel(where, factory=lambda **kw: calls.append(kw) or (lambda **_: None))
    metal, cuda = calls
    compact = launch_source.compact  # (the factories are handed compact sources)
    assert metal["name"] == cuda["name"] and metal["input_names"] == cuda["input_names"] == nr.INPUTS
    assert (
        metal["source"].replace(compact(nr.PRELUDE["metal"]), "")
        == cuda["source"].replace(compact(nr.PRELUDE["cuda"]), "")
        == compact(nr.BODY)
    )
    assert metal["ensure_row_contiguous"] is False and "q_strides" in nr.BODY and "k_strides" in nr.BODY
    used = set(re.findall(r"\b(to_float|from_float|simd_sum|DEV|idx_t|NR_\w+)\b", nr.BODY))
    for where, builtin in (("metal", {"simd_sum"}), ("cuda", set())):
        defined = HEADER[where] + nr.PRELUDE[where]
        missing = [
            n
            for n in used
            if n not in builtin and not re.search(rf"(#define {n}\b|typedef .* {n};|\b{n}\s*\(|\b{n}\s*<)", defined)
        ]
        assert not missing, (where, missing)


def test_self_check_all_checks_every_dtype_and_head_dim_once(fake_gpu):
    """What `dflash-mlx doctor` lists: one result per (dtype, head dim)."""
    good = Recorder(kernel_arithmetic)
    fake_gpu(good)
    heard = []

    def report(result):  # hears each result as its check ends, before the next one runs
        heard.append((result, good.calls))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = nr.self_check_all(report=report)
    assert [r for r, _ in heard] == results
    assert all(a < b for (_, a), (_, b) in zip(heard, heard[1:]))  # the kernel ran between reports
    assert sorted((r.dtype, r.head_dim) for r in results) == sorted(
        (str(t).split(".")[-1], d) for t in (mx.float32, mx.bfloat16, mx.float16) for d in (64, 128, 256)
    )
    assert all(r.ok for r in results)
    calls = good.calls
    nr.self_check_all()
    assert good.calls == calls  # (checked once a process)


# --- A draft tree's per-row positions --------------------------------------------------------------------------


def llama3_rope(dims=64):
    from mlx_lm.models.rope_utils import initialize_rope

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return initialize_rope(dims, 500_000.0, False, scaling, 131072)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("rope", [nn.RoPE(64, base=10_000.0), nn.RoPE(64, traditional=True), nn.RoPE(32), "llama3"])
def test_the_ops_path_rotates_each_row_at_its_own_position(rope, batch):
    rope = llama3_rope() if rope == "llama3" else rope
    x = mx.random.normal((batch, 4, 12, 64), key=mx.random.key(3))
    positions = 900 + mx.array(nr.TREE_DEPTHS, mx.int32)
    one_by_one = [rope(x[:, :, i : i + 1], offset=int(positions[i])) for i in range(12)]
    assert mx.allclose(nr.rotate(rope, x, positions), mx.concatenate(one_by_one, axis=2), atol=1e-5)
    # a tree's norm + rotation: each row normed, then rotated alone at its position
    q, k, qn, kn, _, _ = list(nr._check_cases(mx.float32, 64))[2]
    got = nr.ops_norm_rope(q, k, qn, kn, rope, positions)
    for g, x, norm in zip(got, (q, k), (qn, kn)):
        for i in range(12):
            row = rope(norm(x[:, i : i + 1]).transpose(0, 2, 1, 3), offset=int(positions[i]))
            assert mx.allclose(g[:, :, i : i + 1], row, atol=1e-5), i


def test_positions_of_the_wrong_length_are_one_sentence():
    q, k, qn, kn, rope, _ = next(nr._check_cases(mx.float32, 64))  # 5 rows
    for positions in (mx.array([3, 4, 4], mx.int32), mx.zeros((5, 1), mx.int32)):
        for call in (
            lambda: nr.norm_rope(q, k, qn, kn, rope, positions),
            lambda: nr.rotate(rope, q.transpose(0, 2, 1, 3), positions),
        ):
            with pytest.raises(
                ValueError, match=r"one offset or one position a row \(an array of shape \(5,\)\), not shape"
            ) as e:
                call()
            msg = str(e.value)
            assert msg.endswith(".") and msg.count(". ") == 0 and "\n" not in msg


def test_a_vector_of_positions_takes_the_kernel_only_where_checked(fake_gpu):
    q, k, qn, kn, rope, _ = next(nr._check_cases(mx.float32, 64))
    positions = 60 + mx.array(nr.TREE_DEPTHS[:5], mx.int32)
    want = nr.ops_norm_rope(q, k, qn, kn, rope, positions)
    good = Recorder(kernel_arithmetic)
    fake_gpu(good)
    nr.norm_rope(q, k, qn, kn, rope, positions)
    assert good.calls == 0  # (not checked yet)
    nr.prepare(mx.float32, 64)
    calls = good.calls
    got = nr.norm_rope(q, k, qn, kn, rope, positions)
    assert good.calls == calls + 1
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    nr.prepare(mx.float16, 64)
    calls = good.calls
    nr.norm_rope(q.astype(mx.bfloat16), k.astype(mx.bfloat16), qn, kn, rope, positions)
    assert good.calls == calls  # (bfloat16's variant: not checked)


def test_a_kernel_that_ignores_per_row_positions_fails_its_check(fake_gpu):
    """Rows rotated at offset[0] + l: right for blocks, wrong for a tree, so the variant is never used."""

    def as_a_block(q, k, qw, kw, *, offset, **kwargs):
        start = offset[0] if isinstance(offset, mx.array) and offset.size > 1 else offset
        return kernel_arithmetic(q, k, qw, kw, offset=start, **kwargs)

    wrong = Recorder(as_a_block)
    fake_gpu(wrong)
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        nr.prepare(mx.float32, 64)
    q, k, qn, kn, rope, _ = next(nr._check_cases(mx.float32, 64))
    calls = wrong.calls
    for offset in (mx.array([7, 8, 8, 9, 9], mx.int32), 7):
        got = nr.norm_rope(q, k, qn, kn, rope, offset)
        for g, w in zip(got, nr.ops_norm_rope(q, k, qn, kn, rope, offset)):
            assert mx.array_equal(g, w)
    assert wrong.calls == calls


def run_tree_layer(layer, h, start: int):
    """A qwen3 layer's verify of a tree of h's rows after ``start`` zeros of context."""
    from dflash_mlx.kv.buffer import BufferKVCache
    from dflash_mlx.kv.tree import from_parents
    from dflash_mlx.layers.fused import block

    parents = mx.array([0, 0, 0, 1, 1, 2, 3, 3, 4, 6, 9, 10][: h.shape[1]], mx.int32)
    cache = BufferKVCache()
    cache.set_length(start)
    cache.write(mx.zeros((1, 2, start, 64), h.dtype), mx.zeros((1, 2, start, 64), h.dtype), 0)
    cache.set_length(mx.array(start, mx.int32), start)
    cache.tree = from_parents(parents, 8)
    assert mx.array_equal(cache.tree.depths, mx.array(nr.TREE_DEPTHS[: h.shape[1]]))
    return block(layer)(h, cache.make_mask(h.shape[1]), cache)


def test_a_qwen3_layers_tree_verify_runs_the_checked_kernel(fake_gpu):
    layer = tiny_qwen3_layer()
    h = mx.random.normal((1, 12, 128), key=mx.random.key(2))
    want = run_tree_layer(layer, h, 40)  # (the CPU: the ops path)
    good = Recorder(kernel_arithmetic)
    fake_gpu(good)
    nr.prepare(mx.float32, 64)
    calls = good.calls
    got = run_tree_layer(layer, h, 40)
    assert good.calls == calls + 1
    assert rel_err(got, want) < 1e-5


# --- The Metal body, run on this CPU ---------------------------------------------------------------------------
#
# A variant's source as MLX builds it for a Mac, lowered and compiled by clang for this machine with
# test_kernels.py's harness (a fiber here for every thread of a threadgroup, simd_sum across its 32
# lanes), plus the math functions the body calls; T = float.

METAL_MATH = r"""
namespace metal {
namespace fast {
template <typename T, typename U> T cos(T x) { return T(__builtin_cosf(float(x))); }
template <typename T, typename U> T sin(T x) { return T(__builtin_sinf(float(x))); }
}
namespace precise {
template <typename T, typename U> T rsqrt(T x) { return T(1.0f / __builtin_sqrtf(float(x))); }
}
}
"""


def run_metal_body(tmp_path, monkeypatch, rows: int, offset, plant=None):
    """The float32 variant for ``rows`` rows of 4 query and 2 key heads, views
    into a fused k/v/q product, at ``offset``; run from its Metal source."""
    import ctypes

    script = test_kernels.metal_script()
    recorder = script.Recorder()
    hq, hk, d = 4, 2, 64
    width = (hq + 2 * hk) * d
    fused = np.random.default_rng(rows).standard_normal((1, rows, width)).astype(np.float32)
    weights = (1 + 0.3 * np.random.default_rng(1).standard_normal((2, d))).astype(np.float32)
    k, _, q = mx.split(mx.array(fused), [hk * d, 2 * hk * d], axis=-1)
    q, k = q.reshape(1, rows, hq, d), k.reshape(1, rows, hk, d)
    qn, kn = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
    qn.weight, kn.weight = mx.array(weights[0]), mx.array(weights[1])
    rope = nn.RoPE(d, base=10_000.0)
    nr.NormRopeKernel("metal", factory=recorder.factory)(
        q, k, qn.weight, kn.weight, eps=qn.eps, scale=rope.scale, base=rope.base, offset=offset
    )
    ((name, variant),) = recorder.variants.items()
    ((grid, group),) = variant.launches
    src = variant.source
    if plant is not None:
        assert plant[0] in src
        src = src.replace(plant[0], plant[1])
    strides = np.array([rows * width, width, d, 1], np.int64)
    base = fused.ctypes.data
    arrays = {
        "k": None,  # (at the fused product's first element: k's view)
        "q": None,  # (2 * hk * d elements on)
        "q_shape": np.array([1, rows, hq, d], np.int32),
        "q_strides": strides,
        "k_shape": np.array([1, rows, hk, d], np.int32),
        "k_strides": strides,
        "q_weight": weights[0],
        "k_weight": weights[1],
        "offset": np.array(offset, np.int32).reshape(-1),
        "params": np.array([qn.eps, rope.scale, math.log2(rope.base)], np.float32),
        "q_out": np.zeros((1, hq, rows, d), np.float32),
        "k_out": np.zeros((1, hk, rows, d), np.float32),
    }
    names = list(arrays)
    pointers = {"k": base, "q": base + 2 * hk * d * 4}
    monkeypatch.setattr(test_kernels, "TREE_STUB", test_kernels.TREE_STUB + METAL_MATH)
    monkeypatch.setitem(test_kernels.TREE_ATTRIBUTES, "thread_position_in_grid", f"uint3(x * {group[0]} + tid, 0u, 0u)")
    lib = test_kernels.build_tree_pass(script, src, names, tmp_path)
    bufs = (ctypes.c_void_p * len(names))(*[pointers.get(n) or arrays[n].ctypes.data for n in names])
    run_grid(lib, bufs, grid[0] // group[0], grid[1], grid[2], group[0])
    want = nr.ops_norm_rope(q, k, qn, kn, rope, offset)
    return name, (arrays["q_out"], arrays["k_out"]), [np.array(w) for w in want]


needs_clang = pytest.mark.skipif(test_kernels.metal_script().find_clang() is None, reason="no clang++ on PATH")


@needs_clang
@pytest.mark.parametrize(
    "rows, offset, constant",
    [
        (5, 300 + mx.array(nr.TREE_DEPTHS[:5], mx.int32), True),  # a tree of 5: positions in constant memory
        (12, 300 + mx.array(nr.TREE_DEPTHS, mx.int32), False),  # 12: device memory
        (12, mx.array(300, mx.int32), True),  # a block
    ],
)
def test_the_metal_body_run_on_the_cpu_is_the_ops_path(tmp_path, monkeypatch, rows, offset, constant):
    name, got, want = run_metal_body(tmp_path, monkeypatch, rows, offset)
    memory = "_int32_tc_" if constant else "_int32_t_"  # (MLX's name: T, D, PER_ROW, then each input)
    assert f"__float_64_{int(offset.size > 1)}_" in name and memory + "floatc_float_float" in name, name
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < 1e-4 * np.abs(w).max(), np.abs(g - w).max()


@needs_clang
@pytest.mark.parametrize(
    "plant",
    [("offset[l]", "offset[0]"), ("PER_ROW ?", "false ?")],  # every node at the root's position; as a block
)
def test_a_metal_body_that_misreads_the_positions_differs_from_the_ops_path(tmp_path, monkeypatch, plant):
    _, got, want = run_metal_body(tmp_path, monkeypatch, 12, 300 + mx.array(nr.TREE_DEPTHS, mx.int32), plant)
    assert np.abs(got[0] - want[0]).max() > 1e-2 * np.abs(want[0]).max()


def load_script(name: str):
    return repo_module(f"scripts/{name}.py")


def test_the_kernel_checks_record_every_per_row_variant():
    """Each dtype and head dim at one offset and at a tree's positions: on Metal the positions
    in constant memory (fewer than 8) and in device memory, all of them in the self-check's cases."""
    from dflash_mlx.kernels.ops import DTYPES, HEAD_DIMS

    metal = load_script("check_metal_kernels")
    recorder, checked = metal.Recorder(), metal.Recorder()
    metal.record_all(recorder, modules=[])
    metal.record_all(checked, decoding=False, modules=[])
    names = {n for n in recorder.variants if "_norm_rope_" in n}
    assert names == {n for n in checked.variants if "_norm_rope_" in n}
    assert len(names) == len(DTYPES) * len(HEAD_DIMS) * 3
    for d in HEAD_DIMS:
        for per_row, memory in ((0, "int32_tc"), (1, "int32_tc"), (1, "int32_t")):
            tag = f"_norm_rope_v{nr.VERSION}__bfloat16_t_{d}_{per_row}_"
            assert any(tag in n and f"_{memory}_floatc_" in n for n in names), (d, per_row, memory)
    cuda = load_script("check_cuda_kernels")
    recorder = cuda.Recorder()
    cuda.record_all(recorder, modules=[])
    names = {n for n in recorder.variants if n.startswith("dflash_norm_rope_")}
    assert names == {
        f"dflash_norm_rope_v{nr.VERSION}_{str(t).split('.')[-1]}_{d}_{per_row}"
        for t in DTYPES
        for d in HEAD_DIMS
        for per_row in (False, True)
    }
    assert "constexpr bool PER_ROW = true;" in recorder.variants[f"dflash_norm_rope_v{nr.VERSION}_bfloat16_128_True"]


@needs_clang
def test_the_per_row_metal_variants_compile(monkeypatch):
    metal = load_script("check_metal_kernels")
    recorder = metal.Recorder()
    metal.record_all(recorder, dtypes=[mx.bfloat16], head_dims=[128], rows=[16], modules=[])
    recorder.variants = {n: v for n, v in recorder.variants.items() if "_norm_rope_" in n}
    compiler = metal.Compiler(metal.find_clang())
    lines = []
    try:
        assert not metal.check_all(recorder, compiler, report=lines.append), "\n".join(lines)
        # and a body that names the positions wrongly fails to compile, every variant
        monkeypatch.setattr(nr, "BODY", nr.BODY.replace("offset[l]", "offsets[l]"))
        recorder = metal.Recorder()
        metal.record_all(recorder, dtypes=[mx.bfloat16], head_dims=[128], rows=[16], modules=[])
        recorder.variants = {n: v for n, v in recorder.variants.items() if "_norm_rope_" in n}
        failed = metal.check_all(recorder, compiler, report=lines.append)
    finally:
        compiler.close()
    assert len(failed) == 3 and "use of undeclared identifier 'offsets'" in "\n".join(lines)
