"""The verify's and the drafter's attention through the block-attention
kernel (dflash_mlx/targets/attention.py), on a stand-in GPU backend whose
"kernel" records its calls and computes through the ops path (the contract's
reference): a fused qwen3/llama layer and a drafter layer call it with their
cache's start and valid length where the table picks it, decoding stays
exactly mlx-lm's, the
check runs when the target's layers are made, and a kernel that fails its
check, or a cache the kernel does not read, never reaches it."""

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
from dflash_mlx.targets import adapt

VOCAB = 48


class RecordingKernel:
    """Stands in for a GPU's kernel: computes with the ops path, wrong by
    ``error`` (a kernel that fails its check), and records every call."""

    def __init__(self, error: float = 0.0):
        self.error, self.calls = error, []

    def __call__(self, q, k, v, **kw):
        self.calls.append(dict(kw, rows=q.shape[2]))
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
