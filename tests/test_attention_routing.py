"""The verify's and the drafter's attention through the block-attention
kernel (dflash_mlx/layers/attention.py), on a stand-in GPU backend whose
"kernel" records its calls and computes through the ops path (the contract's
reference): a fused qwen3/llama layer and a drafter layer call it with their
cache's start and valid length where the table picks it, decoding stays
exactly mlx-lm's, the
check runs when the target's layers are made, and a kernel that fails its
check, or a cache the kernel does not read, never reaches it. A draft tree's
verify takes the tree variant only once that variant passed its own check."""

import random

import mlx.core as mx
import pytest
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
from dflash_mlx.kernels import dispatch, ops_attention
from dflash_mlx.kernels.dispatch import ops_tree_attention
from dflash_mlx.kv.tree import from_parents
from dflash_mlx.layers.attention import prepare
from dflash_mlx.targets import adapt

VOCAB = 48


class RecordingKernel:
    """Stands in for a GPU's kernel: computes with the ops path, wrong by
    ``error`` (a kernel that fails its check), and records every call."""

    def __init__(self, error: float = 0.0, tree_error: float = 0.0):
        self.error, self.tree_error, self.calls = error, tree_error, []

    def __call__(self, q, k, v, tree=None, **kw):
        self.calls.append(dict(kw, rows=q.shape[2], tree=tree, keys=k.shape[2]))
        if tree is not None:
            assert kw.pop("causal")
            return ops_tree_attention(q, k, v, tree=tree, **kw) + self.tree_error
        return ops_attention(q, k, v, **kw) + self.error


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(kernel, table=((64, 0),)):
        monkeypatch.setattr(dispatch, "backend", lambda: "fake")
        monkeypatch.setitem(dispatch.BUILDERS, "fake", lambda where: kernel)
        monkeypatch.setattr(dispatch, "KERNEL_WINS", table)
        return kernel

    dispatch.reset()
    yield install
    dispatch.reset()


def pair(family: str, seed: int):
    tcfg = target_config(family, vocab=VOCAB, layers=2, hidden=256)  # head dim 64: a kernel variant
    model = make_target(tcfg, seed=seed)
    dcfg = draft_config(tcfg, layers=1, block_size=8)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1))


def decode(model, draft, prompt, **kw):
    out = list(stream_generate(model, draft, make_tokenizer(VOCAB), prompt, max_tokens=24, **kw))
    return [t for r in out for t in r.tokens]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_attention_goes_through_the_kernel_and_stays_exact(fake_gpu, family):
    kernel = fake_gpu(RecordingKernel())
    model, draft = pair(family, seed=11)
    adapt(model)  # the variant's check runs here, once
    rng = random.Random(3)
    for n, block in ((5, 4), (40, 8), (90, 2)):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(n)]
        kernel.calls.clear()
        assert decode(model, draft, prompt, block_size=block, prefill_step_size=16) == greedy_reference(
            model, prompt, 24
        )
        starts, drafts = [], []
        for c in kernel.calls:
            start, length = (x.item() if isinstance(x, mx.array) else x for x in (c["q_offset"], c["kv_length"]))
            assert c["window"] is None and length == start + c["rows"]
            assert c["keys"] % 256 == 0  # a cache's whole buffer (steps of 256), never a view to copy
            (starts if c["causal"] else drafts).append((start, c["rows"]))
        # the target's: the prompt's 16-token chunks from position 0 (32 rows per kv head at
        # GQA 2, within the table), then the verifies past the prompt
        assert {s for s, _ in starts} >= set(range(0, n, 16)) and max(s for s, _ in starts) >= n
        # the drafter's: its non-causal block right after the committed context, every cycle
        assert drafts and all(rows == block and start >= n for start, rows in drafts)


