"""The DFlash block-diffusion drafter: its config and its MLX module, for
inference (a context KV cache, one block a call) and training (blocks on the
batch axis). It owns no embedding; ``bind`` shares the target's, and its head
too unless the drafter has its own over a reduced vocabulary (``d2t``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..kernels.norm_rope import norm_rope, norm_rope_keys
from ..kv.buffer import BufferKVCache, positions_mask
from ..layers.attention import attention_output as cache_attention
from ..layers.attention import prepare as prepare_attention
from ..layers.fused import projections
from ..layers.linear import apply_linear, apply_linear_output, takes_norm

LAYER_TYPES = ("full_attention", "sliding_attention")

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "num_target_layers",
)


# Upper bounds that no real drafter reaches; past them a config is damaged.
_MAX_LAYERS = 1024
MAX_BLOCK_SIZE = 256  # (the trainer makes no larger drafter)
_MAX_DIM = 1 << 24
_MAX_POSITIONS = 1 << 31


def _bad(field: str, value: Any, want: str) -> ValueError:
    return ValueError(f"the drafter's config.json has {field} = {value!r}, but it must be {want}; fix config.json.")


def _count(field: str, value: Any, hi: int, lo: int = 1) -> int:
    """``value`` as an int in [lo, hi], else ValueError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(field, value, f"an integer from {lo} to {hi}")
    return value


