"""Tiny random models made on the fly, for tests and benchmarks that need no
download: mlx-lm targets, Z Lab-layout drafters, a word-level tokenizer, and
the reference measures (mlx-lm's greedy decoding, mean acceptance length)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_mlx.draft.dflash import DFlashDraft, DraftConfig


def target_config(family: str = "qwen3", vocab: int = 32, layers: int = 6, hidden: int = 64, tie: bool = False) -> dict:
    cfg = {
        "model_type": family,
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
    }
    if family == "llama":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
    return cfg


def make_target(cfg: dict, seed: int = 0) -> nn.Module:
    """An mlx-lm model with random float32 weights."""
    if cfg["model_type"] == "qwen3":
        from mlx_lm.models.qwen3 import Model, ModelArgs
    else:
        from mlx_lm.models.llama import Model, ModelArgs
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(cfg))
    # Sharper than the default init, so greedy choices are far from ties.
    model.update({"model": {"norm": {"weight": mx.full((cfg["hidden_size"],), 3.0)}}})
    mx.eval(model.parameters())
    return model


def draft_config(
    tcfg: dict,
    layers: int = 2,
    block_size: int = 8,
    taps: list[int] | None = None,
    mask_token_id: int | None = None,
    **extra,
) -> dict:
    """A Z Lab drafter config.json for the target config ``tcfg``."""
    n = tcfg["num_hidden_layers"]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tcfg["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": tcfg["hidden_size"] // 4,
        "intermediate_size": 2 * tcfg["hidden_size"],
        "vocab_size": tcfg["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "num_target_layers": n,
        "block_size": block_size,
        "dflash_config": {
            "target_layer_ids": taps if taps is not None else [1, n - 2][:layers],
            "mask_token_id": tcfg["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        },
        "torch_dtype": "bfloat16",
    }
    cfg.update(extra)
    return cfg


def random_draft_weights(cfg: dict, seed: int = 1) -> dict[str, mx.array]:
    """Random drafter tensors under their Z Lab names."""
    mx.random.seed(seed)
    model = DFlashDraft(DraftConfig.from_dict(cfg))
    weights = dict(tree_flatten(model.parameters()))
    # Norm weights away from 1 so a wrong norm shows in the logits.
    return {k: (v + 0.5 * mx.random.uniform(shape=v.shape)) if "norm" in k else v for k, v in weights.items()}


def make_draft(cfg: dict, weights: dict[str, mx.array]) -> DFlashDraft:
    model = DFlashDraft(DraftConfig.from_dict(cfg))
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def write_zlab_draft(path: Path, cfg: dict, weights: dict[str, mx.array], dtype=mx.bfloat16) -> Path:
    """A drafter directory as Z Lab publishes it: config.json + safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()}, metadata={"format": "pt"}
    )
    return path


def make_tokenizer(vocab: int, eos: int | None = None) -> TokenizerWrapper:
    """A word-level tokenizer over the words w0..w{vocab-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    kwargs = {"eos_token": f"w{eos}"} if eos is not None else {}
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs))


def write_target(path: Path, cfg: dict, model: nn.Module, tokenizer: TokenizerWrapper) -> Path:
    """A target directory in the Hugging Face layout that mlx_lm.load reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    tokenizer._tokenizer.save_pretrained(str(path))
    return path


def mean_acceptance(
    model: nn.Module, draft: DFlashDraft, tokenizer, prompts: list[list[int]], max_tokens: int = 40
) -> float:
    """Mean greedy acceptance length over ``prompts``, at the drafter's own
    block (``auto`` would follow the machine's timings)."""
    from dflash_mlx import stream_generate

    lengths = []
    for p in prompts:
        for r in stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens, block_size=draft.config.block_size):
            pass
        lengths.append(r.acceptance_length)
    return sum(lengths) / len(lengths)


def greedy_reference(model: nn.Module, prompt: list[int], max_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """mlx-lm's own greedy decoding of the target, cut after the first EOS."""
    out = []
    for token, _ in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        out.append(token)
        if token in eos:
            break
    return out
