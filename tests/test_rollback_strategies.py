"""The two rollbacks of a hybrid target's delta-net layers (recurrent.py):
``replay`` (re-run the kept steps from the saved state) and ``per-step``
(keep the state after every step of the verify, take the kept one). At every
accepted count both leave the same states, those of mlx-lm's plain decoding,
bit for bit alike; each makes the recurrence runs its cost counts; greedy
output equals mlx-lm's with either. Where replay is one kernel launch, the
machine measures it against per-step once and keeps the faster (replay
unmeasured, or under a policy; a damaged store is measured again)."""

import random

import mlx.core as mx
import numpy as np
import pytest
from family_models import family_config, greedy_over_blocks, make_family_target, scripted
from gated_delta_stand_in import checked_kernel  # noqa: F401 (a fixture)
from tiny import draft_config, make_draft, random_draft_weights

import dflash_mlx.targets.recurrent as recurrent
from dflash_mlx.kernels import decisions
from dflash_mlx.kernels.decisions import Decision
from dflash_mlx.kv.tree import from_parents
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
        runs = []
        real = recurrent.recurrence
        monkeypatch.setattr(
            recurrent, "recurrence", lambda *a, **k: runs.append((a[0].shape[1], "steps" in k)) or real(*a, **k)
        )
        per_step, held = verify_then_cut(target, "per-step", prompt, block, accepted)
        monkeypatch.undo()
        assert held == [B + 1] * len(per_step)
        # Per layer: the prefill (longer than a verify block) in one run, and
        # once more, limited, where the cycle names its length (it kept no
        # states); the verify one step a run, and nothing at its cut.
        assert len(prompt) > DeltaCache.per_step_longest
        assert runs == (
            [(len(prompt), False)] * len(per_step)
            + [(len(prompt), True)] * len(per_step)
            + [(1, False)] * len(per_step) * B
        )
        want = model.make_cache()
        model(mx.array(prompt + block[: accepted + 1])[None], cache=want)
        want = [w for w, linear in zip(want, target.linear) if linear]
        for r, p, w in zip(replay, per_step, want):
            mx.eval(r.ssm, p.ssm, r.conv, p.conv)
            assert mx.array_equal(r.ssm, p.ssm).item() and mx.array_equal(r.conv, p.conv).item(), accepted
            np.testing.assert_allclose(np.array(p.ssm), np.array(w[1]), atol=1e-5)
            np.testing.assert_allclose(np.array(p.conv), np.array(w[0]), atol=1e-5)
            assert p.pending is None and all(x.states is None for x in p.writes)  # the T states are let go


@pytest.mark.parametrize("strategy", ROLLBACKS)
def test_launches_per_cycle(model, monkeypatch, strategy):
    """The recurrence runs a cycle makes per delta-net layer (each one kernel
    launch where a kernel runs): replay, the verify's and the cut's; per-step,
    one a step and none at the cut."""
    target = adapt(model)
    prompt, block = list(range(5)), list(range(10, 10 + 16))
    cache = [DeltaCache(strategy) if isinstance(c, DeltaCache) else c for c in target.make_cache()]
    target(mx.array(prompt)[None], cache, [0])
    target.set_length(cache, len(prompt))
    runs = []
    real = recurrent.recurrence
    monkeypatch.setattr(
        recurrent, "recurrence", lambda *a, **k: runs.append((a[0].shape[1], "steps" in k)) or real(*a, **k)
    )
    target(mx.array(block)[None], cache, [0])
    target.set_length(cache, mx.array(len(prompt) + 3, mx.int32), len(prompt) + len(block))
    layers = sum(isinstance(c, DeltaCache) for c in cache)
    if strategy == "replay":
        assert runs == [(16, False)] * layers + [(16, True)] * layers
    else:
        assert runs == [(1, False)] * 16 * layers


def test_the_default_on_the_ops_path_is_per_step(model):
    """On the CPU the recurrence runs as ops, where a replay would run each
    step's ops again: the default keeps the verify's states."""
    target = adapt(model)
    cache = target.make_cache()
    target(mx.array([1, 2, 3])[None], cache, [0])
    target.set_length(cache, mx.array(3, mx.int32), 3)
    target(mx.array([4, 5, 6])[None], cache, [0])
    assert all(c.rollback is None and c.pending.states is not None for c in cache if isinstance(c, DeltaCache))


@pytest.mark.parametrize("strategy", ROLLBACKS)
def test_greedy_equals_mlx_lm_with_either_rollback(model, monkeypatch, strategy):
    monkeypatch.setattr(DeltaCache, "rollback", strategy)
    dcfg = draft_config(family_config("qwen3_5", vocab=VOCAB), layers=1, block_size=16)
    draft = scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=2)))
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 12, 90), (2, 5, 16), prefill_step_size=40)
    assert set(range(4)) <= accepted and max(accepted) >= 7


def test_an_unknown_rollback_is_one_sentence():
    assert ROLLBACKS == ("replay", "per-step")
    with pytest.raises(ValueError, match=r"^unknown rollback 'snapshot'; choose one of: replay, per-step\.$"):
        DeltaCache("snapshot")


# --- the rollback as this machine's measured decision (decisions.py) -------------------------------


