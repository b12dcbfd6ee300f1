"""Draft trees (draft/tree.py, kv/tree.py): the tree is the best-first
prefixes over the drafter's candidates; a tree's verify gives every node
the logits of a plain run over its path, on every family that takes trees;
decoding with trees is the target's own, greedy token for token and seeded
samples the plain sampler's, at every budget and auto, with lookup, across
prompt-cache turns and stopped generators."""

import itertools
import math
import random

import mlx.core as mx
import pytest
from family_models import LARGE, family_config, make_family_target
from test_sampling import plain_sampled
from tiny import (
    draft_config,
    greedy_reference,
    make_draft,
    make_target,
    make_tokenizer,
    random_draft_weights,
    target_config,
)

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.draft.tree import TreeParams, accepted_path, build_tree
from dflash_mlx.kv.tree import chain, from_parents
from dflash_mlx.targets import adapt

VOCAB = 48
TREE_FAMILIES = [
    "qwen3",
    "llama",
    "qwen3_moe",
    "gpt_oss",
    "gemma3_text",
    "gemma4_text",
    "muse_glimmer",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    *LARGE,
]


def paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's token path from the root (the root's own token left out)."""
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j != 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return out


def test_a_tree_keeps_the_most_probable_prefixes():
    rng = random.Random(0)
    for trial in range(40):
        depth, vocab, k = rng.randrange(1, 5), rng.randrange(3, 9), rng.randrange(1, 4)
        logits = mx.random.normal((depth, vocab), key=mx.random.key(trial)) * 2
        logp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
        ranked = [sorted(range(vocab), key=lambda t: -row[t])[:k] for row in logp]
        params = TreeParams(depth + 1, k)
        for budget in range(1, 24):
            rows = params.rows(budget)
            tokens, layout = build_tree(logits, rows, k) if rows > 1 else (mx.zeros((1,), mx.int32), chain(1))
            parents = layout.parents.tolist()
            assert all(p < i for i, p in enumerate(parents) if i) and parents[0] == 0
            got = paths(tokens.tolist(), parents)
            assert len(set(got)) == rows  # no prefix twice
            assert layout.depths.tolist() == [len(p) for p in got]
            # every prefix over each depth's top k, by log-probability
            every = [p for d in range(1, depth + 1) for p in itertools.product(*ranked[:d])]
            score = {p: sum(logp[i][t] for i, t in enumerate(p)) for p in every}
            want = {(), *sorted(every, key=lambda p: -score[p])[: rows - 1]}
            assert set(got) == want, (trial, budget)
            assert rows == min(budget, 1 + len(every))


def test_a_looked_up_chain_joins_the_tree_first_where_it_was_found():
    rng = random.Random(4)
    for trial in range(30):
        depth, vocab, k = rng.randrange(2, 6), 9, rng.randrange(1, 4)
        logits = mx.random.normal((depth, vocab), key=mx.random.key(100 + trial)) * 2
        chain_tokens = [rng.randrange(vocab) for _ in range(depth)]
        for budget in (2, depth + 1, 2 * depth + 3):
            rows = TreeParams(depth + 1, k).rows(budget)
            plain, plain_layout = build_tree(logits, rows, k)
            for hit in (False, True):
                tokens, layout = build_tree(logits, rows, k, mx.array(chain_tokens), mx.array(hit))
                got = paths(tokens.tolist(), layout.parents.tolist())
                if not hit:  # nothing found: the drafter's tree
                    assert set(got) == set(paths(plain.tolist(), plain_layout.parents.tolist()))
                    continue
                looked = [tuple(chain_tokens[:d]) for d in range(1, depth + 1)][: rows - 1]
                assert set(looked) <= set(got), (trial, rows)


def test_the_walk_keeps_the_deepest_path_the_target_agrees_with():
    rng = random.Random(1)
    for trial in range(200):
        n = rng.randrange(1, 12)
        parents = [0] + [rng.randrange(i) for i in range(1, n)]
        tokens = [0] + [rng.randrange(3) for _ in range(1, n)]
        target = [rng.randrange(3) for _ in range(n)]
        layout = from_parents(mx.array(parents, mx.int32), n)
        depth = max(layout.depths.tolist())
        accepted, path = accepted_path(mx.array(tokens), layout, mx.array(target), depth)
        kept = [i for i in range(n) if all(tokens[j] == target[parents[j]] for j in lineage(parents, i) if j)]
        deepest = max(len(lineage(parents, i)) - 1 for i in kept)
        assert accepted.item() == deepest
        walked = path.tolist()[: deepest + 1]
        assert walked[0] == 0 and all(parents[b] == a for a, b in zip(walked, walked[1:]))
        assert all(tokens[b] == target[a] for a, b in zip(walked, walked[1:]))


def lineage(parents, i):
    out = [i]
    while i:
        i = parents[i]
        out.append(i)
    return out


def family_pair(family: str, block: int = 8):
    if family in ("qwen3", "llama"):
        cfg = target_config(family, vocab=VOCAB, layers=4)
        model = make_target(cfg, seed=1)
    else:
        cfg = family_config(family, vocab=VOCAB, layers=6 if family.startswith("gemma") else 4)
        model = make_family_target(cfg, seed=1)
    dcfg = draft_config(cfg.get("text_config", cfg), layers=1, block_size=block)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=2))


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_a_tree_verify_gives_each_node_its_paths_logits(family):
    """Logits and tapped states of every node of a random tree, verified
    after a prompt longer than the sliding windows, equal a plain run over
    the node's path; after keeping one path, decoding goes on as over a cache
    that only ever saw it."""
    model, _ = family_pair(family)
    target = adapt(model)
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(11)]
    n = 9
    parents = [0] + [rng.randrange(i) for i in range(1, n)]
    nodes = [prompt[-1]] + [rng.randrange(VOCAB) for _ in range(1, n)]
    layout = from_parents(mx.array(parents, mx.int32), n)

    cache = target.make_cache()
    assert target.takes_trees(cache)
    target(mx.array(prompt[:-1])[None], cache, [0])
    start = len(prompt) - 1
    target.set_tree(cache, layout)
    logits, hidden = target(mx.array(nodes)[None], cache, [0, 1])
    target.set_tree(cache, None)
    for i in range(n):
        path = [nodes[j] for j in reversed(lineage(parents, i))]
        fresh = target.make_cache()
        want, want_hidden = target(mx.array(prompt[:-1] + path)[None], fresh, [0, 1])
        assert mx.allclose(logits[0, i], want[0, -1], atol=2e-4, rtol=2e-4).item(), (family, i)
        assert mx.allclose(hidden[0, i], want_hidden[0, -1], atol=2e-4, rtol=2e-4).item(), (family, i)

    deepest = max(range(n), key=lambda i: len(lineage(parents, i)))
    keep = list(reversed(lineage(parents, deepest)))
    path = keep + [0] * (n - len(keep))
    target.keep_path(cache, mx.array(start, mx.int32), mx.array(path[: layout.depths.max().item() + 1], mx.int32))
    target.set_length(cache, mx.array(start + len(keep), mx.int32), start + n)
    follow = [rng.randrange(VOCAB) for _ in range(3)]
    got, _ = target(mx.array(follow)[None], cache, [0])
    want, _ = target(mx.array(prompt[:-1] + [nodes[j] for j in keep] + follow)[None], target.make_cache(), [0])
    assert mx.allclose(got[0], want[0, -3:], atol=2e-4, rtol=2e-4).item()


def decoded(model, draft, prompt, **kw):
    responses = list(stream_generate(model, draft, make_tokenizer(VOCAB), prompt, **kw))
    return [t for r in responses for t in r.tokens], responses


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_greedy_trees_equal_mlx_lm_on_every_family(family):
    model, draft = family_pair(family)
    rng = random.Random(3)
    for i, (budget, lookup) in enumerate([(2, False), (9, True), (33, False), ("auto", "auto")]):
        prompt = [rng.randrange(VOCAB) for _ in range(9 + 5 * i)]
        want = greedy_reference(model, prompt, 24)
        got, responses = decoded(model, draft, prompt, max_tokens=24, tree_budget=budget, lookup=lookup)
        assert got == want, (family, budget)
        if budget != "auto":
            drafting = [r for r in responses[1:] if r.block_size > 1]
            assert drafting and responses[-1].rows_verified == len(drafting) * TreeParams(8).rows(budget)


def leaning_pair(block: int = 8):
    """A target that often repeats itself and a drafter sharing its
    embedding: drafts are accepted part of the time."""
    from tiny import lean_towards_one_token

    model, draft = family_pair("qwen3", block)
    return lean_towards_one_token(model, 2.0), draft


@pytest.mark.parametrize("budget", [2, 4, 8, 16, 40, 64])
def test_greedy_trees_at_every_budget_compiled_or_not(budget, compiled):
    model, draft = leaning_pair()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = greedy_reference(model, prompt, 40)
    got, responses = decoded(model, draft, prompt, max_tokens=40, tree_budget=budget)
    assert got == want
    assert any(r.accepted for r in responses[1:])


class SecondGuessDraft:
    """Mixed into a DFlash drafter: at each position the target's coming
    token is its first choice, its second, or absent, by a fixed pattern."""

    def set_script(self, sequence: list[int], seed: int = 0) -> None:
        rng = random.Random(seed)
        self.script = mx.array(sequence + [0] * 64, mx.int32)
        self.rank = mx.array([rng.choice([0, 0, 1, 1, 2]) for _ in range(len(sequence) + 64)], mx.int32)

    def __call__(self, block, taps, cache, fused=None):
        if taps is not None and taps.shape[1]:
            self.extend(taps, cache, fused)
        at = cache[0].offset + 1 + mx.arange(block.shape[1] - 1)
        want, rank = self.script[at], self.rank[at]
        decoy = (want + 1) % VOCAB
        logits = mx.zeros((block.shape[1] - 1, VOCAB))
        hot = mx.eye(VOCAB)
        logits = logits + 4.0 * hot[decoy] * (rank == 1)[:, None] + 4.0 * hot[want] * (rank == 0)[:, None]
        logits = logits + 3.0 * hot[want] * (rank == 1)[:, None] + 4.0 * hot[decoy] * (rank == 2)[:, None]
        return logits[None]


def test_trees_commit_more_per_cycle_than_blocks_where_second_guesses_are_right():
    model, draft = family_pair("qwen3")
    draft.__class__ = type("SecondGuess", (SecondGuessDraft, type(draft)), {})
    prompt = [5, 3, 8, 1, 9, 2, 7]
    want = greedy_reference(model, prompt, 48)
    draft.set_script(prompt + want)
    per_cycle = {}
    for budget in (None, 8, 24):
        got, responses = decoded(model, draft, prompt, max_tokens=48, block_size=8, tree_budget=budget)
        assert got == want, budget
        per_cycle[budget] = responses[-1].acceptance_length
    assert per_cycle[8] > 1.3 * per_cycle[None]  # as many rows as the block, spent on second guesses
    assert per_cycle[24] > per_cycle[8]


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 1.0, 0), (1.0, 0.9, 5)])
def test_seeded_samples_with_trees_are_the_plain_samplers(temperature, top_p, top_k, compiled):
    model, draft = leaning_pair()
    prompt = [2, 7, 1, 8, 2, 8]
    for seed in (0, 1):
        want = plain_sampled(model, prompt, 28, seed, temperature, top_p, top_k)
        for budget, lookup in [(3, False), (16, True), ("auto", False)]:
            got, _ = decoded(
                model,
                draft,
                prompt,
                max_tokens=28,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                tree_budget=budget,
                lookup=lookup,
            )
            assert got == want, (seed, budget)


def test_sampled_trees_follow_the_targets_distribution():
    """Chi-square over seeds: the second token a tree commits is drawn from
    the target's distribution after the first (the drafter's guesses never
    bias it)."""
    model, draft = leaning_pair()
    prompt = [4, 4, 2]
    counts: dict[int, dict[int, int]] = {}
    for seed in range(300):
        got, _ = decoded(model, draft, prompt, max_tokens=3, temperature=1.0, seed=seed, tree_budget=12)
        counts.setdefault(got[0], {}).setdefault(got[1], 0)
        counts[got[0]][got[1]] += 1
    first, seen = max(counts.items(), key=lambda kv: sum(kv[1].values()))
    n = sum(seen.values())
    logits = model(mx.array(prompt + [first])[None])[0, -1]
    p = mx.softmax(logits.astype(mx.float32)).tolist()
    common = [t for t in range(VOCAB) if p[t] * n >= 5]
    other = 1 - sum(p[t] for t in common)
    observed = [seen.get(t, 0) for t in common] + [n - sum(seen.get(t, 0) for t in common)]
    expected = [p[t] * n for t in common] + [other * n]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = len([e for e in expected if e > 0]) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (chi2, dof)


def test_prompt_cache_exact_across_turns_and_a_stopped_generator_with_trees():
    model, draft = leaning_pair()
    cache = make_prompt_cache(model, draft)
    turn1 = [1, 2, 3, 4, 5, 6, 7]
    out1, _ = decoded(model, draft, turn1, max_tokens=20, tree_budget=12, prompt_cache=cache)
    assert out1 == greedy_reference(model, turn1, 20)
    turn2 = turn1 + out1 + [9, 9]
    out2, _ = decoded(model, draft, turn2, max_tokens=20, tree_budget="auto", prompt_cache=cache)
    assert out2 == greedy_reference(model, turn2, 20)
    gen = stream_generate(
        model, draft, make_tokenizer(VOCAB), turn2 + [5], max_tokens=30, prompt_cache=cache, tree_budget=20
    )
    seen = next(gen).tokens + next(gen).tokens + next(gen).tokens
    gen.close()
    assert cache.tokens == turn2 + [5] + seen[:-1]
    assert cache.consistent()
    turn3 = turn2 + [5] + seen + [3]
    out3, _ = decoded(model, draft, turn3, max_tokens=16, tree_budget=7, prompt_cache=cache)
    assert out3 == greedy_reference(model, turn3, 16)


def test_a_stale_generator_with_trees_leaves_the_cache_exact():
    model, draft = leaning_pair()
    cache = make_prompt_cache(model, draft)
    prompt = [6, 1, 6, 1, 6]
    old = stream_generate(
        model, draft, make_tokenizer(VOCAB), prompt, max_tokens=30, prompt_cache=cache, tree_budget=16
    )
    next(old), next(old)
    new, _ = decoded(model, draft, prompt + [2], max_tokens=20, tree_budget=16, prompt_cache=cache)
    assert new == greedy_reference(model, prompt + [2], 20)
    with pytest.raises(RuntimeError):
        next(old)


@pytest.mark.parametrize("budget", [0, 65, 2.5, True, "many"])
def test_bad_tree_budgets_say_how_to_fix_them(budget):
    model, draft = family_pair("qwen3")
    with pytest.raises(ValueError, match="tree_budget"):
        decoded(model, draft, [1, 2, 3], max_tokens=4, tree_budget=budget)


def test_trees_need_a_drafter_and_caches_that_take_them():
    model, draft = family_pair("qwen3")
    with pytest.raises(ValueError, match="drafter"):
        decoded(model, None, [1, 2, 3], max_tokens=4, tree_budget=8, lookup=True)
    bounded = make_prompt_cache(model, draft, max_kv_size=64)
    with pytest.raises(ValueError, match="cannot verify draft trees"):
        decoded(model, draft, [1, 2, 3], max_tokens=4, tree_budget=8, prompt_cache=bounded)
    # "auto" verifies blocks instead
    got, _ = decoded(model, draft, [1, 2, 3], max_tokens=8, tree_budget="auto", prompt_cache=bounded)
    assert len(got) == 8


def test_the_tree_of_one_row_is_a_plain_step():
    model, draft = leaning_pair()
    got, responses = decoded(model, draft, [1, 2, 3], max_tokens=10, tree_budget=1)
    assert got == greedy_reference(model, [1, 2, 3], 10)
    assert {r.block_size for r in responses[1:]} == {1}


def kernels(*outputs) -> int:
    """The kernels MLX would run for ``outputs`` from evaluated arrays: the
    graph's primitives but views (mx.export_to_dot)."""
    import os
    import re
    import tempfile

    views = {"Broadcast", "Reshape", "Flatten", "Unflatten", "Squeeze", "ExpandDims", "Transpose", "Slice", "Split"}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "graph.dot")
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            names = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    return sum(n not in views for n in names)


