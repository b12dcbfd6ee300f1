"""Sampling stays lossless on a hybrid (qwen3_5: delta-net rollback), a
MoE (qwen3_moe) and a latent, sparse-attention (glm_moe_dsa) target: DFlash's sampled sequences follow the target's own
sequence distribution (chi-square, as in test_sampling)."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from family_models import family_config, make_family_target
from mlx.utils import tree_flatten
from test_sampling import ALPHA, chi_square_pvalue, sequence_distribution
from tiny import draft_config, make_draft, make_tokenizer, random_draft_weights

from dflash_mlx import stream_generate


class WithVocab:
    """The target as sequence_distribution reads it (qwen3_5 keeps its
    vocabulary size in a text config)."""

    def __init__(self, model, vocab: int):
        self.model, self.args = model, SimpleNamespace(vocab_size=vocab)

    def __call__(self, tokens):
        return self.model(tokens)


def small_pair(family: str):
    # GLM-5's indexer keeps 3 of the 3..6 positions here, so it selects.
    extra = {"index_topk": 3} if family == "glm_moe_dsa" else {}
    cfg = family_config(family, vocab=6, layers=2, hidden=32, **extra)
    model = make_family_target(cfg, seed=7)
    # A softer final norm than the family tests' so no sequence is negligible.
    norm = next(k for k, _ in tree_flatten(model.parameters()) if k.endswith("model.norm.weight"))
    model.load_weights([(norm, mx.full((32,), 1.5))], strict=False)
    dcfg = draft_config(cfg, layers=1, block_size=3, taps=[1], mask_token_id=5)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=8)), make_tokenizer(6)


@pytest.mark.parametrize(
    "family,temperature,top_p,top_k",
    [("qwen3_5", 1.0, 1.0, 0), ("qwen3_moe", 0.8, 0.9, 0), ("glm_moe_dsa", 1.0, 1.0, 0)],
)
def test_sampled_sequences_follow_the_target(family, temperature, top_p, top_k):
    model, draft, tok = small_pair(family)
    prompt, length, n = [1, 2, 3], 3, 800
    seqs, expected = sequence_distribution(WithVocab(model, 6), prompt, length, temperature, top_p, top_k)
    index = {s: i for i, s in enumerate(seqs)}
    observed = np.zeros(len(seqs))
    accepted = rejected = 0
    for seed in range(n):
        responses = list(
            stream_generate(
                model,
                draft,
                tok,
                prompt,
                max_tokens=length,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                block_size=3,
                seed=seed,
            )
        )
        observed[index[tuple(t for r in responses for t in r.tokens)]] += 1
        accepted += sum(r.accepted for r in responses[1:])
        rejected += sum(r.accepted < r.block_size - 1 for r in responses[1:])
    assert accepted > n // 40 and rejected > n // 40  # both branches of the rule
    assert chi_square_pvalue(observed, n * expected) > ALPHA
