"""The exact verify attention's draft tree variant (kernels/exact_attention.py):
a node at depth d computed bit for bit as the one-row call of the plain step
that would produce its token, over the context and then its ancestors at
depths 0..d in order. Its table of ancestors, its self-check, where a tree's
verify takes it, greedy trees through it; then the Metal source, run on this
CPU with a tree's gather, against the transcription of MLX's one-row kernels."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from metal_on_cpu import CLANG_F16
from test_exact_attention import (  # noqa: F401 (on_cpu, fake_gpu: fixtures)
    FEWER_KEYS,
    FakeKernel,
    Storage,
    fake_gpu,
    metal_case,
    mlx_one_row_order,
    on_cpu,
    reference,
    run_metal_source,
    verify_case,
)

from dflash_mlx.kernels import exact_attention as ea
from dflash_mlx.kv.tree import chain, from_parents


def deep_tree(nodes: int, depth: int, seed: int) -> np.ndarray:
    """Parents of a tree ``depth`` deep: a path of depth + 1 nodes, the rest hung anywhere before them."""
    rng = np.random.default_rng(seed)
    return np.array([max(0, i - 1) if i <= depth else int(rng.integers(0, i)) for i in range(nodes)], np.int32)


@pytest.mark.parametrize(
    "parents",
    [ea.random_parents(20, 1), ea.random_parents(33, 2), deep_tree(24, 16, 3), np.zeros(9, np.int32)]
    + [np.maximum(np.arange(12, dtype=np.int32) - 1, 0)],
    ids=["random", "random-33", "deep", "star", "chain"],
)
def test_the_ancestor_table_holds_each_nodes_path_by_depth(parents):
    depths, table = ea.ancestor_table(from_parents(mx.array(parents), len(parents)))
    assert table.shape == (len(parents), len(parents)) and table.dtype == depths.dtype == mx.int32
    for i, path in enumerate(ea.tree_paths(parents)):
        assert depths[i].item() == len(path) - 1 and table[i, : len(path)].tolist() == path


def test_a_chains_nodes_are_a_blocks_rows():
    """A chain is a block: its nodes' one-row calls are the block's rows'."""
    q, k, v, start = verify_case(rows=7)
    parents = np.array(chain(7).parents)
    tree = ea.one_row_tree_attention(q, k, v, scale=0.125, q_offset=start, parents=parents)
    assert mx.array_equal(tree, ea.one_row_attention(q, k, v, scale=0.125, q_offset=start))


# --- Its check and where it serves --------------------------------------------------------------------------


class ReadsABlock(FakeKernel):
    """Reads a tree's nodes as a block's rows, in buffer order (a tree's verify before the variant)."""

    def __call__(self, *a, tree=None, **kw):
        return super().__call__(*a, **kw)


class WrongAncestor(FakeKernel):
    """Takes the last node's parent from its parent's sibling (node 2 for node 1's child)."""

    def __call__(self, *a, tree=None, **kw):
        if tree is not None:
            depths, table = tree
            last = table.shape[0] - 1
            at = depths[last].item() - 1
            if at >= 0:
                planted = mx.where(table[last, at] == 1, 2, 1)
                table = table.at[last, at].add(planted - table[last, at])
            tree = (depths, table)
        return super().__call__(*a, tree=tree, **kw)


@pytest.mark.parametrize("stand_in", [ReadsABlock, WrongAncestor])
def test_a_tree_variant_reading_other_keys_fails_its_check_and_never_serves(fake_gpu, monkeypatch, stand_in):
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    monkeypatch.setitem(ea.CHECK_CASES, "metal", ((1, 6, 37, 256), (4, 9, 300, 512)))
    from dflash_mlx.kernels import decisions

    decisions.reset()
    fake_gpu(stand_in())
    with pytest.warns(RuntimeWarning, match=r"metal float16 head_dim=64 tree exact verify attention failed"):
        ea.prepare(mx.float16, 64, trees=True)
    assert ea._checks[("metal", mx.float16, 64, False)].ok and not ea._checks[("metal", mx.float16, 64, True)].ok
    q, k, v, start = verify_case(rows=9)
    tree = from_parents(mx.array(ea.random_parents(9, 5)), 9)
    assert ea.tree_attention(q, k, v, scale=0.125, q_offset=mx.array(start), tree=tree) is None
    assert ea.attention(q, k, v, scale=0.125, q_offset=mx.array(start)) is not None  # (the block's passed)
    decisions.reset()


