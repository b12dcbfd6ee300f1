"""The block-product kernel's dispatch (kernels/block_products.py): on the CPU
a layer's products are its modules' own; on a pretend GPU a kernel that
checks out takes a verify's 2-16-row products (and only those), one that does
not never does, one that does not build is named; decoding through it stays
the target's own greedy output."""

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from repo_files import repo_module
from test_norm_rope import run_layer as run_qwen3_layer
from test_norm_rope import tiny_qwen3_layer
from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
)

from dflash_mlx.kernels import norm_rope as nr
from dflash_mlx.kernels.cuda import products as bp
from dflash_mlx.layers import linear


def kernel_arithmetic(x, weight, bias=None, residual=None):
    """What the kernel computes: each output a float32 sum of products (plus
    the bias), rounded once to the dtype; then the residual added, rounded."""
    xs = np.array(x.astype(mx.float32), dtype=np.float32)
    ws = np.array(weight.astype(mx.float32), dtype=np.float32)
    out = xs @ ws.T
    if bias is not None:
        out = out + np.array(bias.astype(mx.float32), dtype=np.float32)
    out = mx.array(out).astype(x.dtype)
    return out if residual is None else residual + out


def swiglu_arithmetic(x, weight):
    """What the SwiGLU epilogue computes: the fused gate/up product (as
    kernel_arithmetic), split, then mlx-lm's swiglu."""
    from mlx_lm.models.activations import swiglu

    gate, up = mx.split(kernel_arithmetic(x, weight), 2, axis=-1)
    return swiglu(gate, up)


def norm_arithmetic(x, norm):
    """What the RMSNorm prologue computes before the product: x through the
    norm (weight, eps), by MLX's op."""
    weight, eps = norm
    return mx.fast.rms_norm(x, weight, eps)


class FakeKernel:
    """A kernel as the module's callers see it, counting its calls."""

    def __init__(self, fn=kernel_arithmetic, epilogue=swiglu_arithmetic, prologue=norm_arithmetic):
        self.fn, self.epilogue, self.prologue = fn, epilogue, prologue
        self.calls = self.heads = self.swiglus = self.norms = 0

    def __call__(self, x, weight, bias=None, residual=None, heads=False, swiglu=False, norm=None):
        self.calls += 1
        if norm is not None:
            assert not heads
            self.norms += 1
            x = self.prologue(x, norm)
        if swiglu:
            self.swiglus += 1
            return self.epilogue(x, weight)
        if heads:  # (an attention's output [1, heads, rows, D], taken as its rows)
            self.heads += 1
            x = x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
        return self.fn(x, weight, bias, residual)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The block-product kernel as if MLX ran on a GPU backend named 'fake'
    with a kernel of our choosing (norm_rope stays on its ops path)."""
    bp.reset()
    nr.reset()
    monkeypatch.setattr(bp, "backend", lambda: "fake")
    monkeypatch.setattr(linear, "backend", lambda: "fake")

    def install(kernel):
        monkeypatch.setitem(bp.BUILDERS, "fake", lambda where: kernel)
        return kernel

    yield install
    bp.reset()


def rel_err(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-6)).item()


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_on_the_cpu_a_linear_is_its_own_module(rows):
    mx.random.seed(3)
    x = mx.random.normal((1, rows, 64)).astype(mx.bfloat16)
    for module in (nn.Linear(64, 48, bias=False), nn.Linear(64, 48), nn.QuantizedLinear(64, 48, group_size=32)):
        module.set_dtype(mx.bfloat16)
        assert mx.array_equal(linear.apply_linear(module, x), module(x))


def tiny_layer(dtype=mx.bfloat16):
    return tiny_qwen3_layer(dtype)


def run_layer(layer, rows: int, offset: int = 40):
    """test_norm_rope's layer run over ``rows`` random rows after ``offset`` cached positions."""
    h = mx.random.normal((1, rows, 128), key=mx.random.key(rows)).astype(layer.input_layernorm.weight.dtype)
    return run_qwen3_layer(layer, h, offset)


