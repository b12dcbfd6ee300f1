"""Conformance with the official Z Lab MLX code (`dflash.model_mlx`): the same
checkpoint gives the same drafter logits, and the same decode gives the same
tokens and accepted counts cycle by cycle. The official loop's greedy token is
the logits' argmax, ours mlx-lm's (the log-probabilities' argmax): they part
only at ties of rounding, which these float32 targets do not reach."""

import random

import dflash.model_mlx as dflash_official  # the oracle: pip install --no-deps dflash==0.1.0  # noqa: E402
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as official_cache  # noqa: E402
from tiny import (  # noqa: E402
    draft_config,
    lean_towards_one_token,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
    write_zlab_draft,
)

from dflash_mlx import load_draft, stream_generate  # noqa: E402
from dflash_mlx.targets import adapt  # noqa: E402


def official_load_draft(path, monkeypatch):
    # The official loader always goes through snapshot_download; point it at
    # the local directory instead.
    monkeypatch.setattr(dflash_official, "snapshot_download", lambda *a, **k: str(path))
    return dflash_official.load_draft(str(path))


VARIANTS = {
    "v1": {},
    "transformers5_yarn": {
        "rope_theta": None,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "rope_scaling_llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "sliding": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 9},
    "scaled_softcapped": {
        "dflash_extra": {"input_embedding_scale": 1.7, "output_multiplier": 0.6, "final_logit_softcapping": 3.0}
    },
    "causal_full": {"is_causal": True},
}


def variant_config(tcfg, name):
    extra = dict(VARIANTS[name])
    dflash_extra = extra.pop("dflash_extra", {})
    layers = len(extra.get("layer_types", [])) or 2
    cfg = draft_config(tcfg, layers=layers, block_size=6, taps=[0, 2, 4][:layers] if layers == 3 else [1, 4])
    for k, v in extra.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg["dflash_config"].update(dflash_extra)
    return cfg


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_logits_match_official(tmp_path, monkeypatch, variant):
    tcfg = target_config("qwen3", vocab=40, layers=6)
    model = make_target(tcfg, seed=11)
    cfg = variant_config(tcfg, variant)
    path = write_zlab_draft(tmp_path / variant, cfg, random_draft_weights(cfg, seed=12), dtype=mx.float32)

    ours = load_draft(path).bind(adapt(model))
    theirs = official_load_draft(path, monkeypatch).bind(model)
    assert list(ours.config.target_layer_ids) == list(theirs.config.target_layer_ids)
    assert ours.config.rope_theta == theirs.config.rope_theta

    our_cache, their_cache = ours.make_cache(), official_cache(theirs)
    device_cache = ours.make_cache()  # lengths held as arrays, as the pipelined loop holds them
    for c in device_cache:
        c.set_length(mx.array(0, mx.int32), 0)
    rng = np.random.default_rng(0)
    n_taps = len(cfg["dflash_config"]["target_layer_ids"]) * tcfg["hidden_size"]
    mask = cfg["dflash_config"]["mask_token_id"]
    history = []
    # Several cycles: a long first context (past any window), then short ones.
    for step, (ctx_len, bs) in enumerate([(23, 6), (3, 6), (1, 4), (6, 6), (2, 3)]):
        taps = mx.array(rng.standard_normal((1, ctx_len, n_taps)).astype(np.float32))
        history.append(taps)
        block = mx.array([[int(rng.integers(0, 39))] + [mask] * (bs - 1)])
        a = ours(block, taps, our_cache)
        # The oracle from scratch on the whole context so far ...
        fresh = theirs(block, mx.concatenate(history, axis=1), official_cache(theirs), logits_start=1)
        assert a.shape == fresh.shape == (1, bs - 1, tcfg["vocab_size"])
        np.testing.assert_allclose(np.array(a), np.array(fresh), rtol=1e-4, atol=1e-4, err_msg=f"{variant} step {step}")
        on_device = ours(block, taps, device_cache)
        np.testing.assert_allclose(
            np.array(on_device),
            np.array(fresh),
            rtol=1e-4,
            atol=1e-4,
            err_msg=f"{variant} step {step} (device lengths)",
        )
        # ... and incrementally, as its decode loop runs it. Its sliding layers
        # keep a rotating cache whose slots leave temporal order once it
        # wraps, while its mask assumes temporal order (the PyTorch reference
        # masks by position, as we do), so there only the fresh run is the oracle.
        incremental = theirs(block, taps, their_cache, logits_start=1)
        if variant != "sliding":
            np.testing.assert_allclose(np.array(a), np.array(incremental), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,bs", [("qwen3", 4), ("qwen3", 16), ("llama", 7)])
def test_decode_cycles_match_official_loop(tmp_path, monkeypatch, family, bs):
    tcfg = target_config(family, vocab=24, layers=5)
    ours_target = lean_towards_one_token(make_target(tcfg, seed=21), 0.36)
    their_target = lean_towards_one_token(make_target(tcfg, seed=21), 0.36)  # the official loop wraps its layers
    cfg = draft_config(tcfg, layers=2, block_size=bs, taps=[0, 3])
    path = write_zlab_draft(tmp_path / "d", cfg, random_draft_weights(cfg, seed=22), dtype=mx.float32)
    ours, theirs = load_draft(path), official_load_draft(path, monkeypatch)
    tok = make_tokenizer(24)
    rng = random.Random(bs)
    accepted = []
    for n in (1, 9, 60, 100):
        prompt = [rng.randrange(23) for _ in range(n)]
        a = list(stream_generate(ours_target, ours, tok, prompt, max_tokens=40, block_size=bs))
        b = [
            r
            for r in dflash_official.stream_generate(their_target, theirs, tok, prompt, block_size=bs, max_tokens=40)
            if r.tokens
        ]
        assert [t for r in a for t in r.tokens] == [t for r in b for t in r.tokens]
        # Cycle by cycle, until the official loop cuts its last blocks to the
        # tokens still wanted (dflash-mlx keeps the block and drops the excess).
        whole = [i for i, r in enumerate(b) if 40 - (sum(len(x.tokens) for x in b[:i])) >= bs]
        assert [r.tokens for r in a[: len(whole)]] == [r.tokens for r in b[: len(whole)]]
        # Official `accepted` counts committed tokens (drafts + bonus).
        for ra, rb in zip(a[1 : len(whole)], b[1 : len(whole)]):
            assert ra.accepted + 1 == rb.accepted
            accepted.append(ra.accepted)
    # Cycles that accepted none, some and all of their drafts were all compared.
    assert len(accepted) > 20
    assert 0 in accepted and bs - 1 in accepted and any(0 < a < bs - 1 for a in accepted), accepted


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("C,L,window", [(0, 8, 5), (3, 8, 5), (20, 6, 9), (20, 16, 4), (2, 3, None)])
def test_block_mask_is_positional(C, L, window, causal):
    """Z Lab's PyTorch reference masks by absolute position over context and
    block alike: causal keys at or before the query, windowed keys less than
    `window` positions away. (The official MLX loop leaves block keys out of
    the window, which differs only when the window is shorter than the block;
    published drafters use windows of 2048+ with blocks of 16.)"""
    from dflash_mlx.draft.dflash import block_mask

    mask = block_mask(L, C, causal, window)
    got = np.ones((L, C + L), dtype=bool) if mask is None else np.array(mask)
    for i in range(L):
        for j in range(C + L):
            q, k = C + i, j
            want = (not causal or k <= q) and (window is None or (q - k < window and (causal or k - q < window)))
            assert got[i, j] == want, (i, j)
