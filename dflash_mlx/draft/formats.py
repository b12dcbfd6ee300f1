"""The published drafter formats, read into one: Z Lab's config.json layout
(what ``DraftConfig.from_dict`` parses) and module weight names.

- Z Lab (``DFlashDraftModel`` / ``DFlash2DraftModel``): the layout itself.
- vllm-project/speculators (``speculators_model_type`` "dflash" / "dflash2",
  as RedHatAI publishes): the backbone under ``transformer_layer_config``,
  hidden states counted from the embeddings (aux id = Z Lab layer + 1), the
  drafter's own head over a reduced vocabulary mapped by ``d2t`` / ``t2d``.
- transformers-native assistants (e.g. ``muse_glimmer_assistant``): the
  DFlash contract (``block_size``, ``mask_token_id``, ``target_layer_ids``)
  at the top level, the context projection as ``encoder.*``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

ZLAB = "Z Lab DFlash"
ZLAB2 = "Z Lab DFlash 2"
SPECULATORS = "speculators DFlash"
SPECULATORS2 = "speculators DFlash 2"
ASSISTANT = "transformers assistant"
FORMATS = (ZLAB, ZLAB2, SPECULATORS, SPECULATORS2, ASSISTANT)

_SPECULATORS_TYPES = {"dflash": SPECULATORS, "dflash2": SPECULATORS2}
_CONTRACT = ("block_size", "mask_token_id", "target_layer_ids")
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# What transformers' Qwen3Config leaves out of a saved transformer_layer_config
# (speculators writes only the fields that differ from these).
_QWEN3_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "max_window_layers": 28,
}
# The backbone fields a Z Lab config.json holds, copied from the other formats.
_BACKBONE = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "layer_types",
    "sliding_window",
)


def _refuse(what: str) -> ValueError:
    return ValueError(f"the drafter's config.json {what}; re-download the drafter.")


def is_assistant(raw: dict) -> bool:
    """A transformers-native drafter: the DFlash contract at the top level."""
    archs = raw.get("architectures") or []
    zlab = "dflash_config" in raw or any("DFlash" in str(a) for a in archs)
    return not zlab and "speculators_model_type" not in raw and all(k in raw for k in _CONTRACT)


def drafter_format(raw: Any) -> str | None:
    """The format of a config.json (as a dict), None if it is no drafter's."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("speculators_model_type")
    if kind is not None:
        return _SPECULATORS_TYPES.get(kind)
    if is_assistant(raw):
        return ASSISTANT
    archs = [str(a) for a in raw.get("architectures") or []]
    if any("DFlash2" in a for a in archs):
        return ZLAB2
    if raw.get("dflash_config") or any("DFlash" in a for a in archs):
        return ZLAB
    return None


def zlab_config(raw: dict) -> dict:
    """``raw`` in Z Lab's config.json layout (Z Lab's own as is); raises
    ValueError in one sentence for a config no runtime of its format reads."""
    fmt = drafter_format(raw)
    if fmt in (SPECULATORS, SPECULATORS2):
        return _from_speculators(raw, fmt)
    if fmt == ASSISTANT:
        return _from_assistant(raw)
    kind = raw.get("speculators_model_type") if isinstance(raw, dict) else None
    if kind is not None:
        raise ValueError(
            f"this is a speculators {kind!r} drafter, not DFlash; pass a DFlash drafter "
            "(speculators_model_type dflash or dflash2)."
        )
    return raw


