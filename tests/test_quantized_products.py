"""The quantized verify product (kernels/quantized.py): which layers it can
serve, its launch shapes, its self-check (bit for bit against MLX's one-row
product), and the routing in layers/linear.py. On the CPU every product is
MLX's; on a pretend GPU a kernel that checks out takes a verify's 2-32-row
products of quantized layers (and only those), one that does not never does,
and decoding through it stays the target's own greedy output. What the
kernel computes on a GPU is its self-check's to show on the device; that
its Metal and CUDA sources compile is the check scripts' (test_check_*)."""

import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from launch_recorder import recording_factory
from metal_on_cpu import CLANG_F16, build_on_cpu, check_metal_script, run_grid
from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
)

from dflash_mlx.kernels import quantized as qp
from dflash_mlx.kernels import serving
from dflash_mlx.layers import linear


def quantized_linear(
    k: int, n: int, bits: int = 4, group: int = 64, mode: str = "affine", bias: bool = False, dtype=mx.bfloat16
):
    mx.random.seed(k + n + bits)
    dense = nn.Linear(k, n, bias=bias)
    dense.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(dense, group_size=group, bits=bits, mode=mode)


def rows_of(rows: int, k: int, dtype=mx.bfloat16):
    return mx.random.normal((1, rows, k), key=mx.random.key(rows)).astype(dtype)


