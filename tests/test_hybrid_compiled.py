"""Hybrid targets' cycles through mx.compile (as on a GPU; forced here on the
CPU) beyond test_hybrid.py: prompt lookup across prompt-cache turns and a
stale generator, log-probs, a DFlash 2 drafter, prompt-cache files saved
after a decode, seeded sampling with trees, replies crossing the buffers'
growth, generations interleaved over one pair's traces, and the states a
compiled decode leaves (the drafter's context included, which a scripted
drafter never reads) equal to an eager decode's. Run as a script, this file
is one rank of a pipelined hybrid target with compiled cycles
(test_distributed.py's ``runs``).

The scripted drafter's script is one of its arrays: each ``set_script``
makes new traces. Tests that need traces kept across generations script
the whole conversation once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dflash_mlx.decode.cycle import Cycle  # noqa: E402


def rank_main(target: str, draft: str, out: str) -> None:
    """One rank of a pipelined pair, every cycle compiled."""
    from test_distributed import runs

    from dflash_mlx import stream_generate
    from dflash_mlx.loading import load

    Cycle.compile_graphs = True
    group = mx.distributed.init()
    model, drafter, tokenizer = load(target, draft, group=group, split="pipeline", dtype="float32")
    result = runs(model, drafter, tokenizer, hybrid=True)
    long = [3, 17, 5, 9, 20, 11, 4] * 3
    result["long"] = [
        t
        for r in stream_generate(model, drafter, tokenizer, long, max_tokens=40, block_size="auto", tree_budget="auto")
        for t in r.tokens
    ]
    result["compiled"] = compiled_keys(drafter) > 0
    (Path(out) / f"rank{group.rank()}.json").write_text(json.dumps(result))


def compiled_keys(drafter) -> int:
    """How many compiled cycles the pair keeps."""
    from dflash_mlx.decode.traces import traces_for

    return len(traces_for(drafter.target, drafter).compiled)


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
    sys.exit(0)


from family_models import family_config, make_family_target, run  # noqa: E402
from test_hybrid import VOCAB, make_pair  # noqa: E402
from test_logprobs import check_against_reference  # noqa: E402
from test_lookup import copy_heavy  # noqa: E402
from test_sampling import plain_sampled  # noqa: E402
from tiny import (  # noqa: E402
    draft_config,
    greedy_reference,
    lean_towards_one_token,
    make_draft,
    make_tokenizer,
    random_draft_weights,
)

from dflash_mlx import make_prompt_cache, stream_generate  # noqa: E402
from dflash_mlx.cache.prompt import StaleGenerationError  # noqa: E402
from dflash_mlx.decode import loop  # noqa: E402
from dflash_mlx.draft.lookup import lookup_drafter  # noqa: E402
from dflash_mlx.targets.recurrent import DeltaCache  # noqa: E402


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    """Every cycle through mx.compile; the cycles made, to check they were."""
    made = []

    class Recorded(Cycle):
        compile_graphs = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(Cycle, "compile_graphs", True)
    monkeypatch.setattr(loop, "Cycle", Recorded)
    return made


def decoded(model, draft, prompt, **kw):
    responses = list(stream_generate(model, draft, make_tokenizer(VOCAB), prompt, **kw))
    return [t for r in responses for t in r.tokens], responses


def scripted_once(family: str, length: int, reply: int, seed: int = 1, p_right: float = 0.7):
    """A pair, and one sequence (a random start then mlx-lm's greedy reply)
    its drafter is scripted with for the whole test."""
    model, draft = make_pair(family, seed=seed)
    rng = random.Random(seed)
    start = [rng.randrange(VOCAB - 1) for _ in range(length)]
    sequence = start + greedy_reference(model, start, reply)
    draft.set_script(sequence, p_right=p_right)
    mx.eval(draft.script, draft.right)
    return model, draft, sequence


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("alone", [False, True], ids=["beside", "alone"])
def test_lookup_across_prompt_cache_turns_edits_and_a_stale_generator(family, alone, compiled):
    model, draft = make_pair(family)
    drafter = lookup_drafter(model) if alone else draft
    rng = random.Random(5)
    cache = make_prompt_cache(model, drafter)
    conversation = copy_heavy(rng, 14)
    hits = 0
    settings = [(6, True, None), ("auto", "auto", None), (8, True, 12), (4, "auto", "auto"), ("auto", True, None)]
    for turn, (bs, lookup, budget) in enumerate(settings):
        want = greedy_reference(model, conversation, 24)
        if not alone:
            draft.set_script(conversation + want)
        got, responses = decoded(
            model,
            drafter,
            conversation,
            max_tokens=24,
            block_size=bs,
            lookup=lookup,
            tree_budget=None if alone else budget,
            prompt_cache=cache,
        )
        assert got == want and cache.consistent(), turn
        hits += responses[-1].lookup_hits
        conversation = conversation + got + conversation[:5]
        if turn == 2:  # an edit early in the conversation: its states re-read
            conversation[4] = (conversation[4] + 1) % (VOCAB - 1)
    assert hits
    # A second generation takes the cache over from the first mid-reply.
    old = stream_generate(
        model,
        drafter,
        make_tokenizer(VOCAB),
        conversation,
        max_tokens=30,
        prompt_cache=cache,
        lookup=True,
        block_size=5,
    )
    next(old), next(old)
    newer = conversation[:20] + [5, 6]
    want = greedy_reference(model, newer, 20)
    if not alone:
        draft.set_script(newer + want)
    got, _ = decoded(model, drafter, newer, max_tokens=20, block_size=5, prompt_cache=cache, lookup=True)
    assert got == want
    with pytest.raises(StaleGenerationError):
        next(old)
    assert cache.consistent()
    follow = newer + got + newer[:6]
    want = greedy_reference(model, follow, 16)
    if not alone:
        draft.set_script(follow + want)
    got, _ = decoded(model, drafter, follow, max_tokens=16, block_size="auto", prompt_cache=cache, lookup="auto")
    assert got == want
    assert all(c.compiled for c in compiled)


@pytest.mark.parametrize("settings", [dict(block_size=6), dict(tree_budget=12), dict(block_size="auto")])
def test_logprobs_are_the_targets(settings, compiled):
    """Greedy and seeded-sampled, with blocks, trees and auto (plain steps):
    each token's log-prob and the top k are the target's own, and asking for
    them changes no token."""
    model, draft = make_pair("qwen3_5")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for k, sampling in ((3, {}), (0, {}), (2, dict(temperature=0.8, top_p=0.9, seed=3))):
        want = plain_sampled(model, prompt, 30, 3, 0.8, 0.9, 0) if sampling else greedy_reference(model, prompt, 30)
        draft.set_script(prompt + want)
        got, responses = decoded(model, draft, prompt, max_tokens=30, logprobs=k, **settings, **sampling)
        assert got == want, (k, sampling)
        assert any(r.accepted for r in responses[1:])
        check_against_reference(model, prompt, got, responses, k)
    assert all(c.compiled for c in compiled)


def dflash2_pair(tmp_path):
    """A qwen3_5 target and a DFlash 2 drafter over it, on a vocabulary small
    enough that a random drafter's drafts get accepted."""
    from test_dflash2 import dflash2_config, random_dflash2_weights
    from tiny import write_zlab_draft

    from dflash_mlx import load_draft

    tcfg = family_config("qwen3_5", vocab=8, layers=4)
    model = make_family_target(tcfg, seed=21)
    cfg = dflash2_config(
        tcfg, layers=1, block_size=8, taps=(1, 3), mask_token_id=7, selector_top_k=3, selector_rank=16, window=16
    )
    draft = load_draft(write_zlab_draft(tmp_path / "d", cfg, random_dflash2_weights(cfg, seed=8), dtype=mx.float32))
    return model, draft


def test_a_dflash2_drafter_greedy_and_seeded(tmp_path, compiled, monkeypatch):
    """Greedy: mlx-lm's tokens (context past the drafter's window). Seeded
    sampling (the selector's own rule, not the plain sampler's noise): the
    compiled cycles sample what the eager ones do."""
    model, draft = dflash2_pair(tmp_path)
    tok = make_tokenizer(8)
    rng = random.Random(0)
    accepted = set()
    for n, bs in [(1, 8), (9, 3), (40, 5), (30, "auto")]:
        prompt = [rng.randrange(7) for _ in range(n)]
        responses = list(stream_generate(model, draft, tok, prompt, max_tokens=40, block_size=bs))
        assert [t for r in responses for t in r.tokens] == greedy_reference(model, prompt, 40), (n, bs)
        accepted |= {r.accepted for r in responses[1:]}
    assert max(accepted) >= 2
    assert all(c.compiled for c in compiled)
    for seed in range(3):
        sampled = []
        for compile_graphs in (True, False):
            monkeypatch.setattr(loop.Cycle, "compile_graphs", compile_graphs)
            kw = dict(max_tokens=30, block_size=6, temperature=1.0, seed=seed)
            sampled.append([t for r in stream_generate(model, draft, tok, [1, 2, 3, 4, 5], **kw) for t in r.tokens])
        assert sampled[0] == sampled[1], seed


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_prompt_cache_file_saved_after_a_compiled_decode_continues_exactly(family, tmp_path, compiled):
    from dflash_mlx.cache.files import load_prompt_cache, save_prompt_cache

    model, draft, sequence = scripted_once(family, 30, 80)
    for settings in (dict(block_size=6), dict(tree_budget=12), dict(block_size="auto", lookup=True)):
        cache = make_prompt_cache(model, draft)
        got, _ = decoded(model, draft, sequence[:30], max_tokens=25, prompt_cache=cache, **settings)
        assert got == sequence[30:55]
        path = tmp_path / "cache.safetensors"
        save_prompt_cache(path, cache)
        for n in (58, 40):  # a follow-up past the saved tokens, and one cut back into them
            loaded, _ = load_prompt_cache(path, model, draft)
            got, _ = decoded(model, draft, sequence[:n], max_tokens=20, prompt_cache=loaded, **settings)
            assert got == sequence[n : n + 20], (settings, n)
            assert loaded.consistent()
    assert all(c.compiled for c in compiled)


@pytest.mark.parametrize("settings", [dict(block_size=6), dict(tree_budget=10), dict(block_size="auto")])
def test_a_stale_generator_leaves_the_cache_exact(settings, compiled):
    """A generation taken over mid-reply by one of the same prompt (cut
    back), of the prompt and what it had seen, and of one past its reply;
    each, and each next turn, exact."""
    model, draft, sequence = scripted_once("qwen3_5_moe", 18, 200)
    cache = make_prompt_cache(model, draft)
    tok = make_tokenizer(VOCAB)
    old = stream_generate(model, draft, tok, sequence[:18], max_tokens=30, prompt_cache=cache, **settings)
    seen = next(old).tokens + next(old).tokens + next(old).tokens
    assert seen == sequence[18 : 18 + len(seen)]
    for n in (18, 18 + len(seen) - 1, 40):  # (from 18 on the sequence is the greedy reply)
        got, _ = decoded(model, draft, sequence[:n], max_tokens=20, prompt_cache=cache, **settings)
        assert got == sequence[n : n + 20], n
        with pytest.raises(StaleGenerationError):
            next(old)
        follow = n + 20 + 3
        got, _ = decoded(model, draft, sequence[:follow], max_tokens=15, prompt_cache=cache, **settings)
        assert got == sequence[follow : follow + 15] and cache.consistent(), n
        old = stream_generate(model, draft, tok, sequence[: follow + 5], max_tokens=30, prompt_cache=cache, **settings)
        next(old), next(old)
    assert all(c.compiled for c in compiled)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_seeded_samples_with_trees_are_the_plain_samplers(family, compiled):
    model, draft = make_pair(family)
    prompt = [3, 1, 4, 1, 5]
    for seed, (temperature, top_p, top_k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 5)]):
        want = plain_sampled(model, prompt, 32, seed, temperature, top_p, top_k)
        draft.set_script(prompt + want)
        for settings in (
            dict(tree_budget=4),
            dict(tree_budget=16),
            dict(block_size="auto", tree_budget="auto"),
            dict(tree_budget=12, lookup=True),
        ):
            got, responses = decoded(
                model,
                draft,
                prompt,
                max_tokens=32,
                seed=seed,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                **settings,
            )
            assert got == want, (seed, settings)
            assert any(r.accepted for r in responses[1:])
    assert any("tree" in key for c in compiled for key in c.traces.compiled)


