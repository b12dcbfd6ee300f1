"""The quantized target KV cache (kv_bits, kv_group_size, quantized_kv_start):
greedy DFlash equals mlx-lm's own greedy decoding with its QuantizedKVCache
under the same settings, token for token; prompt-cache turns and interrupts
stay exact, with cycles built eagerly and through mx.compile (a GPU's); the
cache is smaller."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.kv.buffer import BufferKVCache
from dflash_mlx.kv.quantized import QuantizedBufferKVCache

VOCAB = 48
STEP = 16  # prefill chunk, the same for DFlash and mlx-lm


@pytest.fixture(scope="module")
def qpair():
    tcfg = target_config("qwen3", vocab=VOCAB, hidden=128)  # head_dim 32: mlx-lm quantizes along it
    model = make_target(tcfg, seed=3)
    dcfg = draft_config(tcfg, layers=2, block_size=16)
    return model, make_draft(dcfg, random_draft_weights(dcfg, seed=4))


def reference(model, prompt, n, kv_bits=None, kv_group_size=32, quantized_kv_start=0):
    """mlx-lm's greedy decoding with its own (quantized) KV cache."""
    return [
        t
        for t, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=n,
            sampler=lambda x: mx.argmax(x, axis=-1),
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
            prefill_step_size=STEP,
        )
    ]


def run(pair, prompt, cache, n, block_size):
    model, draft = pair
    tok = make_tokenizer(VOCAB)
    return [
        t
        for r in stream_generate(
            model, draft, tok, prompt, max_tokens=n, block_size=block_size, prompt_cache=cache, prefill_step_size=STEP
        )
        for t in r.tokens
    ]


@pytest.mark.parametrize("bits,start", [(4, 0), (8, 20), (2, 10), (4, 40)])
def test_greedy_equals_mlx_lm_with_its_quantized_cache(qpair, bits, start, compiled, monkeypatch):
    model, draft = qpair
    taken = []  # the quantized buffers a compiled cycle handed back
    real = QuantizedBufferKVCache.take_outputs
    monkeypatch.setattr(QuantizedBufferKVCache, "take_outputs", lambda c, *a: taken.append(1) or real(c, *a))
    rng = random.Random(bits * 100 + start)
    differs = 0
    for i, length in enumerate([1, 17, 45]):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(length)]
        want = reference(model, prompt, 40, bits, 32, start)
        differs += want != reference(model, prompt, 40)
        for bs in [2, 16] if i != 1 else [5]:
            cache = make_prompt_cache(model, draft, kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
            assert run(qpair, prompt, cache, 40, bs) == want, (bits, start, length, bs)
            if length >= start:  # quantized by the prefill at the latest
                assert all(type(c) is QuantizedBufferKVCache and c.bits == bits for c in cache.target)
            assert all(type(c) is BufferKVCache for c in cache.draft) and cache.consistent()
    if bits <= 4:
        assert differs  # the quantized cache changed mlx-lm's own output: the comparison is not vacuous
    assert bool(taken) == compiled  # the quantized cycles were the compiled ones, not an eager fallback


def test_the_cache_stays_unquantized_below_the_start(qpair):
    model, draft = qpair
    prompt = [3, 1, 4, 1, 5]
    cache = make_prompt_cache(model, draft, kv_bits=4, kv_group_size=32, quantized_kv_start=1000)
    assert run(qpair, prompt, cache, 20, 8) == reference(model, prompt, 20, 4, 32, 1000) == reference(model, prompt, 20)
    assert all(type(c) is BufferKVCache for c in cache.target)


@pytest.mark.parametrize("start", [0, 20])
def test_prompt_cache_turns_stay_exact(qpair, start, compiled):
    """Each turn continues the cache; mlx-lm reads the whole conversation
    afresh (its first chunk, where quantizing starts, is the same)."""
    model, draft = qpair
    rng = random.Random(start)
    cache = make_prompt_cache(model, draft, kv_bits=4, kv_group_size=32, quantized_kv_start=start)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(40)]
    for turn, bs in enumerate([4, 16, 3]):
        want = reference(model, conversation, 16, 4, 32, start)
        assert run(qpair, conversation, cache, 16, bs) == want, turn
        assert cache.consistent()
        conversation += want + [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 9))]


