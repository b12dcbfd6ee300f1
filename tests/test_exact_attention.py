"""The exact verify attention (kernels/exact_attention.py): MLX's one-row choice
of kernel and block count it follows, its launches, its self-check (bit for bit
against MLX's one-row attention of each row alone) and where a verify takes it.
Then the Metal source itself, compiled for this CPU and run over its grid,
against a plain transcription of MLX's Metal ``sdpa_vector`` and
``sdpa_vector_2pass`` (mlx/backend/metal/kernels/sdpa_vector.h) bit for bit."""

import ctypes
import warnings

import metal_on_cpu
import mlx.core as mx
import numpy as np
import pytest
from launch_recorder import recording_factory
from metal_on_cpu import CLANG_F16, build_on_cpu, check_metal_script, run_grid

from dflash_mlx.kernels import exact_attention as ea
from dflash_mlx.kernels.exact_attention_source import (
    GQA_INPUTS,
    GQA_OUTPUTS,
    MERGE_INPUTS,
    MERGE_OUTPUTS,
    ONE_PASS_INPUTS,
    ONE_PASS_OUTPUTS,
    PARTIAL_INPUTS,
    PARTIAL_OUTPUTS,
    TREE_INPUTS,
)

F32 = np.float32
FINITE_MIN = F32(-np.finfo(np.float32).max)


# --- MLX's one-row choice -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, n, g, want",
    [
        (0, 1023, 1, 0),  # any device: one pass ...
        (0, 9000, 1, 0),  # ... without GQA, at any length
        (0, 4095, 4, 0),
        (0, 4096, 4, 64),  # GQA from 4096 keys: two passes, 64 blocks at 4 simdgroups or more
        (0, 4096, 2, 32),
        (1, 1023, 1, 0),  # 's' (Max): two passes from 1024 keys
        (1, 1024, 1, 64),
        (1, 1025, 8, 128),  # more than 4 simdgroups past 1024 keys: by length
        (1, 8193, 8, 256),
        (1, 32769, 6, 512),
        (1, 65537, 6, 1024),
        (1, 9000, 4, 64),
        (2, 1024, 4, 128),  # 'd' (Ultra)
        (2, 8193, 2, 256),
        (2, 16384, 6, 512),
        (2, 65536, 8, 1024),
        (2, 16384, 4, 128),
    ],
)
def test_metal_takes_the_kernel_and_blocks_mlxs_dispatch_picks(arch, n, g, want):
    assert ea.blocks("metal", arch, n, g) == want
    assert ea.blocks("cuda", arch, n, g) == 0  # (CUDA: MLX's one-pass kernel, all it serves)


def test_more_keys_never_take_fewer_blocks():
    """A launch sizes its streams for the buffer's width: every row's count must fit."""
    for arch, g in ((0, 1), (0, 4), (1, 2), (1, 8), (2, 2), (2, 6)):
        counts = [max(32, ea.blocks("metal", arch, n, g)) for n in range(1, 70000, 97)]
        assert counts == sorted(counts)


def test_cuda_serves_only_keys_under_cudnns_and_metal_any():
    assert ea.most_keys("cuda") == 255 and ea.most_keys("metal") is None


@pytest.mark.parametrize(
    "n, g, d, takes",
    [(8192, 8, 128, True), (8191, 8, 128, False), (8192, 8, 64, True), (8192, 8, 256, False)]
    + [(8192, 12, 128, True), (8192, 16, 128, True), (8192, 12, 64, False), (9000, 4, 128, False)],
)
def test_metal_sends_gqa_8_12_16_from_8192_keys_to_its_gqa_kernel(n, g, d, takes):
    assert ea.gqa_kernel("metal", n, g, d) == takes
    assert not ea.gqa_kernel("cuda", n, g, d)


def test_cuda_reads_q_scaled_into_base_2_as_mlx_rounds_it():
    """MLX's CUDA kernel multiplies float scale by the double M_LOG2E, then rounds to float."""
    scale = 128**-0.5
    assert ea.q_scale("cuda", scale) == float(F32(np.float64(F32(scale)) * 1.4426950408889634))
    assert ea.q_scale("metal", scale) == float(F32(scale))


# --- Launches and serving -----------------------------------------------------------------------------------


def record_launches(backend_name: str):
    factory, launches = recording_factory()
    return ea.ExactAttentionKernel(backend_name, factory=factory), launches