def test_long_replies_across_buffer_growth_and_edited_turns(compiled):
    """Replies of 230 tokens through one prompt cache (its buffers and the
    lookup history growing past 256 and 512 positions mid-reply), auto
    blocks and trees, each turn editing the conversation a third of the way in."""
    model, draft = make_pair("qwen3_5", seed=2)
    rng = random.Random(3)
    cache = make_prompt_cache(model, draft)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(40)]
    for settings in (
        dict(block_size="auto", tree_budget="auto"),
        dict(tree_budget=33),
        dict(block_size="auto", tree_budget="auto", lookup="auto"),
    ):
        want = greedy_reference(model, conversation, 230)
        got, responses = run(
            model, draft, conversation, want, vocab=VOCAB, max_tokens=230, prompt_cache=cache, **settings
        )
        assert got == want and cache.consistent(), settings
        conversation += got
        conversation[len(conversation) // 3] = (conversation[len(conversation) // 3] + 1) % (VOCAB - 1)
        conversation += [rng.randrange(VOCAB - 1) for _ in range(3)]
    assert len(conversation) > 512
    assert all(c.compiled for c in compiled)


def test_interleaved_generations_over_one_pairs_traces(compiled):
    """Three generations on their own caches (other lengths, blocks, trees,
    lookup and log-probs) advanced in turn, replaying one pair's traces:
    each is exact, and so is each cache's next turn."""
    model, draft, sequence = scripted_once("qwen3_next", 30, 330, seed=9)
    tok = make_tokenizer(VOCAB)
    starts = [30, 95, 200]
    settings = [
        dict(block_size=8),
        dict(tree_budget="auto", block_size="auto"),
        dict(block_size=5, lookup=True, logprobs=2),
    ]
    caches = [make_prompt_cache(model, draft) for _ in starts]
    gens = [
        stream_generate(model, draft, tok, sequence[:s], max_tokens=100, prompt_cache=c, **kw)
        for c, s, kw in zip(caches, starts, settings)
    ]
    outs = [[] for _ in gens]
    alive = set(range(len(gens)))
    while alive:
        for i in sorted(alive):
            try:
                outs[i] += next(gens[i]).tokens
            except StopIteration:
                alive.discard(i)
    for out, s in zip(outs, starts):
        assert out == sequence[s : s + 100], s
    for c, s, kw in zip(caches, starts, settings):
        n = s + 100 + 7
        got, _ = decoded(model, draft, sequence[:n], max_tokens=20, prompt_cache=c, **kw)
        assert got == sequence[n : n + 20] and c.consistent(), s
    assert len({id(c.traces) for c in compiled}) == 1  # one script: the traces were kept throughout


def real_pair(family: str):
    """A target leaning towards one token and a random (not scripted) drafter,
    whose drafts follow its own context."""
    cfg = family_config(family, vocab=VOCAB)
    model = make_family_target(cfg, 1)
    lean_towards_one_token(model.language_model if hasattr(model, "language_model") else model, 0.5)
    dcfg = draft_config(cfg, layers=1, block_size=8)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=2))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_compiled_decodes_leave_the_eager_ones_states(family, monkeypatch):
    """With a drafter that reads its context, compiled and eager decodes
    accept the same drafts each cycle and leave the same drafter context
    and delta-net states (blocks, trees, lookup beside the drafter)."""
    model, draft = real_pair(family)
    rng = random.Random(0)
    accepted = 0
    for settings in (dict(block_size=8), dict(tree_budget=10), dict(block_size=6, lookup=True)):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(20)]
        want = greedy_reference(model, prompt, 48)
        runs = []
        for compile_graphs in (True, False):
            monkeypatch.setattr(loop.Cycle, "compile_graphs", compile_graphs)
            cache = make_prompt_cache(model, draft)
            got, responses = decoded(model, draft, prompt, max_tokens=48, prompt_cache=cache, **settings)
            assert got == want, (settings, compile_graphs)
            runs.append(([r.accepted for r in responses], cache))
        (steps, compiled_cache), (eager_steps, eager_cache) = runs
        assert steps == eager_steps, settings
        accepted += sum(steps[1:])
        n = len(compiled_cache.tokens)
        for c, e in zip(compiled_cache.draft, eager_cache.draft):
            np.testing.assert_allclose(np.array(c.keys[..., :n, :]), np.array(e.keys[..., :n, :]), atol=1e-5)
            np.testing.assert_allclose(np.array(c.values[..., :n, :]), np.array(e.values[..., :n, :]), atol=1e-5)
        for c, e in zip(compiled_cache.target, eager_cache.target):
            if isinstance(c, DeltaCache):
                np.testing.assert_allclose(np.array(c.ssm), np.array(e.ssm), atol=1e-5)
                np.testing.assert_allclose(np.array(c.conv), np.array(e.conv), atol=1e-5)
    assert accepted


