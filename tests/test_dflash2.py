"""DFlash 2 drafters: a checkpoint in Z Lab's layout (the fixture's config
fields, codebooks stored without ".weight") loads, converts and quantizes;
its convolutions, logits and selector proposals match a plain
reimplementation of the spec written here and the official
`dflash.model_mlx` code; a sampled selector with the general rejection rule
keeps the target's distribution; greedy decoding with a DFlash 2 drafter
equals mlx-lm's; each bad config is one sentence."""

import json
import random

import dflash.model_mlx as dflash_official  # the oracle: pip install --no-deps dflash==0.1.0  # noqa: E402
import mlx.core as mx
import numpy as np
import pytest
from family_models import family_config, make_family_target
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache as official_cache
from test_sampling import chi_square_pvalue, reference_probs, sequence_distribution
from tiny import (
    draft_config,
    greedy_reference,
    make_target,
    make_tokenizer,
    target_config,
    write_zlab_draft,
)

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.convert.weights import convert
from dflash_mlx.decode.sampling import SamplingParams, accept_proposals
from dflash_mlx.draft.dflash2 import CODEBOOKS, DFlash2Draft, Draft2Config
from dflash_mlx.targets import adapt

TCFG = target_config("qwen3", vocab=40, layers=6)


def dflash2_config(tcfg, layers=2, block_size=6, taps=(1, 4), window=64, **dflash):
    """A DFlash 2 config.json shaped like Z Lab's fixture (dflash2-config.json):
    every layer sliding, non-causal, rope_parameters, block size and the
    DFlash 2 fields inside dflash_config, output multiplier and softcap."""
    cfg = draft_config(tcfg, layers=layers, taps=list(taps))
    for k in ("block_size", "rope_theta"):
        cfg.pop(k)
    cfg.update(
        architectures=["DFlash2DraftModel"],
        is_causal=False,
        layer_types=["sliding_attention"] * layers,
        sliding_window=window,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        use_sliding_window=True,
    )
    cfg["dflash_config"].update(
        block_size=block_size,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=32,
        selector_top_k=5,
        output_multiplier=0.6,
        final_logit_softcapping=6.0,
    )
    cfg["dflash_config"].update(dflash)
    return cfg


def random_dflash2_weights(cfg, seed=1):
    """Random tensors under Z Lab's names: static kernels and norms away from
    their init so every part shows in the logits, codebooks without .weight."""
    mx.random.seed(seed)
    weights = dict(tree_flatten(DFlash2Draft(Draft2Config.from_dict(cfg)).parameters()))
    out = {}
    for k, v in weights.items():
        if "base_kernel" in k:
            v = 0.5 * mx.random.normal(v.shape)
        elif "norm" in k:
            v = v + 0.5 * mx.random.uniform(shape=v.shape)
        elif "codebook" in k:
            v = 0.5 * mx.random.normal(v.shape)
        out[k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k] = v
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dflash2_config(TCFG)
    path = write_zlab_draft(tmp_path_factory.mktemp("d2") / "zlab", cfg, random_dflash2_weights(cfg), dtype=mx.float32)
    return path, make_target(TCFG, seed=11)


def official_load_draft(path, monkeypatch):
    monkeypatch.setattr(dflash_official, "snapshot_download", lambda *a, **k: str(path))
    return dflash_official.load_draft(str(path))


# -- the spec, written out -----------------------------------------------------


def spec_conv(x, base, dyn, group):
    """x [L, H], base [K, H], dyn [L, K, groups]: out[t] = sum_o (base[o] +
    dyn[t, o] over the group's channels) * x[t - o], x before 0 being 0."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + np.repeat(dyn[t, o], group)) * x[t - o]
    return out


def spec_select(hidden, logits, anchor, sel, top_k, temperature, path=None):
    """The selector's walk: candidates = top-k logits, score = logit + sum
    over rank of predecessor[prev] * projection(h) * successor[candidate];
    greedy takes the best, sampling follows ``path`` and returns each
    position's q = softmax(score / T) over the vocabulary."""
    proj = np.array(sel.hidden_projection.weight)
    pred, succ = np.array(sel.predecessor_codebook.weight), np.array(sel.successor_codebook.weight)
    prev, drafts, qs = anchor, [], []
    for t in range(logits.shape[0]):
        cand = np.argsort(-logits[t])[:top_k]
        h = proj @ hidden[t]
        score = logits[t][cand] + np.array([np.sum(pred[prev] * h * succ[c]) for c in cand])
        if temperature == 0:
            prev = int(cand[np.argmax(score)])
        else:
            e = np.exp((score - score.max()) / temperature)
            q = np.zeros(logits.shape[1])
            q[cand] = e / e.sum()
            qs.append(q)
            prev = int(path[t])
        drafts.append(prev)
    return drafts, (np.stack(qs) if qs else None)