def _positive(field: str, value: Any) -> float:
    """``value`` as a finite positive float, else ValueError naming ``field``.
    Non-finite values must stop here: mlx-lm's save_config writes them as
    tagged objects that no float() reads back."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _bad(field, value, "a finite positive number")
    return float(value)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Z Lab's rule when a checkpoint does not list its taps: spread them from
    layer 1 to layer N-3 of the target."""
    n, l = num_target_layers, num_draft_layers
    if l == 1:
        return [1]
    return [round(1 + i * (n - 4) / (l - 1)) for i in range(l)]


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None  # None: the target's (a format that does not record it)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    num_target_layers: int | None  # None: not recorded; checked against the target
    target_layer_ids: list[int]
    mask_token_id: int
    rope_scaling: dict[str, Any] | None = None
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # Its own head over this many tokens, mapped to the target's by d2t.
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DraftConfig:
        """Parse a Z Lab drafter config.json; raises ValueError naming what is wrong."""
        if not isinstance(cfg, dict):
            raise ValueError("the drafter's config.json must hold a JSON object.")
        archs = cfg.get("architectures") or []
        if any("DFlash2" in a for a in archs):
            raise ValueError(
                "this is a DFlash 2 drafter (architectures lists DFlash2DraftModel); "
                "read it with dflash_mlx.draft.dflash2.parse_draft_config, as dflash_mlx.load does."
            )
        dflash = cfg.get("dflash_config") or {}
        if not dflash and "mask_token_id" not in cfg and "target_layer_ids" not in cfg:
            raise ValueError(
                "config.json has no dflash_config, so this is not a DFlash drafter "
                "(a plain language model cannot be used as a drafter); pass a Z Lab "
                "DFlash drafter such as z-lab/Qwen3-8B-DFlash-b16."
            )
        missing = [k for k in _REQUIRED if k not in cfg]
        mask_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_id is None:
            missing.append("dflash_config.mask_token_id")
        rope = cfg.get("rope_parameters") or None
        rope_theta = cfg.get("rope_theta", (rope or {}).get("rope_theta"))
        if rope_theta is None:
            missing.append("rope_theta")
        if missing:
            raise ValueError(
                "the drafter's config.json is missing "
                + ", ".join(missing)
                + "; re-download or re-convert the checkpoint."
            )

        rope_scaling = cfg.get("rope_scaling") or rope
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise _bad("rope_scaling", rope_scaling, "an object")
        if rope_scaling is not None:
            rope_type = rope_scaling.get("type") or rope_scaling.get("rope_type", "default")
            rope_scaling = None if rope_type == "default" else dict(rope_scaling)

        n_layers = _count("num_hidden_layers", cfg["num_hidden_layers"], _MAX_LAYERS)
        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if not isinstance(layer_types, list):
            raise _bad("layer_types", layer_types, f"a list of {n_layers} layer types")
        layer_types = list(layer_types)
        if len(layer_types) != n_layers:
            raise ValueError(
                f"layer_types lists {len(layer_types)} layers but num_hidden_layers is "
                f"{n_layers}; fix config.json so they agree."
            )
        unknown = sorted({str(t) for t in layer_types} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported drafter layer_types {unknown}; expected {list(LAYER_TYPES)}.")
        sliding_window = cfg.get("sliding_window")
        if sliding_window:
            sliding_window = _count("sliding_window", sliding_window, _MAX_POSITIONS)
        if "sliding_attention" in layer_types and not sliding_window:
            raise ValueError(
                "the drafter has sliding_attention layers but no sliding_window; add sliding_window to config.json."
            )

        # An explicit null: a format that does not record it (the target decides).
        num_target_layers = cfg["num_target_layers"]
        if num_target_layers is not None:
            num_target_layers = _count("num_target_layers", num_target_layers, _MAX_LAYERS)
        taps = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if taps is None and num_target_layers is None:
            raise ValueError("the drafter's config.json lists no target_layer_ids; add them to config.json.")
        if taps is None:
            taps = default_target_layer_ids(num_target_layers, n_layers)
        if not isinstance(taps, list):
            raise _bad("target_layer_ids", taps, "a list of target layer ids")
        if not taps:
            raise ValueError("the drafter's target_layer_ids is empty; list the target layers it reads.")
        bad = [t for t in taps if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _MAX_LAYERS]
        if bad:
            raise _bad("target_layer_ids", taps, f"a list of layer ids from 0 to {_MAX_LAYERS - 1}")
        repeated = sorted({t for t in taps if list(taps).count(t) > 1})
        if repeated:
            raise ValueError(
                f"the drafter's target_layer_ids repeats {', '.join(map(str, repeated))}; "
                "each target layer may be tapped once."
            )
        block_size = dflash.get("block_size", cfg.get("block_size", 16))
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"the drafter's block_size must be an integer >= 2 (one committed token plus drafts) and at "
                f"most {MAX_BLOCK_SIZE}, got {block_size!r}; fix config.json."
            )
        softcap = dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
        hidden = _count("hidden_size", cfg["hidden_size"], _MAX_DIM)
        heads = _count("num_attention_heads", cfg["num_attention_heads"], _MAX_LAYERS)
        kv_heads = _count("num_key_value_heads", cfg["num_key_value_heads"], heads)
        if heads % kv_heads:
            raise _bad("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
        head_dim = cfg.get("head_dim")
        head_dim = _count("head_dim", head_dim, _MAX_DIM) if head_dim else hidden // heads
        if head_dim < 1:
            raise _bad("num_attention_heads", heads, f"at most hidden_size ({hidden})")
        vocab = None if cfg["vocab_size"] is None else _count("vocab_size", cfg["vocab_size"], _MAX_DIM)
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab is not None:
            if vocab is None:
                raise ValueError(
                    "the drafter's config.json has draft_vocab_size but no vocab_size; add the target's "
                    "vocab_size to config.json."
                )
            draft_vocab = _count("draft_vocab_size", draft_vocab, vocab - 1)
        is_causal = cfg.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise _bad("is_causal", is_causal, "true or false")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_count("intermediate_size", cfg["intermediate_size"], _MAX_DIM),
            vocab_size=vocab,
            rms_norm_eps=_positive("rms_norm_eps", cfg["rms_norm_eps"]),
            rope_theta=_positive("rope_theta", rope_theta),
            max_position_embeddings=_count("max_position_embeddings", cfg["max_position_embeddings"], _MAX_POSITIONS),
            block_size=block_size,
            num_target_layers=num_target_layers,
            target_layer_ids=list(taps),
            mask_token_id=_count("mask_token_id", mask_id, _MAX_DIM, lo=0),
            rope_scaling=rope_scaling,
            layer_types=layer_types,
            sliding_window=sliding_window or None,
            is_causal=is_causal,
            input_embedding_scale=_positive("input_embedding_scale", dflash.get("input_embedding_scale", 1.0)),
            output_multiplier=_positive("output_multiplier", dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=_positive("final_logit_softcapping", softcap) if softcap else None,
            draft_vocab_size=draft_vocab,
        )

    def to_dict(self) -> dict[str, Any]:
        """The Z Lab config.json layout (what ``from_dict`` reads back)."""
        d = asdict(self)
        dflash = {
            k: d.pop(k)
            for k in (
                "target_layer_ids",
                "mask_token_id",
                "input_embedding_scale",
                "output_multiplier",
                "final_logit_softcapping",
            )
        }
        if dflash["final_logit_softcapping"] is None:
            del dflash["final_logit_softcapping"]
        for k in ("rope_scaling", "sliding_window", "is_causal", "draft_vocab_size"):
            if d[k] is None:
                del d[k]
        d["dflash_config"] = {"block_size": self.block_size, **dflash}
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **d}


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint holds, with its shape (Z Lab names)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    if cfg.draft_vocab_size:
        shapes["lm_head.weight"] = (cfg.draft_vocab_size, h)
        shapes["d2t"] = (cfg.draft_vocab_size,)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (ff, h),
                p + "mlp.up_proj.weight": (ff, h),
                p + "mlp.down_proj.weight": (h, ff),
            }
        )
    return shapes


