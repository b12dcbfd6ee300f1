"""Hybrid targets (qwen3_5, qwen3_5_moe, qwen3_next): gated delta-net layers
roll back exactly. A verify's rollback (either strategy) at every accepted
count leaves the states mlx-lm's plain decoding reaches; greedy output
equals mlx-lm's (this machine's default rollback, and replay) over
block sizes, prompt lengths, an EOS, a prompt cache across turns (extended,
shortened, repeated); an interrupt at any write, with blocks or trees,
leaves the next turn exact;
seeded sampling gives the target's own sampled text. Each runs with its
cycles built eagerly (the CPU's default) and through mx.compile (a GPU's),
where the delta-net states and their last writes go in and come back."""

import random

import mlx.core as mx
import numpy as np
import pytest
from family_models import check_eos, family_config, greedy_over_blocks, make_family_target, run, scripted
from test_sampling import plain_sampled
from tiny import draft_config, greedy_reference, make_draft, make_tokenizer, random_draft_weights

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.decode.traces import traces_for
from dflash_mlx.kv.buffer import BufferKVCache
from dflash_mlx.targets import adapt
from dflash_mlx.targets.hybrid import HybridTarget
from dflash_mlx.targets.recurrent import ROLLBACKS, DeltaCache

VOCAB = 48
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def make_pair(family: str, seed: int = 1, **extra):
    cfg = family_config(family, vocab=VOCAB, **extra)
    model = make_family_target(cfg, seed)
    dcfg = draft_config(cfg, layers=1, block_size=16)
    return model, scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1)))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    return make_pair(request.param)


