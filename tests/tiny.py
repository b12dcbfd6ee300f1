"""The tiny random models of dflash_mlx.tiny, under the name the tests
import (``from tiny import ...``), and a test-only tweak of a target."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.tiny import (  # noqa: F401  (re-exported for the tests)
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    mean_acceptance,
    random_draft_weights,
    target_config,
    write_target,
    write_zlab_draft,
)


def lean_towards_one_token(model: nn.Module, strength: float, seed: int = 99) -> nn.Module:
    """Add one shared direction to every token embedding, so the target
    often predicts the same token and a random drafter, which shares the
    embedding, agrees with it part of the time: cycles then accept none,
    some or all of their drafts."""
    mx.random.seed(seed)
    embed = model.model.embed_tokens
    embed.weight = embed.weight + strength * mx.random.normal((embed.weight.shape[1],))
    mx.eval(embed.weight)
    return model
