"""Fused q/k/v and gate/up projections for qwen3/llama targets
(dflash_mlx/targets/fused.py): the same logits and taps as mlx-lm's own
layers, no extra memory, the model still mlx-lm's, and layers that cannot be
fused run as they are."""

import gc

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tuner.lora import LoRALinear
from tiny import greedy_reference, make_target, target_config

from dflash_mlx.layers import fused as fused_layers
from dflash_mlx.layers.fused import MOST_FUSED_ROWS, projections
from dflash_mlx.targets import adapt

VOCAB = 40


def unfused_forward(target, tokens, taps):
    """The adapter's forward through mlx-lm's own layer modules."""
    target.blocks = list(target.inner.layers)
    cache = target.make_cache()
    return target(tokens, cache, taps)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("bits", [None, 4])
def test_fused_forward_equals_mlx_lm_layers(family, bits):
    model = make_target(target_config(family, vocab=VOCAB, layers=3, hidden=128), seed=5)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    fused = adapt(model)
    assert all(projections(layer) is not None for layer in model.model.layers)
    # prefill, then a verify-like block over the cache
    cache = fused.make_cache()
    logits, hidden = fused(tokens[:, :7], cache, [0, 2])
    logits2, hidden2 = fused(tokens[:, 7:], cache, [0, 2])
    plain = adapt(model)
    plain.blocks = list(plain.inner.layers)
    pcache = plain.make_cache()
    want, want_h = plain(tokens[:, :7], pcache, [0, 2])
    want2, want_h2 = plain(tokens[:, 7:], pcache, [0, 2])
    for got, ref in ((logits, want), (hidden, want_h), (logits2, want2), (hidden2, want_h2)):
        assert got.shape == ref.shape
        assert mx.array_equal(got, ref).item()  # the same arithmetic per output element


def test_a_prompt_chunk_runs_the_layers_own_projections(monkeypatch):
    """Fused products serve a verify's rows; a prompt chunk's many rows run
    mlx-lm's own modules (views of the fused weights), with its logits."""
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=2, hidden=128), seed=4)
    target = adapt(model)
    fused_rows = []
    for name in ("apply_linear", "apply_linear_swiglu"):
        real = getattr(fused_layers, name)

        def spy(module, x, *args, real=real, **kw):
            fused_rows.append(x.size // x.shape[-1])
            return real(module, x, *args, **kw)

        monkeypatch.setattr(fused_layers, name, spy)
    tokens = mx.array([[(7 * i) % VOCAB for i in range(MOST_FUSED_ROWS + 90)]])
    cache = target.make_cache()
    chunk = target(tokens[:, :-16], cache, [0, 1])
    assert fused_rows == []
    block = target(tokens[:, -16:], cache, [0, 1])
    assert fused_rows and set(fused_rows) == {16}
    plain = adapt(model)
    plain.blocks = list(plain.inner.layers)
    pcache = plain.make_cache()
    want = plain(tokens[:, :-16], pcache, [0, 1]), plain(tokens[:, -16:], pcache, [0, 1])
    for got, ref in zip((*chunk, *block), (*want[0], *want[1])):
        assert mx.array_equal(got, ref).item()


def test_fused_forward_without_a_cache_equals_mlx_lm_layers():
    """The trainer reads a whole sequence's taps with no cache."""
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=3, hidden=128), seed=9)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    target = adapt(model)
    got = target(tokens, [None] * target.num_layers, [0, 2])
    target.blocks = list(target.inner.layers)
    want = target(tokens, [None] * target.num_layers, [0, 2])
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def test_fusing_keeps_memory_and_leaves_mlx_lm_decoding_unchanged():
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=2, hidden=512), seed=6)
    prompt = [5, 7, 11, 13]
    before = greedy_reference(model, prompt, 12)
    gc.collect()
    mx.clear_cache()
    used = mx.get_active_memory()
    weights = sum(v.nbytes for layer in model.model.layers for v in _arrays(layer))
    adapt(model)
    gc.collect()
    mx.clear_cache()
    # The projections are views of the fused matrices: no second copy.
    assert mx.get_active_memory() - used < 0.05 * weights
    assert greedy_reference(model, prompt, 12) == before


def test_fusing_happens_once_per_layer():
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=2), seed=7)
    first = [projections(layer) for layer in adapt(model).inner.layers]
    again = [projections(layer) for layer in adapt(model).inner.layers]
    assert all(a is b for a, b in zip(first, again))


def test_a_layer_with_a_lora_adapter_runs_as_it_is():
    model = make_target(target_config("llama", vocab=VOCAB, layers=2), seed=8)
    attn = model.model.layers[1].self_attn
    attn.q_proj = LoRALinear.from_base(attn.q_proj, r=4)
    attn.q_proj.lora_b = mx.random.normal(attn.q_proj.lora_b.shape) * 0.1
    target = adapt(model)
    assert projections(model.model.layers[0]) is not None
    assert projections(model.model.layers[1]) is None
    assert target.rotates_rows  # its own projections, through our forward
    tokens = mx.array([[1, 2, 3, 4, 5]])
    got, _ = target(tokens, target.make_cache(), [0])
    want = model(tokens)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


def _arrays(module):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(module.parameters())]


def test_new_weights_or_a_quantization_are_fused_again():
    """Fused copies never go stale: weights loaded, or the model quantized,
    after a first adapter make the next adapter fuse afresh."""
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=2, hidden=128), seed=10)
    tokens = mx.array([[2, 7, 1, 8, 2, 8]])
    first = [projections(layer) for layer in adapt(model).inner.layers]
    attn = model.model.layers[0].self_attn
    model.load_weights(
        [("model.layers.0.self_attn.k_proj.weight", mx.random.normal(attn.k_proj.weight.shape))], strict=False
    )
    nn.quantize(model.model.layers[1], group_size=32, bits=4)
    target = adapt(model)
    assert all(projections(layer) is not f for layer, f in zip(model.model.layers, first))
    got = target(tokens, target.make_cache(), [0, 1])
    target.blocks = list(target.inner.layers)
    want = target(tokens, target.make_cache(), [0, 1])
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


@pytest.mark.parametrize("exact_first", [True, False])
def test_a_lone_row_runs_the_layers_own_projections_where_exactness_comes_first(monkeypatch, exact_first):
    """A plain step's row (or a prompt's last id) through a fused product of
    another width would round unlike mlx-lm's step where MLX picks the
    one-row order by width; where exactness comes first it runs the layer's
    own modules. The drafter's one-row context stays fused."""
    from dflash_mlx.kernels import decisions

    monkeypatch.setattr(decisions.Decisions, "exact_first", lambda self, where: exact_first)
    model = make_target(target_config("qwen3", vocab=VOCAB, layers=2, hidden=128), seed=4)
    target = adapt(model)
    fused_rows = []
    real = fused_layers.apply_linear

    def spy(module, x, *args, **kw):
        fused_rows.append(x.size // x.shape[-1])
        return real(module, x, *args, **kw)

    monkeypatch.setattr(fused_layers, "apply_linear", spy)
    tokens = mx.array([[(5 * i) % VOCAB for i in range(9)]])
    cache = target.make_cache()
    target(tokens[:, :8], cache, [0, 1])
    fused_rows.clear()
    target(tokens[:, 8:], cache, [0, 1])
    assert (1 in fused_rows) is not exact_first
    fused_rows.clear()
    projections(model.model.layers[0]).keys_values(mx.ones((1, 1, 128)))
    assert fused_rows == [1]
