"""The bounded target KV cache (max_kv_size): greedy DFlash equals mlx-lm's
own greedy decoding with max_kv_size (its RotatingKVCache, keep=4) token for
token, for prompts shorter and longer than the bound, replies running well
past it, several blocks and prefill steps; turns give what mlx-lm gives when
it reuses its own cache; memory stays bounded, the drafter's included. The
decoding tests run with cycles built eagerly and through mx.compile (a
GPU's), where the ring goes in and comes back."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.kv.rotating import DraftWindowCache, RotatingBufferKVCache

VOCAB = 48
M = 24  # max_kv_size


@pytest.fixture(scope="module")
def pair():
    tcfg = target_config("qwen3", vocab=VOCAB, hidden=64)
    model = make_target(tcfg, seed=5)
    dcfg = draft_config(tcfg, layers=2, block_size=16)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=6))


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compiled(request, monkeypatch):
    """Cycles built eagerly or compiled; with them compiled, each test's
    rings must have gone through a trace (not an eager fallback)."""
    monkeypatch.setattr(Cycle, "compile_graphs", request.param)
    taken = []
    real = RotatingBufferKVCache.take_outputs
    monkeypatch.setattr(RotatingBufferKVCache, "take_outputs", lambda c, *a: taken.append(1) or real(c, *a))
    yield request.param
    assert bool(taken) == request.param


def greedy(x):
    return mx.argmax(x, axis=-1)


def reference(model, prompt, n, step, max_kv_size=M, cache=None):
    """mlx-lm's greedy decoding, bounded by max_kv_size (or continuing ``cache``)."""
    return [
        t
        for t, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=n,
            sampler=greedy,
            max_kv_size=max_kv_size,
            prompt_cache=cache,
            prefill_step_size=step,
        )
    ]


def run(pair, prompt, cache, n, block_size, step):
    model, draft = pair
    return [
        t
        for r in stream_generate(
            model,
            draft,
            make_tokenizer(VOCAB),
            prompt,
            max_tokens=n,
            block_size=block_size,
            prompt_cache=cache,
            prefill_step_size=step,
        )
        for t in r.tokens
    ]


@pytest.mark.parametrize("step", [2048, 7])
def test_greedy_equals_mlx_lm_with_its_rotating_cache(pair, compiled, step):
    model, draft = pair
    rng = random.Random(step)
    differs = 0
    for length in (1, 10, 24, 60):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(length)]
        want = reference(model, prompt, 70, step)
        differs += want != reference(model, prompt, 70, step, max_kv_size=None)
        for bs in (2, 5, 16) if length in (10, 60) else (5,):
            cache = make_prompt_cache(model, draft, max_kv_size=M)
            assert run(pair, prompt, cache, 70, bs, step) == want, (length, bs)
            assert cache.consistent()
            assert all(type(c) is RotatingBufferKVCache for c in cache.target)
    assert differs  # the bound changed mlx-lm's own output: the comparison is not vacuous


def test_auto_block_and_long_replies(pair, compiled):
    model, draft = pair
    prompt = [5, 9, 2, 7, 1, 3]
    want = reference(model, prompt, 150, 2048)
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    assert run(pair, prompt, cache, 150, None, 2048) == want


def test_memory_stays_bounded(pair):
    model, draft = pair
    sizes = []
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    conversation = [1, 2, 3]
    for turn in range(4):
        conversation += run(pair, conversation, cache, 150, 4, 2048) + [7]
        sizes.append((sum(c.nbytes for c in cache.target), sum(c.nbytes for c in cache.draft)))
    assert len(set(s[0] for s in sizes)) == 1  # the target's ring: allocated once
    assert max(s[1] for s in sizes) == sizes[1][1]  # the drafter's context stops growing
    ring = cache.target[0]
    assert ring.capacity == M + 16 - 1 < len(cache.tokens) // 4
    assert all(
        type(c) is DraftWindowCache and c.base > 0 and c.capacity <= -(-(ring.slots + 256 + 16) // 256) * 256
        for c in cache.draft
    )


@pytest.mark.parametrize("step", [2048, 5])
def test_turns_give_what_mlx_lm_gives_reusing_its_cache(pair, compiled, step):
    """Each turn gives the whole conversation; mlx-lm is given each turn's
    new tokens with its own cache, as mlx_lm.chat does."""
    model, draft = pair
    rng = random.Random(step + 1)
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    theirs = mlx_prompt_cache(model, max_kv_size=M)
    conversation, new = [], [rng.randrange(VOCAB - 1) for _ in range(9)]
    for turn, bs in enumerate([4, 16, 3, 7]):
        want = reference(model, new, 20, step, cache=theirs)
        conversation += new
        assert run(pair, conversation, cache, 20, bs, step) == want, turn
        assert cache.consistent() and cache.tokens == conversation + want[:-1]
        conversation += want
        new = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 12))]


def test_a_prompt_that_leaves_the_conversation_is_read_afresh(pair, compiled):
    model, draft = pair
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    got = run(pair, first, cache, 40, 4, 2048)  # the ring wraps
    assert cache.target[0].wrapped
    other = first[:5] + [8, 8]
    assert run(pair, other, cache, 30, 5, 2048) == reference(model, other, 30, 2048)
    # not wrapped yet: cut back exactly
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    run(pair, first, cache, 3, 4, 2048)
    assert not cache.target[0].wrapped
    assert run(pair, other, cache, 30, 5, 2048) == reference(model, other, 30, 2048)
    assert got