def test_the_check_runs_when_the_layers_are_made_not_inside_a_cycle(fake_gpu):
    kernel = fake_gpu(RecordingKernel())
    model, _ = pair("qwen3", seed=5)
    target = adapt(model)
    checked = dict(dispatch._checks)
    assert [k[1:] for k in checked] == [(target.dtype, 64, False)] and all(r.ok for r in checked.values())
    assert len(kernel.calls) == len(
        list(dispatch._check_cases(target.dtype, 64, False))
    )  # the check's, nothing else yet


def test_a_kernel_that_fails_its_check_is_never_called(fake_gpu):
    kernel = fake_gpu(RecordingKernel(error=0.5))
    model, draft = pair("qwen3", seed=7)
    prompt = list(range(1, 30))
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        adapt(model)
    calls = len(kernel.calls)
    assert decode(model, draft, prompt, block_size=4) == greedy_reference(model, prompt, 24)
    assert len(kernel.calls) == calls


@pytest.mark.parametrize("table, kv", [((), {}), (((64, 0),), {"kv_bits": 8, "quantized_kv_start": 0})])
def test_outside_the_table_or_over_a_quantized_cache_the_fused_op_runs(fake_gpu, table, kv):
    kernel = fake_gpu(RecordingKernel(), table=table)
    model, draft = pair("qwen3", seed=9)
    prompt = list(range(1, 20))
    adapt(model)
    calls = len(kernel.calls)
    tokens = decode(model, draft, prompt, block_size=4, prompt_cache=make_prompt_cache(model, draft, **kv))
    # no verify (4 causal rows) reaches the kernel; a quantized cache may read its plain prompt
    # there first, and the drafter's own cache stays a plain buffer
    assert not [c for c in kernel.calls[calls:] if c["rows"] == 4 and c["causal"]]
    assert len(kernel.calls) == calls or kv
    if not kv:
        assert tokens == greedy_reference(model, prompt, 24)


TAPS = [1]
# The root (node 0), two children, and branches down to depth 5.
PARENTS = [0, 0, 0, 1, 1, 2, 3, 6, 7]
TREE = [5, 11, 30, 7, 19, 2, 40, 8, 13]
CONTEXT = [(7 * i + 3) % (VOCAB - 1) for i in range(11)]


