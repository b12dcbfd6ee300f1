"""The two rollbacks of a hybrid target's delta-net layers (recurrent.py):
``replay`` (re-run the kept steps from the saved state) and ``per-step``
(keep the state after every step of the verify, take the kept one). At every
accepted count both leave the same states, those of mlx-lm's plain decoding,
and greedy output equals mlx-lm's with either."""

import random

import mlx.core as mx
import numpy as np
import pytest
from family_models import family_config, greedy_over_blocks, make_family_target, scripted
from tiny import draft_config, make_draft, random_draft_weights

import dflash_mlx.targets.recurrent as recurrent
from dflash_mlx.targets import adapt
from dflash_mlx.targets.recurrent import ROLLBACKS, DeltaCache

VOCAB = 48


@pytest.fixture(scope="module")
def model():
    return make_family_target(family_config("qwen3_5", vocab=VOCAB), seed=1)


def verify_then_cut(target, strategy: str, prompt, block, accepted: int):
    """Prefill, verify ``block``, keep accepted + 1 of its positions (the
    length an array, as the cycle passes it); the delta-net caches, and how
    many states each verify write held."""
    cache = target.make_cache()
    for i, c in enumerate(cache):
        if isinstance(c, DeltaCache):
            cache[i] = DeltaCache(strategy)
    target(mx.array(prompt)[None], cache, [0])
    length = mx.array(len(prompt), mx.int32)
    target.set_length(cache, length, len(prompt))
    target(mx.array(block)[None], cache, [0])
    held = [None if c.pending.states is None else c.pending.states.shape[0] for c in cache if isinstance(c, DeltaCache)]
    target.set_length(cache, length + accepted + 1, len(prompt) + len(block))
    return [c for c in cache if isinstance(c, DeltaCache)], held


def test_both_rollbacks_leave_the_same_states_as_plain_decoding(model, monkeypatch):
    target = adapt(model)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(19)]
    B = 8
    block = [rng.randrange(VOCAB) for _ in range(B)]
    for accepted in range(B):
        replay, held = verify_then_cut(target, "replay", prompt, block, accepted)
        assert held == [None] * len(replay)
        # The per-step cut is a take among the verify's states: no re-run.
        reruns, steps = [], []
        real, real_steps = recurrent.gated_delta_update, recurrent.gated_delta_ops
        monkeypatch.setattr(
            recurrent, "gated_delta_update", lambda *a, **k: reruns.append(a[0].shape[1]) or real(*a, **k)
        )
        monkeypatch.setattr(
            recurrent, "gated_delta_ops", lambda *a, **k: steps.append(a[0].shape[1]) or real_steps(*a, **k)
        )
        per_step, held = verify_then_cut(target, "per-step", prompt, block, accepted)
        monkeypatch.undo()
        assert held == [B + 1] * len(per_step)
        # The prefill (longer than a verify block) in one call, and once more
        # where the cycle names its length (a replay: it kept no states); the
        # verify one recurrence step per call (its gates made once), and
        # none at its cut.
        assert len(prompt) > DeltaCache.per_step_longest
        assert reruns == [len(prompt)] * 2 * len(per_step)
        assert steps == [1] * len(per_step) * B
        want = model.make_cache()
        model(mx.array(prompt + block[: accepted + 1])[None], cache=want)
        want = [w for w, linear in zip(want, target.linear) if linear]
        for r, p, w in zip(replay, per_step, want):
            mx.eval(r.ssm, p.ssm, r.conv, p.conv)
            assert mx.array_equal(r.ssm, p.ssm).item() and mx.array_equal(r.conv, p.conv).item(), accepted
            np.testing.assert_allclose(np.array(p.ssm), np.array(w[1]), atol=1e-5)
            np.testing.assert_allclose(np.array(p.conv), np.array(w[0]), atol=1e-5)
            assert p.pending is None and all(x.states is None for x in p.writes)  # the T states are let go


def test_greedy_equals_mlx_lm_with_per_step_rollback(model, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", "per-step")
    dcfg = draft_config(family_config("qwen3_5", vocab=VOCAB), layers=1, block_size=16)
    draft = scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=2)))
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 12, 90), (2, 5, 16), prefill_step_size=40)
    assert set(range(4)) <= accepted and max(accepted) >= 7


def test_an_unknown_rollback_is_one_sentence():
    assert ROLLBACKS == ("replay", "per-step")
    with pytest.raises(ValueError, match=r"^unknown rollback 'snapshot'; choose one of: replay, per-step\.$"):
        DeltaCache("snapshot")
