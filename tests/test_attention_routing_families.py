"""The other families' attention through the block-attention kernel
(dflash_mlx/targets/attention.py), as tests/test_attention_routing.py checks
it for qwen3/llama: on a stand-in GPU backend whose "kernel" records its
calls and computes through the ops path, every attention layer of a target's
prefill and verify calls it, in layer order, with the cache's start and
valid length, sliding layers with their window and full layers without,
gpt-oss's sinks passed along; the variants its layers need are checked when
the target's layers are made; greedy decoding stays exactly mlx-lm's (Muse
Glimmer's global layers run no RoPE: a rotation there would break it)."""

import random

import mlx.core as mx
import pytest
from family_models import family_config, make_family_target
from test_attention_routing import VOCAB, RecordingKernel, decode, fake_gpu  # noqa: F401
from tiny import draft_config, greedy_reference, make_draft, random_draft_weights

from dflash_mlx.kernels import dispatch
from dflash_mlx.targets import adapt

S, F = 8, None  # the tiny configs' sliding window; a full layer's

# Per family, the (window, head dim) of each layer that attends, in layer
# order, at hidden 256 (head dim 64; Gemma 4's full layers 128): the calls
# one forward of the target makes.
LAYERS = {
    "qwen3_moe": [(F, 64)] * 4,
    "gpt_oss": [(S, 64), (F, 64)] * 2,
    "gemma3_text": [(S, 64), (S, 64), (F, 64)] * 2,
    "gemma4_text": [(S, 64), (S, 64), (F, 128)] * 2,  # the last two reuse layers 3 and 2's keys/values
    "muse_glimmer": [(S, 64), (S, 64), (S, 64), (F, 64)],  # the global layer without RoPE
    "qwen3_5": [(F, 64)] * 2,  # layers 1 and 3; 0 and 2 are delta-net layers
    "qwen3_5_moe": [(F, 64)] * 2,
    "qwen3_next": [(F, 64)] * 2,
}


class HeadDimRecorder(RecordingKernel):
    """The recording kernel, each call also noting its head dim."""

    def __call__(self, q, k, v, **kw):
        out = super().__call__(q, k, v, **kw)
        self.calls[-1]["head_dim"] = q.shape[3]
        return out


def pair(family: str, seed: int):
    cfg = family_config(family, vocab=VOCAB, layers=6 if family.startswith("gemma") else 4, hidden=256)
    if family == "gemma4_text":
        cfg["global_head_dim"] = 128
    model = make_family_target(cfg, seed)
    dcfg = draft_config(cfg, layers=1, block_size=8)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=seed + 1))


def value(x) -> int:
    return x.item() if isinstance(x, mx.array) else x


def target_forwards(calls) -> dict[tuple[int, int], list[dict]]:
    """The target's kernel calls (causal; the drafter's block is not),
    grouped by forward: (start, rows) -> its calls in order."""
    forwards: dict[tuple[int, int], list[dict]] = {}
    for c in calls:
        if c["causal"]:
            forwards.setdefault((value(c["q_offset"]), c["rows"]), []).append(c)
    return forwards


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_prefill_and_verify_go_through_the_kernel_and_stay_exact(fake_gpu, family):
    kernel = fake_gpu(HeadDimRecorder())
    model, draft = pair(family, seed=11)
    target = adapt(model)
    # the variants its layers ask for, checked here, once
    assert {key[2:] for key in dispatch._checks} == {(d, w is not None) for w, d in LAYERS[family]}
    draft.bind(target)  # (the drafter's own variant is checked here: not a call of the decode's)
    rng = random.Random(3)
    for n, block in ((5, 4), (40, 8)):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(n)]
        kernel.calls.clear()
        tokens = decode(model, draft, prompt, block_size=block, prefill_step_size=16)
        assert tokens == greedy_reference(model, prompt, 24)
        forwards = target_forwards(kernel.calls)
        for (start, rows), calls in forwards.items():
            assert [(c["window"], c["head_dim"]) for c in calls] == LAYERS[family], (start, rows)
            assert all(value(c["kv_length"]) == start + rows for c in calls)
            for c in calls:
                if family == "gpt_oss":
                    assert c["sinks"] is not None and c["sinks"].shape == (4,)
                else:
                    assert c.get("sinks") is None
        starts = {start for start, _ in forwards}
        # the prompt's 16-token chunks from position 0, then a verify of the block every cycle past it
        assert starts >= set(range(0, n, 16))
        verifies = [rows for start, rows in forwards if start >= n]
        assert verifies and set(verifies) == {block}