@pytest.mark.parametrize("rows, g, keys, arch", [(2, 1, 256, 0), (16, 4, 1280, 1), (7, 2, 9216, 2), (16, 8, 512, 0)])
def test_each_launch_covers_every_row_and_the_buffers_blocks(rows, g, keys, arch):
    """One launch where every row takes MLX's one-pass kernel; where a row of
    the buffer's keys could take its two-pass kernel, its two launches too."""
    kernel, launches = record_launches("metal")
    q = mx.zeros((1, 2 * g, rows, 128), mx.float16)
    kv = mx.zeros((1, 2, keys, 128), mx.float16)
    out = kernel(q, kv, kv, scale=0.1, q_offset=mx.array(keys - rows), arch=arch)
    assert out.shape == q.shape and out.dtype == q.dtype
    streams = ea.blocks("metal", arch, keys, g)
    one_pass, *two_pass = launches
    tile = dict(one_pass["template"])["RT"]
    assert one_pass["threadgroup"] == (1024, 1, 1) and one_pass["grid"] == (-(-g * rows // tile) * 1024, 2, 1)
    assert [int(x) for x in one_pass["inputs"][5]] == [rows, g, streams, arch]
    assert len(two_pass) == (2 if streams else 0)
    if streams:
        partial, merge = two_pass
        tile = dict(partial["template"])["NW"]
        assert tile == ea.row_tile(g * rows) and partial["threadgroup"] == (tile * 32, 1, 1)
        tiles = partial["grid"][0] // (tile * 32)
        assert tiles == streams * -(-g * rows // tile) and partial["grid"][1] == 2
        assert partial["output_shapes"][0] == (2 * g * rows, streams, 128)
        assert merge["grid"][0] == 2 * g * rows * ea.MERGE_WARPS * 32


def table_parents(tree) -> list[int]:
    """Each node's parent, read back from the tree variants' (depths, ancestors) table."""
    depths, ancestors = (np.array(a) for a in tree)
    return [int(ancestors[i, max(0, d - 1)]) for i, d in enumerate(depths)]


class FakeKernel:
    """The kernel as its callers see it: each row MLX's one-row attention (what
    the real kernel must compute; a tree's node over its gathered keys),
    ``nudge`` added to one output; counts calls (rows, form, a tree's or not)."""

    def __init__(self, nudge: float = 0.0):
        self.nudge = nudge
        self.calls = []

    def tree_inputs(self, tree):
        return ea.ancestor_table(tree)

    def __call__(self, queries, keys, values, *, scale, q_offset, arch=0, form=0, tree=None):
        self.calls.append((queries.shape[2], form, tree is not None))
        start = int(q_offset.item()) if isinstance(q_offset, mx.array) else q_offset
        if tree is None:
            out = ea.one_row_attention(queries, keys, values, scale=scale, q_offset=start)
        else:
            parents = table_parents(tree)
            out = ea.one_row_tree_attention(queries, keys, values, scale=scale, q_offset=start, parents=parents)
        if self.nudge:
            out = out.at[0, 0, -1, 0].add(mx.array(self.nudge, out.dtype))
        return out


@pytest.fixture
def fake_gpu(monkeypatch):
    ea.reset()
    monkeypatch.setattr(ea, "backend", lambda: "metal")
    monkeypatch.setitem(ea.CHECK_CASES, "metal", ((1, 3, 37, 256), (4, 5, 300, 512)))

    def install(kernel):
        monkeypatch.setitem(ea.BUILDERS, "metal", lambda where: kernel)
        return kernel

    yield install
    ea.reset()


def verify_case(rows=6, g=4, start=120, n=256, dtype=mx.float16, d=64):
    q = mx.random.normal((1, 2 * g, rows, d), key=mx.random.key(rows)).astype(dtype)
    k = mx.random.normal((1, 2, n, d), key=mx.random.key(n)).astype(dtype)
    v = mx.random.normal((1, 2, n, d), key=mx.random.key(n + 1)).astype(dtype)
    return q, k, v, start


def test_on_the_cpu_it_never_serves():
    ea.reset()
    ea.prepare(mx.float16, 64)
    q, k, v, start = verify_case()
    assert ea.attention(q, k, v, scale=0.125, q_offset=start) is None and not ea._checks


def test_a_kernel_that_checks_out_serves_2_to_16_rows_as_the_one_row_calls(fake_gpu, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    from dflash_mlx.kernels import decisions

    decisions.reset()
    kernel = fake_gpu(FakeKernel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ea.prepare(mx.float16, 64)
    (result,) = ea._checks.values()
    assert result.ok and result.form == 0
    for rows in (1, 2, 6, 16, 17):
        kernel.calls.clear()
        q, k, v, start = verify_case(rows=rows)
        got = ea.attention(q, k, v, scale=0.125, q_offset=mx.array(start))
        assert (got is not None) == (2 <= rows <= 16)
        if got is not None:
            assert mx.array_equal(got, ea.one_row_attention(q, k, v, scale=0.125, q_offset=start))
    q, k, v, start = verify_case(dtype=mx.bfloat16)
    assert ea.attention(q, k, v, scale=0.125, q_offset=start) is None  # (never checked: MLX's)
    q, k, v, start = verify_case()
    two = [mx.concatenate([a, a]) for a in (q, k, v)]
    assert ea.attention(*two, scale=0.125, q_offset=start) is None  # (a batch: MLX's)
    decisions.reset()


def test_a_key_limit_counts_the_keys_rows_read_not_the_buffers_width(fake_gpu, monkeypatch):
    """CUDA follows MLX's one-row order up to 255 keys, and reads a cache's
    buffer whole (steps of 256): a verify whose rows read fewer keys is served."""
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    monkeypatch.setattr(ea, "most_keys", lambda where: 255)
    from dflash_mlx.kernels import decisions

    decisions.reset()
    fake_gpu(FakeKernel())
    ea.prepare(mx.float16, 64)
    q, k, v, start = verify_case(rows=6, start=120, n=256)
    for filled, serves in ((126, True), (None, False), (300, False)):
        got = ea.attention(q, k, v, scale=0.125, q_offset=mx.array(start), filled=filled)
        assert (got is not None) == serves
    decisions.reset()


def test_a_kernel_one_rounding_off_fails_warns_once_and_is_never_used(fake_gpu, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    from dflash_mlx.kernels import decisions

    decisions.reset()
    fake_gpu(FakeKernel(nudge=1.0))
    with pytest.warns(RuntimeWarning, match=r"metal float16 head_dim=64 exact verify attention failed"):
        ea.prepare(mx.float16, 64)
    (result,) = ea._checks.values()
    assert not result.ok and "1 of" in result.detail
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ea.prepare(mx.float16, 64)  # (checked once: no second warning)
    q, k, v, start = verify_case()
    assert ea.attention(q, k, v, scale=0.125, q_offset=start) is None
    decisions.reset()


def test_the_check_keeps_the_multiply_add_form_that_matches(fake_gpu, monkeypatch):
    class OneWay(FakeKernel):
        def __call__(self, *a, form=0, **kw):
            self.nudge = 0.0 if form == 2 else 1.0
            return super().__call__(*a, form=form, **kw)

    fake_gpu(OneWay())
    ea.checked("metal", mx.float16, 64)
    (result,) = ea._checks.values()
    assert result.ok and result.form == 2


def test_a_kernel_that_does_not_build_is_named_and_not_used(fake_gpu, monkeypatch):
    def broken(where):
        raise RuntimeError("metal: error: use of undeclared identifier 'ea_exp'")

    monkeypatch.setitem(ea.BUILDERS, "metal", broken)
    with pytest.warns(RuntimeWarning, match=r"undeclared identifier 'ea_exp'"):
        ea.prepare(mx.float16, 64)
    q, k, v, start = verify_case()
    assert ea.attention(q, k, v, scale=0.125, q_offset=start) is None


@pytest.mark.parametrize("kernel_s, exact_first, serves", [(2.0, (), False), (0.5, (), True), (2.0, ("metal",), True)])
def test_a_checked_variant_serves_where_exact_first_or_measured_faster(
    fake_gpu, monkeypatch, kernel_s, exact_first, serves
):
    """Where exactness comes first (decisions.EXACT_FIRST) a checked variant serves
    whatever it measured; elsewhere only where this machine measured it faster."""
    from dflash_mlx.kernels import decisions

    monkeypatch.setattr(decisions, "EXACT_FIRST", exact_first)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    monkeypatch.setattr(decisions, "remembers", lambda: False)
    monkeypatch.setattr(decisions, "seconds_per_call", lambda ours, theirs: (kernel_s, 1.0))
    monkeypatch.setattr(ea, "KEY_CLASSES", (1024,))
    decisions.reset()
    fake_gpu(FakeKernel())
    ea.prepare(mx.float16, 64)
    (made,) = decisions.current().all()
    assert made.kernel == ea.DECISION and made.faster == (kernel_s < 1.0)
    q, k, v, start = verify_case()
    assert (ea.attention(q, k, v, scale=0.125, q_offset=start) is not None) == serves
    decisions.reset()


def test_rows_mlx_sends_to_its_gqa_kernel_take_a_launch_of_its_shape():
    """GQA 8 at head dim 128 from 8192 keys: a threadgroup of 8 simdgroups a
    (block, row), 4 heads a simdgroup, beside the other two-pass launches."""
    kernel, launches = record_launches("metal")
    q = mx.zeros((1, 16, 3, 128), mx.float16)
    for keys, launched in ((8191, False), (8448, True)):
        launches.clear()
        kv = mx.zeros((1, 2, keys, 128), mx.float16)
        kernel(q, kv, kv, scale=0.1, q_offset=mx.array(keys - 3), arch=0)
        gqa = [x for x in launches if ("GQ", 8) in x["template"]]
        assert bool(gqa) == launched and len(launches) == 3 + launched
        if launched:
            (gqa,) = gqa
            assert ("HPT", 4) in gqa["template"] and gqa["threadgroup"] == (256, 1, 1)
            assert gqa["grid"] == (ea.blocks("metal", 0, keys, 8) * 3 * 256, 2, 1)


def test_every_variant_is_recorded_for_the_check_scripts():
    for backend_name in ("metal", "cuda"):
        recorded = set()

        def factory(**made):
            def launch(*, template, output_shapes, output_dtypes, **kw):
                recorded.add((made["name"], tuple(v for _, v in template)))
                return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

            return launch

        ea.record_variants(factory, backend_name)
        assert {t for name, t in recorded if "_tree_" in name} == {t for name, t in recorded if "_tree_" not in name}
        kinds = {kind: {t for name, t in recorded if kind in name} for kind in ("one_pass", "partial", "merge", "gqa")}
        one_pass = kinds["one_pass"]
        assert {t[0] for t in one_pass} == set(ea.DTYPES) and {t[1] for t in one_pass} == set(
            ea.HEAD_DIMS[backend_name]
        )
        assert {t[2] for t in one_pass} == set(ea.FORMS[backend_name])
        assert {(t[1], t[3]) for t in one_pass} == set(ea.ONE_PASS_ROWS[backend_name].items())
        if backend_name == "metal":
            assert {t[:3] for t in kinds["partial"]} == {t[:3] for t in one_pass} == {t[:3] for t in kinds["merge"]}
            assert {t[3] for t in kinds["partial"]} == set(ea.ROW_TILES)
            assert {(t[3], t[1], t[4]) for t in kinds["gqa"]} == {(g, d, h) for (g, d), h in ea.GQA_HEADS.items()}
        else:  # (CUDA serves MLX's one-pass kernel's rows alone)
            assert not kinds["partial"] and not kinds["merge"] and not kinds["gqa"]


# --- The Metal source itself, run on this CPU ---------------------------------------------------------------

# The stand-in header declares metal::fast::exp; the run defines it through one C
# function the transcription calls as well, so both take the same exponentials.
EXP = r"""
extern "C" float harness_exp(float x) { return __builtin_expf(x); }
namespace metal { namespace fast {
template <typename T, typename U> T exp(T x) { return T(harness_exp(float(x))); }
} }
"""


# For a bfloat16 run, the stand-in header's bfloat (a half's storage there)
# becomes clang's __bf16: bfloat16's 16 bits, converted to float exactly and
# from float rounding to nearest even (as MLX and Apple GPUs round; the
# conversion's runtime function, defined here).
BFLOAT = r"""typedef __bf16 bfloat;
extern "C" __bf16 __truncsfbf2(float f) {
  const unsigned u = __builtin_bit_cast(unsigned, f);
  return __builtin_bit_cast(__bf16, (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
}
"""


class Storage:
    """A dtype's numpy storage (bfloat16: its bits in uint16) and its conversions."""

    def __init__(self, name: str):
        self.name = name
        self.np = np.uint16 if name == "bfloat16" else np.dtype(name).type
        self.mx = getattr(mx, name)

    def f32(self, a):
        a = np.asarray(a)
        return (a.astype(np.uint32) << 16).view(F32) if self.name == "bfloat16" else a.astype(F32)

    def round(self, x):
        x = np.asarray(x, F32)
        if self.name != "bfloat16":
            return x.astype(self.np)
        u = x.view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


class OnCpu:
    """The two passes' sources, as MLX builds them, compiled for this CPU once each."""

    def __init__(self, tmp_path_factory):
        self.tmp = tmp_path_factory
        self.libs = {}

    def lib(self, script, source: str, buffers: list[str], bfloat: bool = False):
        if source not in self.libs:
            if bfloat:  # (the stand-in header with bfloat16's storage and arithmetic)
                stub = self.tmp.mktemp("bf16") / "metal_stub.h"
                stub.write_text(open(script.STUB).read().replace("typedef __fp16 bfloat;", BFLOAT))
                script.STUB = str(stub)
            self.libs[source] = build_on_cpu(script, source, buffers, self.tmp.mktemp("ea"))
        return self.libs[source]


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setattr(metal_on_cpu, "BUILTINS", metal_on_cpu.BUILTINS + EXP)
    yield OnCpu(tmp_path_factory)
    patch.undo()


def run_metal_source(on_cpu, q, k, v, start: int, arch: int, storage: Storage, plant=None, parents=None):
    """The kernel's [B, HQ, L, D] for q [1, HQ, L, D], k, v [1, HKV, N, D] in
    ``storage``, run on this CPU from its Metal source (``plant``: (old, new)
    texts swapped into the passes first; ``parents``: the rows are a draft
    tree's nodes, the tree variants run); and the exponential it used."""
    script = check_metal_script()
    recorder = script.Recorder()
    kernel = ea.ExactAttentionKernel("metal", factory=recorder.factory)
    qm, km, vm = (mx.array(storage.f32(a)).astype(storage.mx) for a in (q, k, v))
    tree = None if parents is None else ea.ancestor_table(ea.from_parents(mx.array(parents), len(parents)))
    kernel(qm, km, vm, scale=q.shape[-1] ** -0.5, q_offset=mx.array(start), arch=arch, tree=tree)
    variants = recorder.variants
    (one_pass,) = [x for x in variants.values() if "one_pass" in x.kernel]
    two_pass = [x for kind in ("partial", "merge", "gqa") for x in variants.values() if kind in x.kernel]
    sources = [one_pass.source] + [x.source for x in two_pass]
    for old, new in plant or ():
        assert any(old in text for text in sources), old
        sources = [text.replace(old, new) for text in sources]
    shape_names = ["queries_shape", "queries_strides", "keys_shape", "keys_strides", "values_strides"]
    bfloat = storage.name == "bfloat16"
    B, HQ, L, D = q.shape
    g = HQ // k.shape[1]
    streams = ea.blocks("metal", arch, k.shape[2], g)
    rows = B * HQ * L
    offset = np.array([start], np.int32)
    params = np.array([ea.q_scale("metal", D**-0.5)], F32)
    dims = np.array([L, g, streams, arch] + ([] if tree is None else [L]), np.int32)
    extra = [] if tree is None else [np.array(a, np.int32) for a in tree]

    def shape(a):
        return np.array(a.shape, np.int32)

    def strides(a):
        return np.array([s // a.itemsize for s in a.strides], np.int64)

    def run(lib, variant, arrays):
        ((grid, group),) = variant.launches
        run_grid(lib, (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays]), *_groups(grid, group))

    inputs = [q, k, v, offset, params, dims, *extra, shape(q), strides(q), shape(k), strides(k), strides(v)]
    names = TREE_INPUTS if tree is not None else []
    lib = on_cpu.lib(script, sources[0], ONE_PASS_INPUTS + names + shape_names + ONE_PASS_OUTPUTS, bfloat)
    first = np.zeros((rows, D), q.dtype)
    run(lib, one_pass, inputs + [first])
    out = first
    if streams:
        assert len(two_pass) == 2 + ea.gqa_kernel("metal", k.shape[2], g, D)
        partial_lib = on_cpu.lib(script, sources[1], PARTIAL_INPUTS + names + shape_names + PARTIAL_OUTPUTS, bfloat)
        merge_lib = on_cpu.lib(script, sources[2], MERGE_INPUTS + names[:1] + MERGE_OUTPUTS, bfloat)
        parts = [np.zeros((rows, streams, D), q.dtype), np.zeros((rows, streams), F32), np.zeros((rows, streams), F32)]
        run(partial_lib, two_pass[0], inputs + parts)
        gqa_parts = parts
        if len(two_pass) == 3:
            gqa_lib = on_cpu.lib(script, sources[3], GQA_INPUTS + names + shape_names + GQA_OUTPUTS, bfloat)
            gqa_parts = [np.zeros_like(a) for a in parts]
            run(gqa_lib, two_pass[2], inputs + gqa_parts)
        out = np.zeros((rows, D), q.dtype)
        run(merge_lib, two_pass[1], parts + gqa_parts + [offset, dims, first, *extra[:1], out])
    exp = lib.harness_exp
    exp.restype, exp.argtypes = ctypes.c_float, [ctypes.c_float]
    return out.reshape(q.shape), np.vectorize(lambda x: F32(exp(float(x))), otypes=[F32])


def _groups(grid, group):
    return grid[0] // group[0], grid[1], group[0] // 32


def seq_sum(values, axis=-1):
    """A simdgroup's sum as the run adds its lanes: in lane order from zero."""
    values = np.moveaxis(values, axis, -1)
    total = np.zeros(values.shape[:-1], F32)
    for i in range(values.shape[-1]):
        total = total + values[..., i]
    return total


def streams_of(q, keys, values, scale, step: int, exp):  # (q, keys, values in float32)
    """MLX's per-simdgroup pass over keys s, s + step, ... (sdpa_vector's loop
    and sdpa_vector_2pass_1's), for one row: each stream's max, sum and
    per-lane outputs [step, 32, D/32], transcribed plainly."""
    n, d = keys.shape
    dl = d // 32
    qs = (F32(scale) * q).reshape(32, dl)
    m = np.full(step, FINITE_MIN, F32)
    s = np.zeros(step, F32)
    o = np.zeros((step, 32, dl), F32)
    for base in range(0, n, step):
        live = np.arange(step) + base < n
        at = base + np.arange(step)[live]
        k = keys[at].reshape(-1, 32, dl)
        v = values[at].reshape(-1, 32, dl)
        score = np.zeros(k.shape[:2], F32)
        for j in range(dl):
            score = score + qs[None, :, j] * k[:, :, j]
        score = seq_sum(score)
        new_m = np.maximum(m[live], score)
        factor, e = exp(m[live] - new_m), exp(score - new_m)
        m[live] = new_m
        s[live] = s[live] * factor + e
        o[live] = o[live] * factor[:, None, None] + e[:, None, None] * v
    return m, s, o


def sdpa_vector(q, keys, values, scale, exp):
    """MLX's Metal sdpa_vector for one row: 32 streams, then its merge."""
    m, s, o = streams_of(q, keys, values, scale, 32, exp)
    factor = exp(m - m.max())
    total = seq_sum(s * factor)
    # element (lane g, value i) is the simd_sum over streams l of o[l, g, i] * factor[l]
    out = seq_sum(o * factor[:, None, None], axis=0).reshape(-1)
    return out if total == 0 else out / total


def sdpa_vector_2pass(q, keys, values, scale, exp, blocks: int, storage: Storage):
    """MLX's Metal sdpa_vector_2pass_1 (blocks streams, partials rounded to T) then _2."""
    m, s, o = streams_of(q, keys, values, scale, blocks, exp)
    partial = storage.f32(storage.round(o.reshape(blocks, -1)))
    lanes = np.arange(32)
    top = np.full(32, FINITE_MIN, F32)
    for b in range(blocks // 32):
        top = np.maximum(top, m[lanes + 32 * b])
    top = top.max()
    total, acc = np.zeros(32, F32), np.zeros((32, partial.shape[1]), F32)
    for b in range(blocks // 32):
        factor = exp(m[lanes + 32 * b] - top)
        total = total + factor * s[lanes + 32 * b]
        acc = acc + factor[:, None] * partial[lanes + 32 * b]
    total = seq_sum(total)
    out = seq_sum(acc, axis=0)
    return out if total == 0 else out / total


def sdpa_vector_2pass_gqa(q, keys, values, scale, exp, blocks: int, heads: int, storage: Storage):
    """MLX's Metal sdpa_vector_2pass_1_gqa then sdpa_vector_2pass_2, for the
    G query heads q [G, D] of one row at once (HPT = ``heads``): each block a
    run of ceil(N / blocks) keys in HPT sub-runs; simdgroup g the sub-run g / NT
    for heads (g % NT) * HPT ..; each sub-run's output normalised, then each
    head's sub-runs weighted by sum x exp(max - their max) in order."""
    g, d = q.shape
    n = keys.shape[0]
    nt = g // heads
    chunk = -(-n // blocks)
    sub = -(-chunk // heads)
    partial = np.zeros((g, blocks, d), F32)
    sums, maxs = np.zeros((g, blocks), F32), np.zeros((g, blocks), F32)
    for b in range(blocks):
        kstart, kend = b * chunk, min(n, b * chunk + chunk)
        o_sh = np.zeros((g, heads, d), F32)  # [head, sub-run]
        se_sh, mx_sh = np.zeros((g, heads), F32), np.zeros((g, heads), F32)
        for sg in range(g):
            cchunk, h0 = sg // nt, (sg % nt) * heads
            s0 = kstart + cchunk * sub
            s1 = min(kend, s0 + sub)
            for j in range(heads):
                at = slice(s0, max(s0, s1))
                m, s, o = streams_of(q[h0 + j], keys[at], values[at], scale, 1, exp)
                inv = F32(1) / s[0] if s[0] > 0 else F32(0)
                o_sh[h0 + j, cchunk] = o[0].reshape(-1) * inv
                se_sh[h0 + j, cchunk], mx_sh[h0 + j, cchunk] = s[0], m[0]
        for h in range(g):
            top = FINITE_MIN
            for c in range(heads):
                top = max(top, mx_sh[h, c])
            denom, acc = F32(0), np.zeros(d, F32)
            for c in range(heads):
                w = se_sh[h, c] * exp(mx_sh[h, c] - top)
                denom = F32(denom + w)
                acc = acc + w * o_sh[h, c]
            partial[h, b] = storage.f32(storage.round(acc))
            sums[h, b], maxs[h, b] = denom, top
    out = np.zeros((g, d), F32)
    lanes = np.arange(32)
    for h in range(g):
        top = np.full(32, FINITE_MIN, F32)
        for b in range(blocks // 32):
            top = np.maximum(top, maxs[h, lanes + 32 * b])
        top = top.max()
        total, acc = np.zeros(32, F32), np.zeros((32, d), F32)
        for b in range(blocks // 32):
            factor = exp(maxs[h, lanes + 32 * b] - top)
            total = total + factor * sums[h, lanes + 32 * b]
            acc = acc + factor[:, None] * partial[h, lanes + 32 * b]
        total = seq_sum(total)
        row = seq_sum(acc, axis=0)
        out[h] = row if total == 0 else row / total
    return out


def key_rows(start: int, i: int, parents=None) -> list[int]:
    """The buffer rows row i's one-row call reads, in order: keys 0..start + i,
    or, for a tree's node i, the context and then its path's rows."""
    if parents is None:
        return list(range(start + i + 1))
    return list(range(start)) + [start + p for p in ea.tree_paths(parents)[i]]


def mlx_one_row_order(q, k, v, start: int, arch: int, exp, storage: Storage, parents=None):
    """Each row of q [1, HQ, L, D] as MLX's one-row Metal call over keys 0..its
    position computes it (a tree's node: over its gathered keys, key_rows)."""
    _, hq, rows, d = q.shape
    g = hq // k.shape[1]
    q32, k32, v32 = storage.f32(q), storage.f32(k), storage.f32(v)
    out = np.zeros(q.shape, q.dtype)
    for h in range(hq):
        for i in range(rows):
            at = key_rows(start, i, parents)
            n = len(at)
            keys, values = k32[0, h // g, at], v32[0, h // g, at]
            blocks = ea.blocks("metal", arch, n, g)
            if ea.gqa_kernel("metal", n, g, d):
                if h % g == 0:  # (a KV head's query heads at once)
                    heads = q32[0, h : h + g, i]
                    rows_out = sdpa_vector_2pass_gqa(
                        heads, keys, values, d**-0.5, exp, blocks, ea.GQA_HEADS[(g, d)], storage
                    )
                    out[0, h : h + g, i] = storage.round(rows_out)
                continue
            if blocks:
                row = sdpa_vector_2pass(q32[0, h, i], keys, values, d**-0.5, exp, blocks, storage)
            else:
                row = sdpa_vector(q32[0, h, i], keys, values, d**-0.5, exp)
            out[0, h, i] = storage.round(row)
    return out


def metal_case(rows: int, g: int, start: int, n: int, d: int, storage: Storage):
    rng = np.random.default_rng(rows * 1000 + n + d)
    return tuple(storage.round(rng.standard_normal(shape)) for shape in ((1, g, rows, d), (1, 1, n, d), (1, 1, n, d)))


def reference(q, k, v, start, storage: Storage, parents=None):
    """Plain softmax attention in float64, each row over keys 0..its position (key_rows)."""
    q, k, v = (storage.f32(a).astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape, np.float64)
    g = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        for i in range(q.shape[2]):
            at = key_rows(start, i, parents)
            s = (k[0, h // g, at] @ q[0, h, i]) * q.shape[-1] ** -0.5
            p = np.exp(s - s.max())
            out[0, h, i] = p @ v[0, h // g, at] / p.sum()
    return out


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "rows, g, start, n, d, dtype, arch",
    [
        (3, 1, 20, 256, 64, "float16", 0),  # one pass, fewer keys than streams
        (4, 2, 90, 256, 128, "bfloat16", 0),  # one pass, GQA
        (5, 1, 1020, 1280, 64, "float16", 1),  # across the switch to two passes (64 blocks) on 's'
        (3, 2, 1021, 1280, 128, "bfloat16", 1),
        (3, 2, 1021, 1280, 64, "float32", 2),  # ... (128 blocks) on 'd'
        (2, 2, 4094, 4352, 64, "float16", 0),  # two passes under GQA from 4096 keys (32 blocks)
        (2, 1, 300, 512, 256, "float32", 0),  # head dim 256
    ],
)
def test_the_metal_source_run_on_the_cpu_computes_each_row_in_mlxs_one_row_order(
    on_cpu, rows, g, start, n, d, dtype, arch
):
    storage = Storage(dtype)
    q, k, v = metal_case(rows, g, start, n, d, storage)
    got, exp = run_metal_source(on_cpu, q, k, v, start, arch, storage)
    want = mlx_one_row_order(q, k, v, start, arch, exp, storage)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (got != want).sum()
    # and attention itself, to a rounding
    assert np.abs(storage.f32(got) - reference(q, k, v, start, storage)).max() < 3e-2


# The key counts from which MLX's one-row call takes two passes under GQA and
# its GQA kernel, lowered in the source and here alike (a run over 8192 keys is
# minutes on this CPU): the orders run are the kernels' own.
FEWER_KEYS = [("(g > 1 && n >= 4096)", "(g > 1 && n >= 256)"), ("return n >= 8192 &&", "return n >= 288 &&")]


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "rows, g, start, d, dtype",
    [
        (3, 8, 285, 64, "float16"),  # GQA 8 at head dim 64: 8 heads a simdgroup; across the switch
        (2, 8, 300, 128, "bfloat16"),  # GQA 8 at 128: 4 heads a simdgroup
        (2, 16, 300, 128, "float32"),  # GQA 16 at 128: 2 heads a simdgroup
    ],
)
def test_the_metal_source_follows_mlxs_gqa_kernel_where_mlx_takes_it(on_cpu, monkeypatch, rows, g, start, d, dtype):
    monkeypatch.setattr(ea, "GQA_TWO_PASS_KEYS", 256)
    monkeypatch.setattr(ea, "GQA_KERNEL_KEYS", 288)
    storage = Storage(dtype)
    q, k, v = metal_case(rows, g, start, 512, d, storage)
    got, exp = run_metal_source(on_cpu, q, k, v, start, 0, storage, plant=FEWER_KEYS)
    want = mlx_one_row_order(q, k, v, start, 0, exp, storage)
    assert ea.gqa_kernel("metal", start + rows, g, d)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (got != want).sum()
    assert np.abs(storage.f32(got) - reference(q, k, v, start, storage)).max() < 3e-2


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "plant, start, arch, dtype",
    [
        # the online softmax's update of the output, fused (one rounding fewer)
        (
            [
                (
                    "o[rr][j] = ea_two<FORM>(o[rr][j], factor, e, vf[j]);",
                    "o[rr][j] = metal::fma(e, vf[j], o[rr][j] * factor);",
                )
            ],
            90,
            0,
            "float32",
        ),
        # the scale applied to the score, not to q as MLX reads it
        (
            [
                ("= params[0] * to_float(", "= 1.0f * to_float("),
                ("score = simd_sum(score);", "score = simd_sum(score) * params[0];"),
            ],
            90,
            0,
            "float32",
        ),
        # the two-pass blocks as runs of keys, not interleaved as MLX's sdpa_vector_2pass takes them
        (
            [
                (
                    "for (int k = stream; k < n; k += blocks) {",
                    "for (int k = stream * ((n + blocks - 1) / blocks); k < n && k < (stream + 1) * ((n + blocks - 1) / blocks); ++k) {",
                )
            ],
            1100,
            1,
            "float16",
        ),
    ],
)
def test_a_planted_order_change_fails_the_comparison(on_cpu, plant, start, arch, dtype):
    storage = Storage(dtype)
    q, k, v = metal_case(4, 2, start, 1280, 128, storage)  # (a scale not a power of 2)
    got, exp = run_metal_source(on_cpu, q, k, v, start, arch, storage, plant=plant)
    want = mlx_one_row_order(q, k, v, start, arch, exp, storage)
    assert not np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.abs(storage.f32(got) - reference(q, k, v, start, storage)).max() < 1e-2


@pytest.mark.skipif(metal_on_cpu.shutil.which("clang++") is None and CLANG_F16 is None, reason="no clang++ here")
def test_every_metal_variant_is_in_the_check_script_and_compiles():
    """scripts/check_metal_kernels.py takes the kernel's variants from its
    record_variants hook (KERNEL_MODULES): each compiles against the stand-in
    Metal header (address spaces, builtins' arities) and fits Apple's limits."""
    script = check_metal_script()
    assert "dflash_mlx.kernels.exact_attention" in script.KERNEL_MODULES
    recorder = script.Recorder()
    script.record_modules(recorder, "metal", modules=["dflash_mlx.kernels.exact_attention"])
    kinds = 1 + len(ea.ROW_TILES) + 1  # (the one-pass kernel, the partial pass's tiles, the merge)
    per_dtype_form = len(ea.HEAD_DIMS["metal"]) * kinds + len(ea.GQA_HEADS)  # (and the GQA kernel's)
    # (a block's and a draft tree's)
    assert len(recorder.variants) == len(ea.DTYPES) * len(ea.FORMS["metal"]) * per_dtype_form * 2
    assert sum("_tree_" in x.kernel for x in recorder.variants.values()) == len(recorder.variants) // 2
    compiler = script.Compiler(script.find_clang() or CLANG_F16)
    lines = []
    try:
        failed = script.check_all(recorder, compiler, jobs=2, report=lines.append)
    finally:
        compiler.close()
    assert not failed, "\n".join(lines)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_decoding_through_the_kernel_is_the_targets_greedy_output(fake_gpu, monkeypatch, dtype):
    """A verify's attention layers take the kernel (each row what the plain step
    computes), so DFlash's output is the target's own greedy text, token for token."""
    from tiny import (
        draft_config,
        greedy_reference,
        make_draft,
        make_target,
        make_tokenizer,
        random_draft_weights,
        target_config,
    )

    from dflash_mlx import stream_generate
    from dflash_mlx.kernels import decisions

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    decisions.reset()
    kernel = fake_gpu(FakeKernel())
    tcfg = target_config("qwen3", vocab=32, layers=2, hidden=256)  # (head dim 64)
    model = make_target(tcfg, seed=81)
    model.set_dtype(dtype)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 1])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=82))
    draft.set_dtype(dtype)
    prompt = [1, 2, 3, 4, 5]
    want = greedy_reference(model, prompt, 12)
    tokens = make_tokenizer(32)
    got = [t for r in stream_generate(model, draft, tokens, prompt, max_tokens=12, block_size=6) for t in r.tokens]
    assert got == want
    assert ea._checks and all(r.ok for r in ea._checks.values())
    verifies = [rows for rows, _, _ in kernel.calls if rows != 3 and rows != 5]  # (not the check's cases)
    assert verifies and all(2 <= rows <= 16 for rows in verifies)
    decisions.reset()


def test_doctor_gets_every_variant_checked(fake_gpu):
    fake_gpu(FakeKernel())
    lines = []
    results = ea.self_check_all(report=lines.append)
    assert len(results) == len(lines) == len(ea.DTYPES) * len(ea.HEAD_DIMS["metal"]) * 2  # (a block's, a tree's)
    assert all(r.ok and r.case.startswith("metal ") for r in results)
    assert sum(r.case.endswith(" tree") for r in results) == len(results) // 2


def test_doctor_on_the_cpu_checks_nothing():
    ea.reset()
    assert ea.self_check_all() == [] and not ea._checks


def test_a_verify_takes_the_kernel_and_a_prompts_chunk_does_not(fake_gpu, monkeypatch):
    """A cycle's verify (its offset on the device) is computed as the plain
    step computes each row; a prompt's chunk (a host offset) as mlx-lm's prefill."""
    from dflash_mlx.kernels import decisions
    from dflash_mlx.kv.buffer import BufferKVCache
    from dflash_mlx.layers.attention import attention_output

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    decisions.reset()
    kernel = fake_gpu(FakeKernel())
    ea.checked("metal", mx.float16, 64)
    q, k, v, start = verify_case(rows=6, n=256)
    for offset, served in ((start, False), (mx.array(start), True)):
        cache = BufferKVCache()
        cache.update_and_fetch(k[:, :, :start], v[:, :, :start])
        keys, values = cache.update_and_fetch(k[:, :, start : start + 6], v[:, :, start : start + 6])
        kernel.calls.clear()
        out, as_rows = attention_output(q, keys, values, cache=cache, scale=0.125, mask="causal", start=offset)
        assert bool(kernel.calls) == served and not as_rows
        want = ea.one_row_attention(q, keys, values, scale=0.125, q_offset=start)
        assert mx.allclose(out, want, atol=1e-2) and (mx.array_equal(out, want) or not served)
    decisions.reset()


@pytest.mark.parametrize("family", ["gemma4_text", "gemma3_text"])
def test_a_prompts_chunks_never_take_the_exact_verify_attention(fake_gpu, monkeypatch, family):
    """Gemma 4's layers hand attention their offset as an array even in a
    prompt; a prompt's chunk still reads as mlx-lm's prefill does (MLX's
    attention), never as a verify's rows, where exactness comes first."""
    from test_attention_routing_families import pair

    from dflash_mlx.cache.prompt import make_prompt_cache
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.targets import adapt

    monkeypatch.setitem(ea.CHECK_CASES, "metal", ((1, 3, 37, 256),))
    kernel = fake_gpu(FakeKernel())
    model, draft = pair(family, seed=23)
    target = adapt(model)
    assert any(c.ok for c in ea._checks.values())  # (the kernel passed its check: it could serve)
    kernel.calls.clear()
    prefill(target, draft, make_prompt_cache(model, draft), list(range(1, 12)), 16, None)
    # (the prompt's chunk is its first 10 ids; a 3-row call is a variant's self-check)
    assert [c for c in kernel.calls if c[0] != 3] == []
