"""A prompt-cache file proves itself: checksums of its metadata and tensors
are written at save and checked at load, every tensor's shape is checked
against the pair, and the token ids are read only as a flat list. Flipped
bytes, NaN, other KV heads or head dims and nested token ids are refused in
one sentence; a file without checksums loads with a warning."""

import json
import struct
import warnings

import mlx.core as mx
import pytest
from tiny import draft_config, make_draft, make_target, make_tokenizer, random_draft_weights, target_config

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cache import files
from dflash_mlx.cache.files import load_prompt_cache, save_prompt_cache

VOCAB = 24
SENTENCE = r"^\S+ is damaged \([^()]+\); make it again with `dflash-mlx cache-prompt`\.$"
TCFG = target_config("qwen3", vocab=VOCAB, layers=5, hidden=128)
DCFG = draft_config(TCFG, layers=2, block_size=8, taps=[0, 3])
PREFIX = [(i * 7) % 23 + 1 for i in range(40)]
KV = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)


@pytest.fixture(scope="module")
def pair():
    return make_target(TCFG, seed=31), make_draft(DCFG, random_draft_weights(DCFG, seed=32))


def tokens(pair, prompt, cache=None):
    rs = stream_generate(*pair, make_tokenizer(VOCAB), prompt, prompt_cache=cache, max_tokens=12, block_size=8)
    return [t for r in rs for t in r.tokens]


def save(pair, path, **kv):
    cache = make_prompt_cache(*pair, **kv)
    tokens(pair, PREFIX + [0], cache)
    cache.keep_prefix(PREFIX + [0])
    save_prompt_cache(path, cache, {"model": "tiny"})
    return path


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    return save(pair, d / "plain.safetensors"), save(pair, d / "q.safetensors", **KV)


def rewrite(src, dst, arrays=lambda a: a, meta=lambda m: m, resum=True):
    """A copy of ``src`` with its arrays and metadata changed; ``resum``: its
    checksums made again for the change (as a deliberate edit would)."""
    a, m = mx.load(str(src), return_metadata=True)
    a, m = arrays(dict(a)), meta(dict(m))
    if resum:
        m[files.TENSORS_SUM] = files.tensors_checksum(a)
        m[files.META_SUM] = files.metadata_checksum(m)
    mx.save_safetensors(str(dst), a, metadata=m)
    return dst


def test_a_good_file_loads_and_decodes_what_the_uncached_prompt_decodes(pair, saved):
    meta = mx.load(str(saved[0]), return_metadata=True)[1]
    assert files.TENSORS_SUM in meta and files.META_SUM in meta
    want = tokens(pair, PREFIX + [5, 6])
    for _ in range(2):
        cache, _ = load_prompt_cache(saved[0], *pair)
        assert tokens(pair, PREFIX + [5, 6], cache) == want


