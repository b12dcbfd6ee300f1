"""The quantized expert verify product (kernels/quantized_gather.py) and the
experts' routing (layers/experts.py). Its Metal source, run on this CPU, gives
each (row, expert) pair bit for bit what MLX's one-row gather product (qmv on
that expert's weight) computes; on a pretend GPU a kernel that checks out
takes a verify's expert products (and not a prompt's or a plain step's), and
greedy DFlash through it on a 4-bit qwen3_moe target is mlx-lm's greedy."""

import ctypes
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from family_models import family_config, make_family_target, run, scripted
from metal_on_cpu import CLANG_F16, build_on_cpu, check_metal_script, run_grid
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU
from test_quantized_products import metal_one_row_order, served_tiles
from tiny import draft_config, greedy_reference, make_draft, random_draft_weights

from dflash_mlx.kernels import quantized as qp
from dflash_mlx.kernels import quantized_gather as qg
from dflash_mlx.kernels.quantized_source import GATHER_INPUTS, OUTPUTS
from dflash_mlx.layers import experts, linear


def quantized_experts(experts_n: int, k: int, n: int, bits=4, group=64, mode="affine", dtype=mx.float16):
    mx.random.seed(experts_n + k + n + bits)
    w = (k**-0.5 * mx.random.normal((experts_n, n, k))).astype(dtype)
    layer = QuantizedSwitchLinear(k, n, experts_n, bias=False, group_size=group, bits=bits, mode=mode)
    layer._quantize(w)
    return layer


def pairs_of(rows: int, top_k: int, experts_n: int, seed: int):
    lhs, rhs = qg.verify_pairs(rows, experts_n, top_k, seed)
    return lhs, rhs


# --- The Metal source itself, run on this CPU --------------------------------------------------------------


def metal_one_row_gather_order(x, lhs, rhs, w, scales, biases, bits, group, mode, words):
    """MLX's Metal gather_qmv(_fast), transcribed: adjust_matrix_offsets moves
    x, w, scales and biases to the pair's row and expert, then qmv(_fast)_impl."""
    return np.concatenate(
        [
            metal_one_row_order(
                x[lhs[p] : lhs[p] + 1],
                w[e],
                scales[e],
                biases[e] if biases.ndim == 3 else biases,
                bits,
                group,
                mode,
                words,
            )
            for p, e in enumerate(rhs)
        ]
    )


