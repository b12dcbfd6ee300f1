"""Block attention: the ops path's mask rules against a dense reference, the
two-pass split/merge arithmetic, dispatch and fallback (a kernel that fails its
self-check is never used), input checks, and the two kernel dialects."""

import random
import re
import warnings

import mlx.core as mx
import numpy as np
import pytest
from metal_on_cpu import FIBERS, run_grid, with_poisoned_threadgroup_memory, with_thread_entry
from repo_files import repo_module

from dflash_mlx.kernels import attention_source as source
from dflash_mlx.kernels import attention_tiles as source_tiles
from dflash_mlx.kernels import block_attention, dispatch, launch_source, ops_attention
from dflash_mlx.kernels.attention import BlockAttentionKernel, chunk_size, max_warps
from dflash_mlx.kernels.attention_source import TREE_NODES
from dflash_mlx.kernels.cuda.products import BlockProductKernel
from dflash_mlx.kernels.dispatch import check_tree, ops_tree_attention, tree_attention
from dflash_mlx.kernels.norm_rope import NormRopeKernel
from dflash_mlx.kernels.ops import visible
from dflash_mlx.kv.tree import chain

TOL = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def dense(q, k, v, *, scale, q_offset, kv_length, causal, window=None, sinks=None):
    """softmax(q k^T) v in float32 with a mask written out key by key."""
    qo, kl = int(np.array(q_offset).reshape(())), int(np.array(kv_length).reshape(()))
    lq, n = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    mask = np.zeros((lq, n), dtype=bool)
    for i in range(lq):
        pos = qo + i
        for j in range(n):
            ok = j < kl and (not causal or j <= pos)
            if window is not None:
                ok = ok and pos - j < window and (causal or j - pos < window)
            mask[i, j] = ok
    kf = mx.repeat(k.astype(mx.float32), g, axis=1)
    vf = mx.repeat(v.astype(mx.float32), g, axis=1)
    s = (q.astype(mx.float32) @ kf.transpose(0, 1, 3, 2)) * scale
    s = mx.where(mx.array(mask), s, -mx.inf)
    if sinks is not None:
        col = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (*s.shape[:3], 1))
        s = mx.concatenate([col, s], axis=-1)
    p = mx.softmax(s, axis=-1)
    return (p[..., 1:] if sinks is not None else p) @ vf


def exp2(x):
    return mx.power(2.0, x)


def two_pass(q, k, v, *, scale, q_offset, kv_length, causal, window=None, sinks=None, chunk=64):
    """The kernels' arithmetic in mx ops: base-2 partial softmax per key chunk, then the merge."""
    g = q.shape[1] // k.shape[1]
    kf = mx.repeat(k.astype(mx.float32), g, axis=1)
    vf = mx.repeat(v.astype(mx.float32), g, axis=1)
    s = (q.astype(mx.float32) * (scale * source.LOG2E)) @ kf.transpose(0, 1, 3, 2)
    s = mx.where(visible(q.shape[2], k.shape[2], q_offset, kv_length, causal, window), s, -mx.inf)
    parts = []
    for c0 in range(0, k.shape[2], chunk):
        sc = s[..., c0 : c0 + chunk]
        m = sc.max(axis=-1, keepdims=True)
        p = mx.where(m == -mx.inf, 0.0, exp2(sc - m))
        parts.append((m, p.sum(axis=-1, keepdims=True), p @ vf[:, :, c0 : c0 + chunk]))
    top = mx.max(mx.stack([m for m, _, _ in parts]), axis=0)
    if sinks is not None:
        sink = (sinks.astype(mx.float32) * source.LOG2E)[None, :, None, None]
        top = mx.maximum(top, sink)
    num, den = 0.0, 0.0
    for m, l, o in parts:
        w = mx.where(m == -mx.inf, 0.0, exp2(m - top))
        num, den = num + o * w, den + l * w
    if sinks is not None:
        den = den + exp2(sink - top)
    return (num / den).astype(q.dtype)


def random_case(rng, dtype=None, as_arrays=None):
    d = rng.choice(source_dims())
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 4])
    lq = rng.randint(1, 9)
    n = rng.choice([32, 64, 96])
    q_offset = rng.randint(0, n - lq)
    kv_length = rng.randint(q_offset + lq, n)  # every row sees at least its own position
    causal = rng.random() < 0.5
    window = rng.choice([None, None, 1, 3, 17])
    dtype = dtype or rng.choice([mx.float32, mx.float16, mx.bfloat16])
    seed = rng.randint(0, 1 << 30)
    kq, kk, kv, ks = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((rng.choice([1, 2]), hq, lq, d), key=kq)
    k = mx.random.normal((q.shape[0], hkv, n, d), key=kk)
    v = mx.random.normal((q.shape[0], hkv, n, d), key=kv)
    sinks = mx.random.normal((hq,), key=ks) if rng.random() < 0.3 else None
    arrays = rng.random() < 0.5 if as_arrays is None else as_arrays
    kw = dict(
        scale=d**-0.5,
        q_offset=mx.array(q_offset) if arrays else q_offset,
        kv_length=mx.array([kv_length], dtype=mx.int32) if arrays else kv_length,
        causal=causal,
        window=window,
        sinks=sinks,
    )
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), kw


def source_dims():
    return [64, 128]  # 256 adds nothing to the mask rules and doubles the time


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-6)).item()


def test_ops_path_matches_dense_reference_over_random_cases():
    rng = random.Random(0)
    for _ in range(80):
        q, k, v, kw = random_case(rng)
        got = ops_attention(q, k, v, **kw)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert rel_err(got, dense(q, k, v, **kw)) < TOL[q.dtype], kw


