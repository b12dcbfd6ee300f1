"""The official Z Lab MLX loop (`dflash.model_mlx.stream_generate`) and ours
commit the same tokens cycle by cycle, with the same accepted counts, on the
target families the official loop runs: the qwen3_5 and qwen3_5_moe hybrids
(through its delta-net state capture), qwen3_moe, gpt_oss (sliding layers in
a rotating cache), gemma3_text and gemma4_text, and the largest published
drafters' targets: deepseek_v3 and kimi_k25 (latent attention), deepseek_v32
and glm_moe_dsa (sparse attention, two caches a layer there), glm4_moe and
minimax_m2.

Both loops get the same scripted drafter (family_models.ScriptedDraft): its
proposals follow the target's own greedy text, each position right or wrong
by a fixed random pattern, so cycles accept none, some or all of their
drafts and every rollback length is exercised. (Drafter logits against the
official code are test_oracle's and test_dflash2's.) qwen3_next is not
here: the official loop's state capture patches only qwen3_5's delta-net
layer and fails on it."""

import random

import dflash.model_mlx as dflash_official  # the oracle: pip install --no-deps dflash==0.1.0  # noqa: E402
import mlx.core as mx
import pytest
from family_models import LARGE, family_config, make_family_target, scripted
from tiny import (
    draft_config,
    greedy_reference,
    make_tokenizer,
    random_draft_weights,
    write_zlab_draft,
)

from dflash_mlx import load_draft, stream_generate

VOCAB = 24
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_moe", "gpt_oss", "gemma3_text", "gemma4_text", *LARGE]


class TheirScript:
    """The official drafter, proposing from the same script as ours: the
    block's first token sits at the position equal to how many positions the
    target has handed the drafter so far."""

    script: mx.array
    right: mx.array
    position: int = 0

    def __call__(self, inputs, target_hidden, cache, logits_start: int = 0):
        self.position += target_hidden.shape[1]
        at = mx.minimum(self.position + 1 + mx.arange(inputs.shape[1] - logits_start), self.script.shape[0] - 1)
        want = self.script[at]
        proposal = mx.where(self.right[at], want, (want + 1) % self.config.vocab_size)
        return 10.0 * mx.eye(self.config.vocab_size)[proposal][None]


class CacheSecond:
    """mlx-lm's minimax Model takes (inputs, mask, cache); the official loop
    calls model(inputs, cache), so without this its cache would land in the
    mask and the loop would run with no cache at all."""

    def __call__(self, inputs, cache=None):
        return super().__call__(inputs, cache=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_cycles_match_the_official_loop(tmp_path, monkeypatch, family):
    cfg = family_config(family, vocab=VOCAB, layers=6 if family.startswith("gemma") else 4)
    ours_target = make_family_target(cfg, seed=21)
    their_target = make_family_target(cfg, seed=21)  # the official loop wraps its layers (and patches delta-net)
    if family == "minimax_m2":
        their_target.__class__ = type("CacheSecond", (CacheSecond, type(their_target)), {})
    dcfg = draft_config(cfg.get("text_config", cfg), layers=1, block_size=8, taps=[1])
    path = write_zlab_draft(tmp_path / "d", dcfg, random_draft_weights(dcfg, seed=22), dtype=mx.float32)
    monkeypatch.setattr(dflash_official, "snapshot_download", lambda *a, **k: str(path))
    rng = random.Random(family)
    ours = scripted(load_draft(path))
    theirs = dflash_official.load_draft(str(path))
    theirs.__class__ = type("Script" + type(theirs).__name__, (TheirScript, type(theirs)), {})
    tok = make_tokenizer(VOCAB)
    accepted = []
    for n, bs in [(1, 8), (12, 5), (30, 8)]:  # prompts past the windows (8)
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        ours.set_script(prompt + greedy_reference(ours_target, prompt, 30), seed=n)
        theirs.script, theirs.right, theirs.position = ours.script, ours.right, 0
        a = list(stream_generate(ours_target, ours, tok, prompt, max_tokens=30, block_size=bs))
        b = [
            r
            for r in dflash_official.stream_generate(their_target, theirs, tok, prompt, block_size=bs, max_tokens=30)
            if r.tokens
        ]
        assert [r.tokens for r in a] == [r.tokens for r in b], (family, n)
        # Official `accepted` counts committed tokens (drafts + bonus).
        for ra, rb in zip(a[1:-1], b[1:-1]):
            assert ra.accepted + 1 == rb.accepted
            accepted.append(ra.accepted)
    assert 0 in accepted and 7 in accepted and any(0 < n < 4 for n in accepted), accepted
