"""The drafter's context under max_kv_size, for every RoPE mlx-lm makes:
kept keys are turned back exactly (so the context stays bounded), and a RoPE
that cannot be turned back is refused in one sentence, never left to grow."""

import mlx.core as mx
import pytest
from mlx_lm.models.rope_utils import initialize_rope
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.kv.rotating import DraftWindowCache, can_shift, shift_rope

VOCAB = 48
D = 16  # head_dim
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0] * (D // 2),
        "long_factor": [1.0 + i / 4 for i in range(D // 2)],
    },
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 1.0},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_shift_turns_keys_to_other_positions(kind):
    rope = initialize_rope(
        D, base=10000.0, traditional=False, scaling_config=SCALINGS[kind], max_position_embeddings=4096
    )
    assert can_shift(rope)
    x = mx.random.normal((1, 2, 5, D), key=mx.random.key(0))
    for p, delta in [(40, -37), (300, -250), (3, 9)]:
        got = shift_rope(rope, rope(x, offset=p), delta)
        assert mx.allclose(got, rope(x, offset=p + delta), atol=1e-4), (p, delta)


def tiny_pair(rope_scaling):
    tcfg = target_config("qwen3", vocab=VOCAB, hidden=64)
    dcfg = draft_config(tcfg, layers=2, block_size=8, rope_scaling=rope_scaling)
    return make_target(tcfg, seed=5), make_draft(dcfg, random_draft_weights(dcfg, seed=6))


@pytest.mark.parametrize("kind", ["longrope", "yarn"])
def test_the_drafter_context_stays_bounded(kind):
    model, draft = tiny_pair(SCALINGS[kind])
    cache = make_prompt_cache(model, draft, max_kv_size=8)
    prompt = [1, 2, 3]
    out = [
        t
        for r in stream_generate(
            model, draft, make_tokenizer(VOCAB), prompt, max_tokens=400, block_size=4, prompt_cache=cache
        )
        for t in r.tokens
    ]
    assert len(out) == 400 and cache.consistent()
    window = cache.target[0].slots
    assert all(type(c) is DraftWindowCache and c.base > 0 and c.offset <= window + c.step for c in cache.draft)


def test_a_rope_without_a_fixed_rotation_is_refused():
    model, draft = tiny_pair({"rope_type": "dynamic", "factor": 2.0})
    assert not can_shift(draft.rope)
    with pytest.raises(
        ValueError,
        match=r"^max_kv_size cannot bound this drafter's context: its RoPE "
        r"\(DynamicNTKScalingRoPE\) .*; run without max_kv_size\.$",
    ):
        make_prompt_cache(model, draft, max_kv_size=8)
    make_prompt_cache(model, draft)  # unbounded: fine