def test_pipelined_ranks_with_compiled_cycles_equal_one_process(tmp_path):
    """qwen3_5 over 2 ranks (mlx.launch, loopback): blocks, auto, trees, a
    seeded sample, prompt-cache turns and an early edit, every cycle compiled
    on each rank, give one compiled process's tokens, which are mlx-lm's."""
    from test_distributed import LAUNCH, PROMPT, launcher, runs, write_pair

    from dflash_mlx.loading import load

    if not Path(LAUNCH).is_file():
        pytest.skip("mlx.launch (MLX's launcher) is not installed")
    target, draft, model = write_pair(tmp_path, "qwen3_5", 4)
    alone_model, alone_draft, tokenizer = load(target, draft, dtype="float32")
    alone = runs(alone_model, alone_draft, tokenizer, hybrid=True)
    long = [3, 17, 5, 9, 20, 11, 4] * 3
    alone["long"] = [
        t
        for r in stream_generate(
            alone_model, alone_draft, tokenizer, long, max_tokens=40, block_size="auto", tree_budget="auto"
        )
        for t in r.tokens
    ]
    alone["compiled"] = compiled_keys(alone_draft) > 0
    assert alone["compiled"]
    assert alone["2"] == alone["trees"] == greedy_reference(model, PROMPT, len(alone["2"]))
    assert alone["long"] == greedy_reference(model, long, 40)
    out = tmp_path / "out"
    out.mkdir()
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [*launcher(2), sys.executable, str(Path(__file__).resolve()), str(target), str(draft), str(out)]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result == alone, f"rank {rank} differs from one process"
