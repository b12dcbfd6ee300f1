"""The exact verify product for dense layers (kernels/exact_products.py): the
one-row order it takes on each backend, its launch shapes, its self-check (bit
for bit against MLX's one-row product), and the routing in layers/linear.py.
On the CPU every product is MLX's; on a pretend GPU a kernel that checks out
takes a verify's 2-32-row products of ``nn.Linear`` layers (the norm, SwiGLU
and residual around them staying MLX's ops), one that does not never does,
and decoding through it stays the target's own greedy output. Then the Metal
source itself, compiled for this CPU and run, against a transcription of MLX's
Metal gemv order."""

import warnings
from dataclasses import astuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
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

from dflash_mlx.kernels import exact_products as ep
from dflash_mlx.kernels import serving
from dflash_mlx.layers import linear


def dense(k: int, n: int, bias: bool = False, dtype=mx.bfloat16) -> nn.Linear:
    mx.random.seed(k + n)
    module = nn.Linear(k, n, bias=bias)
    module.set_dtype(dtype)
    return module


def rows_of(rows: int, k: int, dtype=mx.bfloat16):
    return mx.random.normal((1, rows, k), key=mx.random.key(rows)).astype(dtype)


class FakeKernel:
    """A kernel as the module's callers see it, computing each row as MLX's
    one-row product does (what the real kernel must), counting its calls."""

    def __init__(self, nudge: float = 0.0):
        self.nudge = nudge  # added to one output: a kernel one rounding off
        self.rows = []
        self.forms = []

    def __call__(self, x, weight, bias, *, form=0):
        *lead, k = x.shape
        self.rows.append(x.size // k)
        self.forms.append(form)
        y = ep.one_row_products(x.reshape(-1, k), weight, bias)
        if self.nudge:
            y = y.at[-1, 0].add(mx.array(self.nudge, y.dtype))
        return y.reshape(*lead, -1)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The exact product as if MLX ran on a GPU backend named 'fake' with a
    kernel of our choosing (its one-row order: CUDA's rules)."""
    ep.reset()
    monkeypatch.setattr(ep, "backend", lambda: "fake")

    def install(kernel):
        monkeypatch.setitem(ep.BUILDERS, "fake", lambda where: kernel)
        return kernel

    yield install
    ep.reset()


@pytest.mark.parametrize("rows", [1, 2, 16, 32, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_on_the_cpu_a_linear_layer_is_its_own_module(rows, bias):
    module = dense(256, 64, bias)
    x = rows_of(rows, 256)
    assert ep.product(module, x) is None and not ep.takes(module, x)
    assert mx.array_equal(linear.apply_linear(module, x), module(x))
    h = rows_of(rows, 64)
    assert mx.array_equal(linear.apply_linear(module, x, residual=h), h + module(x))


@pytest.mark.parametrize(
    "k, n, order",
    [
        (4096, 1024, ep.Order(32, 4, 1, True)),  # Qwen3-8B's k/v: gemv_axbpy's BN 1, SN 32
        (4096, 256, ep.Order(32, 4, 8, True)),  # K >= 16 N: BN 8
        (12288, 4096, ep.Order(32, 4, 1, True)),  # down_proj
        (12288, 768, ep.Order(32, 4, 8, True)),
        (64, 4096, ep.Order(4, 4, 1, True)),  # K <= 64: SN 4, whatever N
    ],
)
def test_metal_takes_the_order_gemv_axbpy_picks(k, n, order):
    assert ep.one_row_order("metal", k, n) == order
    assert order in ep.orders_at("metal", k)


@pytest.mark.parametrize("k, vpt", [(4096, 4), (12288, 4), (2880, 2), (576, 2), (520, 1), (100, 1)])
def test_cuda_takes_gemvs_values_a_lane(k, vpt):
    """CUDA's gemv: 4 values a lane where K % 128 == 0, 2 where K % 64 == 0, else 1; any N."""
    assert {ep.one_row_order("cuda", k, n) for n in (8, 4096, 151936)} == {ep.Order(32, vpt, 1, False)}
    assert ep.orders_at("cuda", k) == [ep.Order(32, vpt, 1, False)]


@pytest.mark.parametrize(
    "module, dtype, served",
    [
        (dense(256, 64), mx.bfloat16, True),
        (dense(256, 64, dtype=mx.float16), mx.float16, True),
        (dense(256, 64, dtype=mx.float32), mx.float32, True),
        (dense(256, 64, bias=True), mx.bfloat16, True),
        (dense(256, 64), mx.float16, False),  # (rows of another dtype than the weight: MLX's)
        (nn.QuantizedLinear(256, 64, group_size=64), mx.bfloat16, False),  # (the quantized product's)
    ],
)
def test_the_variants_served(module, dtype, served):
    variant = ep.variant_of(module, dtype, "metal")
    assert (variant is not None) == served
    if served:
        assert variant.k == 256 and variant.bias == ("bias" in module) and variant.dtype == dtype


def record_launches(backend_name: str):
    factory, launches = recording_factory()
    return ep.ExactProductKernel(backend_name, factory=factory), launches


@pytest.mark.parametrize(
    "backend_name, k, n", [("metal", 512, 100), ("metal", 512, 24), ("metal", 64, 100), ("cuda", 512, 100)]
)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 16, 17, 27, 32])
def test_each_launch_covers_every_row_and_output(backend_name, k, n, rows):
    kernel, launches = record_launches(backend_name)
    y = kernel(rows_of(rows, k), mx.zeros((n, k), mx.bfloat16), None)
    assert y.shape == (1, rows, n) and y.dtype == mx.bfloat16
    (launch,) = launches
    t = dict(launch["template"])
    order = ep.one_row_order(backend_name, k, n)
    assert (t["LANES"], t["VPT"], t["SPLIT"], t["EVERY_LANE"]) == (
        order.lanes,
        order.vpt,
        order.split,
        order.every_lane,
    )
    mr, rs = ep.tile(rows)
    assert t["RS"] == rs and t["MR"] * t["RS"] <= 64  # accumulators a lane
    staged = t["MR"] * t["AHEAD"] * order.split * order.lanes * order.vpt * 4  # bytes of x a chunk
    assert staged <= ep.STAGED_BYTES[backend_name] <= 16384 + 16384 * (backend_name == "cuda")
    at = ep.Launch(t["MR"], t["RS"], t["AHEAD"], t["GROUPS"])
    assert staged <= ep.shared_bytes(order, at) <= 32768  # (with the split order's partial sums)
    assert t["MR"] == mr or staged * 2 > ep.STAGED_BYTES[backend_name]  # (cut only to fit)
    threads = t["GROUPS"] * order.split * 32
    assert launch["threadgroup"] == (threads, 1, 1) and threads <= 1024
    gx, gy, gz = launch["grid"]
    assert gx % threads == 0 and gz == 1
    per_threadgroup = t["GROUPS"] * (32 // order.lanes) * t["RS"]
    assert (gx // threads - 1) * per_threadgroup < n <= gx // threads * per_threadgroup
    assert (gy - 1) * t["MR"] < rows <= gy * t["MR"]
    assert not t["HAS_BIAS"] and launch["inputs"][2].shape == (8,)  # (a stand-in in device memory)


def test_a_launch_shape_that_does_not_fit_a_threadgroup_is_refused():
    split = ep.Order(32, 4, 8, True)
    assert ep.launch_for("metal", split, 16, (8, 2, 8)).groups == 4  # (cut to 1,024 threads)
    for override in ((64, 1, 4), (2, 2, 0)):  # the partial sums past 32 KiB; no simdgroups
        with pytest.raises(ValueError, match="fits a threadgroup"):
            ep.launch_for("metal", split, 16, override)


def test_the_self_check_runs_every_row_tile_and_each_order_at_its_k():
    assert {ep.tile(r) for r in ep.CHECK_ROWS} == {ep.tile(r) for r in range(ep.FEWEST_ROWS, ep.MOST_ROWS + 1)}
    for k in (64, 512, 4096, 12288):
        for order in ep.orders_at("metal", k):
            variant = ep.Variant(mx.bfloat16, k, order, False)
            sizes = ep.check_sizes("metal", variant)
            assert all(ep.one_row_order("metal", k, n) == order for n in sizes), (k, sizes)
            for most, _, _ in ep.TILES:  # (the last threadgroup partial)
                at = ep.launch_for("metal", order, most)
                assert any(n % (at.groups * (32 // order.lanes) * at.outputs) for n in sizes), (k, sizes, at)


def layers():
    return {"no bias": dense(256, 64), "bias": dense(256, 64, bias=True), "float32": dense(256, 64, dtype=mx.float32)}


@pytest.mark.parametrize("name", ["no bias", "bias", "float32"])
def test_a_kernel_that_checks_out_takes_2_to_32_rows_and_only_those(fake_gpu, name):
    module = layers()[name]
    dtype = module.weight.dtype
    kernel = fake_gpu(FakeKernel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_exact(module, dtype)
    (result,) = ep._checks.values()
    # the variant's cases, then the layer's own weight at each row class's rows
    assert result.ok and sorted(set(kernel.rows)) == sorted({*ep.CHECK_ROWS, *serving.ROW_CLASSES})
    for rows in (1, 2, 9, 16, 32, 33):
        kernel.rows.clear()
        x = rows_of(rows, 256, dtype)
        got = linear.apply_linear(module, x)
        assert kernel.rows == ([rows] if 2 <= rows <= 32 else [])
        for i in range(rows):  # each row what MLX's product computes for it alone
            assert mx.array_equal(got[:, i], module(x[:, i : i + 1])[:, 0]), (rows, i)
    kernel.rows.clear()
    other = mx.float16 if dtype != mx.float16 else mx.bfloat16
    linear.apply_linear(module, rows_of(5, 256, other))  # (never checked for those rows: MLX's)
    assert kernel.rows == []


def test_the_norm_swiglu_and_residual_around_it_stay_mlxs_ops(fake_gpu):
    """The plain step runs them as MLX's ops, so the verify does too: the
    CUDA block-product kernel's fused prologue and epilogues do not round as
    MLX's rms_norm and swiglu do, and never take a product the exact one takes."""
    from mlx_lm.models.activations import swiglu

    module, gate_up, heads_out = dense(256, 64), dense(256, 128), dense(256, 64)
    norm = nn.RMSNorm(256)
    norm.weight = (1 + 0.1 * mx.random.normal((256,), key=mx.random.key(5))).astype(mx.bfloat16)
    kernel = fake_gpu(FakeKernel())
    for layer in (module, gate_up, heads_out):
        linear.prepare_exact(layer, mx.bfloat16)
    x, h = rows_of(6, 256), rows_of(6, 64)
    kernel.rows.clear()
    got = linear.apply_linear(module, x, residual=h, norm=norm)
    assert kernel.rows == [6] and mx.array_equal(got, h + module(norm(x)))
    assert not linear.takes_norm(module, x, norm)
    kernel.rows.clear()
    gate, up = mx.split(gate_up(norm(x)), 2, axis=-1)
    assert mx.array_equal(linear.apply_linear_swiglu(gate_up, x, norm), swiglu(gate, up)) and kernel.rows == [6]
    heads = mx.random.normal((1, 4, 6, 64), key=mx.random.key(6)).astype(mx.bfloat16)
    kernel.rows.clear()
    want = h + heads_out(heads.transpose(0, 2, 1, 3).reshape(1, 6, -1))
    assert mx.array_equal(linear.apply_linear_output(heads_out, heads, False, residual=h), want)
    assert kernel.rows == [6]


def test_on_metal_each_order_a_layers_k_can_take_is_checked(monkeypatch):
    """Metal's one-row order at a K depends on N (K >= 16 N: 8 simdgroups a
    K): a layer's check covers both, so a fused projection of the same K but
    another N, made after the check, is served too."""
    ep.reset()
    monkeypatch.setattr(ep, "backend", lambda: "metal")
    kernel = FakeKernel()
    monkeypatch.setitem(ep.BUILDERS, "metal", lambda where: kernel)
    small, fused = dense(512, 16), dense(512, 96)  # (512 >= 16 x 16: split; 512 < 16 x 96: not)
    linear.prepare_exact(small, mx.bfloat16)
    assert {v.order.split for _, v in ep._checks} == {1, 8} and all(r.ok for r in ep._checks.values())
    linear.prepare_exact(fused, mx.bfloat16)  # (its own shape's rows, as layers/fused.py does)
    assert {n for v in ep._checks.values() for n in ep.check_sizes("metal", v.variant)} >= {32, 27, 68, 73}
    for module in (small, fused):
        kernel.rows.clear()
        x = rows_of(7, 512)
        assert mx.array_equal(linear.apply_linear(module, x), ep.one_row_products(x[0], module.weight, None)[None])
        assert kernel.rows == [7]
    ep.reset()


def test_a_kernel_one_rounding_off_fails_its_check_warns_once_and_is_never_used(fake_gpu):
    """Exactness is the check: one output one step off fails the variant."""
    module = dense(256, 64)
    kernel = fake_gpu(FakeKernel(nudge=1.0))
    with pytest.warns(RuntimeWarning, match=r"fake bfloat16 K=256 lanes 32 x 4 exact verify product failed"):
        linear.prepare_exact(module, mx.bfloat16)
    (result,) = ep._checks.values()
    assert not result.ok and "1 of" in result.detail and "outputs differ" in result.detail
    calls = len(kernel.rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_exact(module, mx.bfloat16)  # (checked once: no second warning)
        x = rows_of(5, 256)
        assert mx.array_equal(linear.apply_linear(module, x), module(x))
        assert not ep.takes(module, x)
    assert len(kernel.rows) == calls


def test_a_kernel_that_does_not_build_is_named_and_not_used(fake_gpu, monkeypatch):
    def broken(where):
        raise RuntimeError("metal: error: use of undeclared identifier 'ep_madd'")

    monkeypatch.setitem(ep.BUILDERS, "fake", broken)
    module = dense(256, 64)
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: metal: error: use of undeclared identifier 'ep_madd'"):
        linear.prepare_exact(module, mx.bfloat16)
    x = rows_of(5, 256)
    assert not ep.takes(module, x) and mx.array_equal(linear.apply_linear(module, x), module(x))


def test_the_check_tries_each_multiply_add_and_keeps_the_one_that_matches(fake_gpu, monkeypatch):
    """Whether MLX's binary contracted its multiply-add is the compiler's: the
    check tries the backend's forms in order, and products use the one that matched."""

    class OneWay(FakeKernel):
        def __call__(self, x, weight, bias, *, form=0):
            self.nudge = 0.0 if form == 2 else 1.0  # only the last form matches
            return super().__call__(x, weight, bias, form=form)

    kernel = fake_gpu(OneWay())
    monkeypatch.setitem(ep.FORMS, "fake", (0, 1, 2))
    module = dense(256, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_exact(module, mx.bfloat16)
    (result,) = ep._checks.values()
    assert result.ok and result.form == 2 and kernel.forms[0] == 0 and 1 in kernel.forms
    kernel.forms.clear()
    x = rows_of(5, 256)
    assert mx.array_equal(linear.apply_linear(module, x), module(x)) and kernel.forms == [2]


@pytest.mark.parametrize("exact_passes", [True, False])
def test_the_block_product_kernel_takes_only_what_the_exact_one_leaves(fake_gpu, monkeypatch, exact_passes):
    """On CUDA both kernels may check out: a product the exact one takes never
    reaches the block-product kernel (nor its fused norm or SwiGLU); one whose
    exact variant failed (no order matches there) still does."""
    from test_block_products import FakeKernel as BlockKernel

    from dflash_mlx.kernels.cuda import products as bp

    bp.reset()
    monkeypatch.setattr(bp, "backend", lambda: "fake")
    monkeypatch.setattr(linear, "backend", lambda: "fake")
    block = BlockKernel()
    monkeypatch.setitem(bp.BUILDERS, "fake", lambda where: block)
    exact = fake_gpu(FakeKernel(nudge=0.0 if exact_passes else 1.0))
    module, gate_up = dense(256, 64), dense(256, 128)
    norm = nn.RMSNorm(256)
    norm.set_dtype(mx.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linear.prepare(mx.bfloat16)
        linear.prepare_exact(module, mx.bfloat16)
        linear.prepare_exact(gate_up, mx.bfloat16)
    x, h = rows_of(6, 256), rows_of(6, 64)
    block.calls = block.norms = block.swiglus = 0
    exact.rows = []
    linear.apply_linear(module, x, residual=h, norm=norm)
    linear.apply_linear_swiglu(gate_up, x, norm)
    assert linear.takes_norm(module, x, norm) == (not exact_passes)
    if exact_passes:
        assert exact.rows == [6, 6] and block.calls == 0
    else:
        assert exact.rows == [] and block.calls == 2 and block.norms == 2 and block.swiglus == 1
    bp.reset()


def test_a_tied_embeddings_head_is_checked_as_a_linear_layer(fake_gpu):
    embed = nn.Embedding(64, 256)
    embed.set_dtype(mx.bfloat16)
    head = linear.linear_head(embed)
    h = rows_of(6, 256)
    assert mx.array_equal(linear.apply_linear(head, h), embed.as_linear(h))
    kernel = fake_gpu(FakeKernel())
    linear.prepare_exact(embed, mx.bfloat16)  # (a model holding it: its tied head is checked)
    assert [r.ok for r in ep._checks.values()] == [True]
    kernel.rows.clear()
    assert mx.array_equal(linear.apply_linear(linear.linear_head(embed), h), embed.as_linear(h))
    assert kernel.rows == [6]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_decoding_through_the_kernel_is_the_targets_greedy_output(fake_gpu, dtype):
    """The verify's dense products (fused q/k/v, o, fused gate/up, down, the
    output head) go through the kernel; each row as the plain step computes
    it, so the output is the target's own, token for token."""
    from dflash_mlx import stream_generate

    kernel = fake_gpu(FakeKernel())
    tcfg = target_config("qwen3", vocab=32, layers=2, hidden=256)
    model = make_target(tcfg, seed=71)
    model.set_dtype(dtype)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 1])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=72))
    draft.set_dtype(dtype)
    prompt = [1, 2, 3, 4, 5]
    want = greedy_reference(model, prompt, 12)
    linear.prepare_exact(model, dtype)
    assert ep._checks and all(r.ok for r in ep._checks.values())
    kernel.rows.clear()
    tokens = make_tokenizer(32)
    got = [t for r in stream_generate(model, draft, tokens, prompt, max_tokens=12, block_size=6) for t in r.tokens]
    assert got == want
    assert kernel.rows and all(2 <= r <= 32 for r in kernel.rows)


def test_a_short_prompts_prefill_never_takes_the_verify_product(fake_gpu, monkeypatch):
    """A prompt of a few tokens is read as mlx-lm's prefill reads it, through
    MLX's own products, not a verify's, whose one-row order would give the
    target's cache other bits on a GPU (the drafter's context may take it)."""
    from dflash_mlx import make_prompt_cache
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.targets import adapt

    kernel = fake_gpu(FakeKernel())
    tcfg = target_config("qwen3", vocab=32, layers=2, hidden=256)
    model = make_target(tcfg, seed=73)
    model.set_dtype(mx.bfloat16)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 1])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=74))
    draft.set_dtype(mx.bfloat16)
    target = adapt(model)
    drafters = []
    extend = draft.extend

    def drafter_apart(*args, **kw):
        before = len(kernel.rows)
        extend(*args, **kw)
        drafters.extend(kernel.rows[before:])
        del kernel.rows[before:]

    monkeypatch.setattr(draft, "extend", drafter_apart)
    kernel.rows.clear()
    prefill(target, draft, make_prompt_cache(model, draft), [1, 2, 3, 4, 5, 6, 7], 2048, None)
    assert kernel.rows == [] and drafters  # (the drafter's context took it: the kernel served here)


def test_every_variant_is_recorded_for_the_check_scripts():
    for backend_name in ("metal", "cuda"):
        recorded = set()

        def factory(**made):
            def launch(*, template, output_shapes, output_dtypes, **kw):
                recorded.add(tuple(v for _, v in template))
                return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

            return launch

        ep.record_variants(factory, backend_name)
        orders = {values[1:5] for values in recorded}
        if backend_name == "metal":
            assert orders == {(4, 4, 1, True), (32, 4, 8, True), (32, 4, 1, True)}
        else:
            assert orders == {(32, 4, 1, False), (32, 2, 1, False), (32, 1, 1, False)}
        assert {values[0] for values in recorded} == set(ep.DTYPES)
        assert {values[5] for values in recorded} == set(ep.FORMS[backend_name])  # each multiply-add form
        # each order's launches: every row tile's, where a chunk of x fits (else cut)
        for order in orders:
            got = {(v[6], v[7], v[10]) for v in recorded if v[1:5] == order}
            want = {astuple(ep.launch_for(backend_name, ep.Order(*order), most))[:3] for most, _, _ in ep.TILES}
            assert got == want
        assert {values[9] for values in recorded} == {False, True}  # with and without a bias


# --- The Metal source itself, run on this CPU --------------------------------------------------------------
#
# The variant's source, run on this CPU (tests/metal_on_cpu.py), must give rows equal,
# bit for bit, to a plain transcription of MLX's Metal GEMVKernel (the order it claims).


def metal_gemv_order(x, w, bias, order: ep.Order):
    """MLX's Metal GEMVKernel::run for one row, transcribed plainly and run for
    each row: lane l of simdgroup part s takes (s * SN + l) * 4 + t of every
    step of BN * SN * 4 values (zeros past K in the last, every lane adding),
    ``result += float(w) * float(x)`` in float; simd_shuffle_down over the SN
    lanes; the BN parts added in order; one rounding (``T(result) + bias`` in T)."""
    f32 = np.float32
    rows, k = x.shape
    step = order.split * order.lanes * 4
    steps = -(-k // step)
    pad = ((0, 0), (0, steps * step - k))
    xs, ws = np.pad(x.astype(f32), pad), np.pad(w.astype(f32), pad)
    result = np.zeros((order.split, order.lanes, rows, w.shape[0]), f32)
    lanes = np.arange(order.split)[:, None] * order.lanes + np.arange(order.lanes)[None, :]
    for s in range(steps):
        for t in range(4):
            at = s * step + lanes * 4 + t  # [split, lanes]
            inter = ws[:, at].transpose(1, 2, 0)[:, :, None, :]
            v_coeff = xs[:, at].transpose(1, 2, 0)[:, :, :, None]
            result = result + inter * v_coeff
    o = order.lanes // 2
    while o >= 1:  # result += simd_shuffle_down(result, o): lane l adds lane l + o's
        result[:, : order.lanes - o] = result[:, : order.lanes - o] + result[:, o:]
        o //= 2
    total = result[0, 0]
    for part in range(1, order.split):
        total = total + result[part, 0]
    out = total.astype(x.dtype)
    return out if bias is None else out + bias


def run_metal_source(tmp_path, x, w, bias, plant=None):
    """The kernel's rows for x [rows, K] of float16 or float32, run on this CPU
    from the Metal source (``plant``: (old, new) text swapped into it first)."""
    import ctypes

    from dflash_mlx.kernels.exact_products_source import INPUTS, OUTPUTS

    script = check_metal_script()
    recorder = script.Recorder()
    kernel = ep.ExactProductKernel("metal", factory=recorder.factory)
    dtype = mx.float16 if x.dtype == np.float16 else mx.float32
    kernel(mx.array(x), mx.array(w), None if bias is None else mx.array(bias))
    ((name, variant),) = recorder.variants.items()
    ((grid, group),) = variant.launches
    src = variant.source
    if plant is not None:
        assert plant[0] in src
        src = src.replace(plant[0], plant[1])
    lib = build_on_cpu(script, src, INPUTS + ["x_shape", "w_shape"] + OUTPUTS, tmp_path)
    b = bias if bias is not None else np.zeros(8, x.dtype)
    y = np.zeros((x.shape[0], w.shape[0]), x.dtype)
    shapes = np.array(x.shape, np.int32), np.array(w.shape, np.int32)
    buffers = (ctypes.c_void_p * 6)(*[a.ctypes.data for a in (x, w, b, *shapes, y)])
    run_grid(lib, buffers, grid[0] // group[0], grid[1], group[0] // 32)
    assert dtype == mx.float16 or dtype == mx.float32
    return y


def metal_case(rows: int, n: int, k: int, bias: bool, dtype=np.float16):
    rng = np.random.default_rng(rows * 1000 + n + k)
    x = rng.standard_normal((rows, k)).astype(dtype)
    w = (k**-0.5 * rng.standard_normal((n, k))).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if bias else None
    return x, w, b


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "rows, n, k, bias, dtype, ahead",
    [
        (3, 264, 4096, False, np.float16, 2),  # Qwen3-8B's K: BN 1 (K < 16 N), the last threadgroup partial
        (13, 24, 4096, False, np.float16, 2),  # BN 8 (K >= 16 N), threadgroup memory
        (5, 776, 12288, False, np.float16, 2),  # down_proj's K
        (17, 40, 12288, True, np.float16, 2),  # BN 8, with a bias (AddMM's axpby)
        (9, 20, 64, False, np.float16, 2),  # K <= 64: SN 4, 8 outputs a simdgroup
        (4, 264, 4096, False, np.float32, 2),
        (2, 40, 1000, False, np.float16, 2),  # one partial step: lanes past K add zeros
        (3, 72, 1100, False, np.float16, 2),  # 9 steps (an odd one out of AHEAD), the last partial
        (3, 72, 1100, False, np.float16, 4),  # chunks of 4 steps, the last of one
        (27, 264, 4096, False, np.float16, 2),  # 32 rows a threadgroup, one step a chunk
        (17, 72, 1100, False, np.float16, 2),  # (and the last step partial)
        (20, 20, 40, False, np.float16, 2),  # SN 4 with K not a multiple of a step, 32 rows
        (27, 20, 50, False, np.float32, 2),
    ],
)
def test_the_metal_source_run_on_the_cpu_reduces_each_row_in_mlxs_one_row_order(
    tmp_path, monkeypatch, rows, n, k, bias, dtype, ahead
):
    monkeypatch.setitem(ep.AHEAD, "metal", ahead)
    x, w, b = metal_case(rows, n, k, bias, dtype)
    y = run_metal_source(tmp_path, x, w, b)
    want = metal_gemv_order(x, w, b, ep.one_row_order("metal", k, n))
    assert np.array_equal(y.view(np.uint8), want.view(np.uint8)), (y != want).sum()
    # and what MLX's CPU product computes, to the rounding of a sum's order
    mlx = x.astype(np.float32) @ w.astype(np.float32).T + (0 if b is None else b.astype(np.float32))
    assert np.abs(y.astype(np.float32) - mlx).max() <= 1e-2 * np.abs(mlx).max()


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "plant, dtype",
    [
        # the lanes added in another tree (shuffles of 1, 2, 4, ... instead of 16, 8, 4, ...)
        (("for (int o = LANES / 2; o >= 1; o >>= 1)", "for (int o = 1; o < LANES; o <<= 1)"), np.float16),
        # a lane's products added fused (one rounding instead of two; exact for half's products)
        (("acc += w * x;", "acc = metal::fma(static_cast<float>(w), x, acc);"), np.float32),
    ],
)
def test_a_planted_order_change_fails_the_comparison(tmp_path, plant, dtype):
    x, w, b = metal_case(8, 264, 4096, False, dtype)
    y = run_metal_source(tmp_path, x, w, b, plant=plant)
    want = metal_gemv_order(x, w, b, ep.one_row_order("metal", 4096, 264))
    assert not np.array_equal(y.view(np.uint8), want.view(np.uint8))
    assert np.abs(y.astype(np.float32) - want.astype(np.float32)).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("kernel_ms, serves", [(2.0, False), (0.5, True)])
def test_a_checked_variant_serves_only_where_this_machine_measured_it_faster(fake_gpu, measured, kernel_ms, serves):
    """Exact but slower keeps MLX's product; each layer's shape is measured once."""
    from dflash_mlx.kernels import decisions

    timed = measured(kernel_ms, 1.0)
    kernel = fake_gpu(FakeKernel())
    module = dense(512, 64)
    linear.prepare_exact(module, mx.bfloat16)
    linear.prepare_exact(module, mx.bfloat16)  # measured once
    assert len(timed) == 2  # at a block's rows and at a tree's
    made = decisions.current().all()
    assert [d.case.rsplit(" ", 2)[-2:] for d in made] == [["N=64", "rows=16"], ["N=64", "rows=32"]]
    assert all(d.case.startswith("bfloat16 K=512") and d.faster == serves for d in made)
    kernel.rows.clear()
    x = rows_of(5, 512)
    assert mx.array_equal(linear.apply_linear(module, x), module(x))  # exact either way
    assert bool(kernel.rows) == serves


def test_a_kernel_serves_only_the_rows_at_which_it_measured_faster(fake_gpu, monkeypatch):
    """Faster than MLX's product at a block's 16 rows, slower at a draft tree's
    32: a verify of up to 16 rows takes the kernel, one of more MLX's product."""
    from dflash_mlx.kernels import decisions

    kernel = fake_gpu(FakeKernel())

    def seconds_per_call(ours, theirs):
        ours()
        return (0.5e-3, 1e-3) if kernel.rows[-1] <= 16 else (2e-3, 1e-3)

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    decisions.reset()
    monkeypatch.setattr(decisions, "seconds_per_call", seconds_per_call)
    module = dense(512, 64)
    linear.prepare_exact(module, mx.bfloat16)
    assert {d.case.rsplit(" ", 1)[-1]: d.faster for d in decisions.current().all()} == {
        "rows=16": True,
        "rows=32": False,
    }
    for rows, served in ((5, True), (16, True), (17, False), (32, False)):
        kernel.rows.clear()
        x = rows_of(rows, 512)
        assert mx.array_equal(linear.apply_linear(module, x), module(x))
        assert bool(kernel.rows) == served, rows


def test_a_product_is_timed_over_copies_of_its_weight_that_outgrow_a_cache(fake_gpu, monkeypatch):
    """Each timed call of the kernel reads another copy of the layer's weight
    (equal to it), enough copies to take serving.TIMED_BYTES together: one
    weight timed again and again would stay in a GPU's cache, where a
    forward's layers read theirs from memory."""
    from dflash_mlx.kernels import decisions, serving

    class WeightsSeen(FakeKernel):
        def __call__(self, x, weight, bias, *, form=0):
            self.weights.append(weight)
            return super().__call__(x, weight, bias, form=form)

    kernel = fake_gpu(WeightsSeen())
    kernel.weights = []
    module = dense(512, 64)
    monkeypatch.setattr(serving, "TIMED_BYTES", 4 * module.weight.nbytes)
    timed = []

    def seconds_per_call(ours, theirs):
        kernel.weights.clear()
        mx.eval([ours() for _ in range(8)])
        timed.append(list(kernel.weights))
        return 0.5e-3, 1e-3

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    decisions.reset()
    monkeypatch.setattr(decisions, "seconds_per_call", seconds_per_call)
    original = mx.array(module.weight)
    linear.prepare_exact(module, mx.bfloat16)
    assert len(timed) == 2  # a block's rows and a tree's
    for weights in timed:
        assert len({id(w) for w in weights}) == 4  # in turn: 8 calls over 4 copies
        assert all(mx.array_equal(w, original) for w in weights)
    assert mx.array_equal(module.weight, original)


def test_both_sides_are_timed_in_one_turn_over_the_copies():
    """The kernel's calls and MLX's take the copies in one shared turn: in a
    round neither side reads a copy the other has just left in a cache."""
    from dflash_mlx.kernels import serving

    used = []
    ours, theirs = serving.timed_in_turn(lambda c: used.append(("ours", c)), lambda c: used.append(("mlx", c)), "abcd")
    ours(), ours(), theirs(), theirs(), ours()
    assert used == [("ours", "a"), ("ours", "b"), ("mlx", "c"), ("mlx", "d"), ("ours", "a")]


def test_copies_are_of_a_layer_of_arrays_alone():
    from dflash_mlx.kernels import serving

    with pytest.raises(ValueError, match="holds modules"):
        serving.weight_copies(nn.Sequential(dense(64, 8)))
    copies = serving.weight_copies(dense(512, 64))
    assert len(copies) > 1 and all(type(c) is nn.Linear for c in copies)


class OffPastSixteen(FakeKernel):
    """A kernel exact on the self-check's weights, and on a layer of 64 outputs
    exact at up to 16 rows only (its 32-row tile one rounding off there)."""

    def __call__(self, x, weight, bias, *, form=0):
        self.nudge = 1.0 if x.size // x.shape[-1] > 16 and weight.shape[0] == 64 else 0.0
        return super().__call__(x, weight, bias, form=form)


def test_a_layer_exact_only_at_a_blocks_rows_serves_only_those(fake_gpu, measured):
    """The layer's own weight is checked at each row class: a kernel whose
    32-row tile rounds otherwise serves 2-16 rows and leaves 17-32 to MLX."""
    measured(0.5, 1.0)
    kernel = fake_gpu(OffPastSixteen())
    module = dense(512, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear.prepare_exact(module, mx.bfloat16)
    for rows, served in ((8, True), (16, True), (17, False), (32, False)):
        kernel.rows.clear()
        linear.apply_linear(module, rows_of(rows, 512))
        assert bool(kernel.rows) == served, rows