def test_a_kernel_that_checks_out_takes_a_verifys_products_and_only_those(fake_gpu):
    layer = tiny_layer()
    want = {rows: run_layer(layer, rows) for rows in (1, 5, 16, 17)}  # (before the kernel: MLX's products)
    kernel = fake_gpu(FakeKernel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bp.prepare(mx.bfloat16)
    # the products, the SwiGLU, the norms
    assert [r.ok for r in bp._checks.values()] == [True, True, True] and kernel.calls > 0
    for rows, expected in want.items():
        before, heads, swiglus, norms = kernel.calls, kernel.heads, kernel.swiglus, kernel.norms
        got = run_layer(layer, rows)
        # q/k/v (one product, the input norm in its launch), o (reading the attention's heads in
        # place), gate/up (one product, the post-attention norm and the SwiGLU in its launch),
        # down: four launches for 2-16 rows
        taken = 2 <= rows <= 16
        assert kernel.calls - before == (4 if taken else 0), rows
        assert kernel.heads - heads == (1 if taken else 0), rows
        assert kernel.swiglus - swiglus == (1 if taken else 0), rows
        assert kernel.norms - norms == (2 if taken else 0), rows
        assert rel_err(got, expected) < 2e-2


def test_a_norm_prologue_that_does_not_check_out_leaves_the_norms_apart(fake_gpu):
    """The RMSNorm prologue has a check of its own: one that computes
    something else (here the norm without its weight) warns once, naming
    it, and the layer's products still take the kernel (the SwiGLU in its
    launch), each norm a launch of its own; the layer computes what it did."""
    layer = tiny_layer()
    layer.input_layernorm.weight = (1 + mx.random.normal((128,), key=mx.random.key(5))).astype(mx.bfloat16)
    layer.post_attention_layernorm.weight = (1 + mx.random.normal((128,), key=mx.random.key(6))).astype(mx.bfloat16)
    want = run_layer(layer, 5)
    kernel = fake_gpu(FakeKernel(prologue=lambda x, norm: mx.fast.rms_norm(x, None, norm[1])))
    with pytest.warns(RuntimeWarning, match="RMSNorm prologue failed its self-check") as caught:
        bp.prepare(mx.bfloat16)
        bp.prepare(mx.bfloat16)
    assert len(caught) == 1
    assert [r.ok for r in bp._checks.values()] == [True, True, False]
    before, swiglus, norms = kernel.calls, kernel.swiglus, kernel.norms
    got = run_layer(layer, 5)
    assert kernel.calls - before == 4 and kernel.swiglus - swiglus == 1 and kernel.norms == norms
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_norms_stay_apart_before_weights_of_norm_most_elements(fake_gpu, monkeypatch, dtype):
    """The prologue reads a block's rows twice, which pays at small K only:
    a product whose weight has NORM_MOST elements or more takes the kernel
    with its norm a launch of its own (here NORM_MOST set at the tiny
    layer's q/k/v and gate/up sizes, both 512 x 128); both dtypes check the
    prologue."""
    layer = tiny_layer(dtype)
    want = run_layer(layer, 5)
    kernel = fake_gpu(FakeKernel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bp.prepare(dtype)
    assert [r.ok for r in bp._checks.values()] == [True, True, True]
    monkeypatch.setattr(linear, "NORM_MOST", (4 * 64 + 2 * 2 * 64) * 128)  # q (4 heads of 64), k and v (2 each)
    before, norms = kernel.calls, kernel.norms
    got = run_layer(layer, 5)
    assert kernel.calls - before == 4 and kernel.norms == norms
    monkeypatch.setattr(linear, "NORM_MOST", 512 * 128 + 1)
    run_layer(layer, 5)
    assert kernel.norms - norms == 2
    assert rel_err(got, want) < 2e-2


def test_a_swiglu_epilogue_that_does_not_check_out_leaves_the_products_on_the_kernel(fake_gpu):
    """The SwiGLU epilogue has a check of its own: one that computes
    something else (here silu(up) * gate) warns once, naming it, and a
    layer's gate/up product still takes the kernel, its SwiGLU a launch of
    its own; the layer computes what it did."""
    from mlx_lm.models.activations import swiglu

    layer = tiny_layer()
    want = run_layer(layer, 5)

    def swapped(x, w):
        gate, up = mx.split(kernel_arithmetic(x, w), 2, axis=-1)
        return swiglu(up, gate)

    kernel = fake_gpu(FakeKernel(epilogue=swapped))
    with pytest.warns(RuntimeWarning, match="SwiGLU epilogue failed its self-check") as caught:
        bp.prepare(mx.bfloat16)
        bp.prepare(mx.bfloat16)
    assert len(caught) == 1
    assert [r.ok for r in bp._checks.values()] == [True, False, True]  # (the norms checked without the SwiGLU)
    before, swiglus = kernel.calls, kernel.swiglus
    got = run_layer(layer, 5)
    assert kernel.calls - before == 4 and kernel.swiglus == swiglus
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("wrong", ["relu", "half slope", "gelu-like slope"])
def test_the_swiglu_check_fails_a_wrong_activation(fake_gpu, wrong):
    """Its cases keep gate and up O(1), where a wrong activation shows
    beyond the bf16 tolerance (at products of spread sqrt(K) the sigmoid
    saturates and relu passed)."""

    def epilogue(x, w):
        gate, up = mx.split(kernel_arithmetic(x, w), 2, axis=-1)
        g = gate.astype(mx.float32)
        act = {
            "relu": mx.maximum(g, 0),
            "half slope": g * mx.sigmoid(g / 2),
            "gelu-like slope": g * mx.sigmoid(1.702 * g),
        }[wrong]
        return (act * up.astype(mx.float32)).astype(x.dtype)

    fake_gpu(FakeKernel(epilogue=epilogue))
    with pytest.warns(RuntimeWarning, match="SwiGLU epilogue failed"):
        bp.prepare(mx.bfloat16)


def test_the_swiglu_epilogue_refuses_a_bias_a_residual_or_odd_rows():
    kernel = bp.BlockProductKernel("cuda", factory=lambda **made: lambda **kw: [mx.zeros((1,))])
    x, w = mx.zeros((1, 4, 64), mx.bfloat16), mx.zeros((10, 64), mx.bfloat16)
    for bad in (dict(bias=mx.zeros((10,), mx.bfloat16)), dict(residual=mx.zeros((1, 4, 5), mx.bfloat16))):
        with pytest.raises(ValueError, match="SwiGLU epilogue"):
            kernel(x, w, swiglu=True, **bad)
    with pytest.raises(ValueError, match="even number of rows"):
        kernel(x, w[:9], swiglu=True)


def test_the_swiglu_epilogues_reference_is_mlx_lms_swiglu_of_the_rounded_products():
    """reference_swiglu: the fused gate/up product as ``reference`` rounds
    it, split in halves, then mlx-lm's swiglu; its check cases are fused
    weights (an even number of rows) of 2-16-row products."""
    from mlx_lm.models.activations import swiglu

    for x, w in bp.swiglu_check_cases(mx.bfloat16):
        assert w.shape[0] % 2 == 0 and 2 <= x.shape[1] <= 16
        gate, up = mx.split(bp.reference(x, w), 2, axis=-1)
        assert mx.array_equal(bp.reference_swiglu(x, w), swiglu(gate, up))
        assert bp.reference_swiglu(x, w).shape == (*x.shape[:-1], w.shape[0] // 2)


def test_float32_and_quantized_layers_keep_mlxs_products(fake_gpu):
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.float32)
    assert not bp._checks and kernel.calls == 0  # (float32 is never checked: matrix units would round it)
    run_layer(tiny_layer(mx.float32), 5)
    bp.prepare(mx.bfloat16)
    before = kernel.calls
    layer = tiny_layer()
    nn.quantize(layer, group_size=32, bits=4)
    run_layer(layer, 5)
    assert kernel.calls == before


def test_a_kernel_that_does_not_check_out_warns_once_and_is_never_used(fake_gpu):
    kernel = fake_gpu(
        FakeKernel(lambda x, w, b, r: kernel_arithmetic(x, w[::-1], b, r))
    )  # the columns in the wrong order
    with pytest.warns(RuntimeWarning, match=r"fake bfloat16 block-product kernel failed its self-check"):
        bp.prepare(mx.bfloat16)
    checked = kernel.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bp.prepare(mx.bfloat16)  # (checked once: no second warning)
        run_layer(tiny_layer(), 5)
    assert kernel.calls == checked


def test_a_kernel_that_does_not_build_is_named_and_not_used(fake_gpu, monkeypatch):
    def broken(where):
        raise RuntimeError("nvrtc: error: identifier 'mma' is undefined")

    monkeypatch.setitem(bp.BUILDERS, "fake", broken)
    layer = tiny_layer()
    want = run_layer(layer, 5)  # (MLX's products)
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: nvrtc: error: identifier 'mma' is undefined"):
        bp.prepare(mx.bfloat16)
    assert bp.passed(mx.bfloat16) is None
    assert mx.array_equal(run_layer(layer, 5), want)


def mlx_product(x, w, b, r):
    """MLX's product, then the residual: what the layers compute without the kernel."""
    y = x @ w.T if b is None else mx.addmm(b, x, w.T)
    return y if r is None else r + y


def bf16_pair(vocab: int, draft_layers: int, seed: int):
    """A tiny bf16 qwen3 target (3 layers of 64) and a drafter of ``draft_layers`` tapping layers 0 and 2."""
    tcfg = target_config("qwen3", vocab=vocab, layers=3, hidden=64)
    model = make_target(tcfg, seed=seed)
    model.set_dtype(mx.bfloat16)
    dcfg = draft_config(tcfg, layers=draft_layers, block_size=8, taps=[0, 2])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1))
    draft.set_dtype(mx.bfloat16)
    return model, draft