# -- loading, the spec, the oracle ---------------------------------------------


def test_fixture_config_parses_and_round_trips():
    # The fields of z-lab/dflash tests/fixtures/dflash2-config.json (Muse-Glimmer-30B-DFlash2).
    raw = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "is_causal": False,
        "head_dim": 128,
        "hidden_size": 6656,
        "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 52,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "vocab_size": 202048,
        "dflash_config": {
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": 201818,
            "output_multiplier": 0.19611613513818404,
            "selector_rank": 256,
            "selector_top_k": 16,
            "target_layer_ids": [1, 13, 25, 37, 49],
        },
    }
    cfg = Draft2Config.from_dict(raw)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert cfg.conv_groups == 416 and cfg.block_size == 16 and cfg.is_causal is False and cfg.sliding_window == 2048
    assert cfg.final_logit_softcapping == 20.0 and cfg.rope_theta == 500000.0
    assert Draft2Config.from_dict(cfg.to_dict()) == cfg
    # Every tensor of the fixture's safetensors header, with its shape, is what the module holds.
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(DFlash2Draft(cfg).parameters())}
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 6656)
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 6656)
    assert shapes["candidate_selector.predecessor_codebook.weight"] == (202048, 256)
    assert len(shapes) == 3 + 5 * 15 + 3


