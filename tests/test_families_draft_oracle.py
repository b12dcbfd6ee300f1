"""Drafter logits against the official Z Lab MLX code (`dflash.model_mlx`)
on the target families whose own logits go past the raw output head: Gemma 4
(a final logit softcap) and Muse Glimmer (an output multiplier and a softcap);
and on three of the largest published drafters' targets, whose embedding and
head the drafter shares from elsewhere: Kimi K2.5 (under ``language_model``),
GLM-5 and MiniMax M2.

The official drafter shares the target's raw head (``lm_head`` or the tied
embedding) and applies only its own config's ``output_multiplier`` and
``final_logit_softcapping``, as Z Lab's PyTorch reference does (Hugging
Face's Gemma 4 caps in the causal-LM forward, not in ``lm_head``). So a
drafter whose config carries a softcap gets it once, and one whose config
carries none gets none, whatever the target's own head does; the target's
logits stay mlx-lm's.

Gemma 3 (no softcap of its own) differs from the official MLX code in one
known way: its drafter's block embeddings are scaled by sqrt(hidden) as the
target scales its own (DFLASH.md; Hugging Face's scaled embedding module
does it in the PyTorch reference), while the official MLX code looks for an
``embed_scale`` attribute that mlx-lm's gemma3_text lacks and scales by 1.
There the oracle is given the target's scale; no published drafter targets
Gemma 3."""

import dflash.model_mlx as dflash_official  # the oracle: pip install --no-deps dflash==0.1.0  # noqa: E402
import mlx.core as mx
import numpy as np
import pytest
from family_models import family_config, make_family_target
from mlx_lm.models.cache import make_prompt_cache as official_cache
from tiny import draft_config, random_draft_weights, write_zlab_draft

from dflash_mlx import load_draft
from dflash_mlx.targets import adapt

VOCAB = 40
CASES = {
    "gemma4_text": {"final_logit_softcapping": 3.0},
    "gemma4_text-no-cap": {},
    "gemma4": {"final_logit_softcapping": 3.0},
    "muse_glimmer": {"output_multiplier": 0.5, "final_logit_softcapping": 3.0},
    "muse_glimmer-no-cap": {},
    "gemma3_text": {"final_logit_softcapping": 3.0},
    "kimi_k25": {},
    "glm_moe_dsa": {},
    "minimax_m2": {},
}


@pytest.mark.parametrize("case", list(CASES))
def test_drafter_logits_match_official(tmp_path, monkeypatch, case):
    family = case.split("-")[0]
    cfg = family_config(family, vocab=VOCAB, layers=6)
    model = make_family_target(cfg, seed=31)
    text_cfg = {**cfg.get("text_config", cfg), "vocab_size": VOCAB}
    dcfg = draft_config(text_cfg, layers=2, block_size=6, taps=[1, 4])
    dcfg["dflash_config"].update(CASES[case])
    path = write_zlab_draft(tmp_path / "d", dcfg, random_draft_weights(dcfg, seed=32), dtype=mx.float32)
    monkeypatch.setattr(dflash_official, "snapshot_download", lambda *a, **k: str(path))

    target = adapt(model)
    ours = load_draft(path).bind(target)
    theirs = dflash_official.load_draft(str(path)).bind(model)
    if family == "gemma3_text":
        assert theirs.embed_scale == 1.0  # see the module docstring
        theirs.embed_scale = mx.array(text_cfg["hidden_size"] ** 0.5, mx.bfloat16).item()
    rng = np.random.default_rng(0)
    mask = dcfg["dflash_config"]["mask_token_id"]
    history = []
    cache = ours.make_cache()
    for ctx_len, bs in [(11, 6), (3, 6), (1, 4)]:
        taps = mx.array(rng.standard_normal((1, ctx_len, 2 * text_cfg["hidden_size"])).astype(np.float32))
        history.append(taps)
        block = mx.array([[int(rng.integers(0, VOCAB - 1))] + [mask] * (bs - 1)])
        a = ours(block, taps, cache)
        b = theirs(block, mx.concatenate(history, axis=1), official_cache(theirs), logits_start=1)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4, err_msg=case)

    # The target's own logits are still mlx-lm's, softcap and all.
    tokens = mx.array([[1, 5, 9, 2, 7, 30, 11]])
    logits, _ = target(tokens, target.make_cache(), [1])
    np.testing.assert_allclose(np.array(logits), np.array(model(tokens)), rtol=1e-4, atol=1e-4)
