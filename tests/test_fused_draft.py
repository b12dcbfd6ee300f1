"""The drafters' fused products (q/k/v and gate/up as one product each, the
context's k/v as one): the same logits and context caches as the layers'
own modules, for DFlash and DFlash 2 drafters, bf16 and quantized, with no
extra memory."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from test_dflash2 import TCFG, dflash2_config, random_dflash2_weights
from tiny import draft_config, make_draft, make_target, random_draft_weights, target_config, write_zlab_draft

from dflash_mlx import load_draft
from dflash_mlx.targets import adapt


def dflash_pair(bits):
    tcfg = target_config("qwen3", vocab=40, layers=4, hidden=128)
    model = make_target(tcfg, seed=7)
    dcfg = draft_config(tcfg, layers=2, block_size=8, taps=[0, 3])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=8))
    if bits:
        nn.quantize(draft, group_size=32, bits=bits)
    return model, draft


def dflash2_pair(tmp_path):
    cfg = dflash2_config(TCFG)
    path = write_zlab_draft(tmp_path / "zlab", cfg, random_dflash2_weights(cfg), dtype=mx.float32)
    return make_target(TCFG, seed=11), load_draft(str(path))


def draft_twice(model, draft, block):
    """Logits and context caches of two blocks (the second after more
    context), with the fused products and with the modules."""
    target = adapt(model)
    draft.bind(target)
    H = target.hidden_size * len(draft.config.target_layer_ids)
    mx.random.seed(3)
    taps = [mx.random.normal((1, n, H)).astype(target.dtype) for n in (9, 3)]
    out = {}
    for fuse in (True, False):
        draft.fuse_projections = fuse
        cache = draft.make_cache()
        logits = [draft(block, taps[0], cache), draft(block, taps[1], cache)]
        out[fuse] = logits + [a for c in cache for a in (c.keys, c.values)]
    del draft.fuse_projections  # back to the class default
    return out


@pytest.mark.parametrize("bits", [None, 4])
def test_fused_dflash_drafter_equals_its_modules(bits):
    model, draft = dflash_pair(bits)
    before = sum(v.nbytes for _, v in tree_flatten(draft.parameters()))
    block = mx.array([[5] + [draft.config.mask_token_id] * 7])
    out = draft_twice(model, draft, block)
    assert all(f is not None for f in draft.fused_projections())  # the fused path ran
    for got, want in zip(out[True], out[False]):
        assert got.shape == want.shape and mx.array_equal(got, want).item()
    # the layers' projections are views of the fused rows: no extra parameters
    assert sum(v.nbytes for _, v in tree_flatten(draft.parameters())) == before


def test_fused_dflash2_drafter_equals_its_modules(tmp_path):
    model, draft = dflash2_pair(tmp_path)
    block = mx.array([[5] + [draft.config.mask_token_id] * 5])
    out = draft_twice(model, draft, block)
    assert all(f is not None for f in draft.fused_projections())
    for got, want in zip(out[True], out[False]):
        assert got.shape == want.shape and mx.array_equal(got, want).item()


def test_new_drafter_weights_are_fused_again():
    """Weights loaded after fusing (a training step, a checkpoint) are the
    ones the fused products use."""
    model, draft = dflash_pair(None)
    block = mx.array([[5] + [draft.config.mask_token_id] * 7])
    draft_twice(model, draft, block)  # fuses
    fresh = random_draft_weights(
        draft_config(target_config("qwen3", vocab=40, layers=4, hidden=128), layers=2, block_size=8, taps=[0, 3]),
        seed=99,
    )
    draft.load_weights(list(fresh.items()))
    out = draft_twice(model, draft, block)
    for got, want in zip(out[True], out[False]):
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("which", ["dflash", "dflash2"])
def test_a_decode_call_checks_the_drafters_fused_products_once_not_every_cycle(which, tmp_path, monkeypatch):
    """Each check walks every layer's projections: a call makes them once for
    all its cycles (the prompt's chunks, read before, check their own)."""
    from tiny import greedy_reference, make_tokenizer

    from dflash_mlx import stream_generate

    model, draft = dflash_pair(None) if which == "dflash" else dflash2_pair(tmp_path)
    calls = []
    real = type(draft).fused_projections
    monkeypatch.setattr(type(draft), "fused_projections", lambda self: calls.append(1) or real(self))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = list(
        stream_generate(model, draft, make_tokenizer(model.args.vocab_size), prompt, max_tokens=40, block_size=4)
    )
    cycles = len(out)
    assert [t for r in out for t in r.tokens] == greedy_reference(model, prompt, 40)
    # the prompt's two chunks (its ids but the last, then the last alone), the call's Cycle (and a retrace's rebind)
    assert cycles >= 10 and len(calls) <= 4