def test_decoding_through_the_kernel_is_the_targets_greedy_output(fake_gpu):
    """A bf16 pair on the pretend GPU: the verify's and the drafter's
    products go through the kernel (computing as MLX's product does, so the
    output must be the target's own token for token)."""
    from dflash_mlx import stream_generate

    kernel = fake_gpu(FakeKernel(mlx_product))
    model, draft = bf16_pair(vocab=24, draft_layers=1, seed=51)
    prompt = [1, 2, 3, 4, 5]
    want = greedy_reference(model, prompt, 24)
    got = [
        t
        for r in stream_generate(model, draft, make_tokenizer(24), prompt, max_tokens=24, block_size=6)
        for t in r.tokens
    ]
    assert got == want
    assert kernel.calls > 0 and kernel.norms > 0


def test_a_verify_and_a_draft_take_every_rms_norm_into_a_products_launch(fake_gpu):
    """On the pretend GPU a bf16 pair's verify of 5 rows runs no RMSNorm of
    its own: each layer's two go into its q/k/v and gate/up products, the
    final norm into the (small) output head's; the drafter's block
    likewise (its head is the target's), and its context feed's norm into
    every layer's k/v product. Logits as without the kernel."""
    from dflash_mlx.kv.buffer import set_lengths
    from dflash_mlx.targets import adapt

    model, draft = bf16_pair(vocab=40, draft_layers=2, seed=53)
    tokens = mx.array([[3, 1, 4, 1, 5]])

    def verify_and_draft():
        target = adapt(model)
        draft.bind(target)
        tc, dc = target.make_cache(), draft.make_cache()
        logits, hidden = target(tokens, tc, draft.config.target_layer_ids)
        draft.extend(hidden, dc)
        set_lengths(tc, mx.array(5, mx.int32), 5)
        set_lengths(dc, mx.array(5, mx.int32), 5)
        verify = target(tokens, tc, draft.config.target_layer_ids)[0]
        proposed = draft(mx.array([[5, 0, 0, 0, 0, 0]]), None, dc)
        return logits, verify, proposed

    want = verify_and_draft()  # (MLX's products and norms)
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    before = kernel.norms
    got = verify_and_draft()
    # the prefill's 5 rows and the verify's: 2 a layer and the head's each; the context feed: its
    # norm in each drafter layer's k/v product; the draft: 2 a drafter layer and the head's
    assert kernel.norms - before == 2 * (2 * 3 + 1) + 2 + (2 * 2 + 1)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 3e-2