def test_an_interrupt_at_any_write_leaves_the_cache_exact(qpair, monkeypatch, compiled):
    model, draft = qpair
    tok = make_tokenizer(VOCAB)
    rng = random.Random(7)
    cache = make_prompt_cache(model, draft, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(30)]
    for trial in range(5):
        conversation += [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 30))]
        count, at = [0], rng.randrange(1, 60)
        with monkeypatch.context() as m:
            for cls in (BufferKVCache, QuantizedBufferKVCache):

                def write(cache, keys, values, start, real=cls.write):
                    count[0] += 1
                    if count[0] == at:
                        raise KeyboardInterrupt
                    return real(cache, keys, values, start)

                m.setattr(cls, "write", write)
            got = []
            with pytest.raises(KeyboardInterrupt):
                for r in stream_generate(
                    model,
                    draft,
                    tok,
                    conversation,
                    max_tokens=30,
                    prompt_cache=cache,
                    block_size=rng.choice([4, 16]),
                    prefill_step_size=STEP,
                ):
                    got += r.tokens
                raise KeyboardInterrupt  # finished before its moment: still a valid trial
        assert cache.consistent(), trial
        assert cache.tokens == (conversation + got)[: len(cache.tokens)]
        conversation += got + [rng.randrange(VOCAB - 1)]
        want = reference(model, conversation, 12, 4, 32, 0)
        assert run(qpair, conversation, cache, 12, 6) == want, trial
        conversation += want


def test_the_quantized_cache_is_smaller(qpair):
    model, draft = qpair
    prompt = [i % (VOCAB - 1) for i in range(700)]
    sizes = {}
    for bits in (None, 8, 4):
        cache = make_prompt_cache(model, draft, kv_bits=bits, kv_group_size=32)
        run(qpair, prompt, cache, 2, 2)
        sizes[bits] = sum(c.nbytes for c in cache.target)
    # float32 keys/values, a float32 scale and bias per 32: 8 bits 1/4 + 1/16, 4 bits 1/8 + 1/16
    assert sizes[8] <= 0.3125 * sizes[None] and sizes[4] <= 0.1875 * sizes[None]


def test_bad_settings_are_refused_in_one_sentence(qpair):
    model, draft = qpair
    for kw, words in [
        ({"kv_bits": 7}, "kv_bits must be one of"),
        ({"kv_bits": 4, "kv_group_size": 48}, "kv_group_size must be"),
        ({"kv_bits": 4, "kv_group_size": 128}, "does not divide the target's head dimension 32"),
        ({"kv_bits": 4, "quantized_kv_start": -1}, "quantized_kv_start must be 0 or more"),
    ]:
        with pytest.raises(ValueError, match=words):
            make_prompt_cache(model, draft, **kw)