def test_block_attention_on_cpu_is_the_ops_path():
    rng = random.Random(1)
    for _ in range(10):
        q, k, v, kw = random_case(rng)
        assert mx.array_equal(block_attention(q, k, v, **kw), ops_attention(q, k, v, **kw))


def test_mask_corners_verify_and_drafter():
    """Unfilled keys never count; causal hides the block's later keys; a
    non-causal window reaches forward and backward by absolute position."""
    m = np.array(visible(4, 12, mx.array(5), mx.array(9), True, None))
    assert m[0].tolist() == [True] * 6 + [False] * 6
    assert m[3].tolist() == [True] * 9 + [False] * 3
    m = np.array(visible(4, 12, 5, 9, False, 2))
    assert m[0].tolist() == [False] * 4 + [True] * 3 + [False] * 5  # keys 4..6 around position 5
    assert m[3].tolist() == [False] * 7 + [True] * 2 + [False] * 3  # key 9 is unfilled


def test_two_pass_arithmetic_matches_dense_including_sinks():
    rng = random.Random(2)
    for _ in range(30):
        q, k, v, kw = random_case(rng, dtype=mx.float32)
        for chunk in (16, 64):
            assert rel_err(two_pass(q, k, v, chunk=chunk, **kw), dense(q, k, v, **kw)) < 1e-5


class Recorder:
    """A stand-in kernel: counts its calls, computes with `fn`."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, q, k, v, **kw):
        self.calls += 1
        return self.fn(q, k, v, **kw)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Dispatch as if MLX ran on a GPU backend named 'fake' with a kernel of our
    choosing, which the table picks for any call (a test may set its own)."""
    dispatch.reset()
    monkeypatch.setattr(dispatch, "backend", lambda: "fake")
    monkeypatch.setattr(dispatch, "KERNEL_WINS", ((1 << 30, 0),))
    built = []

    def install(kernel=None, error=None):
        def builder(where):
            built.append(where)
            if error is not None:
                raise error
            return kernel

        monkeypatch.setitem(dispatch.BUILDERS, "fake", builder)
        return built

    yield install
    dispatch.reset()


def small_verify(dtype=mx.bfloat16, d=128):
    q = mx.random.normal((1, 4, 5, d), key=mx.random.key(3)).astype(dtype)
    k = mx.random.normal((1, 2, 256, d), key=mx.random.key(4)).astype(dtype)
    return q, k, k, dict(scale=d**-0.5, q_offset=mx.array(100), kv_length=mx.array(105), causal=True)


def test_a_correct_kernel_passes_its_check_and_is_used(fake_gpu):
    good = Recorder(two_pass)
    built = fake_gpu(good)
    q, k, v, kw = small_verify()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = block_attention(q, k, v, **kw)
        first = good.calls
        block_attention(q, k, v, **kw)
    cases = len(list(dispatch._check_cases(mx.bfloat16, 128, False)))
    assert first == cases + 1 and good.calls == cases + 2  # the check's cases once, then one launch per call
    assert built == ["fake"]
    assert rel_err(out, ops_attention(q, k, v, **kw)) < TOL[mx.bfloat16]
    (result,) = dispatch._checks.values()
    assert result.ok and result.case == "fake bfloat16 head_dim=128 full"


def test_a_wrong_kernel_fails_its_check_warns_once_and_is_never_used(fake_gpu):
    wrong = Recorder(lambda q, k, v, **kw: two_pass(q, k, v, **{**kw, "causal": not kw["causal"]}))
    fake_gpu(wrong)
    q, k, v, kw = small_verify(mx.float16, 64)
    with pytest.warns(
        RuntimeWarning, match=r"fake float16 head_dim=64 full .*failed its self-check \(max relative error"
    ):
        out = block_attention(q, k, v, **kw)
    assert mx.array_equal(out, ops_attention(q, k, v, **kw))
    first = wrong.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        out = block_attention(q, k, v, **kw)
    assert wrong.calls == first  # never launched again
    assert mx.array_equal(out, ops_attention(q, k, v, **kw))


def test_a_kernel_that_does_not_build_falls_back_with_the_error_named(fake_gpu):
    fake_gpu(error=RuntimeError("Failed to compile kernel: error: expected ';'"))
    q, k, v, kw = small_verify()
    kw["window"] = 8
    with pytest.warns(RuntimeWarning, match=r"sliding window .*RuntimeError: Failed to compile kernel"):
        out = block_attention(q, k, v, **kw)
    assert mx.array_equal(out, ops_attention(q, k, v, **kw))
    assert not dispatch._checks[("fake", mx.bfloat16, 128, True)].ok


def test_nan_output_fails_the_check(fake_gpu):
    fake_gpu(Recorder(lambda q, k, v, **kw: mx.full(q.shape, float("nan"), dtype=q.dtype)))
    q, k, v, kw = small_verify(mx.float32)
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        block_attention(q, k, v, **kw)


def test_each_variant_is_checked_separately(fake_gpu):
    good = Recorder(two_pass)
    fake_gpu(good)
    q, k, v, kw = small_verify()
    block_attention(q, k, v, **kw)
    block_attention(q, k, v, **{**kw, "window": 16})
    block_attention(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), **kw)
    assert sorted(r.case for r in dispatch._checks.values()) == [
        "fake bfloat16 head_dim=128 full",
        "fake bfloat16 head_dim=128 sliding window",
        "fake float16 head_dim=128 full",
    ]
    assert [r.case for r in dispatch.self_check_all(dtypes=(mx.float32,), head_dims=(64,))][-2:] == [
        "fake float32 head_dim=64 full",
        "fake float32 head_dim=64 sliding window",
    ]