def check_weights(weights: dict[str, mx.array], cfg: DraftConfig, quantization: dict | None = None) -> None:
    """Raise ValueError naming missing, unexpected or misshapen tensors
    (``quantization``: mlx-lm's {"bits", "group_size"})."""
    want = expected_shapes(cfg)
    bits = group = None
    if quantization:
        bits, group = int(quantization["bits"]), int(quantization["group_size"])
    expected: dict[str, tuple[int, ...]] = {}
    for name, shape in want.items():
        prefix = name[: -len(".weight")]
        if bits and len(shape) == 2 and f"{prefix}.scales" in weights:
            out, inp = shape
            expected[name] = (out, inp * bits // 32)
            expected[f"{prefix}.scales"] = (out, inp // group)
            if f"{prefix}.biases" in weights:
                expected[f"{prefix}.biases"] = (out, inp // group)
        else:
            expected[name] = shape
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    bad = sorted(
        f"{k} is {tuple(weights[k].shape)}, expected {expected[k]}"
        for k in set(expected) & set(weights)
        if tuple(weights[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors {_short(missing)}")
    if extra:
        problems.append(f"unexpected tensors {_short(extra)}")
    if bad:
        problems.append("misshapen tensors: " + _short(bad))
    if "d2t" in weights and not mx.issubdtype(weights["d2t"].dtype, mx.integer):
        problems.append(f"d2t holds {weights['d2t'].dtype} values, not integer token offsets")
    if problems:
        raise ValueError(
            "the drafter checkpoint does not match its config.json ("
            + "; ".join(problems)
            + "); re-download or re-convert it."
        )


def check_config(cfg: DraftConfig) -> None:
    """Refuse a drafter config that cannot serve the target it declares (its
    taps and mask token must lie within num_target_layers and vocab_size);
    ``check_pair`` checks the same against an actual target."""
    bad = [t for t in cfg.target_layer_ids if cfg.num_target_layers is not None and t >= cfg.num_target_layers]
    if bad:
        raise ValueError(
            f"the drafter's target_layer_ids lists {', '.join(map(str, bad))}, which are not layers of its "
            f"{cfg.num_target_layers}-layer target (num_target_layers); fix config.json to use ids 0 to "
            f"{cfg.num_target_layers - 1}."
        )
    if cfg.vocab_size is not None and cfg.mask_token_id >= cfg.vocab_size:
        raise ValueError(
            f"the drafter's mask_token_id {cfg.mask_token_id} is outside its {cfg.vocab_size}-token vocabulary "
            "(vocab_size); fix config.json."
        )


def pair_problems(cfg: DraftConfig, hidden_size: int, vocab_size: int, num_layers: int) -> list[str]:
    """What keeps this drafter from serving a target of the given shape."""
    problems = []
    if cfg.hidden_size != hidden_size:
        problems.append(f"the drafter's hidden size is {cfg.hidden_size} but the target's is {hidden_size}")
    if cfg.vocab_size is not None and cfg.vocab_size != vocab_size:
        problems.append(f"the drafter's vocabulary is {cfg.vocab_size} tokens but the target's is {vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_layers:
        problems.append(
            f"the drafter was trained on a {cfg.num_target_layers}-layer target but this one has {num_layers}"
        )
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} do not exist in a {num_layers}-layer target")
    if not 0 <= cfg.mask_token_id < vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is outside the target's {vocab_size}-token vocabulary")
    return problems


def check_pair(cfg: DraftConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    problems = pair_problems(cfg, hidden_size, vocab_size, num_layers)
    if problems:
        raise ValueError(
            "the drafter does not fit the target: "
            + "; ".join(problems)
            + ". Use the drafter published for this target."
        )


def _short(items: list[str], n: int = 4) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


class DraftAttention(nn.Module):
    """Queries from the block only; keys and values from [context ; block]."""

    def __init__(self, cfg: DraftConfig, layer_type: str):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scale = hd**-0.5
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        # Z Lab: sliding layers are causal inside the block unless told otherwise.
        self.causal = (self.window is not None) if cfg.is_causal is None else bool(cfg.is_causal)
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)

    def _heads(self, x, n):
        B, L, _ = x.shape
        return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    def keys_values(
        self, x: mx.array, rope, offset, fused=None, cached: bool = False, norm: nn.Module | None = None
    ) -> tuple[mx.array, mx.array]:
        """Roped, normed keys and plain values of ``x`` at positions offset..
        (``cached``: for the inference context cache; ``norm``: applied to x first)."""
        if fused is not None:
            k, v = fused.keys_values(x, norm)
        else:
            x = x if norm is None else norm(x)
            k, v = self.k_proj(x), self.v_proj(x)
        if cached:
            B, S, _ = x.shape
            keys = norm_rope_keys(k.reshape(B, S, self.n_kv_heads, -1), self.k_norm, rope, offset)
        else:
            keys = self._keys(k, rope, offset)
        return keys, self._heads(v, self.n_kv_heads)

    def _keys(self, k: mx.array, rope, offset) -> mx.array:
        return rope(self.k_norm(self._heads(k, self.n_kv_heads)), offset=offset)

    def __call__(
        self,
        x,
        ctx_keys,
        ctx_values,
        rope,
        offset,
        mask,
        *,
        cache=None,
        attend=None,
        fused=None,
        residual=None,
        norm=None,
    ):
        """x: [B, L, H] block states at positions offset..offset+L-1;
        ctx_keys/values: [B, kv_heads, C, head_dim].

        With ``cache`` (inference) the block's keys/values are written right
        after the cache's valid length without moving it, so the next write
        replaces them, and ``attend`` returns (output, as_rows) as
        ``attention_output`` does. Without a cache ``attend`` has the signature
        of mx.fast.scaled_dot_product_attention. ``residual`` is added to the
        output; ``norm`` is applied to x first."""
        B, L, _ = x.shape
        if fused is not None:
            q, k, v = fused.qkv(x, norm)
        else:
            x = x if norm is None else norm(x)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        values = self._heads(v, self.n_kv_heads)
        if cache is not None:
            queries, keys = norm_rope(
                q.reshape(B, L, self.n_heads, -1),
                k.reshape(B, L, self.n_kv_heads, -1),
                self.q_norm,
                self.k_norm,
                rope,
                offset,
            )
        else:
            queries = rope(self.q_norm(self._heads(q, self.n_heads)), offset=offset)
            keys = self._keys(k, rope, offset)
        if cache is not None:
            keys, values = cache.write(keys, values, cache.offset)
        elif ctx_keys is not None:
            keys = mx.concatenate([ctx_keys, keys], axis=2)
            values = mx.concatenate([ctx_values, values], axis=2)
        if cache is not None:
            # Training keeps the plain modules below: they have a gradient.
            if attend is None:
                out, as_rows = (
                    mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask),
                    False,
                )
            else:
                given = attend(queries, keys, values, scale=self.scale, mask=mask)
                if not isinstance(given, tuple):  # an array would unpack along its batch axis
                    raise TypeError(
                        "with a cache, attend must return (output, as_rows) as targets.attention.attention_output does."
                    )
                out, as_rows = given
            return apply_linear_output(self.o_proj, out, as_rows, residual)
        attend = attend or mx.fast.scaled_dot_product_attention
        out = attend(queries, keys, values, scale=self.scale, mask=mask)
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return out if residual is None else residual + out


class DraftLayer(nn.Module):
    fusable_projections = True  # qwen3's projections and forward (layers/fused.py)

    def __init__(self, cfg: DraftConfig, layer_type: str):
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_type)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_keys, ctx_values, rope, offset, mask, *, cache=None, attend=None, fused=None):
        """``fused``: this layer's FusedProjections; None: the modules."""
        h = self.self_attn(
            x,
            ctx_keys,
            ctx_values,
            rope,
            offset,
            mask,
            cache=cache,
            attend=attend,
            fused=fused,
            residual=x,
            norm=self.input_layernorm,
        )
        if fused is not None:
            return fused.mlp(self.mlp, h, h, self.post_attention_layernorm)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    # Whether drafts come from a candidate selector (DFlash 2's ``propose``).
    selects_candidates = False

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg, t) for t in cfg.layer_types]
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            cfg.head_dim,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        if cfg.draft_vocab_size:
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            # Offsets: target id = draft id + d2t[draft id] (the speculators convention).
            self.d2t = mx.zeros((cfg.draft_vocab_size,), mx.int32)
            self.freeze(recurse=False, keys=["d2t"])  # token ids, never trained
        self._target = None  # a plain attribute: the target's weights are not ours
        self._vocab = None  # the target ids of the draft vocabulary, once bound

    def bind(self, target) -> DFlashDraft:
        """Share the target's embedding (and head), after checking the pair fits."""
        check_pair(self.config, target.hidden_size, target.vocab_size, target.num_layers)
        if self.config.draft_vocab_size:
            self._vocab = draft_vocabulary(self.d2t, target.vocab_size)
        self._target = target
        prepare_attention(target.dtype, self.config.head_dim, [layer.self_attn.window for layer in self.layers])
        return self

    @property
    def target(self):
        if self._target is None:
            raise ValueError("the drafter is not bound to a target; call draft.bind(target) first.")
        return self._target

    def embed(self, tokens: mx.array) -> mx.array:
        scale = self.config.input_embedding_scale
        embedded = self.target.embed(tokens)
        return embedded if scale == 1.0 else embedded * scale

    def logits(self, h: mx.array, norm: nn.Module | None = None) -> mx.array:
        """Logits over the target's vocabulary of ``norm(h)`` (None: h already
        normed), through the target's head or the drafter's own; tokens outside
        a reduced draft vocabulary get -inf, so they are never drafted."""
        own = self.config.draft_vocab_size
        logits = apply_linear(self.lm_head, h, norm=norm) if own else self.target.lm_head(h, norm)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        if not own:
            return logits
        if self._vocab is None:
            raise ValueError("the drafter is not bound to a target; call draft.bind(target) first.")
        full = mx.full((*logits.shape[:-1], self.target.vocab_size), -mx.inf, logits.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self._vocab, logits.shape), logits, axis=-1)

    def context(self, taps: mx.array) -> mx.array:
        """Context features from the target's concatenated tapped states."""
        return self.hidden_norm(self.fc(taps))

    # Inference fuses each layer's q/k/v and gate/up products, as the target does.
    fuse_projections = True

    def fused_projections(self) -> list:
        """Each layer's FusedProjections (None where they cannot be fused)."""
        if not self.fuse_projections:
            return [None] * len(self.layers)
        return [projections(layer) for layer in self.layers]

    def make_cache(self) -> list[BufferKVCache]:
        """Context caches, one buffer per layer."""
        return [BufferKVCache() for _ in self.layers]

    def extend(self, taps: mx.array, cache: list[BufferKVCache], fused: list | None = None) -> None:
        """Append the context keys/values of newly committed positions from
        their tapped target states taps [1, S, n*H]."""
        fused = self.fused_projections() if fused is None else fused
        features = apply_linear(self.fc, taps)
        # hidden_norm goes into each k/v product only if every layer's takes it.
        norm = self.hidden_norm
        if not all(f is not None and takes_norm(f.kv, features, norm) for f in fused):
            features, norm = norm(features), None
        for layer, c, f in zip(self.layers, cache, fused):
            c.update_and_fetch(*layer.self_attn.keys_values(features, self.rope, c.offset, f, cached=True, norm=norm))

    def __call__(
        self, block: mx.array, taps: mx.array | None, cache: list[BufferKVCache], fused: list | None = None
    ) -> mx.array:
        """Draft one block: block [1, bs] ids [last committed, MASK, ...] right
        after the cached context; taps [1, S, n*H] of positions committed since
        the last call, or None. Returns logits [1, bs-1, V] for positions 1..bs-1.
        """
        return self.logits(self.hidden_states(block, taps, cache, fused, normed=False), self.norm)

    def hidden_states(
        self,
        block: mx.array,
        taps: mx.array | None,
        cache: list[BufferKVCache],
        fused: list | None = None,
        normed: bool = True,
    ) -> mx.array:
        """States [1, bs-1, H] of block positions 1..bs-1, final-normed if ``normed``."""
        fused = self.fused_projections() if fused is None else fused
        if taps is not None and taps.shape[1]:
            self.extend(taps, cache, fused)
        x = self.embed(block)
        L = block.shape[1]
        masks = {}
        ends = {}
        for layer, c, layer_fused in zip(self.layers, cache, fused):
            attn = layer.self_attn
            # The mask hides the buffer's unfilled tail and does the windowing.
            length = c.offset if isinstance(c.offset, int) else id(c.offset)
            kind = (attn.causal, attn.window, c.read_width(L), length)
            if kind not in masks:
                masks[kind] = block_mask(L, c.offset, attn.causal, attn.window, total=kind[2])
            if length not in ends:
                ends[length] = c.after(L)
            attend = partial(
                cache_attention,
                cache=c,
                start=c.offset,
                length=ends[length],
                causal=attn.causal,
                window=attn.window,
                exact=False,
            )
            x = layer(x, None, None, self.rope, c.offset, masks[kind], cache=c, fused=layer_fused, attend=attend)
        return self.norm(x[:, 1:]) if normed else x[:, 1:]


