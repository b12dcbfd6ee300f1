"""Loading targets and drafters from local directories or Hub repos."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .draft import DFlashDraft, DraftConfig, check_weights
from .targets import adapt


def resolve(path_or_repo: str, allow_patterns: list[str] | None = None) -> Path:
    """A local directory as is; otherwise a Hub repo id fetched through
    huggingface_hub (its cache, HF_HUB_OFFLINE honoured)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path_or_repo} is a file; pass the model's directory or a Hub repo id.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_repo), allow_patterns=allow_patterns))
    except Exception as e:  # huggingface_hub raises many kinds
        raise ValueError(
            f"cannot find {path_or_repo!r}: it is not a local directory and the Hub "
            f"could not provide it ({type(e).__name__}); check the path or repo id, or "
            "download it first while online."
        ) from e


def read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}; is this a model directory?")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}); re-download it.") from e
    return weights


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json; pass a DFlash drafter directory or repo.")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e.msg} at line {e.lineno}).") from e


def load_draft(path_or_repo: str | Path) -> DFlashDraft:
    """A DFlash drafter from a Z Lab or converted directory, or a Hub repo."""
    path = resolve(str(path_or_repo), allow_patterns=["*.json", "*.safetensors", "*.md"])
    raw = read_config(path)
    cfg = DraftConfig.from_dict(raw)
    weights = read_weights(path)
    quantization = raw.get("quantization")
    check_weights(weights, cfg, quantization)
    model = DFlashDraft(cfg)
    if quantization:
        nn.quantize(
            model,
            group_size=int(quantization["group_size"]),
            bits=int(quantization["bits"]),
            mode=quantization.get("mode", "affine"),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def load(path_or_repo: str, draft: str | Path | None = None, *, lazy: bool = False):
    """Load a target with mlx-lm and its DFlash drafter.

    Returns (model, draft, tokenizer): the mlx-lm model, the drafter bound to
    it, and mlx-lm's tokenizer wrapper."""
    if draft is None:
        raise ValueError("no drafter given; pass draft=<drafter directory or Hub repo id>.")
    from mlx_lm import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(resolve(str(path_or_repo))), lazy=lazy)
    drafter = load_draft(draft).bind(adapt(model))
    return model, drafter, tokenizer