@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_at_every_accepted_count_equals_plain_decoding(family, rollback, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    model, _ = make_pair(family)
    target = adapt(model)
    rng = random.Random(family)
    prompt = [rng.randrange(VOCAB) for _ in range(21)]
    B = 8
    block = [rng.randrange(VOCAB) for _ in range(B)]
    for a in range(B):  # a drafts accepted: a + 1 positions kept
        cache = target.make_cache()
        target(mx.array(prompt)[None], cache, [0])
        length = mx.array(len(prompt), mx.int32)
        target.set_length(cache, length, len(prompt))
        target(mx.array(block)[None], cache, [0])
        target.set_length(cache, length + a + 1, len(prompt) + B)  # on the device
        want = model.make_cache()
        model(mx.array(prompt + block[: a + 1])[None], cache=want)
        deltas = [(c, w) for c, w in zip(cache, want) if isinstance(c, DeltaCache)]
        assert deltas
        for c, w in deltas:
            np.testing.assert_allclose(np.array(c.conv), np.array(w[0]), atol=1e-5)
            np.testing.assert_allclose(np.array(c.ssm), np.array(w[1]), atol=1e-5)
        # ... and settling at any committed length restores it exactly.
        for n in (len(prompt) + a + 1, len(prompt) + (a + 1) // 2, len(prompt)):  # each settle drops what follows
            target.set_length(cache, n)
            want = model.make_cache()
            model(mx.array((prompt + block)[:n])[None], cache=want)
            for c, w in zip(cache, want):
                if isinstance(c, DeltaCache):
                    np.testing.assert_allclose(np.array(c.ssm), np.array(w[1]), atol=1e-5)
                    np.testing.assert_allclose(np.array(c.conv), np.array(w[0]), atol=1e-5)
                else:
                    assert c.offset == n


@pytest.mark.parametrize("rollback", [None, "replay"])  # this machine's default, and Metal's and CUDA's
def test_greedy_equals_mlx_lm(pair, rollback, compiled, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    model, draft = pair
    accepted = greedy_over_blocks(model, draft, VOCAB, (1, 12, 300), (2, 3, 8, 16), prefill_step_size=100)
    assert set(range(5)) <= accepted and max(accepted) >= 7  # short rollbacks and long blocks kept


def test_eos_and_prompt_cache_across_turns(pair, compiled):
    model, draft = pair
    prompt, ref = check_eos(model, draft, VOCAB, 25)

    cache = make_prompt_cache(model, draft)
    out1, _ = run(
        model, draft, prompt, ref, vocab=VOCAB, max_tokens=12, block_size=6, prompt_cache=cache, prefill_step_size=10
    )
    assert out1 == ref[:12]
    turn2 = prompt + out1 + [3, 4, 5]
    out2, _ = run(model, draft, turn2, vocab=VOCAB, max_tokens=16, block_size=4, prompt_cache=cache)
    assert out2 == greedy_reference(model, turn2, 16)
    # The same prompt again (its last id is read again), then an edit early
    # in the conversation: states no write kept, re-read from a checkpoint.
    for turn in (turn2, turn2[:7] + [1] + turn2[8:], prompt[:3]):
        out, _ = run(model, draft, turn, vocab=VOCAB, max_tokens=10, block_size=7, prompt_cache=cache)
        assert out == greedy_reference(model, turn, 10)
        assert cache.consistent()


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_turns_end_from_the_cycles_kept_writes(rollback, compiled, monkeypatch):
    """A reply's end (a queued cycle ran past it) and the next turn's cut
    back are restored from the last cycles' writes, compiled as eager:
    nothing is re-read from a checkpoint."""
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    reread = []
    real = HybridTarget._reread
    monkeypatch.setattr(HybridTarget, "_reread", lambda *a: reread.append(1) or real(*a))
    model, draft = make_pair("qwen3_5")
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 3, 5]
    cache = make_prompt_cache(model, draft)
    for max_tokens in (13, 7, 5, 9):
        want = greedy_reference(model, prompt, max_tokens)
        got, _ = run(model, draft, prompt, want, vocab=VOCAB, max_tokens=max_tokens, block_size=8, prompt_cache=cache)
        assert got == want and cache.consistent()
        prompt = prompt + got[:-1]  # the next turn cuts the last token back
    assert not reread
    assert compiled == any(key[0] == 8 for key in traces_for(adapt(model), draft).compiled)


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_a_plain_step_keeps_its_write_without_a_cut(rollback, compiled, monkeypatch):
    """A plain step's one-step write is kept whole (a cycle's cut keeps at
    least the token it read): its end state is the one its forward left, no
    recurrence runs again for the cut, and every turn is still the target's."""
    from test_deferred_feed import Scripted

    import dflash_mlx.generation as generation
    from dflash_mlx.targets.recurrent import Write

    monkeypatch.setattr(generation.block_memory, "chooser", lambda *a: Scripted([1]))
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    cuts = []  # the writes cut at a device length (a reply's end may restore one at a host length)
    real = Write.after

    def after(self, s):
        if not isinstance(s, int):
            cuts.append(self.steps)
        return real(self, s)

    monkeypatch.setattr(Write, "after", after)
    model, draft = make_pair("qwen3_5")
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 3, 5]
    cache = make_prompt_cache(model, draft)
    for max_tokens in (9, 6):
        want = greedy_reference(model, prompt, max_tokens)
        got, _ = run(
            model, draft, prompt, want, vocab=VOCAB, max_tokens=max_tokens, block_size="auto", prompt_cache=cache
        )
        assert got == want and cache.consistent()
        prompt = prompt + got[:-1] + [4]
    assert 1 not in cuts


class Interrupt:
    """KeyboardInterrupt at the ``at``-th write into any layer, attention or
    delta-net, of either model."""

    def __init__(self, monkeypatch, at: int):
        self.count, self.at = 0, at
        for cls, name in ((BufferKVCache, "write"), (DeltaCache, "forward")):
            monkeypatch.setattr(cls, name, self.wrap(getattr(cls, name)))

    def wrap(self, real):
        def counted(*args):
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt
            return real(*args)

        return counted


@pytest.mark.parametrize("block_size, tree_budget", [(3, None), (16, None), (8, 12)])
def test_an_interrupt_at_any_write_leaves_the_next_turn_exact(monkeypatch, compiled, block_size, tree_budget):
    model, draft = make_pair("qwen3_5", seed=4)
    rng = random.Random(block_size)
    cache = make_prompt_cache(model, draft)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(20)]
    for trial in range(6):
        conversation += [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 30))]
        ref = greedy_reference(model, conversation, 30)
        draft.set_script(conversation + ref)
        got = []
        with monkeypatch.context() as m:
            interrupt = Interrupt(m, at=rng.randrange(1, 120))
            with pytest.raises(KeyboardInterrupt):
                for r in stream_generate(
                    model,
                    draft,
                    make_tokenizer(VOCAB),
                    conversation,
                    max_tokens=30,
                    prompt_cache=cache,
                    block_size=block_size,
                    tree_budget=tree_budget,
                    prefill_step_size=rng.choice([7, 16, 64]),
                ):
                    got += r.tokens
                if interrupt.count < interrupt.at:
                    raise KeyboardInterrupt
        assert cache.consistent(), trial
        assert got == ref[: len(got)]
        conversation += got + [rng.randrange(VOCAB - 1)]
        want = greedy_reference(model, conversation, 10)
        out, _ = run(
            model,
            draft,
            conversation,
            want,
            vocab=VOCAB,
            max_tokens=10,
            block_size=block_size,
            tree_budget=tree_budget,
            prompt_cache=cache,
        )
        assert out == want, trial
        conversation += want


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_moe"])
def test_seeded_sampling_is_the_targets_own(family, compiled):
    """With a seed, the sampled text is the one the target alone samples with
    the same noise, at every block size (the picks are fixed per position)."""
    if family == "qwen3_moe":
        from test_families import make_pair as moe_pair

        model, draft = moe_pair(family)
    else:
        model, draft = make_pair(family)
    prompt = [3, 1, 4, 1, 5]
    for seed, (temperature, top_p, top_k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 5)]):
        want = plain_sampled(model, prompt, 24, seed, temperature, top_p, top_k)
        draft.set_script(prompt + want)
        for bs in (2, 6, 16):
            responses = list(
                stream_generate(
                    model,
                    draft,
                    make_tokenizer(VOCAB),
                    prompt,
                    max_tokens=24,
                    seed=seed,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    block_size=bs,
                )
            )
            assert [t for r in responses for t in r.tokens] == want, (seed, bs)
            assert any(r.accepted for r in responses[1:])
