"""Draft trees on hybrid targets (qwen3_5, qwen3_5_moe, qwen3_next): a tree's
verify gives each node the logits of mlx-lm's plain run over its
root-to-node path (each delta-net node from its ancestors' convolution
inputs and its parent's state), with either rollback, on the ops path and
through a kernel that passed its check; keep_path and the cut leave every
layer as a plain run over the accepted path, so decoding goes on exactly;
re-reads see the path's tokens. Decoding with trees is the target's own:
greedy equal to mlx-lm's across prompt-cache turns, seeded samples the plain
sampler's."""

import random

import mlx.core as mx
import numpy as np
import pytest
from family_models import family_config, make_family_target, run, scripted
from gated_delta_stand_in import checked_kernel  # noqa: F401 (a fixture)
from test_sampling import plain_sampled
from tiny import draft_config, greedy_reference, make_draft, make_tokenizer, random_draft_weights

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.kv.buffer import BufferKVCache
from dflash_mlx.kv.quantized import QuantizedBufferKVCache
from dflash_mlx.kv.tree import chain, from_parents
from dflash_mlx.targets import adapt
from dflash_mlx.targets.recurrent import ROLLBACKS, DeltaCache

VOCAB = 48
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_family_target(family_config(request.param, vocab=VOCAB), seed=1)


def random_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of ``n`` nodes (parents first), from deep chains to wide fans."""
    reach = rng.choice([1, 2, n])
    return [0] + [rng.randrange(max(0, t - reach), t) for t in range(1, n)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def plain_logits(model, tokens: list[int]) -> np.ndarray:
    """mlx-lm's own model over ``tokens`` from an empty cache: the last row's logits."""
    return np.array(model(mx.array(tokens)[None], cache=model.make_cache())[0, -1])


def verify_tree(target, prompt: list[int], parents: list[int], tokens: list[int], cache=None):
    """Prefill ``prompt``, then verify the tree's nodes at its length (an array, as the cycle passes it)."""
    cache = cache if cache is not None else target.make_cache()
    target(mx.array(prompt)[None], cache, [0])
    start = mx.array(len(prompt), mx.int32)
    target.set_length(cache, start, len(prompt))
    target.set_tree(cache, from_parents(mx.array(parents, mx.int32), len(parents)))
    logits, _ = target(mx.array(tokens)[None], cache, [0])
    target.set_tree(cache, None)
    return cache, start, logits


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_each_nodes_logits_are_a_plain_run_over_its_path(model, rollback, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    target = adapt(model)
    rng = random.Random(rollback)
    for n, prompt_length in ((1, 5), (6, 2), (12, 17), (20, 9)):
        parents = random_tree(rng, n)
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_length)]
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        _, _, logits = verify_tree(target, prompt, parents, tokens)
        for i in range(n):
            want = plain_logits(model, prompt + [tokens[j] for j in path_to(parents, i)])
            np.testing.assert_allclose(np.array(logits[0, i]), want, atol=1e-5, err_msg=f"{parents} node {i}")


def test_a_chain_verifies_as_a_block(model):
    """A chain as a tree gives the block's logits bit for bit."""
    target = adapt(model)
    prompt, block = list(range(1, 11)), list(range(20, 28))
    cache = target.make_cache()
    target(mx.array(prompt)[None], cache, [0])
    want, _ = target(mx.array(block)[None], cache, [0])
    cache = target.make_cache()
    target(mx.array(prompt)[None], cache, [0])
    target.set_tree(cache, chain(len(block)))
    got, _ = target(mx.array(block)[None], cache, [0])
    assert mx.array_equal(got, want).item()