def test_self_check_all_reports_each_variant_before_building_the_next(fake_gpu):
    """`dflash-mlx doctor` prints a line per variant as it is checked (a cold
    CUDA process compiles each first): every report comes right after its own
    variant's kernel runs, before the next variant's do."""
    events = []

    def kernel(q, k, v, **kw):
        events.append(("run", str(q.dtype).split(".")[-1], q.shape[-1], kw.get("window") is not None))
        return two_pass(q, k, v, **kw)

    fake_gpu(Recorder(kernel))
    results = dispatch.self_check_all(
        dtypes=(mx.float32, mx.bfloat16),
        head_dims=(64,),
        report=lambda r: events.append(("report", r.dtype, r.head_dim, r.window)),
    )
    reports = [i for i, e in enumerate(events) if e[0] == "report"]
    assert [events[i][1:] for i in reports] == [
        ("float32", 64, False),
        ("float32", 64, True),
        ("bfloat16", 64, False),
        ("bfloat16", 64, True),
    ]
    start = 0
    for i in reports:
        ran = events[start:i]
        assert ran and all(e[1:] == events[i][1:] for e in ran)  # only this variant ran since the last report
        start = i + 1
    assert [r.case for r in results] == [
        f"fake {d} head_dim=64 {w}" for d in ("float32", "bfloat16") for w in ("full", "sliding window")
    ]


def test_the_measured_table_picks_by_rows_and_keys(fake_gpu, monkeypatch):
    good = Recorder(two_pass)
    fake_gpu(good)
    monkeypatch.setattr(dispatch, "KERNEL_WINS", ((2, None), (16, 0), (64, 2048)))
    assert dispatch.kernel_wins(8, 1) and dispatch.kernel_wins(8, 1 << 20) and dispatch.kernel_wins(64, 2048)
    assert not dispatch.kernel_wins(64, 2047) and not dispatch.kernel_wins(65, 1 << 20)
    assert not dispatch.kernel_wins(1, 1 << 20) and not dispatch.kernel_wins(2, 1 << 20)
    q = mx.random.normal((1, 32, 16, 64)).astype(mx.bfloat16)  # 64 rows per kv head
    k = mx.random.normal((1, 8, 4096, 64)).astype(mx.bfloat16)
    kw = dict(scale=0.125, q_offset=1000, kv_length=1016, causal=True)
    block_attention(q, k, k, **kw)  # an int length is the hint: 1016 keys, the fused op, no check either
    assert good.calls == 0 and not dispatch._checks
    block_attention(q, k, k, **{**kw, "kv_length": mx.array(1016)})  # an array: the buffer's 4096 keys
    cases = len(list(dispatch._check_cases(mx.bfloat16, 64, False)))
    assert good.calls == cases + 1  # the check's cases, then the call
    block_attention(mx.concatenate([q, q], axis=1), k, k, **kw)  # 128 rows per kv head: past the table
    assert good.calls == cases + 1


def test_bad_input_is_one_sentence():
    q = mx.zeros((1, 4, 3, 64))
    k = mx.zeros((1, 2, 32, 64))
    kw = dict(scale=0.1, q_offset=0, kv_length=3, causal=True)
    cases = [
        ((mx.zeros((1, 4, 3, 96)), mx.zeros((1, 2, 32, 96)), mx.zeros((1, 2, 32, 96))), {}, "head dims"),
        ((q, k, mx.zeros((1, 2, 31, 64))), {}, "same shape"),
        ((mx.zeros((1, 3, 3, 64)), k, k), {}, "multiple of key-value heads"),
        ((q, k.astype(mx.float16), k.astype(mx.float16)), {}, "one dtype"),
        ((q[0], k, k), {}, "4-d"),
        ((q, k, k), {"window": 0}, "window"),
        ((q, k, k), {"q_offset": -1}, "q_offset"),
        ((q, k, k), {"kv_length": mx.array([1.5])}, "kv_length"),
        ((q, k, k), {"sinks": mx.zeros((2,))}, "sinks"),
    ]
    for args, extra, words in cases:
        with pytest.raises(ValueError, match=words) as e:
            block_attention(*args, **{**kw, **extra})
        msg = str(e.value)
        assert msg.endswith(".") and msg.count(". ") == 0 and "\n" not in msg