def test_a_tied_heads_product_follows_the_embedding(fake_gpu):
    """A tied head runs as a linear layer over the embedding's weight (no
    copy), through the kernel on the pretend GPU with the final norm in its
    launch; it follows a replaced embedding weight, and a quantized
    embedding takes its own head again (the wrapper dropped)."""
    from dflash_mlx.targets import adapt

    model = make_target(target_config("qwen3", vocab=40, layers=2, hidden=64, tie=True), seed=58)
    model.set_dtype(mx.bfloat16)
    target = adapt(model)
    embed, norm = model.model.embed_tokens, model.model.norm
    h = mx.random.normal((1, 5, 64), key=mx.random.key(59)).astype(mx.bfloat16)
    kernel = fake_gpu(FakeKernel(mlx_product))
    bp.prepare(mx.bfloat16)
    before, norms = kernel.calls, kernel.norms
    assert mx.array_equal(target.lm_head(h, norm), embed.as_linear(norm(h)))
    assert kernel.calls - before == 1 and kernel.norms - norms == 1 and target._tied_head.weight is embed.weight
    embed.weight = mx.random.normal(embed.weight.shape, key=mx.random.key(60)).astype(mx.bfloat16)
    assert mx.array_equal(target.lm_head(h, norm), embed.as_linear(norm(h)))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Embedding))
    quantized = model.model.embed_tokens
    assert mx.array_equal(target.lm_head(h, norm), quantized.as_linear(norm(h))) and target._tied_head is None