def path_to(node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def prefilled(target, ids: list[int]) -> list:
    cache = target.make_cache()
    target(mx.array(ids)[None], cache, TAPS)
    return cache


def verify_tree(target) -> mx.array:
    """One verify of TREE after CONTEXT; each node's logits equal a plain
    forward over its path's."""
    cache = prefilled(target, CONTEXT)
    assert target.takes_trees(cache)
    target.set_tree(cache, from_parents(mx.array(PARENTS, mx.int32), max_depth=5))
    logits, _ = target(mx.array(TREE)[None], cache, TAPS)
    target.set_tree(cache, None)
    for node in range(len(TREE)):
        plain, _ = target(mx.array([TREE[j] for j in path_to(node)])[None], prefilled(target, CONTEXT), TAPS)
        assert mx.allclose(logits[0, node], plain[0, -1], atol=1e-4).item(), node
    return logits


def tree_calls(kernel) -> list[dict]:
    return [c for c in kernel.calls if c["tree"] is not None]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_trees_verify_takes_the_tree_kernel_once_checked_and_stays_exact(fake_gpu, family):
    kernel = fake_gpu(RecordingKernel())
    model, _ = pair(family, seed=13)
    target = adapt(model)
    prepare(target.dtype, 64, [None], trees=True)  # (a target that verifies trees: its variants checked too)
    assert [k[1:] for k in dispatch._tree_checks] == [(target.dtype, 64, False)]
    assert all(r.ok and r.case.endswith(" tree") for r in dispatch._tree_checks.values())
    kernel.calls.clear()
    verify_tree(target)
    calls = tree_calls(kernel)
    assert len(calls) == 2  # each layer's verify, through the tree variant
    for c in calls:
        start, length = (x.item() if isinstance(x, mx.array) else x for x in (c["q_offset"], c["kv_length"]))
        assert (start, length, c["rows"]) == (len(CONTEXT), len(CONTEXT) + len(TREE), len(TREE))
        assert c["tree"].size == len(TREE) and c["window"] is None


def test_without_a_passed_tree_check_a_tree_takes_mlxs_attention(fake_gpu):
    kernel = fake_gpu(RecordingKernel())
    model, _ = pair("qwen3", seed=13)
    target = adapt(model)  # the block variant checked, not the tree's
    assert not dispatch._tree_checks
    kernel.calls.clear()
    verify_tree(target)
    assert kernel.calls and not tree_calls(kernel)  # (the context's prefill still took the block kernel)


def test_a_tree_variant_that_fails_its_check_is_never_called(fake_gpu):
    kernel = fake_gpu(RecordingKernel(tree_error=0.5))
    model, _ = pair("qwen3", seed=13)
    target = adapt(model)
    with pytest.warns(RuntimeWarning, match=r"head_dim=64 full tree block-attention kernel failed its self-check"):
        prepare(target.dtype, 64, [None], trees=True)
    assert dispatch._checks[("fake", target.dtype, 64, False)].ok  # the block's own check stands
    kernel.calls.clear()
    verify_tree(target)
    assert kernel.calls and not tree_calls(kernel)


@pytest.mark.parametrize("exact, backend", [(True, "fake"), (False, "fake"), (True, "cuda"), (False, "cuda")])
def test_a_plain_steps_one_row_takes_mlxs_one_row_attention(fake_gpu, monkeypatch, exact, backend):
    """A plain step (a block of 1, as ``auto`` runs it) reads the buffer as
    mlx-lm's step does, not through the block kernel; its token is mlx-lm's.
    On CUDA a step behind a mask (its length not known on the host) keeps the
    kernel: there MLX's attention with a mask is not one fused kernel."""
    from dflash_mlx.decode.cycle import Cycle
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.decode.sampling import SamplingParams

    kernel = fake_gpu(RecordingKernel())
    monkeypatch.setattr(dispatch, "backend", lambda: backend)
    monkeypatch.setitem(dispatch.BUILDERS, backend, lambda where: kernel)
    model, draft = pair("qwen3", seed=13)
    prompt = list(range(1, 41))
    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    last_logits = prefill(target, draft, cache, prompt, 16, None)
    cycle = Cycle(target, draft, cache, SamplingParams(), 0)
    last = cycle.first_token(last_logits, len(prompt))
    kernel.calls.clear()
    flight = cycle.launch(1, last, mx.array(len(prompt), mx.int32), len(prompt), exact=exact)
    mx.eval(flight.result)
    assert bool([c for c in kernel.calls if c["causal"]]) == (backend == "cuda" and not exact)
    want = greedy_reference(model, prompt, 2)
    assert [last.item(), flight.result.tolist()[1]] == want


def test_where_exactness_comes_first_a_prompts_chunks_take_mlxs_attention(fake_gpu, monkeypatch):
    """On an exact-first backend the target's prompt chunks are read as
    mlx-lm's prefill reads them (its attention), so the cache holds mlx-lm's
    bits; the drafter's block still takes the kernel, and decoding stays exact."""
    from dflash_mlx.kernels import decisions

    kernel = fake_gpu(RecordingKernel())
    monkeypatch.setattr(decisions, "EXACT_FIRST", ("fake",))
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    decisions.reset()
    try:
        store = decisions.current()
        monkeypatch.setattr(store, "needs", lambda kernel, case: False)  # nothing to time: every kernel serves
        monkeypatch.setattr(store, "uses", lambda kernel, case: True)
        model, draft = pair("qwen3", seed=17)
        prompt = [random.Random(5).randrange(VOCAB - 1) for _ in range(40)]
        assert decode(model, draft, prompt, block_size=4, prefill_step_size=16) == greedy_reference(model, prompt, 24)
        chunks = [c for c in kernel.calls if c["causal"] and not isinstance(c["q_offset"], mx.array)]
        drafts = [c for c in kernel.calls if not c["causal"]]
        assert not chunks and drafts
    finally:
        decisions.reset()