@pytest.mark.parametrize("lookup", [False, True])
def test_a_compiled_tree_build_takes_three_kernels_a_depth(lookup):
    """On a GPU each kernel is a dispatch a cycle: a depth's candidates are
    one fused table, sorted, and its kept slots one gather."""

    def built(depth_count: int) -> int:
        logits = mx.random.normal((depth_count, 64), key=mx.random.key(depth_count))
        chain_tokens, hit = mx.arange(depth_count), mx.array(True)
        mx.eval(logits, chain_tokens, hit)

        def build(logits, chain_tokens, hit):
            extra = (chain_tokens, hit) if lookup else ()
            tokens, layout = build_tree(logits, 24, 8, *extra)
            return tokens, layout.parents, layout.depths, layout.ancestors

        return kernels(*mx.compile(build)(logits, chain_tokens, hit))

    shallow, deep = built(7), built(15)
    assert deep - shallow <= 3 * 8 + 3  # (and a deeper layout: a squaring more)
    assert deep <= 3 * 15 + 35


def test_layouts_reach_every_ancestor_of_deep_trees():
    for n in (2, 17, 33, 64):
        chain_layout = from_parents(mx.maximum(mx.arange(n) - 1, 0), n - 1)
        assert chain_layout.ancestors.tolist() == (mx.arange(n)[None] <= mx.arange(n)[:, None]).tolist()
        assert chain_layout.depths.tolist() == list(range(n))
        parents = mx.maximum(mx.arange(n) - 1, 0) // 2  # a binary tree
        given = from_parents(parents, n - 1, from_parents(parents, n - 1).depths)
        assert mx.array_equal(given.ancestors, from_parents(parents, n).ancestors).item()


