"""Loading: the registry of known pairs, Hub repo ids from an offline cache,
raw, sharded, converted and quantized drafter directories."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from convert_fixtures import TCFG, draft_logits, hub_cache, shard, zlab_draft
from mlx_lm.utils import quantize_model
from tiny import draft_config, make_target, make_tokenizer, target_config, write_target

from dflash_mlx import load, load_draft
from dflash_mlx.convert.weights import convert
from dflash_mlx.loading import KNOWN_PAIRS, find_drafter, is_cached, known_pairs, read_weights, resolve

QWEN3_8B_DRAFTER = "z-lab/Qwen3-8B-DFlash-b16"


def tiny_target_dir(path: Path, tcfg: dict = TCFG, quantized: bool = False) -> Path:
    model = make_target(tcfg)
    cfg = dict(tcfg)
    if quantized:
        model, cfg = quantize_model(model, cfg, 64, 4)
    return write_target(path, cfg, model, make_tokenizer(tcfg["vocab_size"]))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An offline huggingface_hub cache the test fills."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


# -- the registry ---------------------------------------------------------------


def test_known_pairs():
    pairs = known_pairs()
    assert ("Qwen/Qwen3-8B", QWEN3_8B_DRAFTER) in pairs
    assert ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16") in pairs
    assert ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat") in pairs
    assert ("mlx-community/Qwen3-8B-4bit", QWEN3_8B_DRAFTER) in pairs
    # Each target's default drafter comes first; other formats' follow.
    assert dict(pairs[: len(KNOWN_PAIRS)]) == KNOWN_PAIRS
    assert ("Qwen/Qwen3-8B", "RedHatAI/Qwen3-8B-speculator.dflash") in pairs[len(KNOWN_PAIRS) :]
    assert all(d.startswith(("z-lab/", "RedHatAI/", "meta-models/")) for _, d in pairs)
    # Every mlx-community entry maps to the drafter of a published target.
    published = {t: d for t, d in KNOWN_PAIRS.items() if not t.startswith("mlx-community/")}
    for t, d in pairs:
        if t.startswith("mlx-community/"):
            assert d in published.values() and find_drafter(t) == d


@pytest.mark.parametrize(
    "target, drafter",
    [
        ("Qwen/Qwen3-8B", QWEN3_8B_DRAFTER),
        ("mlx-community/Qwen3-8B-4bit", QWEN3_8B_DRAFTER),
        ("mlx-community/Qwen3-8B-3bit-DWQ", QWEN3_8B_DRAFTER),
        ("Qwen/Qwen3-8B-MLX-bf16", QWEN3_8B_DRAFTER),
        ("mlx-community/Qwen3-4B-8bit", "z-lab/Qwen3-4B-DFlash-b16"),
        ("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("mlx-community/Llama-3.1-8B-Instruct-6bit", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
        ("Qwen/Qwen3-14B", None),
        ("Qwen/Qwen3-8B-Base", None),
        ("gpt2", None),
    ],
)
def test_find_drafter(target, drafter):
    assert find_drafter(target) == drafter


def test_find_drafter_for_local_directories(tmp_path, offline_hub):
    (tmp_path / "Qwen3-8B-4bit").mkdir()
    assert find_drafter(tmp_path / "Qwen3-8B-4bit") == QWEN3_8B_DRAFTER
    snap = hub_cache(offline_hub, "mlx-community/Qwen3-4B-4bit", tmp_path / "Qwen3-8B-4bit")
    assert find_drafter(snap) == "z-lab/Qwen3-4B-DFlash-b16"  # the cache's repo id wins
    (tmp_path / "my-model").mkdir()
    assert find_drafter(tmp_path / "my-model") is None


def test_unknown_target_without_drafter_lists_the_known_pairs(tmp_path):
    target = tiny_target_dir(tmp_path / "my-model")
    with pytest.raises(ValueError) as e:
        load(target)
    msg = str(e.value)
    assert f"no known DFlash drafter for {target}" in msg and "pass draft=" in msg
    assert "known_pairs() lists the known pairs" in msg


# -- the Hub, offline -------------------------------------------------------------


def test_load_resolves_target_and_drafter_from_the_hub_cache(tmp_path, offline_hub):
    hub_cache(offline_hub, "Qwen/Qwen3-8B", tiny_target_dir(tmp_path / "t"))
    hub_cache(offline_hub, QWEN3_8B_DRAFTER, zlab_draft(tmp_path / "d"))
    assert is_cached("Qwen/Qwen3-8B") and is_cached(QWEN3_8B_DRAFTER)
    assert not is_cached("Qwen/Qwen3-4B") and not is_cached("not a repo id!")

    model, draft, tokenizer = load("Qwen/Qwen3-8B")
    assert draft.target.model is model
    assert tokenizer.encode("w3 w4") == [3, 4]
    assert mx.array_equal(draft_logits(draft), draft_logits(load_draft(tmp_path / "d"))).item()


def test_mlx_community_quantized_target_finds_its_drafter(tmp_path, offline_hub):
    hub_cache(offline_hub, "mlx-community/Qwen3-8B-4bit", tiny_target_dir(tmp_path / "t", quantized=True))
    hub_cache(offline_hub, QWEN3_8B_DRAFTER, zlab_draft(tmp_path / "d"))
    model, draft, _ = load("mlx-community/Qwen3-8B-4bit")
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert draft.target.model is model
    logits = draft_logits(draft)
    assert logits.shape == (1, draft.config.block_size - 1, TCFG["vocab_size"])


def test_converted_quantized_drafter_from_the_hub_cache(tmp_path, offline_hub):
    converted = convert(zlab_draft(tmp_path / "d"), tmp_path / "q", quantize=True)
    hub_cache(offline_hub, "me/Tiny-DFlash-4bit", converted)
    target = tiny_target_dir(tmp_path / "t")
    model, draft, _ = load(target, draft="me/Tiny-DFlash-4bit")
    assert isinstance(draft.fc, nn.QuantizedLinear)
    assert mx.array_equal(draft_logits(draft), draft_logits(load_draft(converted))).item()


def test_offline_and_not_cached_is_one_clear_sentence(offline_hub):
    with pytest.raises(ValueError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set; download it once"):
        load_draft("z-lab/Qwen3-4B-DFlash-b16")
    with pytest.raises(ValueError, match="no known DFlash drafter"):
        load("someone/unknown-model")


def test_resolve_rejects_files_and_invalid_ids(tmp_path, offline_hub):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file; pass the model's directory"):
        resolve(f)
    with pytest.raises(ValueError, match="missing/dir does not exist; check the path"):
        resolve(tmp_path / "missing" / "dir")
    with pytest.raises(ValueError, match="not a local directory nor a valid Hub repo id"):
        resolve("not a repo id!")


# -- local directories ---------------------------------------------------------


def test_raw_sharded_drafter_loads_through_its_index(tmp_path):
    src = zlab_draft(tmp_path / "d")
    want = draft_logits(load_draft(src))
    shard(src, 3)
    (src / "stray.safetensors").write_bytes(b"junk the index does not name")
    assert len(read_weights(src)) == len(load_draft(src).parameters()["layers"]) * 11 + 3
    assert mx.array_equal(draft_logits(load_draft(src)), want).item()
    (src / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a valid safetensors index"):
        load_draft(src)


def test_load_with_converted_drafter_dirs(tmp_path):
    src = zlab_draft(tmp_path / "d")
    target = tiny_target_dir(tmp_path / "t")
    for name, kw in {"bf16": {}, "f16": {"dtype": "float16"}, "q8": {"quantize": True, "q_bits": 8}}.items():
        out = convert(src, tmp_path / name, **kw)
        _, draft, _ = load(target, draft=out)
        assert mx.array_equal(draft_logits(draft), draft_logits(load_draft(out))).item()


def test_wrong_pair_is_refused_before_loading(tmp_path):
    target = tiny_target_dir(tmp_path / "t", target_config(layers=4))
    with pytest.raises(ValueError, match="does not fit the target: .*trained on a 6-layer target but this one has 4"):
        load(target, draft=zlab_draft(tmp_path / "d"))


def test_target_without_config_is_refused(tmp_path):
    (tmp_path / "t").mkdir()
    with pytest.raises(ValueError, match="is not a model directory \\(it has no config.json\\)"):
        load(tmp_path / "t", draft=zlab_draft(tmp_path / "d"))


def test_unsupported_target_family_is_refused_before_any_weights(tmp_path, offline_hub):
    """A family without an adapter: one sentence, and neither the drafter (here
    a Hub repo that is not cached, offline) nor the target weights are
    needed to say so."""
    cfg = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 32}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    hub_cache(offline_hub, "someone/mamba-tiny", tmp_path / "t")
    for target in ("someone/mamba-tiny", tmp_path / "t"):
        with pytest.raises(ValueError, match="target model type .mamba. is not supported yet; supported families: "):
            load(target, draft=QWEN3_8B_DRAFTER)


def test_a_snapshot_with_only_its_config_is_not_cached(tmp_path, offline_hub):
    """`convert --target` and the family check fetch a target's config.json
    alone; that must not count as having the model."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(draft_config(TCFG)))
    hub_cache(offline_hub, QWEN3_8B_DRAFTER, tmp_path / "c")
    assert not is_cached(QWEN3_8B_DRAFTER)
    with pytest.raises(
        ValueError, match=f"the cached copy of {QWEN3_8B_DRAFTER} has no weights yet; download it again"
    ):
        load_draft(QWEN3_8B_DRAFTER)


def test_missing_local_target_is_named_before_the_registry(tmp_path):
    from dflash_mlx import load

    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"{missing} does not exist; check the path"):
        load(str(missing))


def test_load_refuses_a_drafter_index_naming_outside_files(tmp_path):
    target_dir = tiny_target_dir(tmp_path / "target")
    d = shard(zlab_draft(tmp_path / "d"), 2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model-00002-of-00002.safetensors"
    (d / name).rename(tmp_path / name)
    index["weight_map"] = {k: (f"../{name}" if v == name else v) for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names the weight file '\.\./model-00002-of-00002\.safetensors', outside"):
        load(str(target_dir), draft=str(d))


def test_load_refuses_a_drafter_with_a_bad_field(tmp_path):
    target_dir = tiny_target_dir(tmp_path / "target")
    d = zlab_draft(tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = 10**9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="block_size must be an integer >= 2 .* at most 256, got 1000000000"):
        load(str(target_dir), draft=str(d))