def test_both_dialects_come_from_one_body():
    """Metal and CUDA sources differ only in header and prelude; each header
    defines every helper the body calls (or Metal has it built in); a draft
    tree's passes are the same bodies with the tree's rows and rule."""
    compact = launch_source.compact  # (the factories are handed compact sources)
    calls = []
    for where in ("metal", "cuda"):
        kernel = BlockAttentionKernel(where, factory=lambda **kw: calls.append(kw) or (lambda **_: None))
        staged = source_tiles.staging_bytes(128, *source_tiles.staging(128, where))
        kernel.partial_tiles(staged)
        kernel.partial_tree()
        kernel.partial_tiles(staged, tree=True)
    metal_p, metal_m, metal_t, metal_pt, metal_tt, cuda_p, cuda_m, cuda_t, cuda_pt, cuda_tt = calls
    for m, c in ((metal_p, cuda_p), (metal_m, cuda_m), (metal_pt, cuda_pt), (metal_tt, cuda_tt)):
        assert m["name"] == c["name"] and m["input_names"] == c["input_names"]
    for block, tree in ((metal_p, metal_pt), (metal_t, metal_tt)):
        assert tree["name"] == block["name"] + "_tree"
        assert tree["input_names"] == block["input_names"] + source.TREE_INPUTS
    trees = {
        where: p["source"].replace(compact(source.PRELUDE[where]), "")
        for where, p in (("metal", metal_pt), ("cuda", cuda_pt))
    }
    assert trees["metal"] == trees["cuda"]
    for t in (metal_pt, metal_tt, cuda_pt, cuda_tt):
        assert "tree_sees(" in t["source"] and "warp_or(" in t["source"] and "#define tree_sees" in t["header"]
    for t in (metal_p, metal_t, cuda_p, cuda_t):
        assert "tree_sees" not in t["source"] + t["header"] and "ancestors" not in t["source"]
    bodies = {
        where: (
            p["source"].replace(compact(source.PRELUDE[where]), ""),
            g["source"].replace(compact(source.PRELUDE[where]), ""),
        )
        for where, p, g in (("metal", metal_p, metal_m), ("cuda", cuda_p, cuda_m))
    }
    assert bodies["metal"][0] == bodies["cuda"][0]
    # the merge's bodies differ only in its parts' pointer type
    for where, (_, merge) in bodies.items():
        assert merge == compact(source.MERGE_BODY.replace("PARTS_PTR", source.PARTS_PTR[where]))
    body = source.PARTIAL_BODY + source.MERGE_BODY + source.TREE_ROWS
    used = set(
        re.findall(
            r"\b(bk_\w+|to_float|from_float|load4|copy4|simd_\w+|TG_\w+|WARP_\w+|DEV|NEG_INF|LOG2E_F|warp_or)\b", body
        )
    )
    for where, builtin in (("metal", {"simd_max", "simd_sum"}), ("cuda", set())):
        hdr = source.header(where, tree=True)
        missing = [n for n in used if n not in builtin and not re.search(rf"(#define {n}\b|\b{n}\s*\(|\b{n}\s*<)", hdr)]
        assert not missing, (where, missing)
    # The matrix-unit pass: one shared body; only the tile products and the
    # fragment coordinates are the dialect's, and each dialect defines them all.
    assert metal_t["name"] == cuda_t["name"] and metal_t["input_names"] == cuda_t["input_names"]
    holes = ("STAGING", "COORDS", "LOAD_Q", "SCORES", "SCALE_OUT", "P_TIMES_V", "STORE")
    shared = re.split(rf"(?m)^(?:{'|'.join(holes + ('TREE_ROWS', 'SEES'))})$|OUT_ELEM|OUT_NEXT", source_tiles.BODY)
    for t, where in ((metal_t, "metal"), (cuda_t, "cuda"), (metal_tt, "metal"), (cuda_tt, "cuda")):
        out_next = source_tiles.OUT[where].replace("(e)", "(e + 1)").replace("[e]", "[e + 1]")
        assert all(compact(part).strip("\n") in t["source"] for part in shared)
        assert all(
            compact(
                getattr(source_tiles, h)[where]
                .replace("OUT_ELEM", source_tiles.OUT[where])
                .replace("OUT_NEXT", out_next)
            ).strip("\n")
            in t["source"]
            for h in holes
        )
        assert source_tiles.OUT[where] in t["source"]
    # only CUDA's pass writes a single chunk's output itself (a run-time flag, params[1]); Metal's
    # store is the partials' alone
    assert "params[1]" in cuda_t["source"] and "params[1]" not in metal_t["source"]
    # The partial passes read queries through their strides, so no copy is made of them.
    for t in (metal_p, metal_t, cuda_p, cuda_t):
        assert t["ensure_row_contiguous"] is False and "queries_strides" in t["source"]
    # Metal threadgroup memory: 32 KB; the kernels stay under it for every head dim and dtype.
    # CUDA's staging is dynamic shared memory of the size the kernel object asks for.
    assert cuda_t["shared_memory"] == source_tiles.staging_bytes(128, *source_tiles.staging(128, "cuda"))
    for d in (64, 128, 256):
        (kt_m, st_m), (kt_c, st_c) = (source_tiles.staging(d, where) for where in ("metal", "cuda"))
        assert source_tiles.staging_bytes(d, kt_m, st_m) <= 32 * 1024 and kt_m % 8 == 0
        assert source_tiles.staging_bytes(d, kt_c, st_c) <= 227 * 1024 and kt_c % 16 == 0
        assert source_tiles.staging_bytes(d, 32, 3) == 3 * 2 * 32 * (d + 8) * 2  # keys and values, pitch d + 8
        with pytest.raises(ValueError, match="multiple of 16"):
            source_tiles.staging(d, "cuda", tile_keys=24)
        nw = max_warps(d)
        assert 1 <= nw <= 16 and nw * source.ROWS_PER_WARP * (d + 32) * 4 <= 32 * 1024


def test_kernels_are_handed_compact_sources_that_keep_every_statement(monkeypatch):
    """MLX's CUDA backend hashes a kernel's whole source at every launch: the
    factories get it without comments, indentation or blank lines, and
    nothing else changes (a ``//`` in a string literal, a macro's line
    continuations and preprocessor lines stay)."""
    text = 'x = "a//b"; // note\n    y;   // "q" b\n\n#define F(a) \\\n  a + 1 \\\n  + 2\n  // only a comment\n'
    assert launch_source.compact(text) == 'x = "a//b";\ny;\n#define F(a) \\\na + 1 \\\n+ 2\n'

    def made(written: bool) -> list[dict]:
        with monkeypatch.context() as m:
            if written:  # the sources as the kernels write them: the compacting undone
                m.setattr(launch_source, "compact", lambda text: text)
                m.setattr(launch_source, "used_header", lambda header, body: header)
            calls = []
            factory = lambda **kw: calls.append(kw) or (lambda **_: None)  # noqa: E731
            BlockAttentionKernel("cuda", factory=factory).partial_tiles(8192)
            BlockProductKernel("cuda", factory=factory)
            NormRopeKernel("cuda", factory=factory)
        return calls

    pairs = list(zip(made(False), made(True), strict=True))
    for short, full in pairs:
        for part in ("source", "header"):
            assert all(line and line == line.strip() for line in short[part].splitlines())
        assert short["source"].split() == re.sub(r"//[^\n]*", "", full["source"]).split()
        assert short["header"] == launch_source.used_header(launch_source.compact(full["header"]), short["source"])
        assert len(short["header"]) < 0.7 * len(full["header"])  # (each kernel calls a part of the shared header)


