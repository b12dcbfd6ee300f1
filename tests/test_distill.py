"""Self-distillation: the batched greedy generator against mlx-lm's own
greedy decoding, one prompt at a time, and ``distill``'s cache on disk."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import dflash_mlx.train.data as data
from dflash_mlx.tiny import greedy_reference, make_target, make_tokenizer, target_config
from dflash_mlx.train.data import Sequence, distill, greedy_batch, load_distilled

VOCAB = 48
LENGTHS = [1, 40, 7, 23, 2, 15, 31, 4, 11, 40, 3, 19]


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in lengths]


def _target(kind):
    if kind == "qwen3":
        cfg = target_config("qwen3", vocab=VOCAB, layers=4, hidden=64)
    elif kind == "llama":
        cfg = target_config("llama", vocab=VOCAB, layers=4, hidden=64)
    else:  # llama with sliding-window layers, windows shorter than the prompts
        cfg = target_config("llama", vocab=VOCAB, layers=4, hidden=64)
        cfg.update(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6)
    return make_target(cfg, seed=3)


def _frequent_late_token(model, prompts, n):
    """A token the target often writes, but rarely first: as EOS it stops
    some rows early and leaves others running."""
    counts = Counter(t for p in prompts for t in greedy_reference(model, p, n)[2:])
    return counts.most_common(1)[0][0]


@pytest.mark.parametrize("kind", ["qwen3", "llama", "llama-sliding"])
@pytest.mark.parametrize("check_every", [16, 3])
def test_greedy_batch_equals_one_at_a_time(kind, check_every):
    model = _target(kind)
    prompts = _prompts(LENGTHS)
    budgets = [20 if i % 3 else 9 for i in range(len(prompts))]
    eos = {_frequent_late_token(model, prompts, 20)}
    got = greedy_batch(model, prompts, budgets, eos, check_every=check_every)
    want = [greedy_reference(model, p, m, eos) for p, m in zip(prompts, budgets)]
    assert got == want
    # Both endings happen: rows stopped on their EOS, rows that used their room.
    stopped = [g for g, m in zip(got, budgets) if len(g) < m]
    assert stopped and all(g[-1] in eos for g in stopped)
    assert any(len(g) == m and not eos & set(g) for g, m in zip(got, budgets))


def test_greedy_batch_edges():
    model = _target("qwen3")
    prompts = _prompts([5, 1, 12])
    # One budget for all, no EOS; a row with no room; the prefill in chunks.
    want = [greedy_reference(model, p, 7) for p in prompts]
    assert greedy_batch(model, prompts, 7, set()) == want
    assert greedy_batch(model, prompts, 7, set(), prefill_step=4) == want
    assert greedy_batch(model, prompts, [7, 0, 7], set()) == [want[0], [], want[2]]
    assert greedy_batch(model, prompts, 0, set()) == [[], [], []]
    # Every row stops on its first token.
    first = {w[0] for w in want}
    assert greedy_batch(model, prompts, 7, first) == [[w[0]] for w in want]


# -- distill: the sequences, their order on disk, resume -------------------------

SEQ_LEN = 30


@pytest.fixture(scope="module")
def setup():
    model = _target("qwen3")
    prompts = _prompts([1, 14, 3, 8, 15, 2, 9, 5, 12, 6, 4, 11, 7, 13, 10], seed=5)
    eos = _frequent_late_token(model, prompts, SEQ_LEN)
    tok = make_tokenizer(VOCAB, eos=eos)
    want = []
    for p in prompts:
        r = greedy_reference(model, p, SEQ_LEN - len(p), {eos})
        want.append(Sequence(p + r, len(p)))
    assert any(s.tokens[-1] == eos and len(s.tokens) < SEQ_LEN for s in want)
    assert any(len(s.tokens) == SEQ_LEN for s in want)
    return model, tok, prompts, want


META = {"data": "x", "model": "m", "seq_len": SEQ_LEN, "prompts": 15}


def test_distill_makes_the_greedy_sequences_in_prompt_order(setup, tmp_path, monkeypatch):
    model, tok, prompts, want = setup
    monkeypatch.setattr(data, "SORT_WINDOW", 2)  # windows of 2 batches of 3
    seen = []
    got = distill(model, tok, prompts, SEQ_LEN, tmp_path, META, gen_batch=3, progress=lambda d, t: seen.append((d, t)))
    assert got == want
    assert load_distilled(tmp_path) == want
    assert seen[0] == (0, 15) and seen[-1] == (15, 15)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_distill_resumes_after_an_interruption(setup, tmp_path, monkeypatch):
    model, tok, prompts, want = setup
    monkeypatch.setattr(data, "SORT_WINDOW", 2)
    real = data.greedy_batch
    calls = []

    def stop_at_fourth_batch(model, ps, *args, **kw):
        calls.append(len(ps))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(model, ps, *args, **kw)

    monkeypatch.setattr(data, "greedy_batch", stop_at_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        distill(model, tok, prompts, SEQ_LEN, tmp_path, META, gen_batch=3)
    # The first window (6 prompts) is on disk, in order; the second window's
    # first batch holds its shortest prompts, whose sequences are on disk
    # only as far as they continue the prompts' order.
    kept = load_distilled(tmp_path)
    assert 6 <= len(kept) < 15 and kept == want[: len(kept)]
    # A line cut short by the interruption is made again.
    with (tmp_path / data.DISTILL_FILE).open("a") as f:
        f.write('{"tokens": [1, 2')
    counted = []
    monkeypatch.setattr(data, "greedy_batch", lambda m, ps, *a, **k: counted.append(len(ps)) or real(m, ps, *a, **k))
    got = distill(model, tok, prompts, SEQ_LEN, tmp_path, META, gen_batch=3)
    assert got == want and load_distilled(tmp_path) == want
    assert sum(counted) == 15 - len(kept)  # nothing made twice
    lines = (tmp_path / data.DISTILL_FILE).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"tokens": s.tokens, "prompt_len": s.prompt_len} for s in want]


def test_distill_refuses_other_meta(setup, tmp_path):
    model, tok, prompts, _ = setup
    distill(model, tok, prompts[:3], SEQ_LEN, tmp_path, {**META, "prompts": 3}, gen_batch=3)
    with pytest.raises(ValueError, match="pass a new --out directory"):
        distill(model, tok, prompts[:3], SEQ_LEN, tmp_path, {**META, "seq_len": 31}, gen_batch=3)