class FakeKernel:
    """A kernel as the module's callers see it, computing each row as MLX's
    one-row product does (what the real kernel must), counting its calls."""

    def __init__(self, nudge: float = 0.0):
        self.nudge = nudge  # added to one output: a kernel one rounding off
        self.rows = []

    def __call__(self, x, weight, scales, biases, *, bits, group, mode, fused=False):
        *lead, k = x.shape
        self.rows.append(x.size // k)
        flat = x.reshape(-1, k)
        y = qp.one_row_products(flat, weight, scales, biases, bits=bits, group=group, mode=mode)
        if self.nudge:
            y = y.at[-1, 0].add(mx.array(self.nudge, y.dtype))
        return y.reshape(*lead, -1)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The quantized product as if MLX ran on a GPU backend named 'fake'
    with a kernel of our choosing."""
    qp.reset()
    monkeypatch.setattr(qp, "backend", lambda: "fake")

    def install(kernel):
        monkeypatch.setitem(qp.BUILDERS, "fake", lambda where: kernel)
        return kernel

    yield install
    qp.reset()


@pytest.mark.parametrize("rows", [1, 2, 16, 32, 33])
@pytest.mark.parametrize("quant", [(4, 64, "affine"), (8, 128, "affine"), (4, 32, "mxfp4")])
def test_on_the_cpu_a_quantized_layer_is_its_own_module(rows, quant):
    bits, group, mode = quant
    module = quantized_linear(512, 64, bits, group, mode)
    x = rows_of(rows, 512)
    assert qp.product(module, x) is None
    assert mx.array_equal(linear.apply_linear(module, x), module(x))
    h = rows_of(rows, 64)
    assert mx.array_equal(linear.apply_linear(module, x, residual=h), h + module(x))


@pytest.mark.parametrize(
    "k, n, bits, group, mode, dtype, served",
    [
        (512, 64, 4, 32, "affine", mx.bfloat16, True),
        (512, 64, 4, 64, "affine", mx.float16, True),
        (1024, 64, 4, 128, "affine", mx.bfloat16, True),
        (256, 64, 8, 64, "affine", mx.bfloat16, True),
        (512, 64, 4, 32, "mxfp4", mx.bfloat16, True),
        (512, 64, 4, 64, "affine", mx.float32, False),  # (float32 activations: MLX's)
        (2880, 64, 4, 32, "mxfp4", mx.bfloat16, True),  # (gpt-oss's K: Metal's one-word steps)
        (384, 64, 8, 64, "affine", mx.bfloat16, True),
        (128, 64, 4, 64, "affine", mx.bfloat16, False),  # K of 64 or 128: Metal's qmv_quad
        (512, 60, 4, 64, "affine", mx.bfloat16, False),  # N not a multiple of 8 (MLX's qmv, not qmv_fast)
        (512, 64, 2, 64, "affine", mx.bfloat16, False),
        (512, 64, 4, 16, "nvfp4", mx.bfloat16, False),
    ],
)
def test_the_variants_served_are_the_shapes_of_mlxs_fast_one_row_kernel(k, n, bits, group, mode, dtype, served):
    module = quantized_linear(k, n, bits, group, mode, dtype=mx.float16 if dtype == mx.float16 else mx.bfloat16)
    variant = qp.variant_of(module, dtype)
    assert (variant is not None) == served
    if served:
        assert (variant.k, variant.bits, variant.group, variant.mode, variant.wide) == (k, bits, group, mode, False)
    assert qp.variant_of(nn.Linear(k, n), dtype) is None
    if served and mode == "affine":  # (scales of another dtype than the rows': MLX's)
        other = mx.float16 if dtype == mx.bfloat16 else mx.bfloat16
        assert qp.variant_of(module, other) is None


@pytest.mark.parametrize(
    "k, bits, metal_words",
    [(4096, 4, 2), (12288, 4, 2), (2880, 4, 1), (768, 4, 1), (256, 8, 2), (384, 8, 1)],
)
def test_a_lane_takes_the_words_a_step_of_its_backends_one_row_kernel(k, bits, metal_words):
    """Metal's one row takes qmv_fast (two words a lane a step) where K is
    whole blocks of them, else qmv (one); CUDA's qmv always two."""
    assert qp.packs(k, bits, "metal") == metal_words
    assert qp.packs(k, bits, "cuda") == 2


def test_a_weight_past_wide_is_its_own_variant():
    """On sm90 MLX's one-row product leaves its qmv kernel past 16384 outputs
    (or inputs): such weights have a variant, and a check, of their own."""
    narrow = qp.variant_of(quantized_linear(512, 64), mx.bfloat16)
    wide = qp.variant_of(quantized_linear(512, qp.WIDE + 8), mx.bfloat16)
    assert wide.wide and not narrow.wide and wide != narrow
    assert {w.shape[0] for _, w, _, _ in qp.check_cases(wide)} == set(qp.CHECK_WIDE_N)
    # (the most outputs a simdgroup and each fewer, as CHECK_N takes them)
    assert {qp.tile(3, "metal", n)[1] for n in qp.CHECK_WIDE_N} == {qp.tile(3, "metal", n)[1] for n in qp.CHECK_N}


def record_launches(backend_name: str):
    factory, launches = recording_factory()
    return qp.QuantizedProductKernel(backend_name, factory=factory), launches


@pytest.mark.parametrize("backend_name", ["metal", "cuda"])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 16, 17, 27, 32])
def test_each_launch_covers_every_row_and_output_once(backend_name, rows):
    kernel, launches = record_launches(backend_name)
    module = quantized_linear(1024, 96)
    y = kernel(rows_of(rows, 1024), module.weight, module.scales, module.biases, bits=4, group=64, mode="affine")
    assert y.shape == (1, rows, 96) and y.dtype == mx.bfloat16
    (launch,) = launches
    template = dict(launch["template"])
    mr, rs, groups = template["MR"], template["RS"], template["GROUPS"]
    assert (mr, rs, groups) == qp.tile(rows, backend_name, 96)
    assert mr * rs <= (64 if backend_name == "metal" else 16)  # accumulators a lane
    assert launch["threadgroup"] == (32 * groups, 1, 1)
    gx, gy, gz = launch["grid"]
    assert gx % (32 * groups) == 0 and gz == 1
    assert gx // (32 * groups) * groups * rs == 96  # groups simdgroups a threadgroup, rs outputs each
    assert (gy - 1) * mr < rows <= gy * mr
    # the staged rows fit the threadgroup memory, in whole turns of the tile
    sr = template["SR"]
    assert sr * 512 * 2 <= qp.STAGED_BYTES and mr % sr == 0
    assert template["T"] == mx.bfloat16 and template["S"] == mx.bfloat16 and not template["MXFP4"]
    assert template["PACKS"] == 2 and not template["FUSED"]
    assert launch["inputs"][0].shape == (rows, 1024)


def test_mxfp4_launches_with_e8m0_scales_and_no_biases():
    kernel, launches = record_launches("metal")
    module = quantized_linear(512, 64, 4, 32, "mxfp4")
    kernel(rows_of(5, 512), module.weight, module.scales, None, bits=4, group=32, mode="mxfp4")
    template = dict(launches[0]["template"])
    assert template["MXFP4"] and template["S"] == mx.uint8 and template["GROUP"] == 32
    # (a stand-in the kernel never reads, of 8 elements: in device memory on Metal, as real biases are)
    assert launches[0]["inputs"][3].shape == (8,)