def test_a_bias_is_the_kernels_too_and_its_check_covers_it(fake_gpu):
    """A linear layer with a bias: the kernel takes it (one rounding, as
    MLX's addmm); a kernel that drops the bias fails its self-check."""
    mx.random.seed(9)
    module = nn.Linear(64, 40)
    module.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 6, 64)).astype(mx.bfloat16)
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    before = kernel.calls
    assert rel_err(linear.apply_linear(module, x), module(x)) < 1e-2
    assert kernel.calls == before + 1
    bp.reset()
    fake_gpu(FakeKernel(lambda x, w, b, r: kernel_arithmetic(x, w, None, r)))
    with pytest.warns(RuntimeWarning, match="block-product kernel failed its self-check"):
        bp.prepare(mx.bfloat16)


def test_a_residual_is_added_in_the_products_launch_and_its_check_covers_it(fake_gpu):
    """``apply_linear(module, x, residual)`` is residual + module(x): one
    kernel launch where the kernel takes the product (a layer's o and down
    products carry their residual adds), the module and an add elsewhere; a
    kernel that drops the residual fails its self-check."""
    mx.random.seed(10)
    module = nn.Linear(64, 40, bias=False)
    module.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 6, 64)).astype(mx.bfloat16)
    residual = mx.random.normal((1, 6, 40)).astype(mx.bfloat16)
    want = residual + module(x)
    assert mx.array_equal(linear.apply_linear(module, x, residual), want)  # (the CPU: the module, then the add)
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    before = kernel.calls
    assert mx.array_equal(linear.apply_linear(module, x, residual), kernel_arithmetic(x, module.weight, None, residual))
    assert rel_err(linear.apply_linear(module, x, residual), want) < 1e-2
    assert kernel.calls == before + 2
    assert mx.array_equal(linear.apply_linear(module, x[:, :1], residual[:, :1]), want[:, :1])  # one row: MLX's
    assert kernel.calls == before + 2
    bp.reset()
    fake_gpu(FakeKernel(lambda x, w, b, r: kernel_arithmetic(x, w, b)))
    with pytest.warns(RuntimeWarning, match="block-product kernel failed its self-check"):
        bp.prepare(mx.bfloat16)