def _from_speculators(raw: dict, fmt: str) -> dict:
    missing = [k for k in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id") if k not in raw]
    if "draft_vocab_size" not in raw:
        missing.append("draft_vocab_size")
    if fmt == SPECULATORS2:
        missing += [k for k in _DFLASH2_FIELDS if k not in raw]
    if missing:
        raise _refuse("is missing " + ", ".join(missing))
    body = raw["transformer_layer_config"]
    if not isinstance(body, dict):
        raise _refuse("has a transformer_layer_config that is not an object")
    if body.get("model_type", "qwen3") == "qwen3":
        body = {**_QWEN3_DEFAULTS, **body}
    if raw.get("sample_from_anchor"):
        raise ValueError(
            "the drafter drafts from the anchor position too (sample_from_anchor), which a DFlash cycle "
            "never asks for; use a drafter trained with sample_from_anchor false."
        )
    if body.get("attention_bias"):
        raise ValueError("the drafter's attention projections have biases (attention_bias), which DFlash's do not.")
    if body.get("hidden_act", "silu") != "silu":
        raise _refuse(f"has hidden_act {body['hidden_act']!r}; a DFlash drafter's MLP is silu")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != body.get("hidden_size"):
        raise ValueError(
            f"the drafter reads target states of width {target_hidden} (target_hidden_size) but its own width is "
            f"{body.get('hidden_size')}; dflash-mlx runs drafters as wide as their target."
        )
    aux = raw["aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not aux or any(isinstance(a, bool) or not isinstance(a, int) for a in aux):
        raise _refuse(f"has aux_hidden_state_layer_ids = {aux!r}, not a list of layer ids")
    if min(aux) < 1:
        raise ValueError(
            f"the drafter's aux_hidden_state_layer_ids {aux} include 0, the embeddings' output; DFlash taps "
            "decoder layers (aux id = layer + 1), so fix config.json."
        )
    n = body.get("num_hidden_layers")
    layer_types = body.get("layer_types")
    if layer_types is None and isinstance(n, int):
        sliding = body.get("use_sliding_window")
        first = body.get("max_window_layers", 0)
        layer_types = ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(n)]
    rope = body.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("sliding_attention"), dict):
        rope = rope["sliding_attention"]  # one rope for every layer type, as speculators builds it
    if rope is None and "rope_theta" not in body:
        rope = {"rope_theta": 10000.0, "rope_type": "default"}  # Qwen3Config's
    window = body.get("sliding_window")
    if window is None and "sliding_attention" in (layer_types or []):
        window = 4096  # Qwen3Config's before transformers 5, left out when unchanged
    vocab = body.get("vocab_size")
    draft_vocab = raw["draft_vocab_size"]
    # Full attention layers are always bidirectional in the block; sliding ones unless told.
    non_causal = raw.get("sliding_window_non_causal", fmt == SPECULATORS2)
    cfg = {
        **{k: body[k] for k in _BACKBONE if k in body},
        "architectures": ["DFlash2DraftModel" if fmt == SPECULATORS2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "layer_types": layer_types,
        "rope_parameters": rope,
        "sliding_window": window,
        "num_target_layers": None,
        "dflash_config": {
            "block_size": raw.get("block_size", 8),
            "mask_token_id": raw["mask_token_id"],
            "target_layer_ids": [a - 1 for a in aux],
            **{k: raw[k] for k in _DFLASH2_FIELDS if k in raw},
        },
    }
    if non_causal:
        cfg["is_causal"] = False
    if draft_vocab != vocab:
        cfg["draft_vocab_size"] = draft_vocab
    return cfg


def _from_assistant(raw: dict) -> dict:
    cfg = {k: raw[k] for k in _BACKBONE if k in raw}
    return {
        **cfg,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": raw.get("vocab_size"),
        "num_target_layers": raw.get("num_target_layers"),
        # Bidirectional within the block whatever its layer_types say, as vLLM runs it.
        "is_causal": False,
        "dflash_config": {k: raw[k] for k in _CONTRACT},
    }


def zlab_weights(raw: dict, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The tensors of a drafter checkpoint in format of ``raw`` under Z Lab's
    names: the context projection renamed, the verifier's own tensors dropped
    (the target's embedding and head serve), a reduced vocabulary's ``d2t``
    checked against ``t2d`` and kept with the drafter's head."""
    fmt = drafter_format(raw)
    if fmt == ASSISTANT:
        renamed = {}
        for k, v in weights.items():
            k = k.removeprefix("model.")
            for old, new in (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm.")):
                if k.startswith(old):
                    k = new + k[len(old) :]
            renamed[k] = v
        return {k: v for k, v in renamed.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    if fmt not in (SPECULATORS, SPECULATORS2):
        return weights
    dropped = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t", "lm_head.weight")
    out = {k: v for k, v in weights.items() if k not in dropped}
    body = {**_QWEN3_DEFAULTS, **raw["transformer_layer_config"]}
    vocab, draft_vocab = body["vocab_size"], raw["draft_vocab_size"]
    if draft_vocab == vocab:
        return out
    if "lm_head.weight" not in weights or "d2t" not in weights:
        lacks = " and ".join(k for k in ("lm_head.weight", "d2t") if k not in weights)
        raise ValueError(
            f"the drafter drafts over a reduced vocabulary of {draft_vocab} tokens but its checkpoint lacks "
            f"{lacks}; re-download it (speculators saves both)."
        )
    d2t = weights["d2t"]
    if d2t.ndim != 1 or d2t.shape[0] != draft_vocab or not mx.issubdtype(d2t.dtype, mx.integer):
        raise ValueError(
            f"the drafter's d2t is {d2t.dtype} of shape {tuple(d2t.shape)}, but it must hold {draft_vocab} "
            "integer offsets (draft_vocab_size); re-download the drafter."
        )
    ids = mx.arange(draft_vocab) + d2t.astype(mx.int64)
    t2d = weights.get("t2d")
    if t2d is not None:
        agree = (
            t2d.ndim == 1
            and t2d.shape[0] == vocab
            and mx.all((ids >= 0) & (ids < vocab)).item()
            and mx.sum(t2d.astype(mx.int64)).item() == draft_vocab
            and mx.all(t2d[mx.clip(ids, 0, vocab - 1)].astype(mx.bool_)).item()
        )
        if not agree:
            raise ValueError("the drafter's t2d and d2t name different draft vocabularies; re-download the drafter.")
    out["lm_head.weight"] = weights["lm_head.weight"]
    out["d2t"] = d2t.astype(mx.int32)
    return out