def test_a_kernel_gets_the_header_items_it_calls_directly_or_through_others():
    header = launch_source.compact(
        "#include <x.h>\n#define USED(a) helper(a)\n#define UNUSED 3\ntypedef long long idx_t;\n"
        "__device__ float helper(float v) {\n  return twice(v);\n}\n__device__ float twice(float v) { return 2 * v; }\n"
        "template <typename U> __device__ U conv(float x);\ntemplate <> __device__ float conv<float>(float x) { return x; }\n"
        "__device__ float lonely(float v) {\n  if (v) {\n    return v;\n  }\n  return 0;\n}\n"
    )
    assert [name for name, _ in launch_source.definitions(header)] == [
        None,
        "USED",
        "UNUSED",
        "idx_t",
        "helper",
        "twice",
        "conv",
        "conv",
        "lonely",
    ]
    kept = launch_source.used_header(header, "y[i] = conv<T>(USED(x[i]));")
    assert kept == (
        "#include <x.h>\n#define USED(a) helper(a)\n__device__ float helper(float v) {\nreturn twice(v);\n}\n"
        "__device__ float twice(float v) { return 2 * v; }\ntemplate <typename U> __device__ U conv(float x);\n"
        "template <> __device__ float conv<float>(float x) { return x; }\n"
    )
    # Metal's headers are compacted, not cut: nothing here compiles them
    made = []
    BlockAttentionKernel("metal", factory=lambda **kw: made.append(kw) or (lambda **_: None))
    assert made[0]["header"] == launch_source.compact(source.header("metal"))


def test_chunks_are_powers_of_two_covering_the_buffer():
    for n in (1, 100, 1024, 32768, 1 << 20):
        for groups in (1, 8, 64, 4096):
            c = chunk_size(n, groups)
            assert 64 <= c <= 4096 and c & (c - 1) == 0
    assert chunk_size(32768, 8) == 256  # 128 chunks x 8 heads = the 1024 threadgroups aimed at


def test_the_default_table_admits_every_row_count_the_kernel_takes():
    """The shipped table admits every call of 1-128 rows per key-value head
    at any length on either backend; within it, a machine's own measurement
    decides (tests/test_decisions.py). More rows never take the kernel."""
    wins = dispatch.kernel_wins
    for where in ("cuda", "metal"):
        assert wins(1, 1, where) and wins(4, 1 << 20, where) and wins(128, 512, where)
        assert not wins(129, 1 << 20, where)
    assert dispatch.shape_class(1, 1) == (4, 1024) and dispatch.shape_class(17, 1025) == (64, 4096)
    assert dispatch.shape_class(128, 1 << 20) == (128, 65536)


@pytest.mark.parametrize("where", ["metal", "cuda"])
def test_the_matrix_unit_pass_stages_whole_tiles_for_every_row_count(where):
    """The tile pass's threads stage a tile of KT keys in passes of
    NW * 32 / (D / 8) rows, which the kernel asserts divides KT (a variant
    where it does not fails to compile, mid-decode: 33-48 rows took 3 warps
    once). Every row count a call can bring, at every head dim and each
    backend's staging, launches a warp count that divides it."""
    from dflash_mlx.kernels.attention import tile_warps

    launches = []

    def factory(**made):
        def launch(**kw):
            launches.append(dict(kw["template"]))
            return [mx.zeros(s, t) for s, t in zip(kw["output_shapes"], kw["output_dtypes"])]

        return launch

    kernel = BlockAttentionKernel(where, factory=factory)
    for d in (64, 128, 256):
        for rows in range(1, 130):
            launches.clear()
            q = mx.zeros((1, 1, rows, d), mx.bfloat16)
            k = mx.zeros((1, 1, 64, d), mx.bfloat16)
            kernel(q, k, k, scale=1.0, q_offset=0, kv_length=rows, causal=True)
            partial = launches[0]
            passes = partial["NW"] * 32 // (d // 8)
            assert partial["KT"] % passes == 0, (where, d, rows, partial["NW"])
            assert partial["NW"] == tile_warps(rows) and partial["NW"] * 16 >= min(rows, 64)


# --- A draft tree's mask ---------------------------------------------------------------------------------


def dense_tree(q, k, v, *, scale, q_offset, kv_length, tree, window=None, sinks=None):
    """softmax(q k^T) v in float32 with kv/tree.py's rule written out key by
    key: node i, at position start + depth i, sees key j < start where its
    position reaches it (window), and the key of node a at start + a where a
    is i or an ancestor of i (walking the parents) within the window."""
    start, length = int(np.array(q_offset).reshape(())), int(np.array(kv_length).reshape(()))
    parents, depths = np.array(tree.parents).tolist(), np.array(tree.depths).tolist()
    nodes, n = q.shape[2], k.shape[2]
    mask = np.zeros((nodes, n), dtype=bool)
    for i in range(nodes):
        pos = start + depths[i]
        for j in range(min(start, length)):
            mask[i, j] = window is None or pos - j < window
        a = i
        while True:
            if start + a < length and (window is None or depths[i] - depths[a] < window):
                mask[i, start + a] = True
            if a == 0:
                break
            a = parents[a]
    g = q.shape[1] // k.shape[1]
    kf = mx.repeat(k.astype(mx.float32), g, axis=1)
    vf = mx.repeat(v.astype(mx.float32), g, axis=1)
    s = (q.astype(mx.float32) @ kf.transpose(0, 1, 3, 2)) * scale
    s = mx.where(mx.array(mask), s, -mx.inf)
    if sinks is not None:
        col = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (*s.shape[:3], 1))
        s = mx.concatenate([col, s], axis=-1)
    p = mx.softmax(s, axis=-1)
    return (p[..., 1:] if sinks is not None else p) @ vf


