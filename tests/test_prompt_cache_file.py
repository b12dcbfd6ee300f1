"""Prompt-cache files: a prefix saved once decodes, with any continuation,
exactly what the uncached run of the whole prompt decodes; a file made for
another pair, or that is not one, is refused with a sentence."""

import mlx.core as mx
import pytest
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cache.files import load_prompt_cache, read_metadata, save_prompt_cache

VOCAB = 24


def tokens(pair, prompt, cache=None, **kw):
    model, draft = pair
    rs = stream_generate(model, draft, make_tokenizer(VOCAB), prompt, prompt_cache=cache, **kw)
    return [t for r in rs for t in r.tokens]


def cached_prefix(pair, prefix):
    """A cache holding exactly ``prefix`` (what cache-prompt writes)."""
    cache = make_prompt_cache(*pair)
    tokens(pair, prefix + [0], cache, max_tokens=1)  # reads prefix + one more id ...
    cache.keep_prefix(prefix + [0])  # ... of which only the prefix is kept
    assert cache.tokens == prefix
    return cache


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=5)])
def test_a_saved_prefix_decodes_what_the_uncached_prompt_decodes(agreeing_pair, tmp_path, sampling):
    prefix = [(i * 7) % 23 + 1 for i in range(300)]  # longer than one buffer step
    path = tmp_path / "prefix.safetensors"
    save_prompt_cache(path, cached_prefix(agreeing_pair, prefix), {"model": "tiny-target", "draft_model": "tiny-draft"})
    meta = read_metadata(path)
    assert meta["model"] == "tiny-target" and meta["tokens"].startswith("[")
    for continuation in ([5, 6, 7], [9]):
        cache, _ = load_prompt_cache(path, *agreeing_pair)
        assert cache.tokens == prefix and cache.consistent()
        prompt = prefix + continuation
        want = tokens(agreeing_pair, prompt, max_tokens=30, block_size=8, **sampling)
        assert tokens(agreeing_pair, prompt, cache, max_tokens=30, block_size=8, **sampling) == want
        assert cache.tokens[: len(prefix)] == prefix  # the prefix was reused, not re-read


def test_a_file_for_another_pair_or_not_a_cache_is_refused(agreeing_pair, tmp_path):
    path = tmp_path / "prefix.safetensors"
    save_prompt_cache(path, cached_prefix(agreeing_pair, [1, 2, 3, 4]), {"model": "tiny-target"})
    model, draft = agreeing_pair
    tcfg = target_config("qwen3", vocab=VOCAB, layers=5)
    other_target = make_target(tcfg, seed=99)  # same shapes, other weights
    with pytest.raises(ValueError, match="made for another model pair \\(tiny-target\\)"):
        load_prompt_cache(path, other_target, draft)
    dcfg = draft_config(tcfg, layers=2, block_size=16, taps=[0, 3])
    with pytest.raises(ValueError, match="another model pair"):
        load_prompt_cache(path, model, make_draft(dcfg, random_draft_weights(dcfg, seed=7)))
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"x": mx.zeros(2)})
    with pytest.raises(ValueError, match="not a dflash-mlx prompt-cache file"):
        load_prompt_cache(plain, model, draft)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_cache(tmp_path / "nowhere.safetensors", model, draft)
    (tmp_path / "junk.safetensors").write_text("junk")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_prompt_cache(tmp_path / "junk.safetensors", model, draft)
    with pytest.raises(ValueError, match="empty"):
        save_prompt_cache(tmp_path / "e.safetensors", make_prompt_cache(model, draft))


def test_a_file_made_in_another_dtype_names_the_dtype_to_read_it_with(tmp_path):
    """The same pair computing in another dtype (--dtype auto takes float32
    on a CPU with OpenBLAS) reads other keys and values: the refusal says
    which dtype the file was made in, and how to load the pair in it."""
    tcfg = target_config("qwen3", vocab=VOCAB, layers=3)
    dcfg = draft_config(tcfg, layers=1, block_size=8, taps=[0, 2])
    weights = random_draft_weights(dcfg, seed=3)
    pairs = {}
    for dtype in (mx.bfloat16, mx.float32):
        model, draft = make_target(tcfg, seed=4), make_draft(dcfg, weights)
        for m in (model, draft):
            m.set_dtype(dtype)
        pairs[dtype] = (model, draft)
    path = tmp_path / "bf16.safetensors"
    save_prompt_cache(path, cached_prefix(pairs[mx.bfloat16], [1, 2, 3, 4]))
    assert read_metadata(path)["dtype"] == "bfloat16"
    with pytest.raises(
        ValueError,
        match=r"made with the pair computing in bfloat16, and this one computes in "
        r"float32; load it with --dtype bfloat16",
    ):
        load_prompt_cache(path, *pairs[mx.float32])
    cache, _ = load_prompt_cache(path, *pairs[mx.bfloat16])
    assert cache.tokens == [1, 2, 3, 4]
