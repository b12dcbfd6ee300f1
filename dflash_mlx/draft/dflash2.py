"""The DFlash 2 drafter (``DFlash2DraftModel``): DFlash layers wrapped in
grouped dynamic convolutions over the block, plus a candidate selector that
walks the block choosing among each position's top-k tokens (``propose``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from .dflash import DFlashDraft, DraftConfig, DraftLayer, _short, check_weights

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Z Lab stores the selector's two embedding tables without a ".weight" suffix.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_dflash2(raw: Any) -> bool:
    """Whether a drafter config.json (as a dict) describes a DFlash 2 drafter."""
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    return isinstance(archs, list) and any("DFlash2" in str(a) for a in archs)


@dataclass
class Draft2Config(DraftConfig):
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    def __post_init__(self):
        super().__post_init__()
        for name in DFLASH2_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dflash_config.{name} must be a positive integer, got {value!r}; fix config.json.")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"dflash_config.conv_group_size {self.conv_group_size} does not divide hidden_size "
                f"{self.hidden_size}; fix config.json."
            )
        if self.codebook_size is None:
            raise ValueError("the DFlash 2 drafter's config.json has no vocab_size; add the target's vocab_size.")
        if self.selector_top_k > self.codebook_size:
            raise ValueError(
                f"dflash_config.selector_top_k {self.selector_top_k} exceeds the {self.codebook_size}-token "
                "vocabulary; fix config.json."
            )

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @property
    def codebook_size(self) -> int | None:
        """The selector's codebook rows: one per token of the draft vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Draft2Config:
        """Parse a Z Lab DFlash 2 config.json (a v1 config plus DFLASH2_FIELDS)."""
        base = DraftConfig.from_dict({**cfg, "architectures": ["DFlashDraftModel"]})
        dflash = cfg.get("dflash_config") or {}
        missing = [f"dflash_config.{k}" for k in DFLASH2_FIELDS if k not in dflash]
        if missing:
            raise ValueError(
                "the DFlash 2 drafter's config.json is missing "
                + ", ".join(missing)
                + "; re-download or re-convert the checkpoint."
            )
        return cls(**vars(base), **{k: dflash[k] for k in DFLASH2_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["dflash_config"].update({k: d.pop(k) for k in DFLASH2_FIELDS})
        d["architectures"] = ["DFlash2DraftModel"]
        return d


def remap_codebooks(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Z Lab names -> module names: the codebooks gain ``.weight``."""
    return {(f"{k}.weight" if k in CODEBOOKS else k): v for k, v in weights.items()}


def _is_dflash2_tensor(name: str) -> bool:
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


def _shown(name: str) -> str:
    """A tensor's name as the Z Lab checkpoint spells it."""
    return name.removesuffix(".weight") if name.removesuffix(".weight") in CODEBOOKS else name


def check_draft_weights(
    weights: dict[str, mx.array], cfg: DraftConfig, quantization: dict | None = None
) -> dict[str, mx.array]:
    """The drafter's weights under module names; raises ValueError for missing,
    unexpected or misshapen tensors."""
    if not isinstance(cfg, Draft2Config):
        check_weights(weights, cfg, quantization)
        return weights
    weights = remap_codebooks(weights)
    check_weights({k: v for k, v in weights.items() if not _is_dflash2_tensor(k)}, cfg, quantization)
    # The module's arrays are lazy: building one to read its shapes allocates nothing.
    model = DFlash2Draft(cfg)
    if quantization:
        quantize_like(model, weights, quantization)
    want = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters()) if _is_dflash2_tensor(k)}
    have = {k: tuple(v.shape) for k, v in weights.items() if _is_dflash2_tensor(k)}
    found = {
        "missing tensors": sorted(_shown(k) for k in set(want) - set(have)),
        "unexpected tensors": sorted(_shown(k) for k in set(have) - set(want)),
        "misshapen tensors:": sorted(
            f"{_shown(k)} is {have[k]}, expected {want[k]}" for k in set(want) & set(have) if want[k] != have[k]
        ),
    }
    problems = [f"{what} {_short(names)}" for what, names in found.items() if names]
    if problems:
        raise ValueError(
            "the DFlash 2 drafter checkpoint does not match its config.json ("
            + "; ".join(problems)
            + f"; codebooks are vocab_size x selector_rank = {cfg.codebook_size} x {cfg.selector_rank}); "
            "re-download or re-convert it."
        )
    return weights


def quantize_like(model: nn.Module, weights: dict[str, mx.array], quantization: dict) -> None:
    """Quantize the layers of ``model`` that ``weights`` holds quantized."""
    nn.quantize(
        model,
        group_size=int(quantization["group_size"]),
        bits=int(quantization["bits"]),
        mode=quantization.get("mode", "affine"),
        class_predicate=lambda p, m: f"{p}.scales" in weights,
    )


def parse_draft_config(raw: dict) -> DraftConfig:
    """A drafter config.json of either kind: Draft2Config for DFlash 2."""
    return Draft2Config.from_dict(raw) if is_dflash2(raw) else DraftConfig.from_dict(raw)


def draft_model(cfg: DraftConfig) -> DFlashDraft:
    return DFlash2Draft(cfg) if isinstance(cfg, Draft2Config) else DFlashDraft(cfg)


class GroupedDynamicConv(nn.Module):
    """Two causal convolutions over the block (0 before a sublayer, 1 after),
    each a static kernel per channel plus a dynamic one per position and group."""

    def __init__(self, cfg: Draft2Config):
        super().__init__()
        self.kernel_size, self.group_size = cfg.conv_kernel_size, cfg.conv_group_size
        self.base_kernel = mx.zeros((2, cfg.conv_kernel_size, cfg.hidden_size))
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * cfg.conv_kernel_size * cfg.conv_groups, bias=False)

    def dynamic(self, x: mx.array) -> mx.array:
        """The dynamic kernels [B, L, 2, K, groups] of the sublayer input x."""
        B, L, H = x.shape
        return self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, H // self.group_size)

    def __call__(self, x: mx.array, dynamic: mx.array, which: int) -> mx.array:
        """out[t] = sum_o (base[o] + dynamic[t, o]) * x[t - o], zero before
        the block's first position."""
        B, L, H = x.shape
        groups = H // self.group_size
        x = x.reshape(B, L, groups, self.group_size)
        out = None
        for o in range(self.kernel_size):
            shifted = x if o == 0 else mx.pad(x, [(0, 0), (o, 0), (0, 0), (0, 0)])[:, :L]
            kernel = self.base_kernel[which, o].reshape(groups, self.group_size).astype(x.dtype)
            term = (kernel + dynamic[:, :, which, o, :, None]) * shifted
            out = term if out is None else out + term
        return out.reshape(B, L, H)


