"""Target adapters, one per model family mlx-lm knows by ``model_type``."""

from __future__ import annotations

import mlx.nn as nn

from .base import DenseTarget
from .gemma import Gemma3Target, Gemma4Target
from .gpt_oss import GptOssTarget
from .hybrid import HybridTarget, Qwen3_5MoeTarget, Qwen3NextTarget
from .llama import LlamaTarget
from .muse_glimmer import MuseGlimmerTarget
from .qwen3 import Qwen3Target
from .qwen3_moe import Qwen3MoeTarget

ADAPTERS: dict[str, type[DenseTarget]] = {
    "qwen3": Qwen3Target,
    "llama": LlamaTarget,
    "qwen3_moe": Qwen3MoeTarget,
    "gpt_oss": GptOssTarget,
    "gemma3_text": Gemma3Target,
    "gemma3": Gemma3Target,
    "gemma4_text": Gemma4Target,
    "gemma4": Gemma4Target,
    "muse_glimmer": MuseGlimmerTarget,
    "qwen3_5": HybridTarget,
    "qwen3_5_moe": Qwen3_5MoeTarget,
    "qwen3_next": Qwen3NextTarget,
}


def adapt(model: nn.Module) -> DenseTarget:
    """Wrap an mlx-lm model (as returned by ``mlx_lm.load``) in its adapter."""
    if isinstance(model, DenseTarget):
        return model
    model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"target model type {model_type!r} is not supported yet; supported families: {', '.join(sorted(ADAPTERS))}."
        )
    return ADAPTERS[model_type](model)


__all__ = [
    "ADAPTERS",
    "DenseTarget",
    "Gemma3Target",
    "Gemma4Target",
    "GptOssTarget",
    "HybridTarget",
    "LlamaTarget",
    "MuseGlimmerTarget",
    "Qwen3MoeTarget",
    "Qwen3NextTarget",
    "Qwen3_5MoeTarget",
    "Qwen3Target",
    "adapt",
]