def test_a_trees_verify_takes_the_tree_variant_and_a_prompts_chunk_does_not(fake_gpu, monkeypatch):
    """A cache carrying a draft tree, its nodes written at an offset on the
    device (a cycle's verify): each node as the plain step producing its token
    computes it. At a host offset (a prompt's chunk), or where the rows are not
    the tree's nodes, MLX's attention with the tree's mask."""
    from dflash_mlx.kernels import decisions
    from dflash_mlx.kv.buffer import BufferKVCache
    from dflash_mlx.layers.attention import attention_output

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    decisions.reset()
    kernel = fake_gpu(FakeKernel())
    ea.checked("metal", mx.float16, 64, tree=True)
    nodes = 12
    q, k, v, start = verify_case(rows=nodes, n=256)
    parents = ea.random_parents(nodes, 7)
    layout = from_parents(mx.array(parents), nodes)
    want = ea.one_row_tree_attention(q, k, v, scale=0.125, q_offset=start, parents=parents)
    for offset, rows, served in (
        (start, nodes, False),
        (mx.array(start), nodes - 1, False),
        (mx.array(start), nodes, True),
    ):
        cache = BufferKVCache()
        cache.update_and_fetch(k[:, :, :start], v[:, :, :start])
        cache.tree = layout
        keys, values = cache.update_and_fetch(k[:, :, start : start + nodes], v[:, :, start : start + nodes])
        mask = layout.mask(start, keys.shape[2])[:rows]
        kernel.calls.clear()
        out, as_rows = attention_output(q[:, :, :rows], keys, values, cache=cache, scale=0.125, mask=mask, start=offset)
        assert [c[2] for c in kernel.calls] == ([True] if served else []) and not as_rows
        assert mx.allclose(out, want[:, :, :rows], atol=1e-2) and (mx.array_equal(out, want) or not served)
    decisions.reset()


@pytest.mark.parametrize("budget", [12, 16])  # (past the drafter's block of 8: a tree)
def test_greedy_trees_through_the_tree_variant_are_the_targets_greedy_output(fake_gpu, monkeypatch, budget):
    """A tree's verify takes the variant in every attention layer (each node
    what the plain step computes), so the output is the target's own greedy text."""
    from tiny import (
        draft_config,
        greedy_reference,
        lean_towards_one_token,
        make_draft,
        make_target,
        make_tokenizer,
        random_draft_weights,
        target_config,
    )

    from dflash_mlx import stream_generate
    from dflash_mlx.decode.cycle import Cycle
    from dflash_mlx.kernels import decisions

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "on")
    monkeypatch.setattr(Cycle, "compile_graphs", False)  # (the stand-in reads the tree on the host)
    decisions.reset()
    kernel = fake_gpu(FakeKernel())
    tcfg = target_config("qwen3", vocab=32, layers=2, hidden=256)  # (head dim 64)
    model = lean_towards_one_token(make_target(tcfg, seed=91), 2.0)
    model.set_dtype(mx.float16)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 1])
    draft = make_draft(dcfg, random_draft_weights(dcfg, seed=92))
    draft.set_dtype(mx.float16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = greedy_reference(model, prompt, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        responses = list(stream_generate(model, draft, make_tokenizer(32), prompt, max_tokens=24, tree_budget=budget))
    assert [t for r in responses for t in r.tokens] == want
    assert ea._checks[("metal", mx.float16, 64, True)].ok
    trees = [rows for rows, _, tree in kernel.calls if tree and rows == budget]
    assert len(trees) >= 2 * 2  # (two layers a verify, two verifies or more)
    decisions.reset()


# --- The Metal source itself, run on this CPU ---------------------------------------------------------------

LOWER = [("GQA_TWO_PASS_KEYS", 256), ("GQA_KERNEL_KEYS", 288)]


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "parents, g, start",
    [
        (deep_tree(20, 16, 1), 1, 30),  # one pass, 16 deep
        (deep_tree(20, 16, 2), 2, 244),  # GQA 2 across the (lowered) switch to two passes
        (np.array([0, 0, 0, 2], np.int32), 8, 285),  # GQA 8 across the (lowered) switch to MLX's GQA kernel
    ],
    ids=["one-pass", "two-pass", "gqa-kernel"],
)
def test_the_metal_tree_source_computes_each_node_in_mlxs_one_row_order(on_cpu, monkeypatch, parents, g, start):
    for name, keys in LOWER:
        monkeypatch.setattr(ea, name, keys)
    storage = Storage("float16")
    q, k, v = metal_case(len(parents), g, start, 512, 64, storage)
    got, exp = run_metal_source(on_cpu, q, k, v, start, 0, storage, plant=FEWER_KEYS, parents=parents)
    want = mlx_one_row_order(q, k, v, start, 0, exp, storage, parents=parents)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (got != want).sum()
    assert np.abs(storage.f32(got) - reference(q, k, v, start, storage, parents=parents)).max() < 3e-2


@pytest.mark.skipif(CLANG_F16 is None, reason="no clang++ with _Float16 here (clang 15 on)")
@pytest.mark.parametrize(
    "plant",
    [
        # the node's own key at its depth read from its parent's row
        [("+ (k) - q_offset[0]])", "+ (k) - q_offset[0] - ((k) - q_offset[0] == depths[i] ? 1 : 0)])")],
        # the nodes read as a block's rows, in the buffer's order
        [("q_offset[0] + ancestors[(i) * dims[4] + (k) - q_offset[0]]", "(k)")],
    ],
    ids=["parents-row", "buffer-order"],
)
def test_a_planted_wrong_ancestor_fails_the_comparison(on_cpu, plant):
    storage = Storage("float16")
    parents = deep_tree(12, 8, 4)
    q, k, v = metal_case(12, 1, 30, 256, 64, storage)
    got, exp = run_metal_source(on_cpu, q, k, v, 30, 0, storage, plant=plant, parents=parents)
    want = mlx_one_row_order(q, k, v, 30, 0, exp, storage, parents=parents)
    assert not np.array_equal(got.view(np.uint8), want.view(np.uint8))