def run_on_cpu(tmp_path, layer, x, lhs, rhs, plant=None):
    script = check_metal_script()
    recorder = script.Recorder()
    kernel = qg.QuantizedGatherKernel("metal", factory=recorder.factory)
    biases = layer.get("biases")
    kernel(x, lhs, rhs, layer.weight, layer.scales, biases, bits=layer.bits, group=layer.group_size, mode=layer.mode)
    ((name, variant),) = recorder.variants.items()
    ((grid, group_size),) = variant.launches
    source = variant.source if plant is None else plant(variant.source)
    assert plant is None or source != variant.source
    names = GATHER_INPUTS + ["x_shape", "w_shape", "rhs_shape"] + OUTPUTS
    lib = build_on_cpu(script, source, names, tmp_path)
    xs, ws, sc = np.array(x), np.array(layer.weight), np.array(layer.scales)
    ls, rs = np.array(lhs, np.int32), np.array(rhs, np.int32)
    bi = np.array(biases) if biases is not None else np.zeros(8, np.float16)
    y = np.zeros((rs.size, ws.shape[1]), np.float16)
    shapes = [np.array(a.shape, np.int32) for a in (xs, ws, rs)]
    arrays = {"x": xs, "lhs": ls, "rhs": rs, "w": ws, "scales": sc, "biases": bi, "y": y}
    arrays.update(zip(("x_shape", "w_shape", "rhs_shape"), shapes))
    buffers = (ctypes.c_void_p * len(names))(*[arrays[n].ctypes.data for n in names])
    run_grid(lib, buffers, grid[0] // group_size[0], grid[1], group_size[0] // 32)
    return y, (xs, ls, rs, ws, sc, bi)


CPU_CASES = [
    # rows, top k, experts, N, K, bits, group, mode
    (3, 2, 4, 16, 512, 4, 64, "affine"),  # qmv_fast, 8 outputs a simdgroup
    (5, 3, 6, 8, 768, 4, 32, "affine"),  # qmv (one word a lane a step)
    (4, 4, 5, 8, 384, 8, 32, "affine"),
    (9, 4, 8, 8, 256, 8, 128, "affine"),  # 36 pairs: two tiles of 32
    (2, 2, 3, 8, 2880, 4, 32, "mxfp4"),  # gpt-oss's K
]


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize("rows, top_k, experts_n, n, k, bits, group, mode", CPU_CASES)
def test_the_metal_source_reduces_each_pair_in_mlxs_one_row_gather_order(
    tmp_path, rows, top_k, experts_n, n, k, bits, group, mode
):
    layer = quantized_experts(experts_n, k, n, bits, group, mode)
    lhs, rhs = pairs_of(rows, top_k, experts_n, seed=rows + k)
    order = mx.argsort(rhs)  # (as the routing sends them: sorted by expert, rows sharing reads)
    lhs, rhs = lhs[order], rhs[order]
    x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.float16)
    y, (xs, ls, rs, ws, sc, bi) = run_on_cpu(tmp_path, layer, x, lhs, rhs)
    words = qp.packs(k, bits, "metal")
    want = metal_one_row_gather_order(xs, ls, rs, ws, sc, bi, bits, group, mode, words)
    assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (y != want).sum()
    # and MLX's own gather product (this CPU's), to the rounding of a float16 sum
    mlx = np.array(qg.one_row_products(x, ls.tolist(), rhs, layer.weight, layer.scales, layer.get("biases"),
                                       bits=bits, group=group, mode=mode).astype(mx.float32))  # fmt: skip
    assert np.abs(y.astype(np.float32) - mlx).max() <= 2e-2 * np.abs(mlx).max()


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "plant",
    [
        # qmv's four x added in float, not in the activations' type, before the float sum
        lambda s: s.replace("sum += x[i] + x[i + 1]", "sum += float(x[i]) + x[i + 1]"),
        # a tile's later pairs reusing its first expert's weights
        lambda s: s.replace("if (e != loaded)", "if (loaded < 0)"),
    ],
    ids=["x sums in float", "expert reuse"],
)
def test_a_planted_change_fails_the_transcription(tmp_path, plant):
    rows, top_k, experts_n, n, k = 6, 3, 4, 16, 512
    layer = quantized_experts(experts_n, k, n)
    lhs, rhs = pairs_of(rows, top_k, experts_n, seed=3)
    x = mx.random.normal((rows, k), key=mx.random.key(4)).astype(mx.float16)
    y, (xs, ls, rs, ws, sc, bi) = run_on_cpu(tmp_path, layer, x, lhs, rhs, plant)
    want = metal_one_row_gather_order(xs, ls, rs, ws, sc, bi, 4, 64, "affine", qp.packs(k, 4, "metal"))
    assert not np.array_equal(y.view(np.uint16), want.view(np.uint16))


# --- Routing, on a pretend GPU ---------------------------------------------------------------------------------


class FakeGather:
    """The kernel as its callers see it: each pair as MLX's one-row gather
    product computes it (what the real kernel must), its calls counted."""

    def __init__(self, nudge: float = 0.0):
        self.nudge = nudge
        self.pairs = []

    def __call__(self, x, lhs, rhs, weight, scales, biases, *, bits, group, mode, fused=False):
        self.pairs.append(rhs.size)
        y = qg.one_row_products(x, lhs.tolist(), rhs, weight, scales, biases, bits=bits, group=group, mode=mode)
        return y.at[-1, 0].add(mx.array(self.nudge, y.dtype)) if self.nudge else y


@pytest.fixture
def fake_gpu(monkeypatch):
    qg.reset()
    monkeypatch.setattr(qg, "backend", lambda: "fake")

    def install(kernel):
        monkeypatch.setitem(qg.BUILDERS, "fake", lambda where: kernel)
        return kernel

    yield install
    qg.reset()


