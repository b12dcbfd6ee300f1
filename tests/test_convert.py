"""`dflash-mlx convert`: round trips, every bad input, atomicity, upload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from convert_fixtures import (
    TCFG,
    assert_clean_failure,
    cli,
    draft_logits,
    hub_cache,
    leftovers,
    max_rel_err,
    shard,
    tiny_target,
    zlab_draft,
)
from tiny import draft_config, make_target, make_tokenizer, target_config, write_target

from dflash_mlx import DraftConfig, atomic_dir, load_draft
from dflash_mlx.convert import weights as convert_module
from dflash_mlx.convert.weights import convert


@pytest.fixture
def src(tmp_path):
    return zlab_draft(tmp_path / "zlab")


def _ok(result):
    assert result.exit_code == 0, result.output
    return result


# -- round trips -----------------------------------------------------------------


def test_round_trip_keeps_logits_config_and_writes_card(tmp_path, src):
    out = tmp_path / "mlx"
    result = _ok(cli("--hf-path", src, "--mlx-path", out))
    assert "Converted" in result.output

    raw, conv = load_draft(src), load_draft(out)
    # Same dtype (the checkpoint's bf16), same tensors: identical logits.
    assert conv.fc.weight.dtype == mx.bfloat16
    assert mx.array_equal(draft_logits(raw), draft_logits(conv)).item()

    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    assert cfg["dflash_config"] == src_cfg["dflash_config"]
    assert "quantization" not in cfg
    assert DraftConfig.from_dict(cfg) == DraftConfig.from_dict(src_cfg)
    card = (out / "README.md").read_text()
    from dflash_mlx import __version__

    assert str(src.resolve()) in card and f"dflash-mlx\n{__version__}" in card and "bfloat16" in card
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    assert leftovers(tmp_path, "mlx") == ["mlx"]


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-2), ("float16", 2e-2)])
def test_dtype_conversion_within_tolerance(tmp_path, src, dtype, tol):
    """bf16 -> float32 is exact on the weights; the logits differ from the bf16
    drafter's only by bf16 activation rounding. float16 adds its own rounding."""
    out = tmp_path / dtype
    _ok(cli("--hf-path", src, "--mlx-path", out, "--dtype", dtype))
    conv = load_draft(out)
    assert {v.dtype for _, v in nn.utils.tree_flatten(conv.parameters())} == {getattr(mx, dtype)}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    assert max_rel_err(draft_logits(conv), draft_logits(load_draft(src))) < tol


def _dequantized(conv):
    """A float32 drafter holding the dequantized weights of ``conv``."""
    from dflash_mlx import DFlashDraft

    weights = {}
    for name, m in conv.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            weights[f"{name}.weight"] = mx.dequantize(
                m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode
            )
    for name, v in nn.utils.tree_flatten(conv.parameters()):
        if not name.endswith((".scales", ".biases")) and name not in weights:
            weights[name] = v
    model = DFlashDraft(conv.config)
    model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    return model


def _rel_fro(a: mx.array, b: mx.array) -> float:
    return (mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((b**2).sum())).item()