class Draft2Layer(DraftLayer):
    def __init__(self, cfg: Draft2Config, layer_type: str):
        super().__init__(cfg, layer_type)
        self.attention_conv = GroupedDynamicConv(cfg)
        self.mlp_conv = GroupedDynamicConv(cfg)

    def __call__(self, x, ctx_keys, ctx_values, rope, offset, mask, *, cache=None, attend=None, fused=None):
        h = self.input_layernorm(x)
        dyn = self.attention_conv.dynamic(h)
        conv = self.attention_conv(h, dyn, 0)
        a = self.self_attn(conv, ctx_keys, ctx_values, rope, offset, mask, cache=cache, attend=attend, fused=fused)
        x = x + self.attention_conv(a, dyn, 1)
        h = self.post_attention_layernorm(x)
        dyn = self.mlp_conv.dynamic(h)
        mixed = self.mlp_conv(h, dyn, 0)
        return x + self.mlp_conv(fused.mlp(self.mlp, mixed) if fused is not None else self.mlp(mixed), dyn, 1)


class CandidateSelector(nn.Module):
    """Chooses one of each block position's top-k tokens, scoring a
    candidate by its logit plus a low-rank pair score with the token chosen
    at the previous position."""

    def __init__(self, cfg: Draft2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.predecessor_codebook = nn.Embedding(cfg.codebook_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.codebook_size, cfg.selector_rank)

    def __call__(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchor: mx.array,
        temperature: float = 0.0,
        key: mx.array | None = None,
        *,
        rows: mx.array | None = None,
    ):
        """hidden [n, H], logits [n, V] of block positions 1..n; anchor the last
        committed token; ``rows``: each target token's codebook row (None: its
        id). Returns (drafts [n], candidates [n, k], q [n, k] or None): q row t
        is the distribution draft t was drawn from given draft t-1."""
        n = logits.shape[0]
        candidates = mx.argpartition(-logits, self.top_k - 1, axis=-1)[:, : self.top_k].astype(mx.int32)
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        proj = self.hidden_projection(hidden).astype(mx.float32)  # [n, r]
        previous = mx.concatenate([anchor.reshape(1), candidates[:-1].reshape(-1)])
        if rows is not None:
            previous, successors = rows[previous], rows[candidates]
        else:
            successors = candidates
        succ = self.successor_codebook(successors).astype(mx.float32)  # [n, k, r]
        pred = self.predecessor_codebook(previous)
        pred = pred.astype(mx.float32)
        first = succ[0] @ (pred[0] * proj[0])  # [k]
        trans = (pred[1:].reshape(n - 1, self.top_k, pred.shape[-1]) * proj[1:, None]) @ succ[1:].transpose(
            0, 2, 1
        )  # [n-1, k, k]
        keys = mx.random.split(key, n) if (temperature > 0 and key is not None) else [None] * n
        picks, q_rows = [], []
        prev = None
        for t in range(n):
            score = unary[t] + (first if t == 0 else trans[t - 1][prev])
            if temperature > 0:
                scaled = score / temperature
                q_rows.append(mx.softmax(scaled, axis=-1))
                prev = mx.random.categorical(scaled, key=keys[t])
            else:
                prev = mx.argmax(score, axis=-1)
            picks.append(prev)
        index = mx.stack(picks)
        drafts = mx.take_along_axis(candidates, index[:, None], axis=-1)[:, 0]
        return drafts, candidates, (mx.stack(q_rows) if q_rows else None)


class DFlash2Draft(DFlashDraft):
    selects_candidates = True

    def __init__(self, cfg: Draft2Config):
        super().__init__(cfg)
        self.layers = [Draft2Layer(cfg, t) for t in cfg.layer_types]
        self.candidate_selector = CandidateSelector(cfg)
        self._rows = None

    def bind(self, target) -> DFlash2Draft:
        super().bind(target)
        if self._vocab is not None:
            self._rows = codebook_rows(self._vocab, target.vocab_size)
        return self

    def propose(
        self,
        block: mx.array,
        taps: mx.array | None,
        cache,
        temperature: float = 0.0,
        key: mx.array | None = None,
        fused: list | None = None,
    ):
        """(drafts [bs-1], q [bs-1, V]) for block positions 1..bs-1, q None at
        temperature 0: row i of q is what draft i was drawn from given drafts
        0..i-1, zero outside its top-k, for ``sampling.accept_proposals``."""
        hidden = self.hidden_states(block, taps, cache, fused)
        logits = self.logits(hidden)
        drafts, candidates, q = self.candidate_selector(
            hidden.squeeze(0), logits.squeeze(0), block[0, 0], temperature, key, rows=self._rows
        )
        if q is not None:
            q = mx.put_along_axis(mx.zeros(logits.shape[1:], mx.float32), candidates, q, axis=-1)
        return drafts, q


def codebook_rows(vocab: mx.array, target_vocab: int) -> mx.array:
    """Each target token's codebook row for a reduced draft vocabulary (its
    target ids ``vocab``, increasing): its draft id, and for a token outside the
    vocabulary that of the last draft token before it, the last row before the
    first, as the speculators trainer indexes predecessors."""
    inside = mx.zeros((target_vocab,), mx.int32).at[vocab].add(1)
    return (mx.cumsum(inside) - 1) % vocab.shape[0]