@pytest.mark.parametrize("backend_name", ["metal", "cuda"])
def test_a_weight_of_fewer_outputs_takes_fewer_a_simdgroup(backend_name):
    for rows in range(qp.FEWEST_ROWS, qp.MOST_ROWS + 1):
        mr, most, groups = qp.tile(rows, backend_name)
        for n in (8, 16, 24, 64, 72, 4096):
            assert qp.tile(rows, backend_name, n)[::2] == (mr, groups)
            rs = qp.tile(rows, backend_name, n)[1]
            assert n % (groups * rs) == 0 and (rs == most or n % (groups * 2 * rs))


def served_tiles(backend_name: str, ns) -> set:
    """Every tile a weight of each N in ``ns`` takes at 2-32 rows."""
    return {qp.tile(rows, backend_name, n) for rows in range(qp.FEWEST_ROWS, qp.MOST_ROWS + 1) for n in ns}


@pytest.mark.parametrize("backend_name", ["metal", "cuda"])
def test_the_self_check_launches_every_tile_a_layer_can_take(backend_name):
    """Each (rows, outputs, simdgroups) tile a weight's N (a multiple of 8) takes
    at 2-32 rows is one the check's cases launch, past WIDE too."""
    for check_n, ns in ((qp.CHECK_N, range(8, 1025, 8)), (qp.CHECK_WIDE_N, range(qp.WIDE + 8, qp.WIDE + 1025, 8))):
        served = served_tiles(backend_name, ns)
        checked = {qp.tile(rows, backend_name, n) for rows in qp.CHECK_ROWS for n in check_n}
        assert served <= checked, served - checked


def test_the_self_check_runs_every_row_tile():
    for backend_name in ("metal", "cuda"):
        tiles = {qp.tile(rows, backend_name) for rows in range(qp.FEWEST_ROWS, qp.MOST_ROWS + 1)}
        assert {qp.tile(rows, backend_name) for rows in qp.CHECK_ROWS} == tiles
        # and a partial tile of each (rows past the last are skipped whole)
        assert all(rows % qp.tile(rows, backend_name)[0] for rows in qp.CHECK_ROWS if rows != 8)


def layer_modules():
    return {
        "affine 4-bit": quantized_linear(512, 64),
        "affine 8-bit": quantized_linear(256, 64, 8, 128),
        "mxfp4": quantized_linear(512, 64, 4, 32, "mxfp4"),
    }