def tree_case(nodes: int, *, start=60, keys=128, window=None, sinks=False, dtype=mx.float32, seed=0, d=64):
    kq, kk, kv, ks = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((1, nodes, 4, d), key=kq).astype(dtype).transpose(0, 2, 1, 3)  # (a strided view)
    k = mx.random.normal((1, 2, keys, d), key=kk).astype(dtype)
    v = mx.random.normal((1, 2, keys, d), key=kv).astype(dtype)
    kw = dict(
        scale=d**-0.5,
        q_offset=mx.array(start),
        kv_length=mx.array(start + nodes),
        tree=check_tree(nodes, seed=seed),
        window=window,
        sinks=mx.random.normal((4,), key=ks) if sinks else None,
    )
    return q, k, v, kw


@pytest.mark.parametrize("nodes, window, sinks", [(1, None, False), (9, None, True), (40, 6, False), (64, 45, True)])
def test_the_ops_path_over_a_tree_is_the_rule_written_out(nodes, window, sinks):
    q, k, v, kw = tree_case(nodes, window=window, sinks=sinks, seed=nodes)
    if window is not None:
        assert int(mx.max(kw["tree"].depths).item()) > window  # (the window cuts into the tree)
    got = ops_tree_attention(q, k, v, **kw)
    assert got.shape == q.shape and rel_err(got, dense_tree(q, k, v, **kw)) < 2e-5
    assert mx.array_equal(tree_attention(q, k, v, **kw), got)  # on the CPU, the ops path


def test_a_chain_is_a_block():
    q, k, v, kw = tree_case(8, window=5)
    kw["tree"] = chain(8)
    block = ops_attention(q, k, v, causal=True, **{key: value for key, value in kw.items() if key != "tree"})
    assert rel_err(tree_attention(q, k, v, **kw), block) < 2e-5


def test_bad_tree_input_is_one_sentence():
    q, k, v, kw = tree_case(6)
    for tree, words in ((chain(5), "one query row a node"), ("tree", "TreeLayout")):
        with pytest.raises(ValueError, match=words) as e:
            tree_attention(q, k, v, **{**kw, "tree": tree})
        msg = str(e.value)
        assert msg.endswith(".") and msg.count(". ") == 0 and "\n" not in msg
    big = mx.zeros((1, 2, TREE_NODES + 1, 64))
    with pytest.raises(ValueError, match=f"at most {TREE_NODES} nodes"):
        tree_attention(big, k, k, **{**kw, "tree": chain(TREE_NODES + 1)})


# --- The tree's Metal passes, run on this CPU ---------------------------------------------------------------
#
# A tree variant's partial pass as a Mac would compile it (its source as MLX builds it,
# lowered as scripts/check_metal_kernels.py lowers it) is compiled by clang for this
# machine, every thread of a threadgroup a fiber here (the simdgroup functions
# exchanging within its 32 lanes, threadgroup_barrier across the threadgroup, a
# simdgroup_matrix held two elements a lane in Metal's layout, the body's COORDS), and
# run over the launch's grid; its partials, merged, must equal MLX's attention with the
# tree's mask. The matrix-unit pass runs with T = float (clang 14 has no _Float16 here):
# the tree's rows and rule do not depend on T.