@pytest.mark.parametrize(
    "args, bound",
    [
        ((), 0.35),  # 4-bit affine, group 64: mlx-lm's defaults
        (("--q-bits", "8"), 0.03),
        (("--q-bits", "4", "--q-group-size", "32"), 0.45),
        (("--q-mode", "mxfp4"), 0.5),
        (("--q-mode", "mxfp8"), 0.15),
    ],
)
def test_quantized_round_trip_within_bound(tmp_path, src, args, bound):
    """Quantized drafters: (1) every affine weight is within one quantization
    step of the original; (2) the loaded drafter computes exactly what a float
    drafter with the dequantized weights computes; (3) its logits stay within
    ``bound`` (relative Frobenius error) of the raw checkpoint's. The bound is
    for random weights on a 64-wide model, the worst case for quantization."""
    out = tmp_path / "q"
    _ok(cli("--hf-path", src, "--mlx-path", out, "--dtype", "float32", "-q", *args))
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert set(q) == {"group_size", "bits", "mode"} and cfg["quantization_config"] == q
    conv = load_draft(out)
    linears = {n: m for n, m in conv.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}
    assert linears and all(isinstance(m, nn.QuantizedLinear) for m in linears.values())
    assert all(
        m.bits == q["bits"] and m.group_size == q["group_size"] and m.mode == q["mode"] for m in linears.values()
    )
    # Norms are 1-D and stay unquantized, in the chosen dtype.
    for name, m in conv.named_modules():
        if isinstance(m, nn.RMSNorm):
            assert m.weight.dtype == mx.float32 and m.weight.ndim == 1, name

    raw = load_draft(src)
    raw.update(nn.utils.tree_map(lambda v: v.astype(mx.float32), raw.parameters()))
    raw_params = dict(nn.utils.tree_flatten(raw.parameters()))
    deq = _dequantized(conv)
    deq_params = dict(nn.utils.tree_flatten(deq.parameters()))
    if q["mode"] == "affine":
        for name in linears:
            w = raw_params[f"{name}.weight"].reshape(-1, q["group_size"])
            step = (w.max(axis=1) - w.min(axis=1)) / (2 ** q["bits"] - 1)
            err = mx.abs(deq_params[f"{name}.weight"].reshape(-1, q["group_size"]) - w).max(axis=1)
            assert (err <= step * 1.01 + 1e-6).all().item(), name
    got = draft_logits(conv)
    assert mx.allclose(got, draft_logits(deq), rtol=1e-4, atol=1e-4).item()
    err = _rel_fro(got, draft_logits(raw))
    assert 0 < err < bound, err


def test_quantize_skips_layers_whose_input_is_not_divisible(tmp_path):
    """hidden 96: q/k/v/gate/up (input 96) stay full precision at group 64;
    o_proj (input 4*24=96) too; down_proj (input 192) and fc (input 192) quantize."""
    tcfg = target_config(hidden=96)
    src = zlab_draft(tmp_path / "zlab", tcfg)
    out = tmp_path / "q"
    _ok(cli("--hf-path", src, "--mlx-path", out, "-q"))
    conv = load_draft(out)
    kinds = {n: type(m).__name__ for n, m in conv.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}
    assert kinds["fc"] == "QuantizedLinear" and kinds["layers.0.mlp.down_proj"] == "QuantizedLinear"
    assert kinds["layers.0.self_attn.q_proj"] == "Linear"
    assert _rel_fro(draft_logits(conv, tcfg), draft_logits(load_draft(src), tcfg)) < 0.35