def draft_vocabulary(d2t: mx.array, target_vocab: int) -> mx.array:
    """The target ids [draft vocab] of a reduced draft vocabulary from its
    offsets ``d2t``: increasing (the draft vocabulary is a sorted subset of the
    target's) and inside the target's vocabulary, else ValueError."""
    ids = mx.arange(d2t.shape[0], dtype=mx.int32) + d2t.astype(mx.int32)
    inside = mx.all((ids >= 0) & (ids < target_vocab)).item()
    increasing = d2t.shape[0] < 2 or mx.all(ids[1:] > ids[:-1]).item()
    if not (inside and increasing):
        where = "outside the target's" if not inside else "not in increasing order over the target's"
        raise ValueError(
            f"the drafter's d2t maps its {d2t.shape[0]} draft tokens to ids {where} {target_vocab}-token "
            "vocabulary; use the drafter published for this target."
        )
    return ids


def block_mask(L: int, C, causal: bool, window: int | None, total: int | None = None):
    """Boolean [L, total] mask for one block after C context keys (keys past
    C + L unfilled), or None when every query sees every key. Windows count
    absolute positions on either side, as in Z Lab's reference."""
    if total is None:
        total = C + L
        if not causal and (window is None or total <= window):
            return None
    return positions_mask(L, C, total, window, causal, limit=C + L)