def test_an_attentions_heads_are_the_kernels_rows_in_place(fake_gpu):
    """``apply_linear_heads(module, out, residual)`` is module(out's rows)
    plus the residual, out [1, heads, L, D] as the attention gives it: the
    kernel reads the heads (no transposed copy) where it takes the product;
    elsewhere (one row, a batch of two, a quantized layer, the CPU) the rows
    are made and ``apply_linear`` does the rest. A kernel that reads the
    heads as rows fails its self-check."""
    mx.random.seed(11)
    module = nn.Linear(4 * 32, 40, bias=False)
    module.set_dtype(mx.bfloat16)

    def rows_of(out):
        return out.transpose(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)

    out = mx.random.normal((1, 4, 6, 32)).astype(mx.bfloat16)
    residual = mx.random.normal((1, 6, 40)).astype(mx.bfloat16)
    want = residual + module(rows_of(out))
    assert mx.array_equal(linear.apply_linear_heads(module, out, residual), want)  # (the CPU)
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    calls, heads = kernel.calls, kernel.heads
    assert mx.array_equal(
        linear.apply_linear_heads(module, out, residual), kernel_arithmetic(rows_of(out), module.weight, None, residual)
    )
    assert (kernel.calls, kernel.heads) == (calls + 1, heads + 1)
    for other in (out[:, :, :1], mx.concatenate([out, out])):  # one row; a batch of two: rows made first
        assert rel_err(linear.apply_linear_heads(module, other), module(rows_of(other))) < 1e-2
    assert kernel.heads == heads + 1
    bp.reset()

    def as_rows(x, w, b=None, r=None, heads=False, swiglu=False):  # the heads' memory read as if it were rows
        return kernel_arithmetic(x.reshape(x.shape[0], x.shape[2], -1) if heads else x, w, b, r)

    fake_gpu(as_rows)
    with pytest.warns(RuntimeWarning, match="block-product kernel failed its self-check"):
        bp.prepare(mx.bfloat16)


def test_the_block_attention_kernels_rows_go_to_the_o_product_as_rows(fake_gpu, monkeypatch):
    """Where the block-attention kernel runs, its output is stored as rows
    (each row's heads side by side): the o product takes those rows as they
    are (no heads read, no copy), where after MLX's fused attention it reads
    the heads in place; the layer computes the same either way."""
    from dflash_mlx.kernels import dispatch, ops_attention

    layer = tiny_layer()
    want = run_layer(layer, 5)  # (the CPU)
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    fused = run_layer(layer, 5)
    calls, heads = kernel.calls, kernel.heads
    attended = []

    def block_attention(q, k, v, **kw):  # a GPU's kernel as its callers see it: rows, viewed as heads
        attended.append(q.shape)
        out = ops_attention(q, k, v, **kw)
        return mx.contiguous(out.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    dispatch.reset()
    monkeypatch.setattr(dispatch, "backend", lambda: "fake")
    monkeypatch.setitem(dispatch.BUILDERS, "fake", lambda where: block_attention)
    monkeypatch.setattr(dispatch, "KERNEL_WINS", ((64, 0),))
    assert dispatch.checked_kernel("fake", mx.bfloat16, 64, False) is block_attention
    attended.clear()
    got = run_layer(layer, 5)
    dispatch.reset()
    assert attended == [(1, 4, 5, 64)]
    assert kernel.calls - calls == 4 and kernel.heads == heads  # q/k/v, o (as rows), gate/up, down
    assert rel_err(got, fused) < 1e-2 and rel_err(got, want) < 2e-2


@pytest.mark.parametrize("dtype", bp.DTYPES)
def test_the_self_checks_reference_is_the_float32_product_rounded_then_the_residual(dtype):
    """The self-check compares the kernel with ``reference``: every check
    case's product in float32, rounded once, the residual added after (MLX's
    CUDA products fail on the check's views off a 16-byte boundary, so the
    reference never multiplies them in bf16/fp16)."""
    cases = list(bp.check_cases(dtype))
    assert any(r is not None for *_, r, _ in cases) and any(b is not None for _, _, b, _, _ in cases)
    assert any(heads for *_, heads in cases)
    for x, w, bias, residual, heads in cases:
        rows = x.transpose(0, 2, 1, 3).reshape(1, x.shape[2], -1) if heads else x
        assert rel_err(bp.reference(x, w, bias, residual, heads), kernel_arithmetic(rows, w, bias, residual)) < 1e-2


def test_the_drafter_takes_the_kernel_when_decoding_not_when_training(fake_gpu):
    """The drafter's attention output product goes through the kernel with a
    cache (inference), through its module without one (training, which needs
    its gradient)."""
    from dflash_mlx.kv.buffer import BufferKVCache

    tcfg = target_config("qwen3", vocab=24, layers=3, hidden=64)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 2])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=3))
    draft.set_dtype(mx.bfloat16)
    attn = draft.layers[0].self_attn
    kernel = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    x = mx.random.normal((1, 8, 64), key=mx.random.key(4)).astype(mx.bfloat16)
    before = kernel.calls
    attn(x, None, None, draft.rope, 0, None)
    assert kernel.calls == before
    cache = BufferKVCache()
    cache.set_length(0)
    attn(x, None, None, draft.rope, 0, None, cache=cache)
    assert kernel.calls == before + 1
    # with a cache, ``attend`` returns the output as stored (attention_output's pair); an array is refused
    with pytest.raises(TypeError, match="attention_output"):
        attn(x, None, None, draft.rope, 0, None, cache=cache, attend=mx.fast.scaled_dot_product_attention)