def written_tree(seed: int):
    """Two buffers holding a context of 5 rows, then a tree's 9 rows as its
    verify wrote them, and those rows; the tree's layout."""
    from dflash_mlx.kv.buffer import BufferKVCache

    rng = random.Random(seed)
    parents = [0] + [rng.randrange(i) for i in range(1, 9)]
    layout = from_parents(mx.array(parents, mx.int32), 8)
    caches, rows = [], []
    for i in range(2):
        c = BufferKVCache()
        context = mx.random.normal((1, 2, 5, 4), key=mx.random.key(10 * seed + i))
        c.write(context, -context, 0)
        c.set_length(mx.array(5, mx.int32), 5)
        keys = mx.random.normal((1, 2, 9, 4), key=mx.random.key(10 * seed + i + 5))
        c.tree = layout
        c.write(keys, 2 * keys, mx.array(5, mx.int32))
        c.tree = None
        caches.append(c)
        rows.append((keys, 2 * keys))
    return caches, rows, layout, parents


def test_keep_path_moves_the_same_rows_from_a_verifys_own_writes():
    """A buffer that kept the rows a tree's verify wrote (``tree_rows``)
    scatters them back once; every row up to the accepted depth, and the
    context, equal the gather-and-scatter move's."""
    from dflash_mlx.kv.tree import keep_path

    for seed in range(12):
        moved, _, layout, parents = written_tree(seed)
        scattered, rows, _, _ = written_tree(seed)
        for c, written in zip(scattered, rows):
            c.tree_rows = written
        deepest = random.Random(seed).randrange(9)
        line = list(reversed(lineage(parents, deepest)))
        path = mx.array(line + [0] * (layout.depths.max().item() + 1 - len(line)), mx.int32)
        start = mx.array(5, mx.int32)
        keep_path(moved, start, path)
        keep_path(scattered, start, path)
        kept = 5 + len(line)
        for a, b in zip(moved, scattered):
            assert b.tree_rows is None
            assert mx.array_equal(a.keys[:, :, :kept], b.keys[:, :, :kept]).item(), seed
            assert mx.array_equal(a.values[:, :, :kept], b.values[:, :, :kept]).item(), seed


