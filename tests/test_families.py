"""The MoE and sliding-window families (qwen3_moe, gpt_oss, gemma3_text,
gemma4_text, muse_glimmer): greedy DFlash output equals mlx-lm's own greedy decoding token
for token, over block sizes, prompt lengths past the sliding window, an EOS,
a prompt cache reused across turns, and 4-bit weights."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from family_models import check_turns, family_config, greedy_over_blocks, make_family_target, run, scripted
from test_families_large import FAMILY as LARGE_ADAPTERS
from tiny import draft_config, greedy_reference, make_draft, random_draft_weights

from dflash_mlx.targets import ADAPTERS, adapt

VOCAB = 48
FAMILIES = ["qwen3_moe", "gpt_oss", "gemma3_text", "gemma4_text", "muse_glimmer"]


def make_pair(family: str, seed: int = 1, quantize: bool = False):
    cfg = family_config(family, vocab=VOCAB, layers=6 if family.startswith("gemma") else 4)
    model = make_family_target(cfg, seed)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    dcfg = draft_config(cfg, layers=1, block_size=16)
    return model, scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1)))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    return make_pair(request.param)


def test_every_family_is_registered():
    assert set(FAMILIES) <= set(ADAPTERS)
    for family in FAMILIES:
        model, _ = make_pair(family)
        assert adapt(model).family == family


def test_greedy_equals_mlx_lm(pair):
    model, draft = pair
    # Prompts past the sliding window (8) and past a buffer growth (256).
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 11, 300), (2, 4, 7, 16), prefill_step_size=45)
    assert set(range(7)) <= accepted  # rollbacks of every short length


def test_eos_and_prompt_cache_across_turns(pair):
    model, draft = pair
    check_turns(model, draft, VOCAB)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_target(family):
    model, draft = make_pair(family, seed=5, quantize=True)
    prompt = list(range(1, 30))
    tokens, _ = run(model, draft, prompt, vocab=VOCAB, max_tokens=24, block_size=4)
    assert tokens == greedy_reference(model, prompt, 24)


def test_muse_glimmer_shares_the_raw_embedding_and_head_with_the_drafter():
    """The target's forward normalizes the embeddings and scales and caps the
    logits (as mlx-lm's model does); the drafter gets the raw table and head,
    as Z Lab's reference feeds it (its own config holds the multiplier/cap)."""
    model, _ = make_pair("muse_glimmer")
    target, tokens = adapt(model), mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    assert mx.array_equal(target.embed(tokens), model.model.embed_tokens(tokens)).item()
    h = mx.random.normal((1, 2, 64))
    assert mx.allclose(target.lm_head(h), model.lm_head(h)).item()
    logits, _ = target(tokens, target.make_cache(), [1])
    assert mx.allclose(logits, model(tokens), atol=1e-5).item()
    assert mx.abs(logits).max().item() < 4.0  # the cap is applied


def test_the_registry_says_runs_only_for_tested_families():
    from mlx_lm.utils import MODEL_REMAPPING

    from dflash_mlx.loading import FAMILIES as REGISTRY
    from dflash_mlx.loading import family_runs, why_not_runs

    tested = {
        "qwen3",
        "llama",
        *FAMILIES,
        "gemma3",
        "gemma4",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        *LARGE_ADAPTERS.values(),
        "kimi_k25",
    }  # test_greedy, here, test_families_wrappers, test_hybrid, test_families_large
    assert set(ADAPTERS) == tested
    for target, family in REGISTRY.items():
        runs = family in tested or MODEL_REMAPPING.get(family) in tested  # e.g. minimax_m2 is mlx-lm's minimax
        assert family_runs(family) == runs and (why_not_runs(target) is None) == runs