def test_bad_settings_are_refused_in_one_sentence(pair):
    model, draft = pair
    for kw, words in [
        ({"max_kv_size": 4}, "max_kv_size must be an integer above 4"),
        ({"max_kv_size": 64, "kv_bits": 4}, "max_kv_size and kv_bits cannot be combined"),
    ]:
        with pytest.raises(ValueError, match=words):
            make_prompt_cache(model, draft, **kw)


def test_cli_max_kv_size(tmp_path, monkeypatch):
    """--max-kv-size on generate: the API's output, no stop at the target's
    context length (here 40 positions), and mistakes in one sentence."""
    from tiny import write_target, write_zlab_draft
    from typer.testing import CliRunner

    import dflash_mlx
    from dflash_mlx.cli.app import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tcfg = {**target_config("qwen3", vocab=VOCAB, hidden=128), "max_position_embeddings": 40}  # head_dim 32
    write_target(tmp_path / "t", tcfg, make_target(tcfg, seed=5), make_tokenizer(VOCAB))
    dcfg = draft_config(tcfg, layers=2, block_size=8)
    write_zlab_draft(tmp_path / "d", dcfg, random_draft_weights(dcfg, seed=6))

    def cli(*args, command="generate"):
        return CliRunner().invoke(
            app,
            [
                command,
                "--model",
                str(tmp_path / "t"),
                "--draft-model",
                str(tmp_path / "d"),
                "--ignore-chat-template",
                "-p",
                "a b c",
                *args,
            ],
            prog_name="dflash-mlx",
            env={"COLUMNS": "200"},
        )

    result = cli("-m", "60", "--block-size", "4", "--max-kv-size", str(M))
    assert result.exit_code == 0, result.output
    model, draft, tok = dflash_mlx.load(str(tmp_path / "t"), draft=str(tmp_path / "d"))
    want = dflash_mlx.generate(
        model,
        draft,
        tok,
        "a b c",
        max_tokens=60,
        block_size=4,
        prompt_cache=make_prompt_cache(model, draft, max_kv_size=M),
    )
    assert result.stdout.strip() == want.strip()
    assert "context" not in result.stderr and "60 tokens" in result.stderr
    unbounded = cli("-m", "60", "--block-size", "4")
    assert unbounded.exit_code == 0 and "the target's context length (40 positions)" in " ".join(
        unbounded.stderr.split()
    )
    for args, words in [
        (["--max-kv-size", "4"], "--max-kv-size must be more than 4"),
        (["--max-kv-size", "64", "--kv-bits", "4"], "--max-kv-size and --kv-bits cannot be combined"),
    ]:
        result = cli(*args)
        assert result.exit_code == 1 and words in " ".join(result.stderr.split()), result.output
        assert "Traceback" not in result.output
    # a quantized prefix cached, then used with its settings; other settings refused
    kv = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    made = CliRunner().invoke(
        app,
        [
            "cache-prompt",
            "--model",
            str(tmp_path / "t"),
            "--draft-model",
            str(tmp_path / "d"),
            "--ignore-chat-template",
            "-p",
            "x y z w",
            "--prompt-cache-file",
            str(tmp_path / "q.safetensors"),
            *kv,
        ],
        prog_name="dflash-mlx",
    )
    assert made.exit_code == 0, made.output
    used = cli("-m", "8", "--block-size", "4", "--prompt-cache-file", str(tmp_path / "q.safetensors"), *kv)
    assert used.exit_code == 0, used.output
    fresh = cli("-m", "8", "--block-size", "4", *kv, "-p", "x y z wa b c")
    refused = cli("-m", "8", "--prompt-cache-file", str(tmp_path / "q.safetensors"))
    assert (
        refused.exit_code == 1
        and "was made with --kv-bits 8, --kv-group-size 32, --quantized-kv-start 0, not no KV "
        "quantization; use the settings it was made with"
        in " ".join(refused.stderr.split())
    ), refused.output
    assert fresh.exit_code == 0 and used.stdout
    bounded = cli("-m", "8", "--prompt-cache-file", str(tmp_path / "q.safetensors"), "--max-kv-size", "64")
    assert (
        bounded.exit_code == 1
        and "a prompt-cache file holds an unbounded cache; run without --max-kv-size to use it."
        in " ".join(bounded.stderr.split())
    )


def test_a_reply_stopped_early_keeps_the_turns_exact(pair, compiled):
    """A reply closed after a few cycles (a Ctrl-C) leaves the bounded cache
    exact: the next turn still gives what mlx-lm gives reusing its cache."""
    model, draft = pair
    cache = make_prompt_cache(model, draft, max_kv_size=M)
    theirs = mlx_prompt_cache(model, max_kv_size=M)
    conversation, new = [], [3, 1, 4, 1, 5, 9, 2, 6]
    for turn, cycles in enumerate([9, 4, 12]):
        gen = stream_generate(
            model,
            draft,
            make_tokenizer(VOCAB),
            conversation + new,
            max_tokens=60,
            block_size=5,
            prompt_cache=cache,
            prefill_step_size=5,
        )
        got = [t for _, r in zip(range(cycles), gen) for t in r.tokens]
        gen.close()
        assert cache.consistent() and got == reference(model, new, len(got), 5, cache=theirs), turn
        conversation += new + got
        new = [7, 7, turn]