def test_keep_path_from_a_verifys_own_writes_is_one_scatter_a_buffer():
    from dflash_mlx.kv.tree import keep_path

    def moved(buffers: int) -> int:
        caches = []
        for seed in range(buffers // 2):
            made, rows, _, _ = written_tree(seed)
            for c, written in zip(made, rows):
                c.tree_rows = written
            caches += made
        mx.eval([a for c in caches for a in (c.keys, c.values, *c.tree_rows)])
        keep_path(caches, mx.array(5, mx.int32), mx.array([0, 2, 0, 0], mx.int32))
        return kernels(*[a for c in caches for a in (c.keys, c.values)])

    assert moved(4) - moved(2) == 2 * 2  # a scatter for the keys, one for the values


def test_trees_turn_to_blocks_once_the_kv_cache_is_quantized():
    """Decided once a size, yet anew when the caches are replaced: after
    quantized_kv_start the cycles verify blocks, and the text stays mlx-lm's
    with its own quantized cache."""
    from test_kv_quantized import STEP, reference

    cfg = target_config("qwen3", vocab=VOCAB, hidden=128)
    model = make_target(cfg, seed=3)
    dcfg = draft_config(cfg, layers=1, block_size=8)
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=4))
    prompt = [5, 3, 8, 1, 9, 2, 7]
    cache = make_prompt_cache(model, draft, kv_bits=8, kv_group_size=32, quantized_kv_start=30)
    got, responses = decoded(
        model, draft, prompt, max_tokens=40, tree_budget=16, prompt_cache=cache, prefill_step_size=STEP
    )
    assert got == reference(model, prompt, 40, 8, 32, 30)
    rows = [b.rows_verified - a.rows_verified for a, b in zip(responses, responses[1:]) if b.block_size > 1]
    assert rows[0] == 16 and rows[-1] == 8  # trees first, blocks once quantized
