"""Helpers shared by the converter and loading tests: tiny drafter checkpoints
in each published format (Z Lab's, speculators', transformers assistants'),
each published drafter's structure, fake Hugging Face caches, drafter logits."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from tiny import draft_config, make_target, random_draft_weights, target_config, write_zlab_draft
from typer.testing import CliRunner

from dflash_mlx.cli.app import app
from dflash_mlx.draft import formats
from dflash_mlx.draft.dflash2 import CODEBOOKS
from dflash_mlx.targets import adapt

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, ["convert", *map(str, args)])


def assert_clean_failure(result, *fragments: str) -> None:
    """Non-zero exit, no traceback, one message holding every fragment."""
    text = result.output
    assert result.exit_code != 0, text
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text, text
    flat = " ".join(text.split())
    for f in fragments:
        assert f in flat, f"{f!r} not in {flat!r}"


def leftovers(parent: Path, name: str) -> list[str]:
    """Anything a conversion to parent/name left behind (output or temp)."""
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


TCFG = target_config()


def zlab_draft(path: Path, tcfg: dict = TCFG, weights=None, cfg=None, **extra) -> Path:
    """A tiny bf16 Z Lab drafter checkpoint for ``tcfg``."""
    cfg = cfg or draft_config(tcfg, **extra)
    weights = weights if weights is not None else random_draft_weights(cfg)
    return write_zlab_draft(path, cfg, weights)


def shard(path: Path, n: int = 2) -> Path:
    """Split a one-file checkpoint into ``n`` shards with an index."""
    weights = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: weights[k] for k in names[i::n]}
        mx.save_safetensors(str(path / fname), part, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


_TARGETS: dict = {}


def tiny_target(tcfg: dict = TCFG):
    key = json.dumps(tcfg, sort_keys=True)
    if key not in _TARGETS:
        _TARGETS[key] = adapt(make_target(tcfg))
    return _TARGETS[key]


def draft_logits(draft, tcfg: dict = TCFG, ctx: int = 12, seed: int = 3) -> mx.array:
    """Float32 logits of one block after ``ctx`` random context positions,
    the drafter bound to the tiny target of ``tcfg``."""
    target = tiny_target(tcfg)
    draft.bind(target)
    cfg = draft.config
    mx.random.seed(seed)
    taps = mx.random.normal((1, ctx, len(cfg.target_layer_ids) * cfg.hidden_size))
    block = mx.array([[5] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    out = draft(block, taps, draft.make_cache())
    return out.astype(mx.float32)


def max_rel_err(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def hub_cache(root: Path, repo_id: str, src: Path, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Put the files of ``src`` into a huggingface_hub cache at ``root`` as the
    snapshot ``revision`` of ``repo_id`` (refs/main pointing at it)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    shutil.copytree(src, snap, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snap


# -- every published drafter format, written from one Z Lab config and its weights ------------


def _backbone(zcfg: dict) -> dict:
    """transformer_layer_config as speculators saves it: Qwen3Config's diff
    against its defaults (rms_norm_eps 1e-6 and a default rope left out), Z
    Lab's non-transformer keys stripped."""
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "layer_types",
        "sliding_window",
        "rope_parameters",
    )
    body = {"model_type": "qwen3", **{k: zcfg[k] for k in keep if k in zcfg}, "torch_dtype": "float32"}
    if zcfg.get("rope_theta", 10000.0) != 10000.0:
        body["rope_parameters"] = {"rope_theta": zcfg["rope_theta"], "rope_type": "default"}
    return body