def quantized_glu(k=256, hidden=128, experts_n=6, bits=4, group=64, mode="affine"):
    mx.random.seed(k + hidden)
    glu = SwitchGLU(k, hidden, experts_n)
    glu.set_dtype(mx.bfloat16)
    nn.quantize(glu, group_size=group, bits=bits, mode=mode, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    return glu


def routed(rows: int, k: int, experts_n: int, top_k: int = 2):
    x = mx.random.normal((1, rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
    scores = mx.random.uniform(shape=(1, rows, experts_n), key=mx.random.key(rows + 1))
    return x, mx.argpartition(scores, kth=-top_k, axis=-1)[..., -top_k:]


def test_on_the_cpu_the_experts_are_mlx_lms_own():
    glu = quantized_glu()
    for rows in (1, 5, 40):
        x, inds = routed(rows, 256, 6)
        assert mx.array_equal(experts.switch_glu(glu, x, inds), glu(x, inds))


@pytest.mark.parametrize("quant", [(4, 64, "affine"), (8, 32, "affine"), (4, 32, "mxfp4")])
def test_a_verifys_expert_products_take_the_kernel_and_a_prompts_do_not(fake_gpu, quant):
    glu = quantized_glu(bits=quant[0], group=quant[1], mode=quant[2])
    kernel = fake_gpu(FakeGather())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_quantized(glu, mx.bfloat16)
    assert qg._checks and all(r.ok for r in qg._checks.values())
    for rows in (1, 2, 7, 16, 32, 33, 64):
        kernel.pairs.clear()
        x, inds = routed(rows, 256, 6)
        got = experts.switch_glu(glu, x, inds)
        # gate, up and down, each over every (row, expert) pair; one row and a prompt: mlx-lm's
        assert kernel.pairs == ([2 * rows] * 3 if 2 <= rows <= 32 else [])
        # each row what a plain step computes for it alone
        for i in range(rows):
            assert mx.array_equal(got[:, i], glu(x[:, i : i + 1], inds[:, i : i + 1])[:, 0]), (rows, i)
        # a prompt's chunk of any rows: mlx-lm's own, as its prefill computes it
        kernel.pairs.clear()
        with linear.prompt_products():
            assert mx.array_equal(experts.switch_glu(glu, x, inds), glu(x, inds))
        assert kernel.pairs == []


def test_an_expert_kernel_one_rounding_off_is_never_used(fake_gpu):
    glu = quantized_glu()
    kernel = fake_gpu(FakeGather(nudge=1.0))
    with pytest.warns(RuntimeWarning, match=r"quantized expert verify product failed its self-check"):
        linear.prepare_quantized(glu, mx.bfloat16)
    assert not any(r.ok for r in qg._checks.values())
    kernel.pairs.clear()
    x, inds = routed(5, 256, 6)
    assert mx.array_equal(experts.switch_glu(glu, x, inds), glu(x, inds)) and kernel.pairs == []


def test_a_layer_that_rounds_otherwise_at_its_own_shape_is_not_served(fake_gpu):
    """Exact on the check's experts, off at the layer's own: that layer keeps MLX's."""

    class OffPastCheck(FakeGather):
        def __call__(self, x, lhs, rhs, weight, *rest, **kw):
            y = super().__call__(x, lhs, rhs, weight, *rest, **kw)
            return y.at[0, 0].add(mx.array(1.0, y.dtype)) if weight.shape[0] == 6 else y

    glu = quantized_glu()
    kernel = fake_gpu(OffPastCheck())
    linear.prepare_quantized(glu, mx.bfloat16)
    assert all(r.ok for r in qg._checks.values())
    assert not experts.takes(glu, routed(5, 256, 6)[0])
    kernel.pairs.clear()
    x, inds = routed(5, 256, 6)
    assert mx.array_equal(experts.switch_glu(glu, x, inds), glu(x, inds)) and kernel.pairs == []


def test_the_check_covers_every_pair_tile_and_shared_experts():
    variant = qg.variant_of(quantized_experts(4, 512, 16, dtype=mx.bfloat16), mx.bfloat16)
    cases = list(qg.check_cases(variant))
    sizes = {c[2].size for c in cases}
    assert {qp.tile(p, "metal") for p in sizes} == {qp.tile(r, "metal") for r in range(2, 33)}
    # a row to several distinct experts, an expert to several rows
    lhs, rhs = cases[-1][1], cases[-1][2]
    assert len(set(rhs.tolist())) < rhs.size and len(set(lhs.tolist())) < lhs.size


def test_the_variants_served_are_mlx_lms_quantized_experts():
    dtype = mx.bfloat16
    assert qg.variant_of(quantized_experts(4, 512, 16, dtype=dtype), dtype).k == 512
    assert qg.variant_of(quantized_experts(4, 512, 16, 4, 32, "mxfp4", dtype=dtype), dtype).mode == "mxfp4"
    assert qg.variant_of(quantized_experts(4, 128, 16, dtype=dtype), dtype) is not None  # (no qmv_quad in a gather)
    assert qg.variant_of(quantized_experts(4, 512, 12, dtype=dtype), dtype) is None  # N not whole simdgroups
    assert qg.variant_of(quantized_experts(4, 512, 16, 2, dtype=dtype), dtype) is None
    assert qg.variant_of(quantized_experts(4, 512, 16, dtype=dtype), mx.float32) is None
    assert qg.variant_of(nn.QuantizedLinear(512, 16), dtype) is None


def recorded_launches(backend_name: str) -> list[dict]:
    launches = []

    def factory(*, name, source, header, **made):
        def launch(*, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
            launches.append(dict(template=dict(template), grid=grid, threadgroup=threadgroup))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    qg.record_variants(factory, backend_name)
    return launches


def test_on_cuda_an_mxfp4_experts_lanes_take_fp_gather_qmvs_four_words_a_step():
    """MLX's one-row gather of mxfp4 experts on CUDA is fp_gather_qmv (fp_qmv's
    order: 32 values a lane a step, float sums), not the dense product's qmv:
    the gather's mxfp4 variants take four words a lane, every other two (qmv's);
    Metal's keep its qmv(_fast) words; the staged rows still fit."""
    cuda = recorded_launches("cuda")
    for launch in cuda:
        t = launch["template"]
        assert t["PACKS"] == (4 if t["MXFP4"] else 2), t
        step = 32 * t["PACKS"] * 32 // t["BITS"]
        assert t["MR"] % t["SR"] == 0 and t["SR"] * step * 2 <= qp.STAGED_BYTES
    assert any(launch["template"]["MXFP4"] for launch in cuda)
    assert {launch["template"]["PACKS"] for launch in recorded_launches("metal")} == {1, 2}
    # the dense product's mxfp4 rows stay qmv's (its one row is qmv on CUDA)
    assert qp.packs(2880, 4, "cuda") == 2 and qp.packs(2880, 4, "cuda", fp_gather=True) == 4
    assert qp.packs(2880, 4, "metal", fp_gather=True) == qp.packs(2880, 4, "metal") == 1


def test_the_cuda_header_follows_fp_gather_qmvs_lane_arithmetic():
    """The lane's sums as fp_gather_qmv's PTX (MLX 0.32.4) has them: even and odd
    values into two float fma chains, their sum times the e8m0 scale fma'd into
    the lane's total; each multiply-add one rounding, written out (never left to
    the compiler's contraction)."""
    from dflash_mlx.kernels.quantized_source import HEADER

    cuda = HEADER["cuda"]
    assert "MXFP4 && VPT == 32" in cuda
    assert "ex = __fmaf_rn(to_float(xs.p[i].x), to_float(d.q[i].x), ex);" in cuda
    assert "od = __fmaf_rn(to_float(xs.p[i].y), to_float(d.q[i].y), od);" in cuda
    assert "a.t = __fmaf_rn(__fadd_rn(ex, od), d.s, a.t);" in cuda
    assert "0x400000u" in cuda and "0x7fffffffu" in cuda  # (e8m0: 0 is 2^-127, 255 NaN, as cutlass's)


def test_every_variant_is_recorded_for_the_check_scripts():
    recorded = set()

    def factory(*, name, **made):
        def launch(*, template, output_shapes, output_dtypes, **kw):
            recorded.add(tuple(v for _, v in template))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    qg.record_variants(factory, "metal")
    assert len({values[:5] for values in recorded}) == 2 * (len(qp.AFFINE_BITS) * len(qp.GROUPS) + 1)
    assert served_tiles("metal", range(8, 513, 8)) <= {values[7:10] for values in recorded}


# --- Decoding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", [(4, 64, "affine"), (4, 32, "mxfp4")])
def test_greedy_dflash_through_the_kernel_on_a_quantized_moe_target_is_mlx_lms(fake_gpu, quant):
    bits, group, mode = quant
    cfg = family_config("qwen3_moe", vocab=48, layers=2, hidden=256)
    model = make_family_target(cfg, seed=7)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=group, bits=bits, mode=mode, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    mx.eval(model.parameters())
    dcfg = draft_config(cfg, layers=1, block_size=8)
    draft = scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=8)))
    draft.set_dtype(mx.bfloat16)
    kernel = fake_gpu(FakeGather())
    prompt = list(range(1, 12))
    want = greedy_reference(model, prompt, 16)
    tokens, _ = run(model, draft, prompt, vocab=48, max_tokens=16, block_size=6)
    assert tokens == want
    # the adapter checked every expert layer's variant, and the verifies' experts went through it
    assert qg._checks and all(r.ok for r in qg._checks.values())
    # (a verify of 2-6 rows, two experts a row; the checks' pairs are of other counts)
    assert {4, 6, 10, 12} & set(kernel.pairs)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_a_moe_blocks_verify_rows_are_its_plain_steps(fake_gpu, family):
    """experts.mlp runs mlx-lm's sparse block op for op: on the CPU it is the
    block; through a checked kernel each verify row is what a plain step gives."""
    cfg = family_config(family, vocab=48, layers=2, hidden=256)
    model = make_family_target(cfg, seed=3)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4" if family == "gpt_oss" else "affine")
    block = next(layer.mlp for layer in model.model.layers if type(layer.mlp) in experts.FORWARDS)
    x = mx.random.normal((1, 6, 256), key=mx.random.key(9)).astype(mx.bfloat16)
    forward = experts.mlp(block)
    assert forward is not block and mx.array_equal(forward(x), block(x))
    kernel = fake_gpu(FakeGather())
    linear.prepare_quantized(model, mx.bfloat16)
    kernel.pairs.clear()
    got = forward(x)
    assert len(kernel.pairs) == 3  # gate, up and down
    for i in range(6):
        assert mx.array_equal(got[:, i], block(x[:, i : i + 1])[:, 0]), i


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ here")
def test_the_metal_check_compiles_the_gather_variants_and_catches_a_device_weight(monkeypatch):
    """scripts/check_metal_kernels.py compiles the recorded variants; the lanes'
    arithmetic handed the device weights instead of its registers is caught."""
    from dflash_mlx.kernels import quantized_source

    def check(most=2):
        script = check_metal_script()
        recorder = script.Recorder()
        qg.record_variants(recorder.factory, "metal")
        recorder.variants = {n: recorder.variants[n] for n in sorted(recorder.variants)[:most]}
        compiler = script.Compiler(script.find_clang())
        lines = []
        try:
            failed = script.check_all(recorder, compiler, report=lines.append)
        finally:
            compiler.close()
        return failed, "\n".join(lines)

    failed, log = check()
    assert not failed, log
    body = quantized_source.GATHER_BODY.replace("(acc[m][r], xv, wq[r])", "(acc[m][r], xv, w)")
    assert body != quantized_source.GATHER_BODY
    monkeypatch.setattr(quantized_source, "GATHER_BODY", body)
    failed, log = check()
    assert len(failed) == 2 and "no matching function for call to 'qv_add'" in log, log


def test_a_hybrid_targets_re_read_takes_each_stretch_as_it_was_written(fake_gpu):
    """A delta-net state no cache kept is rebuilt by re-reading the ids from a
    checkpoint: positions a prompt wrote through MLX's own experts (as mlx-lm's
    prefill), positions written outside a prompt through the verify's kernel."""
    from dflash_mlx.targets import adapt

    cfg = family_config("qwen3_next", vocab=48, layers=2, hidden=256)
    model = make_family_target(cfg, seed=5)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    kernel = fake_gpu(FakeGather())
    linear.prepare_quantized(model, mx.bfloat16)
    target = adapt(model)
    cache = target.make_cache()
    ids = [(7 * i) % 47 for i in range(240)]
    for start in (0, 80):  # two prompt chunks longer than a kept write: a checkpoint at each start
        with linear.prompt_products():
            mx.eval(target(mx.array(ids[start : start + 80])[None], cache, [0])[0])
    mx.eval(target(mx.array(ids[160:240])[None], cache, [0])[0])  # written outside a prompt
    kernel.pairs.clear()
    target.set_length(cache, 180)  # re-reads 160..179, not a prompt's
    assert kernel.pairs
    kernel.pairs.clear()
    target.set_length(cache, 100)  # re-reads 80..99, a prompt's
    assert kernel.pairs == []