TREE_DRIVER = (
    FIBERS
    + r"""
extern "C" void harness_thread(void** bufs, unsigned tid, unsigned x, unsigned y, unsigned z, unsigned gx, unsigned gy, unsigned gz);
static unsigned slots[32][32][8];
extern "C" unsigned harness_lane() { return fibers::index() % 32; }
// Each lane's n words to every lane of its simdgroup: the slots, valid until harness_done().
extern "C" const unsigned* harness_share(const unsigned* v, unsigned n) {
  const unsigned sg = fibers::index() / 32;
  for (unsigned i = 0; i < n; ++i) slots[sg][harness_lane()][i] = v[i];
  fibers::wait(fibers::simd_bars[sg]);
  return &slots[sg][0][0];
}
extern "C" void harness_done() { fibers::wait(fibers::simd_bars[fibers::index() / 32]); }
extern "C" unsigned harness_run(void** bufs, unsigned gx, unsigned gy, unsigned gz, unsigned threads) {
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        const unsigned stuck = fibers::threadgroup(threads, [=](unsigned tid) { harness_thread(bufs, tid, x, y, z, gx, gy, gz); });
        if (stuck) return stuck;
      }
  return 0;
}
"""
)
TREE_STUB = r"""#pragma once
#include "metal_stub_decls.h"
extern "C" unsigned harness_lane();
extern "C" const unsigned* harness_share(const unsigned* v, unsigned n);
extern "C" void harness_done();
extern "C" void harness_group_barrier();
namespace metal {
template <typename T> unsigned bits_of(T v) { return __builtin_bit_cast(unsigned, v); }
template <typename T> T of_bits(unsigned b) { return __builtin_bit_cast(T, b); }
template <typename T, typename U> T simd_sum(T v) {
  const unsigned b = bits_of(v);
  const unsigned* s = harness_share(&b, 1);
  T acc = T(0);
  for (int l = 0; l < 32; ++l) acc += of_bits<T>(s[l * 8]);
  harness_done();
  return acc;
}
template <typename T, typename U> T simd_max(T v) {
  const unsigned b = bits_of(v);
  const unsigned* s = harness_share(&b, 1);
  T acc = of_bits<T>(s[0]);
  for (int l = 1; l < 32; ++l) acc = of_bits<T>(s[l * 8]) > acc ? of_bits<T>(s[l * 8]) : acc;
  harness_done();
  return acc;
}
template <typename T, typename U> T simd_shuffle_xor(T v, ushort mask) {
  const unsigned b = bits_of(v);
  const unsigned* s = harness_share(&b, 1);
  const T got = of_bits<T>(s[(harness_lane() ^ mask) * 8]);
  harness_done();
  return got;
}
bool simd_any(bool p) {
  const unsigned b = p;
  const unsigned* s = harness_share(&b, 1);
  bool any = false;
  for (int l = 0; l < 32; ++l) any = any || s[l * 8];
  harness_done();
  return any;
}
template <typename T, typename U> T exp2(T x) { return T(__builtin_exp2f(float(x))); }
template <typename T, typename U> T max(T x, T y) { return x > y ? x : y; }
void simdgroup_barrier(mem_flags) { harness_done(); }
void threadgroup_barrier(mem_flags) { harness_group_barrier(); }
// A lane's two elements of an 8 x 8 matrix: row fr, columns fc and fc + 1 (the body's COORDS).
inline int tile_row(unsigned l) { return ((l >> 2) & 4) + ((l >> 1) & 3); }
inline int tile_col(unsigned l) { return ((l >> 2) & 2) * 2 + (l & 1) * 2; }
template <typename T, int C, int R>
thread typename simdgroup_matrix<T, C, R>::elements_t& simdgroup_matrix<T, C, R>::thread_elements() { return elements_; }
template <typename T, int C, int R> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, C, R> m;
  m.thread_elements() = vec<T, 2>(value);
  return m;
}
template <typename TD, typename TA, typename TB, typename TC, int K, int M, int N>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, K, M>& d, const thread simdgroup_matrix<TA, N, M>& a,
                                   const thread simdgroup_matrix<TB, K, N>& b, const thread simdgroup_matrix<TC, K, M>& c) {
  auto& ea = const_cast<simdgroup_matrix<TA, N, M>&>(a).thread_elements();
  auto& eb = const_cast<simdgroup_matrix<TB, K, N>&>(b).thread_elements();
  auto& ec = const_cast<simdgroup_matrix<TC, K, M>&>(c).thread_elements();
  const unsigned mine[6] = {bits_of(float(ea[0])), bits_of(float(ea[1])), bits_of(float(eb[0])),
                            bits_of(float(eb[1])), bits_of(float(ec[0])), bits_of(float(ec[1]))};
  const unsigned* s = harness_share(mine, 6);
  float ma[8][8], mb[8][8], mc[8][8];
  for (unsigned l = 0; l < 32; ++l)
    for (int e = 0; e < 2; ++e) {
      ma[tile_row(l)][tile_col(l) + e] = of_bits<float>(s[l * 8 + e]);
      mb[tile_row(l)][tile_col(l) + e] = of_bits<float>(s[l * 8 + 2 + e]);
      mc[tile_row(l)][tile_col(l) + e] = of_bits<float>(s[l * 8 + 4 + e]);
    }
  harness_done();
  const int r = tile_row(harness_lane()), c0 = tile_col(harness_lane());
  for (int e = 0; e < 2; ++e) {
    float acc = mc[r][c0 + e];
    for (int k = 0; k < 8; ++k) acc += ma[r][k] * mb[k][c0 + e];
    d.thread_elements()[e] = TD(acc);
  }
}
}
"""
TREE_ATTRIBUTES = {
    "simdgroup_index_in_threadgroup": "tid / 32",
    "thread_index_in_simdgroup": "tid % 32",
    "thread_position_in_threadgroup": "uint3(tid, 0u, 0u)",
    "threadgroup_position_in_grid": "uint3(x, y, z)",
    "threadgroups_per_grid": "uint3(gx, gy, gz)",
}


def metal_script():
    return repo_module("scripts/check_metal_kernels.py")