def speculators_files(
    path: Path,
    zcfg: dict,
    weights: dict,
    embed: mx.array,
    head: mx.array,
    kept: list[int] | None = None,
    **override,
) -> Path:
    """A vllm-project/speculators checkpoint of the Z Lab drafter (zcfg,
    weights): DFlashSpeculatorConfig's field set, the verifier's ``embed``
    and the rows of its ``head`` saved beside the body, and for a reduced
    draft vocabulary ``kept`` (sorted target ids) d2t offsets and the t2d mask."""
    dflash = zcfg["dflash_config"]
    dflash2 = "DFlash2DraftModel" in zcfg["architectures"]
    vocab = zcfg["vocab_size"]
    rows = mx.array(kept if kept is not None else list(range(vocab)))
    raw = {
        "architectures": ["DFlash2Speculator" if dflash2 else "DFlashSpeculator"],
        "speculators_model_type": "dflash2" if dflash2 else "dflash",
        "speculators_version": "0.5.0",
        "transformer_layer_config": _backbone(zcfg),
        "draft_vocab_size": rows.shape[0],
        "block_size": dflash.get("block_size", zcfg.get("block_size")),
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [t + 1 for t in dflash["target_layer_ids"]],
        "mask_token_id": dflash["mask_token_id"],
        "sliding_window_non_causal": zcfg.get("is_causal") is False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash2" if dflash2 else "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "google/gemma-4-31B-it", "architectures": ["Qwen3ForCausalLM"]},
        },
        "torch_dtype": "float32",
    }
    if dflash2:
        raw.update({k: dflash[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
    raw.update(override)
    tensors = dict(weights)
    for name in CODEBOOKS:
        if name in tensors:
            tensors[name] = tensors[name][rows]
    tensors["embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head[rows]
    if kept is not None:
        tensors["d2t"] = (rows - mx.arange(rows.shape[0])).astype(mx.int64)
        tensors["t2d"] = mx.zeros((vocab,), mx.bool_).at[rows].add(True)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "pt"})
    return path


def assistant_files(path: Path, zcfg: dict, weights: dict, prefix: str = "model.") -> Path:
    """A transformers-native assistant checkpoint of the Z Lab drafter: the
    field set of Z Lab's tests/fixtures/assistant-config.json, the context
    projection as encoder.*, the tensors under ``prefix``."""
    dflash = zcfg["dflash_config"]
    raw = {
        "architectures": ["MuseGlimmerAssistantModel"],
        "attention_dropout": 0,
        "block_size": dflash.get("block_size", zcfg.get("block_size")),
        "bos_token_id": 0,
        "dtype": "float32",
        "eos_token_id": 1,
        "head_dim": zcfg["head_dim"],
        "hidden_act": "silu",
        "hidden_size": zcfg["hidden_size"],
        "intermediate_size": zcfg["intermediate_size"],
        "layer_types": zcfg.get("layer_types") or ["full_attention"] * zcfg["num_hidden_layers"],
        "mask_token_id": dflash["mask_token_id"],
        "max_position_embeddings": zcfg["max_position_embeddings"],
        "model_type": "muse_glimmer_assistant",
        "num_attention_heads": zcfg["num_attention_heads"],
        "num_hidden_layers": zcfg["num_hidden_layers"],
        "num_key_value_heads": zcfg["num_key_value_heads"],
        "pad_token_id": 2,
        "rms_norm_eps": zcfg["rms_norm_eps"],
        "rope_parameters": {"rope_theta": zcfg["rope_theta"], "rope_type": "default"},
        "sliding_window": zcfg.get("sliding_window"),
        "target_layer_ids": dflash["target_layer_ids"],
        "transformers_version": "5.15.0.dev0",
    }
    renamed = {
        prefix + k.replace("hidden_norm.", "encoder.output_norm_enc.").replace("fc.", "encoder.fc.", 1): v
        for k, v in weights.items()
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), renamed, metadata={"format": "pt"})
    return path


@dataclass(frozen=True)
class Published:
    """A published drafter's structure: layers, attention heads / KV heads,
    block size, how many leading layers slide and their window, the target
    layers it taps, of how many. Facts from each repo's config.json (Z Lab's
    fixtures for the DFlash 2 and assistant ones); where the config is gated
    or not yet readable, the nearest published sibling's, noted."""

    layers: int
    heads: tuple[int, int]
    block: int
    sliding: int
    window: int | None
    taps: tuple[int, ...]
    target_layers: int


_KIMI = Published(6, (64, 8), 8, 0, None, (1, 12, 24, 35, 47, 58), 61)
_GEMMA_31B = Published(5, (64, 8), 16, 4, 2048, (1, 12, 23, 35, 46, 57), 60)
_MUSE = Published(5, (32, 8), 16, 5, 2048, (1, 13, 25, 37, 49), 52)
PUBLISHED: dict[str, Published] = {
    "z-lab/Qwen3-4B-DFlash-b16": Published(5, (32, 8), 16, 0, None, (1, 9, 17, 25, 33), 36),
    "z-lab/Qwen3-8B-DFlash-b16": Published(5, (32, 8), 16, 0, None, (1, 9, 17, 25, 33), 36),
    "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat": Published(5, (32, 8), 10, 0, None, (1, 8, 15, 22, 29), 32),
    "z-lab/Qwen3-Coder-30B-A3B-DFlash": Published(8, (32, 4), 16, 0, None, (1, 12, 23, 34, 45), 48),
    "z-lab/Qwen3-Coder-Next-DFlash": Published(8, (32, 4), 16, 0, None, (3, 11, 23, 35, 43), 48),
    "z-lab/Qwen3.5-4B-DFlash": Published(6, (32, 8), 16, 5, 4096, (1, 5, 9, 13, 17, 21, 25, 29), 32),
    "z-lab/Qwen3.5-9B-DFlash": Published(6, (32, 8), 16, 5, 4096, (1, 5, 9, 13, 17, 21, 25, 29), 32),
    "z-lab/Qwen3.5-27B-DFlash": Published(6, (32, 8), 16, 5, 4096, (1, 10, 18, 27, 35, 44, 52, 61), 64),
    "z-lab/Qwen3.5-35B-A3B-DFlash": Published(6, (32, 8), 16, 5, 4096, (1, 6, 11, 16, 22, 27, 32, 37), 40),
    "z-lab/Qwen3.5-122B-A10B-DFlash": Published(6, (32, 8), 16, 5, 4096, (1, 7, 14, 20, 26, 32, 39, 45), 48),
    "z-lab/Qwen3.6-27B-DFlash": Published(5, (32, 8), 16, 4, 2048, (1, 16, 31, 46, 61), 64),
    "z-lab/Qwen3.6-35B-A3B-DFlash": Published(6, (32, 8), 16, 5, 4096, (1, 6, 11, 16, 22, 27, 32, 37), 40),
    # Not readable yet: Qwen3.6-27B's structure, over Qwen3.8-27B's 64 layers.
    "z-lab/Qwen3.8-27B-DFlash2": Published(5, (32, 8), 16, 5, 2048, (1, 16, 31, 46, 61), 64),
    "z-lab/Muse-Glimmer-30B-DFlash2": _MUSE,
    "meta-models/Muse-Glimmer-30B-assistant": _MUSE,
    "z-lab/gemma-4-31B-it-DFlash": _GEMMA_31B,
    "z-lab/gemma-4-26B-A4B-it-DFlash": Published(5, (32, 8), 16, 4, 2048, (1, 6, 11, 17, 22, 27), 30),
    "z-lab/gpt-oss-20b-DFlash": Published(8, (64, 8), 8, 0, None, (1, 6, 11, 16, 21), 24),
    "z-lab/gpt-oss-120b-DFlash": Published(8, (64, 8), 10, 0, None, (1, 9, 17, 25, 33), 36),
    "z-lab/Kimi-K2.5-DFlash": _KIMI,
    "z-lab/Kimi-K2.6-DFlash": _KIMI,  # gated: Kimi-K2.5's (same target depth, same weight size)
    # Gated or unpublished: a Z Lab v1 drafter over the target's layers (MiniMax-M2 62, GLM-5 78).
    "z-lab/MiniMax-M2.5-DFlash": Published(5, (32, 8), 16, 0, None, (1, 15, 30, 45, 59), 62),
    "z-lab/MiniMax-M2.7-DFlash": Published(5, (32, 8), 16, 0, None, (1, 15, 30, 45, 59), 62),
    "z-lab/GLM-5.1-DFlash": Published(5, (32, 8), 16, 0, None, (1, 19, 38, 57, 75), 78),
    # RedHatAI's: speculators' default taps (aux ids 2, N/2, N-3, i.e. Z Lab layers 1, N/2-1, N-4).
    "RedHatAI/gemma-4-31B-it-speculator.dflash": Published(5, (32, 8), 8, 0, None, (1, 29, 56), 60),
    "RedHatAI/gemma-4-31B-it-speculator.dflash2": Published(5, (32, 8), 8, 0, None, (1, 29, 56), 60),
    "RedHatAI/Qwen3-8B-speculator.dflash": Published(5, (32, 8), 8, 0, None, (1, 17, 32), 36),
    "RedHatAI/Qwen3-30B-A3B-speculator.dflash": Published(5, (32, 4), 8, 0, None, (1, 23, 44), 48),
}


def published_drafter(path: Path, repo: str, hidden: int = 64, vocab: int = 48) -> Path:
    """A tiny drafter with ``repo``'s structure (PUBLISHED) in its format, at
    width ``hidden`` (heads scaled in their published ratio) and ``vocab``."""
    from test_dflash2 import random_dflash2_weights

    from dflash_mlx.loading import drafter_format

    facts, fmt = PUBLISHED[repo], drafter_format(repo)
    heads = max(2, hidden // 16)
    kv = max(1, heads * facts.heads[1] // facts.heads[0])
    layer_types = ["sliding_attention"] * facts.sliding + ["full_attention"] * (facts.layers - facts.sliding)
    tcfg = {"hidden_size": hidden, "num_hidden_layers": facts.target_layers, "vocab_size": vocab}
    cfg = draft_config(tcfg, layers=facts.layers, block_size=facts.block, taps=list(facts.taps))
    cfg.update(
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        layer_types=layer_types,
        torch_dtype="float32",
    )
    if facts.window:
        cfg["sliding_window"] = facts.window
    if fmt in (formats.ZLAB2, formats.SPECULATORS2):
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["is_causal"] = False
        cfg["dflash_config"].update(
            block_size=cfg.pop("block_size"), conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4
        )
        weights = random_dflash2_weights(cfg)
    else:
        weights = random_draft_weights(cfg)
    if fmt in (formats.ZLAB, formats.ZLAB2):
        return write_zlab_draft(path, cfg, weights, dtype=mx.float32)
    if fmt == formats.ASSISTANT:
        return assistant_files(path, cfg, weights)
    mx.random.seed(2)
    embed, head = mx.random.normal((vocab, hidden)), mx.random.normal((vocab, hidden))
    return speculators_files(path, cfg, weights, embed, head, kept=list(range(0, vocab, 2)) + [vocab - 1])