@pytest.mark.parametrize("name", ["affine 4-bit", "affine 8-bit", "mxfp4"])
def test_a_kernel_that_checks_out_takes_2_to_32_rows_and_only_those(fake_gpu, name):
    module = layer_modules()[name]
    kernel = fake_gpu(FakeKernel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_quantized(module, mx.bfloat16)
    (result,) = qp._checks.values()
    # the variant's cases, then the layer's own weight at each row class's rows
    assert result.ok and sorted(set(kernel.rows)) == sorted({*qp.CHECK_ROWS, *serving.ROW_CLASSES})
    k = module.weight.shape[1] * 32 // module.bits
    for rows in (1, 2, 9, 16, 32, 33):
        kernel.rows.clear()
        x = rows_of(rows, k)
        got = linear.apply_linear(module, x)
        assert kernel.rows == ([rows] if 2 <= rows <= 32 else [])
        # each row what MLX's product computes for it alone
        for i in range(rows):
            assert mx.array_equal(got[:, i], module(x[:, i : i + 1])[:, 0]), (rows, i)
    # another dtype was never checked: MLX's product
    kernel.rows.clear()
    linear.apply_linear(module, rows_of(5, k, mx.float16))
    assert kernel.rows == []


def test_a_layers_bias_and_a_residual_follow_the_kernels_product(fake_gpu):
    module = quantized_linear(512, 64, bias=True)
    fake_gpu(FakeKernel())
    linear.prepare_quantized(module, mx.bfloat16)
    x, h = rows_of(5, 512), rows_of(5, 64)
    assert mx.array_equal(linear.apply_linear(module, x, residual=h), h + module(x))


def test_a_kernel_one_rounding_off_fails_its_check_warns_once_and_is_never_used(fake_gpu):
    """Exactness is the check: one output one step off fails the variant."""
    module = quantized_linear(512, 64)
    kernel = fake_gpu(FakeKernel(nudge=1.0))
    with pytest.warns(
        RuntimeWarning, match=r"fake bfloat16 affine 4-bit group 64 K=512 quantized verify product failed"
    ):
        linear.prepare_quantized(module, mx.bfloat16)
    (result,) = qp._checks.values()
    assert not result.ok and "1 of" in result.detail and "outputs differ" in result.detail
    calls = len(kernel.rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_quantized(module, mx.bfloat16)  # (checked once: no second warning)
        x = rows_of(5, 512)
        assert mx.array_equal(linear.apply_linear(module, x), module(x))
    assert len(kernel.rows) == calls


def test_a_kernel_that_does_not_build_is_named_and_not_used(fake_gpu, monkeypatch):
    def broken(where):
        raise RuntimeError("metal: error: use of undeclared identifier 'qv_load'")

    monkeypatch.setitem(qp.BUILDERS, "fake", broken)
    module = quantized_linear(512, 64)
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: metal: error: use of undeclared identifier 'qv_load'"):
        linear.prepare_quantized(module, mx.bfloat16)
    assert not qp.use_quantized_kernel("fake", qp.variant_of(module, mx.bfloat16), 64, 16)
    x = rows_of(5, 512)
    assert mx.array_equal(linear.apply_linear(module, x), module(x))


def quantized_pair(bits: int, group: int, mode: str, seed: int):
    """A tiny bf16 qwen3 target of width 512 (every product's K whole blocks),
    quantized, and a bf16 drafter."""
    tcfg = target_config("qwen3", vocab=32, layers=2, hidden=512)
    model = make_target(tcfg, seed=seed)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=group, bits=bits, mode=mode, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 1])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1))
    draft.set_dtype(mx.bfloat16)
    return model, draft


@pytest.mark.parametrize("quant", [(4, 64, "affine"), (4, 32, "mxfp4")])
def test_decoding_a_quantized_target_through_the_kernel_is_its_greedy_output(fake_gpu, quant):
    """The verify's quantized products (fused q/k/v, o, fused gate/up, down,
    the output head) go through the kernel; each row as the plain step
    computes it, so the output is the target's own, token for token."""
    from dflash_mlx import stream_generate

    kernel = fake_gpu(FakeKernel())
    model, draft = quantized_pair(*quant, seed=61)
    prompt = [1, 2, 3, 4, 5]
    want = greedy_reference(model, prompt, 12)
    kernel.rows.clear()
    got = [
        t
        for r in stream_generate(model, draft, make_tokenizer(32), prompt, max_tokens=12, block_size=6)
        for t in r.tokens
    ]
    assert got == want
    # the adapter checked every quantized layer's variant itself, outside the cycle's graphs
    assert qp._checks and all(r.ok for r in qp._checks.values())
    assert kernel.rows and all(2 <= r <= 32 for r in kernel.rows)


@pytest.mark.parametrize("prompt_tokens", [5, 33, 70])
def test_a_prompts_chunks_never_take_the_verify_product(fake_gpu, prompt_tokens):
    """A prompt's chunk of 2-32 rows is not a verify: its products are MLX's
    own and unfused, as mlx-lm's prefill computes them (the verify product's
    one-row order would give the cache other bits than mlx-lm's on a GPU)."""
    from dflash_mlx import make_prompt_cache
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.targets import adapt

    kernel = fake_gpu(FakeKernel())
    model, draft = quantized_pair(4, 64, "affine", seed=67)
    target = adapt(model)
    kernel.rows.clear()
    prompt = [1 + i % 30 for i in range(prompt_tokens)]
    prefill(target, draft, make_prompt_cache(model, draft), prompt, 32, None)
    assert kernel.rows == []