def test_layer_and_selector_match_the_spec(checkpoint):
    path, model = checkpoint
    draft = load_draft(path).bind(adapt(model))
    assert isinstance(draft, DFlash2Draft)
    cfg = draft.config
    rng = np.random.default_rng(0)
    # One layer on its own: the convolutions around attention and MLP.
    layer = draft.layers[0]
    x = mx.array(rng.standard_normal((1, 6, 64)).astype(np.float32))
    ctx = mx.array(rng.standard_normal((1, 5, 64)).astype(np.float32))
    ctx_k, ctx_v = layer.self_attn.keys_values(ctx, draft.rope, 0)
    got = np.array(layer(x, ctx_k, ctx_v, draft.rope, 5, None))[0]

    def conv(module, h):  # the spec's convolutions, numpy
        dyn = np.array(module.kernel_projection(mx.array(h)[None]))[0].reshape(6, 2, 2, 4)
        base = np.array(module.base_kernel)
        return lambda y, i: spec_conv(y, base[i], dyn[:, i], 16)

    h = np.array(layer.input_layernorm(x))[0]
    c = conv(layer.attention_conv, h)
    a = np.array(layer.self_attn(mx.array(c(h, 0))[None], ctx_k, ctx_v, draft.rope, 5, None))[0]
    x1 = np.array(x)[0] + c(a, 1)
    h = np.array(layer.post_attention_layernorm(mx.array(x1)[None]))[0]
    c = conv(layer.mlp_conv, h)
    want = x1 + c(np.array(layer.mlp(mx.array(c(h, 0))[None]))[0], 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    # The selector: greedy drafts, and q along a sampled walk.
    taps = mx.array(rng.standard_normal((1, 9, 128)).astype(np.float32))
    block = mx.array([[7] + [cfg.mask_token_id] * 5])
    hidden = np.array(draft.hidden_states(block, taps, draft.make_cache()))[0]
    logits = np.array(draft(block, taps, draft.make_cache()))[0]
    drafts, q = draft.propose(block, taps, draft.make_cache())
    assert q is None
    want, _ = spec_select(hidden, logits, 7, draft.candidate_selector, 5, 0.0)
    assert drafts.tolist() == want
    assert want != logits.argmax(-1).tolist()  # the pair scores changed a choice
    for temperature, seed in [(1.0, 0), (0.6, 1), (1.0, 2)]:
        drafts, q = draft.propose(block, taps, draft.make_cache(), temperature, mx.random.key(seed))
        _, want_q = spec_select(hidden, logits, 7, draft.candidate_selector, 5, temperature, drafts.tolist())
        np.testing.assert_allclose(np.array(q), want_q, atol=1e-5)
        assert all(np.array(q)[i, d] > 0 for i, d in enumerate(drafts.tolist()))


def test_logits_and_proposals_match_official(checkpoint, monkeypatch):
    path, model = checkpoint
    ours = load_draft(path).bind(adapt(model))
    theirs = official_load_draft(path, monkeypatch).bind(model)
    assert type(theirs).__name__ == "DFlash2DraftModel"
    rng = np.random.default_rng(1)
    our_cache, their_cache = ours.make_cache(), official_cache(theirs)
    history = []
    for step, (ctx_len, bs) in enumerate([(17, 6), (3, 6), (1, 4), (5, 2), (2, 6)]):
        taps = mx.array(rng.standard_normal((1, ctx_len, 128)).astype(np.float32))
        history.append(taps)
        block = mx.array([[int(rng.integers(0, 39))] + [39] * (bs - 1)])
        # Incrementally on both sides (the window, 64, is never reached).
        a = ours(block, taps, our_cache)
        b = theirs(block, taps, their_cache, logits_start=1)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
        # Drafts and proposals of the same block (ours from its cache, theirs afresh on the whole context).
        context = mx.concatenate(history, axis=1)
        ours_drafts, _ = ours.propose(block, None, our_cache)
        their_drafts, _, _ = theirs.propose(block, context, official_cache(theirs), 0.0, logits_start=1)
        assert ours_drafts.tolist() == their_drafts[0].tolist(), step
        path_, candidates, q_rows = theirs.propose(block, context, official_cache(theirs), 0.9, logits_start=1)
        their_q = np.zeros((bs - 1, 40))
        np.put_along_axis(their_q, np.array(candidates[0]), np.array(q_rows[0]), axis=-1)
        hidden = np.array(ours.hidden_states(block, None, our_cache))[0]
        _, want_q = spec_select(
            hidden, np.array(a)[0], int(block[0, 0]), ours.candidate_selector, 5, 0.9, path_[0].tolist()
        )
        np.testing.assert_allclose(their_q, want_q, atol=1e-5, err_msg=f"step {step}")


def test_converts_quantizes_and_loads_back(checkpoint, tmp_path):
    path, model = checkpoint
    target = adapt(model)
    rng = np.random.default_rng(2)
    taps = mx.array(rng.standard_normal((1, 12, 128)).astype(np.float32))
    block = mx.array([[3] + [39] * 5])

    def logits(d):
        return d.bind(target)(block, taps, d.make_cache())

    want = logits(load_draft(path))
    out = convert(path, tmp_path / "f32", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 5
    assert "candidate_selector.predecessor_codebook.weight" in mx.load(str(out / "model.safetensors"))
    np.testing.assert_allclose(np.array(logits(load_draft(out))), np.array(want), atol=1e-5)

    # 8-bit: close to the float logits (relative Frobenius error); 4-bit: loads and proposes.
    for bits, bound in [(8, 0.05), (4, None)]:
        out = convert(path, tmp_path / f"q{bits}", quantize=True, q_bits=bits, q_group_size=32)
        q = load_draft(out)
        modules = dict(q.named_modules())
        assert isinstance(modules["candidate_selector.predecessor_codebook"], nn.QuantizedEmbedding)
        assert isinstance(modules["layers.0.attention_conv.kernel_projection"], nn.QuantizedLinear)
        got = logits(q)
        if bound:
            assert 0 < (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item() < bound
        drafts, qd = q.propose(block, taps, q.make_cache(), 1.0, mx.random.key(0))
        assert drafts.shape == (5,) and np.allclose(np.array(qd).sum(-1), 1, atol=1e-5)


# -- bad configs and checkpoints -------------------------------------------------


def _dflash(**kw):
    return lambda c: c["dflash_config"].update(kw)


BAD = {
    "missing selector field": (
        lambda c: c["dflash_config"].pop("selector_top_k"),
        "DFlash 2 drafter's config.json is missing dflash_config.selector_top_k",
    ),
    "missing conv fields": (
        lambda c: [c["dflash_config"].pop(k) for k in ("conv_kernel_size", "conv_group_size")],
        "missing dflash_config.conv_kernel_size, dflash_config.conv_group_size",
    ),
    "zero kernel": (_dflash(conv_kernel_size=0), "dflash_config.conv_kernel_size must be a positive integer, got 0"),
    "string rank": (_dflash(selector_rank="32"), "dflash_config.selector_rank must be a positive integer, got '32'"),
    "group not dividing hidden": (_dflash(conv_group_size=24), "conv_group_size 24 does not divide hidden_size 64"),
    "top-k past the vocabulary": (_dflash(selector_top_k=41), "selector_top_k 41 exceeds the 40-token vocabulary"),
}

BAD_WEIGHTS = {
    "codebook of the wrong vocabulary": (
        lambda w: w.update({"candidate_selector.predecessor_codebook": mx.zeros((39, 32))}),
        "misshapen tensors: candidate_selector.predecessor_codebook is (39, 32), expected (40, 32)",
    ),
    "codebook of the wrong rank": (
        lambda w: w.update({"candidate_selector.successor_codebook": mx.zeros((40, 16))}),
        "candidate_selector.successor_codebook is (40, 16), expected (40, 32)",
    ),
    "missing codebook": (
        lambda w: w.pop("candidate_selector.successor_codebook"),
        "missing tensors candidate_selector.successor_codebook",
    ),
    "missing static kernel": (
        lambda w: w.pop("layers.1.mlp_conv.base_kernel"),
        "missing tensors layers.1.mlp_conv.base_kernel",
    ),
    "kernel projection for another group size": (
        lambda w: w.update({"layers.0.attention_conv.kernel_projection.weight": mx.zeros((32, 64))}),
        "layers.0.attention_conv.kernel_projection.weight is (32, 64), expected (16, 64)",
    ),
}


def assert_one_sentence(err: ValueError, fragment: str) -> None:
    msg = str(err)
    assert fragment in msg, msg
    assert "\n" not in msg and msg.endswith(".") and ". " not in msg[:-1].replace("e.g. ", ""), msg


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_one_sentence(tmp_path, case):
    edit, fragment = BAD[case]
    cfg = dflash2_config(TCFG)
    weights = random_dflash2_weights(dflash2_config(TCFG))
    edit(cfg)
    path = write_zlab_draft(tmp_path / "d", cfg, weights, dtype=mx.float32)
    with pytest.raises(ValueError) as e:
        load_draft(path)
    assert_one_sentence(e.value, fragment)


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_bad_checkpoint_is_one_sentence(tmp_path, case):
    edit, fragment = BAD_WEIGHTS[case]
    cfg = dflash2_config(TCFG)
    weights = random_dflash2_weights(cfg)
    edit(weights)
    path = write_zlab_draft(tmp_path / "d", cfg, weights, dtype=mx.float32)
    for fn in (load_draft, lambda p: convert(p, tmp_path / "out")):
        with pytest.raises(ValueError) as e:
            fn(path)
        assert_one_sentence(e.value, fragment)
    assert not (tmp_path / "out").exists()


# -- decoding ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_greedy_equals_mlx_lm(tmp_path, family):
    """The current loop drafts the argmax of a DFlash 2 drafter's logits:
    output is the target's greedy decoding at every block size (a dense
    target, and the hybrid family of Qwen3.8-27B, the DFlash 2 pair)."""
    if family == "qwen3":
        tcfg = target_config("qwen3", vocab=24, layers=5)
        model = make_target(tcfg, seed=21)
    else:
        tcfg = family_config("qwen3_5", vocab=24, layers=4)
        model = make_family_target(tcfg, seed=21)
    cfg = dflash2_config(tcfg, block_size=16, taps=(0, 3), window=16, selector_top_k=4)
    draft = load_draft(write_zlab_draft(tmp_path / "d", cfg, random_dflash2_weights(cfg, seed=22), dtype=mx.float32))
    tok = make_tokenizer(24)
    rng = random.Random(0)
    for n, bs in [(1, 16), (9, 2), (40, 5), (100, 11)]:  # context past the window (16)
        prompt = [rng.randrange(23) for _ in range(n)]
        out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=30, block_size=bs) for t in r.tokens]
        assert out == greedy_reference(model, prompt, 30), (n, bs)


def sampled_selector_decode(target, draft, prompt, length, temperature, seed):
    """The loop a DFlash 2 cycle needs, written out plainly (the target run
    afresh each cycle): the selector samples drafts with their q, the target
    verifies [last, drafts], accept_proposals keeps a prefix plus a
    corrected or bonus token."""
    taps, bs = list(draft.config.target_layer_ids), 3
    logits, hidden = target(mx.array(prompt)[None], target.make_cache(), taps)
    p = reference_probs(np.array(logits[0, -1]), temperature, 1.0, 0)
    seq = list(prompt) + [int(np.random.default_rng(seed).choice(len(p), p=p / p.sum()))]
    key, accepted, rejected = mx.random.key(seed), 0, 0
    while len(seq) < len(prompt) + length:
        key, k_draft, k_accept = mx.random.split(key, 3)
        block = mx.array([[seq[-1]] + [draft.config.mask_token_id] * (bs - 1)])
        # The drafter's context: every committed position but the last (a causal target's taps stay exact).
        drafts, q = draft.propose(block, hidden[:, : len(seq) - 1], draft.make_cache(), temperature, k_draft)
        logits, hidden = target(mx.array(seq + drafts.tolist())[None], target.make_cache(), taps)
        result = accept_proposals(drafts, q, logits[0, len(seq) - 1 :], SamplingParams(temperature), k_accept).tolist()
        accepted, rejected = accepted + result[0], rejected + (result[0] < bs - 1)
        seq += result[1 : result[0] + 2]
    return seq[len(prompt) : len(prompt) + length], accepted, rejected


def check_sequence_distribution(model, sample, n: int = 700) -> None:
    """``sample(prompt, length, seed)`` -> (tokens, accepted, rejected), n
    seeds at temperature 1: both branches of the rule are taken, and the
    sequences follow the target's own distribution (chi-square, 1e-3)."""
    prompt, length = [1, 2, 3], 3
    seqs, expected = sequence_distribution(model, prompt, length, 1.0, 1.0, 0)
    index = {s: i for i, s in enumerate(seqs)}
    observed = np.zeros(len(seqs))
    accepted = rejected = 0
    for seed in range(n):
        out, a, r = sample(prompt, length, seed)
        observed[index[tuple(out)]] += 1
        accepted, rejected = accepted + a, rejected + r
    assert accepted > n // 10 and rejected > n // 10
    assert chi_square_pvalue(observed, n * expected) > 1e-3


def small_sampling_pair(tmp_path):
    """A 6-token target and a DFlash 2 drafter over it, for chi-square tests."""
    tcfg = target_config("qwen3", vocab=6, layers=3, hidden=32)
    model = make_target(tcfg, seed=7)
    model.update({"model": {"norm": {"weight": mx.full((32,), 1.5)}}})
    cfg = dflash2_config(tcfg, layers=1, block_size=3, taps=(1,), mask_token_id=5, selector_top_k=3, selector_rank=16)
    draft = load_draft(write_zlab_draft(tmp_path / "d", cfg, random_dflash2_weights(cfg, seed=8), dtype=mx.float32))
    return model, draft


def test_sampled_selector_with_the_general_rule_keeps_the_target_distribution(tmp_path):
    model, draft = small_sampling_pair(tmp_path)
    target = adapt(model)
    draft.bind(target)
    check_sequence_distribution(
        model, lambda prompt, length, seed: sampled_selector_decode(target, draft, prompt, length, 1.0, seed)
    )


def test_the_loop_samples_through_the_selector_and_keeps_the_target_distribution(tmp_path):
    """stream_generate with a DFlash 2 drafter at temperature > 0: drafts
    sampled by the selector, accepted by min(1, p/q), the sequences follow
    the target's own distribution."""
    from tiny import make_tokenizer

    from dflash_mlx import stream_generate

    model, draft = small_sampling_pair(tmp_path)
    tok = make_tokenizer(6)

    def sample(prompt, length, seed):
        responses = list(
            stream_generate(model, draft, tok, prompt, max_tokens=length, temperature=1.0, block_size=3, seed=seed)
        )
        return (
            [t for r in responses for t in r.tokens],
            sum(r.accepted for r in responses[1:]),
            sum(r.accepted < r.block_size - 1 for r in responses[1:]),
        )

    check_sequence_distribution(model, sample)