def test_flipped_bytes_in_tensor_data_are_refused(pair, saved, tmp_path):
    data = bytearray(saved[0].read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    for k, at in enumerate(start + (len(data) - start) * f // 7 for f in range(6)):
        flipped = bytearray(data)
        flipped[at] ^= 0x40
        path = tmp_path / f"flip{k}.safetensors"
        path.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match=SENTENCE) as e:
            load_prompt_cache(path, *pair)
        assert "checksum does not match" in str(e.value)


@pytest.mark.parametrize("resum", [False, True])
def test_nan_in_a_layer_is_refused(pair, saved, tmp_path, resum):
    def nan(a):
        v = a["target.2.values"]
        return {**a, "target.2.values": mx.where(mx.arange(v.shape[2])[:, None] == 7, mx.nan, v)}

    path = rewrite(saved[0], tmp_path / "nan.safetensors", arrays=nan, resum=resum)
    with pytest.raises(ValueError, match=SENTENCE) as e:
        load_prompt_cache(path, *pair)
    said = "the tensor target.2.values holds NaN or infinity" if resum else "checksum does not match"
    assert said in str(e.value)


def half_dim(a):
    return a[..., : a.shape[-1] // 2]


SHAPES = {
    "target KV heads": ("target.1.keys", lambda a: a[:, :1], "has 1 KV heads, and this pair's layer has 2"),
    "target head dim": ("target.3.values", half_dim, "has a head dim of 16, and this pair's layer has 32"),
    "draft KV heads": ("draft.0.keys", lambda a: mx.concatenate([a, a], 1), "has 4 KV heads"),
    "draft head dim": ("draft.1.values", half_dim, "has a head dim of 16"),
}


@pytest.mark.parametrize("how", sorted(SHAPES))
def test_other_kv_heads_or_head_dim_are_refused_naming_it(pair, saved, tmp_path, how):
    name, change, said = SHAPES[how]
    path = rewrite(saved[0], tmp_path / "s.safetensors", arrays=lambda a: {**a, name: change(a[name])})
    with pytest.raises(ValueError, match=SENTENCE) as e:
        load_prompt_cache(path, *pair)
    assert f"the tensor {name} {said}" in str(e.value)


def test_quantized_parts_of_another_head_dim_are_refused(pair, saved, tmp_path):
    load_prompt_cache(saved[1], *pair, **KV)
    path = rewrite(
        saved[1], tmp_path / "q.safetensors", arrays=lambda a: {**a, "target.0.keys.0": half_dim(a["target.0.keys.0"])}
    )
    with pytest.raises(ValueError, match=SENTENCE) as e:
        load_prompt_cache(path, *pair, **KV)
    assert "the tensor target.0.keys.0 has a packed head dim of 2, and this pair's layer has 4" in str(e.value)


@pytest.mark.parametrize("resum", [False, True])
@pytest.mark.parametrize(
    "text", ["[" * 100000 + "]" * 100000, "[[1, 2], [3]]", '[1, {"a": 2}]', "[1, 2.0]", "[1, -2]", "[1e3]"]
)
def test_token_ids_not_a_flat_list_of_ints_are_refused(pair, saved, tmp_path, text, resum):
    path = rewrite(saved[0], tmp_path / "t.safetensors", meta=lambda m: {**m, "tokens": text}, resum=resum)
    with pytest.raises(ValueError, match=SENTENCE) as e:
        load_prompt_cache(path, *pair)
    assert ("token ids are not a list of ids" if resum else "metadata checksum does not match") in str(e.value)


def test_edited_metadata_is_refused(pair, saved, tmp_path):
    path = rewrite(saved[0], tmp_path / "m.safetensors", meta=lambda m: {**m, "prompt": "other"}, resum=False)
    with pytest.raises(ValueError, match="its metadata checksum does not match"):
        files.read_metadata(path)


def unsummed(m):
    return {k: v for k, v in m.items() if k not in (files.TENSORS_SUM, files.META_SUM)}


def test_a_file_without_checksums_loads_with_a_warning_and_its_tensors_checked(pair, saved, tmp_path):
    path = rewrite(saved[0], tmp_path / "old.safetensors", meta=unsummed, resum=False)
    want = tokens(pair, PREFIX + [5, 6])
    with pytest.warns(UserWarning, match="has no checksums"):
        cache, _ = load_prompt_cache(path, *pair)
    assert tokens(pair, PREFIX + [5, 6], cache) == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a file
        load_prompt_cache(path, *pair)

    def nan(a):
        return {**a, "draft.1.keys": a["draft.1.keys"] * mx.nan}

    bad = rewrite(saved[0], tmp_path / "old-nan.safetensors", arrays=nan, meta=unsummed, resum=False)
    with pytest.raises(ValueError, match=SENTENCE) as e:
        load_prompt_cache(bad, *pair)
    assert "the tensor draft.1.keys holds NaN or infinity" in str(e.value)
    flat = rewrite(
        saved[0], tmp_path / "old-t.safetensors", meta=lambda m: {**unsummed(m), "tokens": "[" * 9999}, resum=False
    )
    with pytest.raises(ValueError, match="token ids are not a list of ids"):
        load_prompt_cache(flat, *pair)
    assert json.loads(mx.load(str(path), return_metadata=True)[1]["tokens"]) == PREFIX