def test_every_variant_is_recorded_for_the_check_scripts():
    recorded = {}

    def factory(*, name, **made):
        def launch(*, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
            recorded.setdefault(tuple(v for _, v in template), (grid, threadgroup))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    qp.record_variants(factory, "metal")
    quants = {values[:5] for values in recorded}
    assert len(quants) == 2 * (len(qp.AFFINE_BITS) * len(qp.GROUPS) + 1)
    assert (mx.bfloat16, mx.uint8, 4, 32, True) in quants
    assert {values[5] for values in recorded} == {1, 2}  # words a lane a step
    assert {values[6] for values in recorded} == {False}  # (FUSED: CUDA's alone)
    tiles = {values[7:10] for values in recorded}
    # every tile a weight's N (a multiple of 8) takes at any rows
    assert served_tiles("metal", range(8, 513, 8)) <= tiles


def test_on_cuda_the_check_tries_each_dequantization_and_keeps_the_one_that_matches(fake_gpu, monkeypatch):
    """CUDA's affine dequantization may be one rounding or two in MLX's binary
    (ptxas may fuse an unrounded multiply and add): the check tries both, in
    order, and the products use the one that matched; mxfp4 has no bias to add."""
    calls = []

    class OneWay(FakeKernel):
        def __call__(self, x, weight, scales, biases, *, bits, group, mode, fused=False):
            calls.append(fused)
            self.nudge = 0.0 if fused else 1.0  # only the fused dequantization matches
            return super().__call__(x, weight, scales, biases, bits=bits, group=group, mode=mode)

    fake_gpu(OneWay())
    monkeypatch.setitem(qp.DEQUANTIZATIONS, "fake", (False, True))
    module = quantized_linear(512, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_quantized(module, mx.bfloat16)
    (result,) = qp._checks.values()
    assert result.ok and result.fused
    assert calls[0] is False and calls[-1] is True
    calls.clear()
    x = rows_of(5, 512)
    assert mx.array_equal(linear.apply_linear(module, x), module(x)) and calls == [True]


# --- The Metal source itself, run on this CPU --------------------------------------------------------------
#
# The variant's source, run on this CPU (tests/metal_on_cpu.py), must give rows equal,
# bit for bit, to a plain transcription of MLX's Metal qmv_fast / qmv (the order it
# claims) with the same lane order.


def metal_one_row_order(x, w, scales, biases, bits: int, group: int, mode: str, words: int):
    """MLX's Metal qmv_fast (``words`` 2) / qmv (1) and their fp twins, transcribed
    plainly for float16 rows: each lane's load_vector, qdot and ``result +=`` in
    float32 (half sums of four x), the lanes added in order, one rounding."""
    import numpy as np

    f32, f16 = np.float32, np.float16
    rows, k = x.shape
    n = w.shape[0]
    vpt = words * (4 if bits == 8 else 8)
    nibble_bytes = w.view(np.uint8).reshape(n, -1)
    out = np.zeros((rows, n), f16)

    def fp4(b: int) -> float:
        e, m = (b >> 1) & 3, b & 1
        mag = 0.5 * m if e == 0 else (2 + m) * 2.0**e * 0.25
        return -mag if b & 8 else mag

    for r in range(rows):
        for o in range(n):
            total = f32(0)
            for lane in range(32):
                result = f32(0)
                for k0 in range(lane * vpt, k, 32 * vpt):
                    xv, g, byte = x[r, k0 : k0 + vpt], k0 // group, nibble_bytes[o]
                    accum = f32(0)
                    if mode == "mxfp4":
                        e = int(scales[o, g])
                        s = np.array([e << 23 if e else 0x400000], np.uint32).view(f32)[0]
                        q = [f32(fp4((int(byte[(k0 + i) // 2]) >> (4 * ((k0 + i) % 2))) & 15)) for i in range(vpt)]
                        for i in range(0, vpt, 4):
                            t = f32(f32(xv[i]) * q[i])
                            for j in range(1, 4):
                                t = f32(t + f32(f32(xv[i + j]) * q[i + j]))
                            accum = f32(accum + t)
                        result = f32(result + f32(s * accum))
                        continue
                    s, b, xsum = f32(scales[o, g]), f32(biases[o, g]), f32(0)
                    if bits == 4:
                        xt = [f32(xv[i]) / f32(16 ** (i % 4)) for i in range(vpt)]
                        for i in range(0, vpt, 4):
                            xsum = f32(xsum + f32(f16(f16(f16(xv[i] + xv[i + 1]) + xv[i + 2]) + xv[i + 3])))
                            pair = int(byte[(k0 + i) // 2]) | int(byte[(k0 + i) // 2 + 1]) << 8
                            t = f32(xt[i] * f32(pair & 0x000F))
                            for j, mask in ((1, 0x00F0), (2, 0x0F00), (3, 0xF000)):
                                t = f32(t + f32(xt[i + j] * f32(pair & mask)))
                            accum = f32(accum + t)
                    else:
                        for i in range(vpt):
                            xsum = f32(xsum + f32(xv[i]))
                            accum = f32(accum + f32(f32(xv[i]) * f32(byte[k0 + i])))
                    result = f32(result + f32(f32(s * accum) + f32(xsum * b)))
                total = f32(total + result)
            out[r, o] = f16(total)
    return out


def metal_operands(xs, module):
    """x, the packed weight, scales and biases (zeros where the mode has none) as numpy arrays."""
    import numpy as np

    biases = module.get("biases")
    bi = np.array(biases) if biases is not None else np.zeros(8, np.float16)
    return xs, np.array(module.weight), np.array(module.scales), bi


def run_metal_source(tmp_path, rows, n, k, bits, group, mode, barrier=None):
    """float16 rows of a random quantized layer, the layer, and the kernel's product
    of them run on this CPU from its Metal source (``barrier``: (i, text), the
    source's i-th threadgroup barrier replaced by ``text``)."""
    import ctypes

    import numpy as np

    from dflash_mlx.kernels.quantized_source import INPUTS, OUTPUTS

    script = check_metal_script()
    recorder = script.Recorder()
    kernel = qp.QuantizedProductKernel("metal", factory=recorder.factory)
    module = quantized_linear(k, n, bits, group, mode, dtype=mx.float16)
    x = rows_of(rows, k, mx.float16)[0]
    kernel(x, module.weight, module.scales, module.get("biases"), bits=bits, group=group, mode=mode)
    ((name, variant),) = recorder.variants.items()
    ((grid, group_size),) = variant.launches
    source = variant.source
    if barrier is not None:
        i, text = barrier
        pieces = source.split("TG_BARRIER();")
        assert len(pieces) > i + 1
        source = "TG_BARRIER();".join(pieces[: i + 1]) + text + "TG_BARRIER();".join(pieces[i + 1 :])
    lib = build_on_cpu(script, source, INPUTS + ["x_shape", "w_shape"] + OUTPUTS, tmp_path)
    xs = np.array(x)
    y = np.zeros((rows, n), np.float16)
    shapes = np.array(xs.shape, np.int32), np.array(module.weight.shape, np.int32)
    arrays = (*metal_operands(xs, module), *shapes, y)  # held while the kernel reads them
    buffers = (ctypes.c_void_p * 7)(*[a.ctypes.data for a in arrays])
    run_grid(lib, buffers, grid[0] // group_size[0], grid[1], group_size[0] // 32)
    return xs, module, y


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "rows, n, k, bits, group, mode",
    [
        (3, 16, 512, 4, 64, "affine"),
        (4, 8, 512, 4, 64, "affine"),
        (13, 8, 768, 4, 32, "affine"),
        (27, 8, 384, 8, 32, "affine"),
        (27, 8, 512, 4, 128, "affine"),
        (5, 8, 2880, 4, 32, "mxfp4"),
    ],
)
def test_the_metal_source_run_on_the_cpu_reduces_each_row_in_mlxs_one_row_order(
    tmp_path, rows, n, k, bits, group, mode
):
    """Every row tile, both of Metal's one-row orders (qmv_fast's two words a lane a
    step at K = 512, qmv's one at 768, 384 and gpt-oss's 2880), affine 4
    and 8 bits and mxfp4, x rows staged in one turn and (27 rows of 4 bits) in two:
    the kernel's rows are the transcription's, bit for bit."""
    import numpy as np

    xs, module, y = run_metal_source(tmp_path, rows, n, k, bits, group, mode)
    want = metal_one_row_order(*metal_operands(xs, module), bits, group, mode, qp.packs(k, bits, "metal"))
    assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (y != want).sum()
    # and what MLX's CPU product computes, to the rounding of a float16 sum of products
    mlx = np.array(module(mx.array(xs)).astype(mx.float32))
    assert np.abs(y.astype(np.float32) - mlx).max() <= 2e-2 * np.abs(mlx).max()


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize("barrier", [0, 1], ids=["before staging", "after staging"])
def test_a_missing_barrier_fails_the_comparison(tmp_path, barrier):
    """The CPU run shows a kernel that stages x without its barriers (a turn's rows
    read before the others wrote them, or overwritten before they were read)."""
    import numpy as np

    xs, module, y = run_metal_source(tmp_path, 27, 8, 512, 4, 128, "affine", barrier=(barrier, ";"))
    want = metal_one_row_order(*metal_operands(xs, module), 4, 128, "affine", qp.packs(512, 4, "metal"))
    assert not np.array_equal(y.view(np.uint16), want.view(np.uint16))


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
def test_a_barrier_only_some_threads_reach_fails_as_a_deadlock(tmp_path):
    with pytest.raises(AssertionError, match="deadlock: .* threads of a threadgroup wait"):
        run_metal_source(tmp_path, 4, 8, 512, 4, 64, "affine", barrier=(0, "if (tid == 0) TG_BARRIER();"))


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_a_tied_quantized_heads_product_is_its_embeddings_and_takes_the_kernel(fake_gpu, mode):
    """``quantized_head`` holds a quantized embedding's arrays as a linear layer:
    its product is ``as_linear``'s, on the CPU and through a checked kernel."""
    embed = nn.Embedding(64, 512)
    embed.set_dtype(mx.bfloat16)
    embed = nn.QuantizedEmbedding.from_embedding(embed, group_size=32 if mode == "mxfp4" else 64, bits=4, mode=mode)
    h = rows_of(6, 512)
    head = linear.quantized_head(embed)
    assert head.weight is embed.weight or mx.array_equal(head.weight, embed.weight)
    assert mx.array_equal(linear.apply_linear(head, h), embed.as_linear(h))
    kernel = fake_gpu(FakeKernel())
    linear.prepare_quantized(embed, mx.bfloat16)  # (a model holding it: its tied head is checked)
    assert [r.ok for r in qp._checks.values()] == [True]
    kernel.rows.clear()
    assert mx.array_equal(linear.apply_linear(linear.quantized_head(embed), h), embed.as_linear(h))
    assert kernel.rows == [6]


@pytest.mark.parametrize("kernel_ms, serves", [(2.0, False), (0.5, True)])
def test_a_checked_variant_serves_only_where_this_machine_measured_it_faster(fake_gpu, measured, kernel_ms, serves):
    """Exact but slower (as CUDA's qmv order is at a verify's rows) keeps MLX's
    product; each layer's shape is measured once, against MLX's 16 and 32 rows."""
    from dflash_mlx.kernels import decisions

    timed = measured(kernel_ms, 1.0)
    kernel = fake_gpu(FakeKernel())
    module = quantized_linear(512, 64)
    linear.prepare_quantized(module, mx.bfloat16)
    linear.prepare_quantized(module, mx.bfloat16)  # measured once
    assert len(timed) == 2
    made = decisions.current().all()
    assert [d.case for d in made] == [f"bfloat16 affine 4-bit group 64 K=512 N=64 rows={r}" for r in (16, 32)]
    assert all(d.faster == serves for d in made)
    kernel.rows.clear()
    x = rows_of(5, 512)
    assert mx.array_equal(linear.apply_linear(module, x), module(x)) or serves
    assert bool(kernel.rows) == serves


class WideOff(FakeKernel):
    """Exact on the check's small weights, one rounding off past their outputs:
    a one-row kernel whose order changes with N."""

    def __call__(self, x, weight, scales, biases, **kw):
        y = super().__call__(x, weight, scales, biases, **kw)
        return y.at[..., 0].add(mx.array(1e-2, y.dtype)) if weight.shape[0] > max(qp.CHECK_N) else y


def test_a_variant_that_checks_out_but_rounds_otherwise_at_a_layers_own_n_is_not_used(fake_gpu):
    kernel = fake_gpu(WideOff())
    small, wide = quantized_linear(512, 64), quantized_linear(512, 128)
    linear.prepare_quantized(small, mx.bfloat16)
    linear.prepare_quantized(wide, mx.bfloat16)
    variant = qp.variant_of(wide, mx.bfloat16)
    assert qp._checks[("fake", variant)].ok
    assert qp.use_quantized_kernel("fake", variant, 64, 16) and not qp.use_quantized_kernel("fake", variant, 128, 16)
    kernel.rows.clear()
    x = rows_of(5, 512)
    assert mx.array_equal(linear.apply_linear(wide, x), wide(x)) and kernel.rows == []