def kernel_sized_model():
    """A Qwen3.5 layout whose delta-net shapes a kernel takes (Dk 32)."""
    cfg = family_config("qwen3_5", vocab=VOCAB, linear_key_head_dim=32, linear_value_head_dim=32)
    model = make_family_target(cfg, seed=1)
    model.eval()  # as mlx-lm's load leaves it: the kernels run only outside training
    return model


def rollbacks_used(target, tree: bool = False) -> set[str]:
    """The rollback each delta-net layer's verify, a block's or a tree's,
    took (per-step keeps the verify's states)."""
    cache = target.make_cache()
    target(mx.array(list(range(1, 9)))[None], cache, [0])
    target.set_length(cache, mx.array(8, mx.int32), 8)
    if tree:
        target.set_tree(cache, from_parents(mx.array([0, 0, 1, 1, 2, 0], mx.int32), 5))
    target(mx.array(list(range(10, 16)))[None], cache, [0])
    return {"replay" if c.pending.states is None else "per-step" for c in cache if isinstance(c, DeltaCache)}


CASES = {
    "float32 Hk=2 Hv=4 Dk=32 Dv=32 T=16, MLX's own: per-step",
    "float32 Hk=2 Hv=4 Dk=32 Dv=32 a tree of 16, MLX's own: per-step",
}


@pytest.mark.parametrize(
    "replay_ms, per_step_ms, used", [(2.0, 1.0, "per-step"), (1.0, 2.0, "replay"), (1.0, 1.01, "per-step")]
)
def test_the_rollback_is_the_one_this_machine_measured_faster(checked_kernel, measured, replay_ms, per_step_ms, used):
    timed = measured(replay_ms, per_step_ms)
    model = kernel_sized_model()
    target = adapt(model)
    assert rollbacks_used(target) == rollbacks_used(target, tree=True) == {used}
    assert len(timed) == 2  # a block and a tree at one shape, every delta-net layer's
    assert {d.kernel for d in decisions.current().all()} == {recurrent.ROLLBACK_DECISION}
    assert {d.case for d in decisions.current().all()} == CASES
    # remembered on this machine: the next process reads it and measures nothing
    decisions.reset()
    target = adapt(model)
    assert rollbacks_used(target) == rollbacks_used(target, tree=True) == {used}
    assert len(timed) == 2


def test_a_block_and_a_tree_follow_their_own_measurements(checked_kernel, measured, monkeypatch):
    measured(1.0, 2.0)
    model = kernel_sized_model()
    adapt(model)
    tree = next(d for d in decisions.current().all() if "tree" in d.case)
    decisions.current().record(Decision(tree.kernel, tree.case, 2.0e-3, 1.0e-3))  # replay slower for trees
    target = adapt(model)
    assert rollbacks_used(target) == {"replay"} and rollbacks_used(target, tree=True) == {"per-step"}


def test_a_real_measurement_times_both_and_is_followed(checked_kernel, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    decisions.reset()
    target = adapt(kernel_sized_model())
    block, tree = sorted(decisions.current().all(), key=lambda d: "tree" in d.case)
    assert {block.case, tree.case} == CASES
    assert all(d.ours > 0 and d.mlx > 0 for d in (block, tree))
    assert {launch[0] for launch in checked_kernel.launches} == {"write", "limited", "tree"}
    assert rollbacks_used(target) == {"replay" if block.faster else "per-step"}
    assert rollbacks_used(target, tree=True) == {"replay" if tree.faster else "per-step"}


def test_nothing_measured_keeps_the_arithmetic_default(checked_kernel, measured):
    """A forward never measures: where this machine measured nothing, replay (one launch)."""
    target = adapt(kernel_sized_model())  # (under the tests' policy `on`: not measured)
    timed = measured(2.0, 1.0)
    assert rollbacks_used(target) == rollbacks_used(target, tree=True) == {"replay"}
    assert timed == [] and decisions.current().all() == []


@pytest.mark.parametrize("policy", ["on", "off"])
def test_a_policy_keeps_the_default_whatever_was_measured(checked_kernel, measured, monkeypatch, policy):
    measured(2.0, 1.0)
    model = kernel_sized_model()
    assert rollbacks_used(adapt(model)) == {"per-step"}
    monkeypatch.setenv("DFLASH_MLX_KERNELS", policy)
    decisions.reset()
    assert rollbacks_used(adapt(model)) == {"replay"}


def test_a_damaged_store_is_ignored_with_a_warning(checked_kernel, measured):
    timed = measured(2.0, 1.0)
    model = kernel_sized_model()
    adapt(model)
    decisions.current().path.write_text('{"format": "dflash-mlx kernel decisions", "decisions": [')
    decisions.reset()
    with pytest.warns(RuntimeWarning, match="ignoring the kernel decisions in .*: it is not readable JSON"):
        target = adapt(model)
    assert len(timed) == 4  # measured again, and kept
    assert rollbacks_used(target) == {"per-step"}
    decisions.reset()
    assert rollbacks_used(adapt(model)) == {"per-step"} and len(timed) == 4


def test_where_replay_is_no_one_launch_nothing_is_measured(model, measured):
    """On the ops path (no kernel passed here) replay would re-run each step's ops: per-step, unmeasured."""
    timed = measured(1.0, 2.0)
    target = adapt(model)
    assert rollbacks_used(target) == rollbacks_used(target, tree=True) == {"per-step"}
    assert timed == [] and decisions.current().all() == []