def test_each_product_launches_with_its_shapes_launch_shape():
    """down-shaped weights (K at least LONG_K and twice N) take LONG_K_SHAPE,
    others of WIDE elements or more WIDE_SHAPE, the rest SHAPE: the template
    and grid a launch gets (a recording factory in place of MLX's)."""
    launches = []

    def factory(**made):
        def launch(**kw):
            launches.append(kw)
            rows, n = kw["output_shapes"][0]
            return [mx.zeros((rows, n), kw["output_dtypes"][0])]

        return launch

    kernel = bp.BlockProductKernel("cuda", factory=factory)
    assert len({bp.SHAPE, bp.WIDE_SHAPE, bp.LONG_K_SHAPE}) == 3
    expected = {
        (4096, 12288): bp.LONG_K_SHAPE,
        (6144, 4096): bp.WIDE_SHAPE,
        (4096, 4096): bp.WIDE_SHAPE,
        (24576, 4096): bp.WIDE_SHAPE,
        (4088, 4096): bp.SHAPE,
        (1024, 3072): bp.SHAPE,
    }
    for (n, k), shape in expected.items():
        y = kernel(mx.zeros((1, 16, k), mx.bfloat16), mx.zeros((n, k), mx.bfloat16))
        assert y.shape == (1, 16, n)
        tiles, split, ahead = shape
        template = dict(launches[-1]["template"])
        assert (template["NT"], template["KW"], template["U"], template["HAS_BIAS"]) == (tiles, split, ahead, False)
        assert launches[-1]["grid"][0] == -(-n // (8 * tiles)) * 32 * split
        assert launches[-1]["threadgroup"][0] == 32 * split <= 1024


def test_the_drafters_context_feed_takes_both_kernels_when_decoding_not_when_training(fake_gpu, monkeypatch):
    """``extend`` (the context cache, at inference) sends ``fc`` through the
    block-product kernel and each layer's keys through the q/k norm + RoPE
    kernel (keys alone: one launch a layer), with the keys and values the
    training path computes; ``context`` and ``keys_values`` as training calls
    them take neither."""
    from test_norm_rope import Recorder
    from test_norm_rope import kernel_arithmetic as norm_rope_arithmetic

    tcfg = target_config("qwen3", vocab=24, layers=3, hidden=256)  # (heads of 64: the rope kernel's least)
    dcfg = draft_config(tcfg, layers=2, block_size=8, taps=[0, 2])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=5))
    draft.set_dtype(mx.bfloat16)
    products = fake_gpu(FakeKernel())
    bp.prepare(mx.bfloat16)
    rope_kernel = Recorder(norm_rope_arithmetic)
    monkeypatch.setattr(nr, "backend", lambda: "fake")
    monkeypatch.setitem(nr.BUILDERS, "fake", lambda where: rope_kernel)
    nr.prepare(mx.bfloat16, draft.config.head_dim)
    bp_checked, nr_checked = products.calls, rope_kernel.calls
    taps = mx.random.normal((1, 6, 2 * 256), key=mx.random.key(6)).astype(mx.bfloat16)
    ctx = draft.context(taps)  # (as training calls them)
    want = [layer.self_attn.keys_values(ctx, draft.rope, 0) for layer in draft.layers]
    assert (products.calls, rope_kernel.calls) == (bp_checked, nr_checked)
    cache = draft.make_cache()
    for c in cache:
        c.set_length(0)
    draft.extend(taps, cache, [None] * len(draft.layers))
    assert products.calls == bp_checked + 1  # fc (the layers' k/v products unfused here: the modules')
    assert rope_kernel.calls == nr_checked + len(draft.layers)
    for c, (keys, values) in zip(cache, want):
        got_keys, got_values = c.state
        assert rel_err(got_keys[:, :, :6], keys) < 2e-2 and rel_err(got_values[:, :, :6], values) < 2e-2
    nr.reset()