def test_cli_kv_flags(tmp_path, monkeypatch):
    from tiny import write_target, write_zlab_draft
    from typer.testing import CliRunner

    import dflash_mlx
    from dflash_mlx.cli.app import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tcfg = target_config("qwen3", vocab=VOCAB, hidden=128)
    write_target(tmp_path / "t", tcfg, make_target(tcfg, seed=3), make_tokenizer(VOCAB))
    dcfg = draft_config(tcfg, layers=2, block_size=8)
    write_zlab_draft(tmp_path / "d", dcfg, random_draft_weights(dcfg, seed=4))

    def cli(*args):
        return CliRunner().invoke(
            app,
            [
                "generate",
                "--model",
                str(tmp_path / "t"),
                "--draft-model",
                str(tmp_path / "d"),
                "--ignore-chat-template",
                "-p",
                "a b c",
                "-m",
                "24",
                "--block-size",
                "4",
                *args,
            ],
            prog_name="dflash-mlx",
            env={"COLUMNS": "200"},
        )

    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    result = cli("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert result.exit_code == 0, result.output
    model, draft, tok = dflash_mlx.load(str(tmp_path / "t"), draft=str(tmp_path / "d"))
    want = dflash_mlx.generate(
        model, draft, tok, "a b c", max_tokens=24, block_size=4, prompt_cache=make_prompt_cache(model, draft, **kv)
    )
    assert result.stdout.strip() == want.strip()
    for args, words in [
        (["--kv-bits", "7"], "--kv-bits must be one of 2, 3, 4, 5, 6, 8, got 7."),
        (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64, 128"),
        (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start must be 0 or more"),
        (
            ["--kv-bits", "4", "--kv-group-size", "128"],
            "--kv-group-size 128 does not divide the target's head dimension 32.",
        ),
    ]:
        result = cli(*args)
        assert result.exit_code == 1 and words in " ".join(result.stderr.split()), result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize("start", [0, 30, 100])
def test_a_quantized_cache_saved_and_loaded_decodes_the_same(qpair, tmp_path, start):
    from dflash_mlx.cache.files import load_prompt_cache, save_prompt_cache

    model, draft = qpair
    rng = random.Random(start + 5)
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=start)
    prefix = [rng.randrange(VOCAB - 1) for _ in range(50)]
    cache = make_prompt_cache(model, draft, **kv)
    run(qpair, prefix, cache, 1, 2)
    save_prompt_cache(tmp_path / "c.safetensors", cache)
    loaded, meta = load_prompt_cache(tmp_path / "c.safetensors", model, draft, **kv)
    assert meta["kv_bits"] == "4" and loaded.tokens == prefix and loaded.consistent()
    assert [type(c) for c in loaded.target] == [type(c) for c in cache.target]
    prompt = prefix + [rng.randrange(VOCAB - 1) for _ in range(9)]
    fresh = make_prompt_cache(model, draft, **kv)
    run(qpair, prefix, fresh, 1, 2)  # the same prefix read first, then the rest: as the file's user does
    assert run(qpair, prompt, loaded, 30, 5) == run(qpair, prompt, fresh, 30, 5)
    for other, words in [
        ({}, f"was made with kv_bits 4, kv_group_size 32, quantized_kv_start {start}, not no KV quantization"),
        ({**kv, "kv_bits": 8}, "not kv_bits 8, kv_group_size 32"),
    ]:
        with pytest.raises(ValueError, match=words):
            load_prompt_cache(tmp_path / "c.safetensors", model, draft, **other)


@pytest.mark.parametrize("start", [32, 40])
def test_a_start_reached_after_the_first_turn_matches_mlx_lm_reusing_its_cache(qpair, start):
    """mlx_lm.chat's way: its cache kept across turns, each turn's new tokens
    read in chunks after the last reply's tokens, decoded one at a time
    (the start falls right after the first reply, or in the next turn)."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    model, draft = qpair
    rng = random.Random(start)
    cache = make_prompt_cache(model, draft, kv_bits=2, kv_group_size=32, quantized_kv_start=start)
    theirs = mlx_prompt_cache(model)
    conversation, new = [], [rng.randrange(VOCAB - 1) for _ in range(20)]
    for turn, (bs, following) in enumerate([(4, 24), (16, 10), (3, 5)]):
        want = [
            t
            for t, _ in generate_step(
                mx.array(new),
                model,
                max_tokens=12,
                sampler=lambda x: mx.argmax(x, axis=-1),
                prompt_cache=theirs,
                kv_bits=2,
                kv_group_size=32,
                quantized_kv_start=start,
                prefill_step_size=STEP,
            )
        ]
        conversation += new
        assert run(qpair, conversation, cache, 12, bs) == want, turn
        conversation += want
        new = [rng.randrange(VOCAB - 1) for _ in range(following)]


def test_a_reused_cache_reads_only_its_filled_positions(qpair):
    """A cache grown for a long prompt, cut back for a short one: a prompt
    chunk reads its filled keys under MLX's causal mask, a verify block up to
    the bound, never the capacity, as BufferKVCache's reads."""
    cache = QuantizedBufferKVCache(group_size=32, bits=4)
    kv = mx.ones((1, 2, 1000, 32))
    cache.update_and_fetch(kv, kv)
    cache.set_length(40)
    kv = mx.ones((1, 2, 7, 32))
    assert cache.make_mask(7) == "causal"
    keys, values = cache.update_and_fetch(kv, kv)
    assert all(a.shape[2] == 47 for a in (*keys, *values)) and cache.capacity == 1024
    cache.set_length(mx.array(47, mx.int32), 50)
    mask = cache.make_mask(4)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 4, 32)), mx.ones((1, 2, 4, 32)))
    assert mask.shape == (4, 54) and keys[0].shape[2] == 54


def test_a_short_prompt_after_a_long_one_matches_mlx_lm(qpair):
    model, _ = qpair
    cache = make_prompt_cache(model, qpair[1], kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    run(qpair, [i % (VOCAB - 1) for i in range(900)], cache, 2, 4)
    short = [(7 * i) % (VOCAB - 1) for i in range(50)]
    assert run(qpair, short, cache, 12, 6) == reference(model, short, 12, 4, 32, 0)
    assert cache.target[0].capacity > 900


def test_a_long_prompt_is_held_at_full_precision_only_up_to_the_start(qpair, monkeypatch, buffer_copies):
    """A prompt whose keys and values are quantized from position 40 on: its
    unquantized buffers never grow much past 40 (not to the whole prompt,
    as a cache made at the prompt's size would), its quantized ones grow to
    the prompt's size once, and greedy output stays mlx-lm's."""
    widest = []
    from_buffer = QuantizedBufferKVCache.from_buffer.__func__

    def recorded(cls, cache, group_size, bits):
        widest.append(cache.capacity)
        return from_buffer(cls, cache, group_size, bits)

    monkeypatch.setattr(QuantizedBufferKVCache, "from_buffer", classmethod(recorded))
    model, draft = qpair
    prompt = [random.Random(9).randrange(1, VOCAB - 1) for _ in range(600)]
    cache = make_prompt_cache(model, draft, kv_bits=8, kv_group_size=32, quantized_kv_start=40)
    assert run(qpair, prompt, cache, 12, 8) == reference(model, prompt, 12, 8, 32, 40)
    assert widest and max(widest) <= 256
    assert len(buffer_copies) <= len(cache.target)
