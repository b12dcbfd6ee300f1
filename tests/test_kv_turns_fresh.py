"""What docs/cli.md ("KV caches across turns") says of a fresh run of a
whole two-turn conversation against the conversation itself (mlx-lm's own
cache kept across turns, which DFlash's turns equal: test_kv_quantized,
test_kv_rotating): with --kv-bits they agree when quantization begins at the
same position in both, and may differ otherwise; with --max-kv-size they
agree while everything fits under the bound."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny import make_target, target_config

VOCAB = 48
SEEDS = range(6)


@pytest.fixture(scope="module")
def model():
    return make_target(target_config("qwen3", vocab=VOCAB, hidden=128), seed=5)  # head_dim 32


def run(model, prompt, n, step, cache=None, **kv):
    return [
        t
        for t, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=n,
            sampler=lambda x: mx.argmax(x, -1),
            prompt_cache=cache,
            prefill_step_size=step,
            **kv,
        )
    ]


def agreements(model, first: int, step: int, **kv) -> int:
    """Of two-turn conversations (a first prompt of ``first`` tokens, a
    12-token reply, 5 new tokens, a 25-token reply), how many give the same
    second reply as a fresh run of the whole conversation."""
    same = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        p1, n2 = [rng.randrange(VOCAB - 1) for _ in range(first)], [rng.randrange(VOCAB - 1) for _ in range(5)]
        cache = make_prompt_cache(model, max_kv_size=kv.get("max_kv_size"))
        r1 = run(model, p1, 12, step, cache, **kv)
        same += run(model, n2, 25, step, cache, **kv) == run(model, p1 + r1 + n2, 25, step, **kv)
    return same


def quantized(start):
    return dict(kv_bits=4, kv_group_size=32, quantized_kv_start=start)


def test_quantized_from_0_with_a_first_prompt_shorter_than_a_step_may_differ(model):
    assert agreements(model, 10, 2048, **quantized(0)) < len(SEEDS)


@pytest.mark.parametrize("first,step,start", [(10, 4, 0), (13, 4, 6), (9, 4, 8)])
def test_quantized_from_the_end_of_a_full_step_in_the_first_prompt_agrees(model, first, step, start):
    assert agreements(model, first, step, **quantized(start)) == len(SEEDS)


@pytest.mark.parametrize("first,step,start", [(8, 4, 6), (8, 4, 7)])
def test_quantized_from_the_first_prompts_end_may_differ(model, first, step, start):
    """Reached at the first prompt's last chunk or last token (read alone):
    a fresh run has no chunk boundary there."""
    assert agreements(model, first, step, **quantized(start)) < len(SEEDS)


@pytest.mark.parametrize("step", [2048, 4])
def test_quantized_from_past_the_last_prompt_agrees(model, step):
    assert agreements(model, 10, step, **quantized(27)) == len(SEEDS)  # the last prompt: 10 + 12 + 5 tokens


def test_bounded_agrees_while_everything_fits(model):
    assert agreements(model, 10, 4, max_kv_size=60) == len(SEEDS)  # 27 + a 25-token reply
