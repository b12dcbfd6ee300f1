"""Target adapters, one per model family mlx-lm knows by ``model_type``."""

from __future__ import annotations

import mlx.nn as nn

from .base import DenseTarget
from .deepseek_v3 import DeepseekV3Target
from .gemma import Gemma3Target, Gemma4Target
from .glm4_moe import Glm4MoeTarget
from .glm_moe_dsa import DeepseekV32Target, GlmMoeDsaTarget
from .gpt_oss import GptOssTarget
from .hybrid import HybridTarget, Qwen3_5MoeTarget, Qwen3NextTarget
from .llama import LlamaTarget
from .minimax import MiniMaxTarget
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
    "deepseek_v3": DeepseekV3Target,
    "kimi_k25": DeepseekV3Target,
    "deepseek_v32": DeepseekV32Target,
    "glm_moe_dsa": GlmMoeDsaTarget,
    "glm4_moe": Glm4MoeTarget,
    "minimax": MiniMaxTarget,
}


def adapt(model: nn.Module) -> DenseTarget:
    """Wrap an mlx-lm model (as returned by ``mlx_lm.load``) in its adapter."""
    if isinstance(model, DenseTarget):
        return model
    from mlx_lm.utils import MODEL_REMAPPING

    name = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    # mlx-lm's own renames: minimax_m2 is its minimax, kimi_k2 its deepseek_v3
    model_type = name if name in ADAPTERS else MODEL_REMAPPING.get(name, name)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"target model type {name!r} is not supported yet; supported families: {', '.join(sorted(ADAPTERS))}."
        )
    return ADAPTERS[model_type](model)


__all__ = [
    "ADAPTERS",
    "DeepseekV32Target",
    "DeepseekV3Target",
    "DenseTarget",
    "Gemma3Target",
    "Gemma4Target",
    "Glm4MoeTarget",
    "GlmMoeDsaTarget",
    "GptOssTarget",
    "HybridTarget",
    "LlamaTarget",
    "MiniMaxTarget",
    "MuseGlimmerTarget",
    "Qwen3MoeTarget",
    "Qwen3NextTarget",
    "Qwen3_5MoeTarget",
    "Qwen3Target",
    "adapt",
]