def build_tree_pass(script, source: str, names: list[str], tmp_path):
    """The variant's lowered source compiled for this CPU, its parameters read from
    ``bufs`` in the order of ``names``: ``harness_run(bufs, gx, gy, gz, threads)``."""
    import ctypes
    import subprocess
    from pathlib import Path

    script.THREADGROUP_MEMORY = 1 << 20  # (this module's own copy: float staging takes twice a Mac's bytes)
    text, problems = script.lower(source)
    assert not problems, problems
    text = with_poisoned_threadgroup_memory(text)
    # (no half runs here: a type of its size for it, where this clang lacks _Float16)
    stub = Path(script.STUB).read_text().replace("typedef _Float16 half;", "typedef char16_t half;")
    (tmp_path / "metal_stub_decls.h").write_text(stub)
    (tmp_path / "metal_stub.h").write_text(TREE_STUB)
    for header in script.METAL_HEADERS:
        (tmp_path / header).write_text('#include "metal_stub.h"\n')
    thread = "unsigned tid, unsigned x, unsigned y, unsigned z, unsigned gx, unsigned gy, unsigned gz"
    (tmp_path / "kernel.cpp").write_text(with_thread_entry(text, names, TREE_ATTRIBUTES, thread))
    (tmp_path / "driver.cpp").write_text(TREE_DRIVER)
    clang = script.find_clang()
    flags = ["-O1", "-fPIC", "-c"]
    for cmd in (
        [clang, "-std=c++17", *flags, "-nostdinc", "-nostdinc++", "-fno-exceptions", "-fno-rtti", "-I", str(tmp_path)]
        + [str(tmp_path / "kernel.cpp"), "-o", str(tmp_path / "k.o")],
        [clang, "-std=c++20", *flags, str(tmp_path / "driver.cpp"), "-o", str(tmp_path / "d.o")],
        [clang, "-shared", str(tmp_path / "k.o"), str(tmp_path / "d.o"), "-o", str(tmp_path / "h.so"), "-lm"],
    ):
        run = subprocess.run(cmd, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
    return ctypes.CDLL(str(tmp_path / "h.so"))


def run_tree_partials(tmp_path, q, k, v, kw, plant=None):
    """The tree variant's partial pass for this call, run on this CPU from its
    Metal source (float32 throughout), and its partials merged as the merge pass
    does (``plant``: (old, new) text swapped into the source first)."""
    import ctypes

    script = metal_script()
    recorder = script.Recorder()
    kernel = BlockAttentionKernel("metal", factory=recorder.factory)
    kernel(q, k, v, causal=True, **kw)
    ((name, variant),) = [(n, v) for n, v in recorder.variants.items() if "_tree_" in n]
    ((grid, group),) = variant.launches
    src = variant.source.replace("float16_t", "float")  # (the matrix-unit pass with T = float)
    if plant is not None:
        assert plant[0] in src
        src = src.replace(plant[0], plant[1])
    f32 = np.float32
    b, hq, lq, d = q.shape
    qs = np.ascontiguousarray(np.array(q.astype(mx.float32)).transpose(0, 2, 1, 3))  # [B, L, Hq, D]
    nch = grid[1]
    tree = kw["tree"]
    arrays = {
        "queries": qs,
        "queries_shape": np.array(q.shape, np.int32),
        "queries_strides": np.array([lq * hq * d, d, hq * d, 1], np.int64),  # (the [B, Hq, L, D] view's)
        "keys": np.array(k.astype(mx.float32)),
        "keys_shape": np.array(k.shape, np.int32),
        "values": np.array(v.astype(mx.float32)),
        "q_offset": np.array([int(kw["q_offset"].item())], np.int32),
        "kv_length": np.array([int(kw["kv_length"].item())], np.int32),
        "params": np.array([kw["scale"] * source.LOG2E, 0.0], f32),
        "ancestors": np.array(tree.ancestors).astype(np.uint8),
        "ancestors_strides": np.array([lq, 1], np.int64),
        "depths": np.array(tree.depths).astype(np.int32),
        "depths_strides": np.array([1], np.int64),
        "o_part": np.zeros((b, hq, lq, nch, d), f32),
        "m_part": np.zeros((b, hq, lq, nch), f32),
        "l_part": np.zeros((b, hq, lq, nch), f32),
    }
    names = list(arrays)
    lib = build_tree_pass(script, src, names, tmp_path)
    bufs = (ctypes.c_void_p * len(names))(*[arrays[n].ctypes.data for n in names])
    run_grid(lib, bufs, grid[0] // group[0], grid[1], grid[2], group[0])
    o, m, l = arrays["o_part"], arrays["m_part"], arrays["l_part"]
    top = m.max(axis=-1, keepdims=True)
    sinks = kw.get("sinks")
    if sinks is not None:
        sink = (np.array(sinks, f32) * source.LOG2E)[None, :, None, None]
        top = np.maximum(top, sink)
    w = np.where(m == -np.inf, 0.0, np.exp2(m - top))
    num, den = (o * w[..., None]).sum(axis=3), (l * w).sum(axis=3, keepdims=True)
    if sinks is not None:
        den = den + np.exp2(sink - top)
    return name, num / den[..., 0, None]


needs_clang = pytest.mark.skipif(metal_script().find_clang() is None, reason="no clang++ on PATH")


@needs_clang
@pytest.mark.parametrize(
    "dtype, nodes, window, sinks",
    [(mx.float32, 40, None, True), (mx.float32, 40, 6, False), (mx.float16, 40, 6, True), (mx.float16, 9, None, False)],
)
def test_the_tree_passes_metal_source_run_on_the_cpu_is_mlxs_attention_with_the_tree_mask(
    tmp_path, dtype, nodes, window, sinks
):
    """Both partial passes (SIMT for float32, the matrix units' for 16-bit types):
    40 nodes (two words of ancestors a row, rows in more than one threadgroup of
    the matrix-unit pass), a window shorter than the tree is deep, sinks."""
    q, k, v, kw = tree_case(nodes, start=70, keys=160, window=window, sinks=sinks, dtype=dtype, seed=nodes)
    name, got = run_tree_partials(tmp_path, q, k, v, kw)
    assert ("partial_tiles_tree" in name) == (dtype != mx.float32), name
    want = np.array(ops_tree_attention(*(a.astype(mx.float32) for a in (q, k, v)), **kw))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), np.abs(got - want).max()


@needs_clang
@pytest.mark.parametrize(
    "dtype, plant",
    [
        (
            mx.float32,
            ("(WINDOW == 0 || depth_ - node_depth", "(true || depth_ - node_depth"),
        ),  # the window not folded in
        (mx.float16, ("(j) < 64 &&", "(j) < 32 &&")),  # the second word of ancestors never read
        (mx.float16, ("pmin = qoff;", "pmin = qoff + 1;")),  # node 1's key seen by every row
    ],
)
def test_a_tree_pass_with_a_planted_error_differs_from_mlxs(tmp_path, dtype, plant):
    q, k, v, kw = tree_case(40, start=70, keys=160, window=6, dtype=dtype, seed=40)
    _, got = run_tree_partials(tmp_path, q, k, v, kw, plant=plant)
    want = np.array(ops_tree_attention(*(a.astype(mx.float32) for a in (q, k, v)), **kw))
    assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()