def block_products_benchmark():
    """benchmarks/block_products.py as a module."""
    return repo_module("benchmarks/block_products.py", "block_products_bench")


def test_the_benchmarks_quantized_sides_run_and_report_exactness(monkeypatch, capsys):
    """benchmarks/block_products.py --quantized on a pretend GPU (a kernel
    computing each row as MLX's one-row product): every product's three sides
    are timed, its check passes and its rows are reported exact."""
    import sys

    from dflash_mlx.kernels import quantized as qp

    bench = block_products_benchmark()

    class Exact:
        def __init__(self, where):
            pass

        def __call__(self, x, weight, scales, biases, *, bits, group, mode, fused=False, launch_tile=None):
            return qp.one_row_products(x, weight, scales, biases, bits=bits, group=group, mode=mode)

    qp.reset()
    monkeypatch.setattr(qp, "backend", lambda: "fake")
    monkeypatch.setitem(qp.BUILDERS, "fake", Exact)
    monkeypatch.setattr(qp, "QuantizedProductKernel", Exact)
    monkeypatch.setitem(bench.QUANTIZED, "qwen3-8b", ((4, 64, "affine"), [("o", 64, 512)]))
    monkeypatch.setitem(bench.QUANTIZED, "gpt-oss-20b", ((4, 32, "mxfp4"), [("o", 32, 2880)]))
    argv = ["block_products.py", "--quantized", "--rows", "3", "--repeat", "2", "--runs", "1", "--repeat-rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv + ["--launches", "8,2,4"])
    bench.main()
    qp.reset()
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if " rows " in line or " row " in line]
    assert len(lines) == 6, lines  # two products, three sides each
    assert all(line.rstrip().endswith("True   passed") for line in lines), lines
    assert {line.split()[3] for line in lines} == {"kernel", "mlx"}
    # and the kernel at the tile --launches adds, each product's rows its own exactness
    tiled = [line for line in out if "kernel 8x2x4" in line]
    assert len(tiled) == 2 and all(line.rstrip().endswith("True   passed") for line in tiled), tiled


def test_the_benchmarks_exact_sides_run_at_a_trees_rows(monkeypatch, capsys):
    """benchmarks/block_products.py --exact on a pretend GPU, at a block's and a
    draft tree's rows: each product's three sides are timed and reported exact."""
    import sys

    from dflash_mlx.kernels import exact_products as ep

    bench = block_products_benchmark()

    class Exact:
        def __init__(self, where):
            pass

        def __call__(self, x, weight, bias, *, form=0, launch=None):
            return ep.one_row_products(x, weight, bias)

    monkeypatch.setattr(ep, "backend", lambda: "fake")
    monkeypatch.setitem(ep.BUILDERS, "fake", Exact)
    monkeypatch.setitem(ep.FORMS, "fake", (1,))
    monkeypatch.setitem(ep.AHEAD, "fake", 2)
    monkeypatch.setitem(ep.STAGED_BYTES, "fake", 32768)
    monkeypatch.setattr(ep, "ExactProductKernel", Exact)
    monkeypatch.setattr(bench, "DENSE", [("o", 64, 512)])
    argv = ["block_products.py", "--exact", "--skip-check", "--rows", "16,32", "--repeat", "2", "--runs", "1"]
    monkeypatch.setattr(sys, "argv", argv + ["--repeat-rounds", "1", "--launches", "2,1:4,2,8"])
    bench.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("o ")]
    assert len(lines) == 10, lines  # two row counts, three sides each and the two added launch shapes
    assert sum("4 out 2 ahead 8 sg" in line for line in lines) == 2, lines
    assert all(" True " in line for line in lines), lines