def kept_states(target, prompt, parents, tokens, path, accepted):
    """Verify the tree, keep ``path`` (its first ``accepted`` + 1 nodes the
    accepted ones), cut on the device as the cycle does; the cache."""
    cache, start, _ = verify_tree(target, prompt, parents, tokens)
    target.keep_path(cache, start, mx.array(path, mx.int32))
    target.set_length(cache, start + accepted + 1, len(prompt) + len(tokens))
    return cache


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_keep_path_and_the_cut_leave_a_plain_runs_states(model, rollback, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    target = adapt(model)
    rng = random.Random(7)
    for trial in range(4):
        n = rng.choice([5, 9, 14])
        parents = random_tree(rng, n)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        deepest = max(range(n), key=lambda i: len(path_to(parents, i)))
        full = path_to(parents, deepest)
        accepted = rng.randrange(len(full))
        # past the accepted depth, the path holds any nodes
        path = full[: accepted + 1] + [rng.randrange(n) for _ in range(len(full) - accepted - 1)]
        cache = kept_states(target, prompt, parents, tokens, path, accepted)
        kept = prompt + [tokens[j] for j in full[: accepted + 1]]
        want = model.make_cache()
        model(mx.array(kept)[None], cache=want)
        for c, w in zip(cache, want):
            if isinstance(c, DeltaCache):
                np.testing.assert_allclose(np.array(c.conv), np.array(w[0]), atol=1e-6, err_msg=str(trial))
                np.testing.assert_allclose(np.array(c.ssm), np.array(w[1]), atol=1e-6, err_msg=str(trial))
        # ... so decoding goes on as over a cache that only saw the path
        more = [rng.randrange(VOCAB) for _ in range(3)]
        target.set_length(cache, mx.array(len(kept), mx.int32), len(kept))
        got, _ = target(mx.array(more)[None], cache, [0])
        for j in range(len(more)):
            want = plain_logits(model, kept + more[: j + 1])
            np.testing.assert_allclose(np.array(got[0, j]), want, atol=1e-5, err_msg=str(trial))


def test_both_rollbacks_keep_the_same_states(model):
    target = adapt(model)
    rng = random.Random(3)
    parents = random_tree(rng, 10)
    prompt = [rng.randrange(VOCAB) for _ in range(8)]
    tokens = [rng.randrange(VOCAB) for _ in range(10)]
    full = path_to(parents, 9)
    states = {}
    for rollback in ROLLBACKS:
        cache = [DeltaCache(rollback) if isinstance(c, DeltaCache) else c for c in target.make_cache()]
        cache = kept_states(target, prompt, parents, tokens, full, len(full) - 1)
        states[rollback] = [(c.conv, c.ssm) for c in cache if isinstance(c, DeltaCache)]
    for (conv_r, ssm_r), (conv_p, ssm_p) in zip(*states.values()):
        assert mx.array_equal(conv_r, conv_p).item() and mx.array_equal(ssm_r, ssm_p).item()


def test_re_reads_see_the_paths_tokens(model):
    """After the tree, later writes push its write out of the kept ones: a
    settle inside the path re-reads it from a checkpoint, by the logged ids."""
    target = adapt(model)
    rng = random.Random(11)
    parents = [0, 0, 1, 1, 3, 2, 5]
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    tokens = [rng.randrange(VOCAB) for _ in range(len(parents))]
    path = path_to(parents, 6)  # 0, 1, 2, 5, 6
    cache = kept_states(target, prompt, parents, tokens, path, len(path) - 1)
    kept = prompt + [tokens[j] for j in path]
    assert cache.ids(len(kept))[0] == kept
    for _ in range(DeltaCache.keep + 1):
        one = [rng.randrange(VOCAB)]
        target.set_length(cache, mx.array(len(kept), mx.int32), len(kept))
        target(mx.array(one)[None], cache, [0])
        kept += one
    for n in (len(prompt) + 3, len(prompt) + 1):
        target.set_length(cache, n)
        want = model.make_cache()
        model(mx.array(kept[:n])[None], cache=want)
        for c, w in zip(cache, want):
            if isinstance(c, DeltaCache):
                np.testing.assert_allclose(np.array(c.ssm), np.array(w[1]), atol=1e-6)
                np.testing.assert_allclose(np.array(c.conv), np.array(w[0]), atol=1e-6)


def test_an_unkept_tree_settles_at_its_root_and_refuses_another_write(model):
    """An interrupt between a tree's verify and its cut: the cache settles
    at the committed length or one past (the root), and no write follows a
    tree not yet cut."""
    target = adapt(model)
    prompt, tokens = list(range(1, 8)), [9, 10, 11, 12]
    for n, kept in ((len(prompt), False), (len(prompt) + 1, False), (len(prompt) + 1, True)):
        cache, start, _ = verify_tree(target, prompt, [0, 0, 1, 1], tokens)
        if kept:
            target.keep_path(cache, start, mx.array([0, 1, 3], mx.int32))
        delta = next(c for c in cache if isinstance(c, DeltaCache))
        with pytest.raises(RuntimeError, match="must be kept"):
            delta.forward(target.inner.layers[0].linear_attn, mx.zeros((1, 1, target.hidden_size)))
        if not kept:
            with pytest.raises(RuntimeError, match="cut after keep_path"):
                delta.set_length(start + 2, len(prompt) + len(tokens))
        target.set_length(cache, n)
        want = model.make_cache()
        model(mx.array((prompt + tokens)[:n])[None], cache=want)
        for c, w in zip(cache, want):
            if isinstance(c, DeltaCache):
                np.testing.assert_allclose(np.array(c.ssm), np.array(w[1]), atol=1e-6)


def test_takes_trees_over_its_own_caches_only(model):
    target = adapt(model)
    cache = target.make_cache()
    assert target.takes_trees(cache)
    quantized = [QuantizedBufferKVCache(64, 8) if isinstance(c, BufferKVCache) else c for c in cache]
    assert not target.takes_trees(quantized)


@pytest.mark.parametrize("rollback", [None, "per-step"])  # None: replay, where a kernel passed
def test_with_a_checked_kernel_a_tree_is_one_launch_and_its_cut_at_most_one_more(checked_kernel, rollback, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    cfg = family_config("qwen3_5", vocab=VOCAB, linear_key_head_dim=32, linear_value_head_dim=32)
    model = make_family_target(cfg, seed=2)
    model.eval()  # as mlx-lm's load leaves it: the kernels run only outside training
    target = adapt(model)
    layers = sum(isinstance(c, DeltaCache) for c in target.make_cache())
    parents, prompt, tokens = [0, 0, 1, 2, 1, 4, 0], list(range(1, 12)), list(range(20, 27))
    path = path_to(parents, 5)  # 0, 1, 4, 5
    cache, start, logits = verify_tree(target, prompt, parents, tokens)
    assert checked_kernel.launches[-layers:] == [("tree", len(parents))] * layers
    del checked_kernel.launches[:]
    target.keep_path(cache, start, mx.array(path, mx.int32))
    target.set_length(cache, start + 3, len(prompt) + len(parents))
    want = model.make_cache()
    model(mx.array(prompt + [tokens[j] for j in path[:3]])[None], cache=want)
    for c, w in zip(cache, want):
        if isinstance(c, DeltaCache):
            np.testing.assert_allclose(np.array(c.ssm), np.array(w[1]), atol=1e-6)
    assert checked_kernel.launches == ([] if rollback else [("limited", len(path))] * layers)
    for i in range(len(parents)):
        want = plain_logits(model, prompt + [tokens[j] for j in path_to(parents, i)])
        np.testing.assert_allclose(np.array(logits[0, i]), want, atol=1e-5)


def scripted_pair(family: str):
    cfg = family_config(family, vocab=VOCAB)
    dcfg = draft_config(cfg, layers=1, block_size=8)
    return make_family_target(cfg, seed=1), scripted(make_draft(dcfg, random_draft_weights(dcfg, seed=2)))


@pytest.mark.parametrize("rollback", [None, "replay"])  # this machine's default, and a GPU's
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_trees_equal_mlx_lm_across_prompt_cache_turns(family, rollback, monkeypatch):
    monkeypatch.setattr(DeltaCache, "rollback", rollback)
    model, draft = scripted_pair(family)
    rng = random.Random(family)
    cache = make_prompt_cache(model, draft)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(11)]
    accepted = set()
    for budget in (3, 16, 33, "auto"):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(3, 30))]
        want = greedy_reference(model, prompt, 24)
        got, responses = run(model, draft, prompt, want, vocab=VOCAB, max_tokens=24, tree_budget=budget)
        assert got == want, budget
        accepted |= {r.accepted for r in responses[1:]}
        conversation += [rng.randrange(VOCAB - 1)]
        want = greedy_reference(model, conversation, 16)
        got, _ = run(
            model, draft, conversation, want, vocab=VOCAB, max_tokens=16, tree_budget=budget, prompt_cache=cache
        )
        assert got == want and cache.consistent(), budget
        conversation += got
    assert {0, 1, 2} <= accepted and max(accepted) >= 4  # cuts at many depths


def test_seeded_samples_with_trees_are_the_plain_samplers():
    model, draft = scripted_pair("qwen3_5")
    prompt = [3, 1, 4, 1, 5]
    for seed, (temperature, top_p, top_k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 5)]):
        want = plain_sampled(model, prompt, 24, seed, temperature, top_p, top_k)
        draft.set_script(prompt + want)
        for budget in (4, 16):
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
                    tree_budget=budget,
                )
            )
            assert [t for r in responses for t in r.tokens] == want, (seed, budget)
            assert any(r.accepted for r in responses[1:])