VARIANTS = {
    "sliding": dict(layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    "rope_parameters": dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "no_taps": dict(),
    "scaled_softcapped": dict(),
    # The keys a transformers-5 save adds around the DFlash fields (as in
    # z-lab/Qwen3-4B-DFlash-b16's config.json).
    "hf_layout": dict(
        attention_bias=False,
        attention_dropout=0.0,
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        bos_token_id=0,
        eos_token_id=1,
        hidden_act="silu",
        initializer_range=0.02,
        layer_types=["full_attention", "full_attention"],
        max_window_layers=2,
        rope_scaling=None,
        sliding_window=None,
        tie_word_embeddings=False,
        use_cache=True,
        use_sliding_window=False,
        transformers_version="5.0.0",
        _name_or_path="/home/zlab/ckpt",
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["llama", "sharded"])
def test_every_zlab_variant_converts(tmp_path, variant):
    tcfg = target_config("llama") if variant == "llama" else TCFG
    cfg = draft_config(tcfg, **VARIANTS.get(variant, {}))
    if variant == "rope_parameters":
        del cfg["rope_theta"]
    if variant == "no_taps":
        del cfg["dflash_config"]["target_layer_ids"]
    if variant == "scaled_softcapped":
        cfg["dflash_config"].update(input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=3.0)
    if variant == "hf_layout":
        cfg["dtype"] = cfg.pop("torch_dtype")
    src = zlab_draft(tmp_path / "zlab", tcfg, cfg=cfg)
    if variant == "sharded":
        shard(src, 3)
    out = tmp_path / "mlx"
    _ok(cli("--hf-path", src, "--mlx-path", out, "--dtype", "float32"))
    raw, conv = load_draft(src), load_draft(out)
    assert conv.config == raw.config
    written = json.loads((out / "config.json").read_text())
    # Every source key is kept (bar the trainer's local path), the dtype updated.
    assert set(written) >= set(cfg) - {"_name_or_path"} and "_name_or_path" not in written
    assert written.get("dtype", written.get("torch_dtype")) == "float32"
    assert written["dflash_config"] == cfg["dflash_config"]
    if variant == "sliding":
        assert conv.layers[0].self_attn.window == 4
    # Long enough context that the sliding window matters.
    assert max_rel_err(draft_logits(conv, tcfg, ctx=9), draft_logits(raw, tcfg, ctx=9)) < 2e-2


def test_sharded_output_loads_through_the_index(tmp_path, src, monkeypatch):
    import mlx_lm.utils

    real = mlx_lm.utils.make_shards
    monkeypatch.setattr(mlx_lm.utils, "make_shards", lambda w, *a, **k: real(w, 0))  # one tensor per shard
    out = tmp_path / "mlx"
    _ok(cli("--hf-path", src, "--mlx-path", out))
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    assert mx.array_equal(draft_logits(load_draft(out)), draft_logits(load_draft(src))).item()


def test_converts_from_a_hub_repo_id_offline_and_records_its_revision(tmp_path, src, monkeypatch):
    cache = tmp_path / "hub"
    rev = "feedfacefeedfacefeedfacefeedfacefeedface"
    hub_cache(cache, "z-lab/Qwen3-8B-DFlash-b16", src, rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "mlx"
    _ok(cli("--hf-path", "z-lab/Qwen3-8B-DFlash-b16", "--mlx-path", out, "-q"))
    card = (out / "README.md").read_text()
    assert "base_model: z-lab/Qwen3-8B-DFlash-b16" in card and rev in card
    assert "4-bit affine quantization, group size 64" in card
    assert 'load("Qwen/Qwen3-8B", draft=' in card  # the registry's target for this drafter


def test_target_check_accepts_the_right_pair(tmp_path, src):
    target = write_target(tmp_path / "target", TCFG, make_target(TCFG), make_tokenizer(TCFG["vocab_size"]))
    out = tmp_path / "mlx"
    result = _ok(cli("--hf-path", src, "--mlx-path", out, "--target", target))
    assert "Checking the pair" in result.output
    assert load_draft(out).bind(tiny_target()) is not None


# -- bad input: one sentence, non-zero exit, no traceback, nothing written ----------


def _bad(tmp_path, src, *args, fragments=(), out_name="mlx"):
    out = tmp_path / out_name
    result = cli("--hf-path", src, "--mlx-path", out, *args)
    assert_clean_failure(result, *fragments)
    assert leftovers(tmp_path, out_name) == []
    return result


def _edit_config(src: Path, fn) -> None:
    cfg = json.loads((src / "config.json").read_text())
    fn(cfg)
    (src / "config.json").write_text(json.dumps(cfg))


def _edit_weights(src: Path, fn) -> None:
    w = dict(mx.load(str(src / "model.safetensors")))
    fn(w)
    mx.save_safetensors(str(src / "model.safetensors"), w)


def test_missing_config_fields(tmp_path, src):
    _edit_config(src, lambda c: [c.pop("hidden_size"), c.pop("num_target_layers")])
    _bad(tmp_path, src, fragments=["missing hidden_size, num_target_layers", "re-convert"])


def test_missing_mask_token(tmp_path, src):
    _edit_config(src, lambda c: c["dflash_config"].pop("mask_token_id"))
    _bad(tmp_path, src, fragments=["missing dflash_config.mask_token_id"])


def test_missing_tensor(tmp_path, src):
    _edit_weights(src, lambda w: w.pop("layers.1.mlp.up_proj.weight"))
    _bad(tmp_path, src, fragments=["missing tensors layers.1.mlp.up_proj.weight"])


def test_extra_tensor(tmp_path, src):
    _edit_weights(src, lambda w: w.update({"lm_head.weight": mx.zeros((32, 64))}))
    _bad(tmp_path, src, fragments=["unexpected tensors lm_head.weight"])


def test_misshapen_tensor(tmp_path, src):
    _edit_weights(src, lambda w: w.update({"fc.weight": mx.zeros((64, 64))}))
    _bad(tmp_path, src, fragments=["misshapen tensors: fc.weight is (64, 64), expected (64, 128)"])


def test_plain_language_model_given_as_drafter(tmp_path):
    target = write_target(tmp_path / "target", TCFG, make_target(TCFG), make_tokenizer(TCFG["vocab_size"]))
    _bad(tmp_path, target, fragments=["not a DFlash drafter", "plain language model"])


def test_dflash2_config_without_its_fields(tmp_path, src):
    # DFlash 2 drafters convert (tests/test_dflash2.py); one lacking its fields is one sentence.
    _edit_config(src, lambda c: c.update(architectures=["DFlash2DraftModel"]))
    _bad(tmp_path, src, fragments=["DFlash 2 drafter's config.json is missing dflash_config.conv_kernel_size"])


def test_corrupt_safetensors(tmp_path, src):
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _bad(tmp_path, src, fragments=["model.safetensors is not a readable safetensors file", "re-download"])


def test_missing_shard(tmp_path, src):
    shard(src, 2)
    (src / "model-00002-of-00002.safetensors").unlink()
    _bad(tmp_path, src, fragments=["lacks the shard(s) model-00002-of-00002.safetensors"])


def _outside_shard(src: Path, tmp_path: Path, how: str) -> None:
    """Point the index's second shard at a file outside the checkpoint."""
    shard(src, 2)
    name = "model-00002-of-00002.safetensors"
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    (src / name).rename(outside)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    entry = {"dotdot": f"../elsewhere/{name}", "absolute": str(outside)}.get(how, name)
    if how == "symlink":
        (src / name).symlink_to(outside)
    index["weight_map"] = {k: (entry if v == name else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, src, how):
    _outside_shard(src, tmp_path, how)
    _bad(tmp_path, src, fragments=["outside the checkpoint", "re-download it from a source you trust"])
    with pytest.raises(ValueError, match="outside the checkpoint"):
        load_draft(src)


def test_weight_file_linked_from_outside_is_refused(tmp_path, src):
    outside = tmp_path / "elsewhere.safetensors"
    (src / "model.safetensors").rename(outside)
    (src / "model.safetensors").symlink_to(outside)
    _bad(tmp_path, src, fragments=["the weight file model.safetensors resolves to", "outside the checkpoint"])


def test_hub_snapshot_links_into_its_blobs_are_accepted(tmp_path, src, monkeypatch):
    """huggingface_hub's snapshots are links into the repo's blobs/."""
    snap = hub_cache(tmp_path / "hub", "z-lab/Tiny-DFlash", src)
    blobs = snap.parents[1] / "blobs"
    blobs.mkdir()
    for f in list(snap.iterdir()):
        f.rename(blobs / f.name)
        f.symlink_to(Path("../..") / "blobs" / f.name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _ok(cli("--hf-path", "z-lab/Tiny-DFlash", "--mlx-path", tmp_path / "mlx"))
    load_draft(tmp_path / "mlx")


@pytest.mark.parametrize(
    "field, value, fragments",
    [
        ("rms_norm_eps", float("nan"), ["rms_norm_eps = nan", "finite positive number"]),
        ("rms_norm_eps", -1e-6, ["rms_norm_eps = -1e-06", "finite positive number"]),
        ("rope_theta", "big", ["rope_theta = 'big'", "finite positive number"]),
        ("num_hidden_layers", "two", ["num_hidden_layers = 'two'", "an integer from 1 to 1024"]),
        ("hidden_size", 64.5, ["hidden_size = 64.5", "an integer"]),
        ("num_key_value_heads", 3, ["num_key_value_heads = 3", "a divisor of num_attention_heads"]),
        ("dflash_config.block_size", 10**9, ["block_size must be an integer >= 2", "at most 256, got 1000000000"]),
        ("dflash_config.block_size", True, ["block_size must be an integer >= 2", "got True"]),
        ("dflash_config.target_layer_ids", [1, 99], ["target_layer_ids lists 99", "6-layer target", "ids 0 to 5"]),
        ("dflash_config.target_layer_ids", [1, -2], ["target_layer_ids = [1, -2]", "layer ids from 0"]),
        ("dflash_config.target_layer_ids", "1,4", ["target_layer_ids = '1,4'", "a list of target layer ids"]),
        ("dflash_config.mask_token_id", 99, ["mask_token_id 99 is outside its 32-token vocabulary"]),
        ("rope_scaling", [1], ["rope_scaling = [1]", "an object"]),
        ("layer_types", "full_attention", ["layer_types = 'full_attention'", "a list of 2 layer types"]),
    ],
)
def test_bad_config_field_is_one_sentence_naming_it(tmp_path, src, field, value, fragments):
    def edit(c):
        where, _, key = field.rpartition(".")
        (c[where] if where else c)[key] = value

    _edit_config(src, edit)
    result = _bad(tmp_path, src, fragments=[*fragments, "fix config.json"])
    assert result.output.count("error:") == 1
    with pytest.raises(ValueError, match="fix config.json"):
        load_draft(src)


def test_target_with_a_bad_layer_count_is_one_sentence(tmp_path, src):
    target = write_target(tmp_path / "target", TCFG, make_target(TCFG), make_tokenizer(TCFG["vocab_size"]))
    _edit_config(target, lambda c: c.update(num_hidden_layers="six"))
    _bad(tmp_path, src, "--target", target, fragments=["num_hidden_layers = 'six'", "positive integer"])


def test_taps_outside_the_given_target_are_refused(tmp_path, src):
    small = target_config(layers=4)
    target = write_target(tmp_path / "target", small, make_target(small), make_tokenizer(small["vocab_size"]))
    _edit_config(src, lambda c: c.update(num_target_layers=4) or c["dflash_config"].update(target_layer_ids=[1, 5]))
    _bad(tmp_path, src, "--target", target, fragments=["target_layer_ids lists 5", "4-layer target"])


def test_invalid_config_json(tmp_path, src):
    (src / "config.json").write_text("{not json")
    _bad(tmp_path, src, fragments=["config.json is not valid JSON"])


def test_missing_source(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    _bad(tmp_path, "z-lab/Nope-DFlash", fragments=["not in the Hugging Face cache", "HF_HUB_OFFLINE"])
    _bad(tmp_path, tmp_path / "no" / "such" / "dir", fragments=["does not exist; check the path"])


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("--dtype", "float8"), ["unknown dtype 'float8'", "--dtype float16, bfloat16, float32"]),
        (("-q", "--q-bits", "7"), ["affine quantization cannot use 7 bits", "--q-bits 2 or 3 or 4 or 5 or 6 or 8"]),
        (("-q", "--q-group-size", "48"), ["cannot use group size 48"]),
        (("-q", "--q-mode", "int4"), ["unknown quantization mode 'int4'"]),
        (("-q", "--q-mode", "mxfp4", "--q-bits", "8"), ["mxfp4 quantization cannot use 8 bits"]),
        (("--q-bits", "4"), ["--q-bits only apply when quantizing", "-q/--quantize"]),
        (("-q", "--q-bits", "four"), ["Invalid value for '--q-bits'"]),  # Typer's own usage error
    ],
)
def test_unknown_dtype_or_quantization_option(tmp_path, src, args, fragments):
    _bad(tmp_path, src, *args, fragments=fragments)


def test_quantized_source_is_refused(tmp_path, src):
    _ok(cli("--hf-path", src, "--mlx-path", tmp_path / "q", "-q"))
    _bad(tmp_path, tmp_path / "q", "-q", fragments=["already a quantized MLX drafter"])


@pytest.mark.parametrize(
    "tcfg, fragments",
    [
        (target_config(hidden=32), ["hidden size is 64 but the target's is 32"]),
        (target_config(vocab=16), ["vocabulary is 32 tokens but the target's is 16", "mask_token_id 31 is outside"]),
        (target_config(layers=4), ["trained on a 6-layer target but this one has 4", "target_layer_ids [4]"]),
    ],
)
def test_mismatched_target_pair(tmp_path, src, tcfg, fragments):
    target = write_target(tmp_path / "target", tcfg, make_target(tcfg), make_tokenizer(tcfg["vocab_size"]))
    _bad(tmp_path, src, "--target", target, fragments=["does not fit --target", *fragments])


def test_target_that_is_a_drafter(tmp_path, src):
    _bad(tmp_path, src, "--target", src, fragments=["is a DFlash drafter; pass the target model"])


def test_existing_output_is_refused_without_force_and_replaced_with_it(tmp_path, src):
    out = tmp_path / "mlx"
    _ok(cli("--hf-path", src, "--mlx-path", out))
    (out / "stale.txt").write_text("from an earlier conversion")
    result = cli("--hf-path", src, "--mlx-path", out, "--dtype", "float32")
    assert_clean_failure(result, "already exists", "--force")
    assert (out / "stale.txt").is_file()
    _ok(cli("--hf-path", src, "--mlx-path", out, "--dtype", "float32", "--force"))
    assert not (out / "stale.txt").exists() and load_draft(out).fc.weight.dtype == mx.float32
    assert leftovers(tmp_path, "mlx") == ["mlx"]


def test_force_never_replaces_a_directory_that_is_not_a_model(tmp_path, src):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = cli("--hf-path", src, "--mlx-path", mine, "--force")
    assert_clean_failure(result, "holds no model (no config.json), so --force will not replace it")
    assert (mine / "notes.txt").read_text() == "mine"
    # An empty directory or a file may be replaced.
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for name in ("empty", "file"):
        _ok(cli("--hf-path", src, "--mlx-path", tmp_path / name, "--force"))
        assert (tmp_path / name / "config.json").is_file()


def test_unwritable_destination(tmp_path, src, monkeypatch):
    def denied(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic_dir.tempfile, "mkdtemp", denied)
    result = cli("--hf-path", src, "--mlx-path", tmp_path / "sub" / "mlx")
    assert_clean_failure(result, "cannot write", "Permission denied", "writable")
    assert not (tmp_path / "sub").exists()


def test_output_over_the_source_is_refused(tmp_path, src):
    result = cli("--hf-path", src, "--mlx-path", src, "--force")
    assert_clean_failure(result, "would replace the source checkpoint")
    assert (src / "model.safetensors").is_file()


# -- atomicity -------------------------------------------------------------------


def test_failure_while_writing_leaves_nothing(tmp_path, src, monkeypatch):
    from mlx_lm import utils

    def save_then_fail(config, path, **kw):
        Path(path).write_text("{half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(utils, "save_config", save_then_fail)
    result = cli("--hf-path", src, "--mlx-path", tmp_path / "new" / "mlx")
    assert_clean_failure(result, "cannot write", "No space left on device", "disk has room")
    assert not (tmp_path / "new").exists()  # not even the parent it created
    # --force over an existing directory: the old one survives the failure.
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="No space left on device"):
        convert(src, old, force=True)
    assert (old / "keep.txt").read_text() == "mine"
    assert leftovers(tmp_path, "old") == ["old"]


def test_interrupt_is_one_sentence_and_leaves_nothing(tmp_path, src, monkeypatch):
    from mlx_lm import utils

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(utils, "save_model", interrupted)
    result = cli("--hf-path", src, "--mlx-path", tmp_path / "mlx")
    assert_clean_failure(result, "interrupted; nothing was written")
    assert result.exit_code == 130
    assert leftovers(tmp_path, "mlx") == []


KILLED_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mlx_lm import utils

    real = utils.save_config

    def save_config_then_hang(config, path, **kw):
        real(config, path, **kw)  # weights and config are on disk, the card is not
        Path(sys.argv[3]).write_text("ready")
        time.sleep(60)

    utils.save_config = save_config_then_hang
    from dflash_mlx.convert.weights import convert
    convert(sys.argv[1], sys.argv[2])
    """
)


def test_sigkill_midway_leaves_no_output_and_the_next_run_cleans_up(tmp_path, src):
    out, ready = tmp_path / "mlx", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(src), str(out), str(ready)])
    try:
        deadline = time.time() + 30
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline, "the child conversion never got to writing"
            time.sleep(0.05)
        partial = [p for p in tmp_path.iterdir() if p.name.startswith(".mlx.partial-")]
        assert len(partial) == 1 and (partial[0] / "config.json").is_file()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    # The next conversion to the same place removes the dead one's temp dir.
    convert(src, out)
    assert leftovers(tmp_path, "mlx") == ["mlx"]
    load_draft(out)


def test_dead_leftovers_in_the_parent_are_removed_and_live_ones_kept(tmp_path, src):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    made = {
        f".other.partial-{dead.pid}-abc": "dead partial of another destination",
        f".mlx.partial-{dead.pid}-xyz": "dead partial of this destination",
        f".mine.partial-{os.getpid()}-abc": "live partial (this process)",
        f".gone.old-{dead.pid}": "set-aside copy nothing replaced",
        f".kept.old-{dead.pid}": "set-aside copy already replaced",
        "kept": "the replacement",
        ".unrelated.partial-x": "not a writer's name",
    }
    for name, text in made.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(text)
    convert(src, tmp_path / "mlx")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("zlab",))
    assert names == sorted([".mine.partial-" + f"{os.getpid()}-abc", ".unrelated.partial-x", "gone", "kept", "mlx"])
    assert (tmp_path / "gone" / "f").read_text() == "set-aside copy nothing replaced"
    assert (tmp_path / "kept" / "f").read_text() == "the replacement"


# -- upload ------------------------------------------------------------------------


class FakeHfApi:
    calls: list = []
    fail: Exception | None = None

    def create_repo(self, repo_id, repo_type=None, exist_ok=False, **kw):
        FakeHfApi.calls.append(("create_repo", repo_id, repo_type, exist_ok))

    def upload_folder(self, folder_path, repo_id, repo_type=None, **kw):
        if FakeHfApi.fail:
            raise FakeHfApi.fail
        FakeHfApi.calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path))))


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeHfApi.calls, FakeHfApi.fail = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_upload_repo(tmp_path, src, fake_hub):
    out = tmp_path / "mlx"
    _ok(cli("--hf-path", src, "--mlx-path", out, "--upload-repo", "me/Tiny-DFlash-mlx"))
    assert fake_hub.calls == [
        ("create_repo", "me/Tiny-DFlash-mlx", "model", True),
        (
            "upload_folder",
            "me/Tiny-DFlash-mlx",
            ["README.md", "config.json", "model.safetensors", "model.safetensors.index.json"],
        ),
    ]
    assert 'draft="me/Tiny-DFlash-mlx"' in (out / "README.md").read_text()


def test_upload_failure_is_one_sentence_and_keeps_the_conversion(tmp_path, src, fake_hub):
    fake_hub.fail = PermissionError("401 Unauthorized")
    out = tmp_path / "mlx"
    result = cli("--hf-path", src, "--mlx-path", out, "--upload-repo", "me/x")
    assert_clean_failure(result, "upload to me/x failed", "hf auth login")
    load_draft(out)


def test_convert_module_keeps_imports_light():
    """The CLI imports every command at startup; the converter loads only when run."""
    code = "import sys; import dflash_mlx.cli.app; print('dflash_mlx.convert.weights' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert convert_module.__name__ == "dflash_mlx.convert.weights"


def test_the_installed_command_fails_in_one_line(tmp_path, src):
    """Through the real console entry point, in a fresh process: exit 1, one
    line on stderr, no traceback, nothing written."""
    code = "import sys; from dflash_mlx.cli.app import main; sys.argv[0] = 'dflash-mlx'; main()"
    args = ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "mlx"), "-q", "--q-bits", "7"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr
    assert lines == ["error: affine quantization cannot use 7 bits; use --q-bits 2 or 3 or 4 or 5 or 6 or 8."]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert leftovers(tmp_path, "mlx") == []


def test_converted_directory_matches_the_official_code(tmp_path, monkeypatch):
    """The official Z Lab MLX loader reads a converted (unquantized) directory
    too, and computes from it what we compute from it and from the raw one."""
    import dflash.model_mlx as official  # the oracle: pip install --no-deps dflash==0.1.0
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import random_draft_weights, write_zlab_draft

    # A window shorter than the context (11) but not than the block (8).
    cfg = draft_config(TCFG, layer_types=["sliding_attention", "full_attention"], sliding_window=9)
    cfg["dflash_config"].update(input_embedding_scale=1.3, output_multiplier=0.7, final_logit_softcapping=4.0)
    raw = write_zlab_draft(tmp_path / "raw", cfg, random_draft_weights(cfg, seed=5), dtype=mx.float32)
    out = convert(raw, tmp_path / "mlx")
    # The default dtype is the stored one (float32 here), not config.json's torch_dtype (bfloat16).
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    monkeypatch.setattr(official, "snapshot_download", lambda repo, **kw: repo)
    theirs = official.load_draft(str(out)).bind(make_target(TCFG))  # it wraps its target's layers
    mx.random.seed(4)
    taps = mx.random.normal((1, 11, 2 * TCFG["hidden_size"]))
    block = mx.array([[7] + [cfg["dflash_config"]["mask_token_id"]] * (cfg["block_size"] - 1)])
    want = theirs(block, taps, make_prompt_cache(theirs), logits_start=1)
    for ours in (load_draft(out), load_draft(raw)):
        got = ours.bind(tiny_target())(block, taps, ours.make_cache())
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()
