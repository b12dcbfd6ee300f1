"""dflash-mlx: lossless DFlash speculative decoding on MLX.

    from dflash_mlx import load, generate, stream_generate
    model, draft, tokenizer = load("Qwen/Qwen3-8B", draft="z-lab/Qwen3-8B-DFlash-b16")
    print(generate(model, draft, tokenizer, "The capital of France is", max_tokens=64))
"""

from .draft import DFlashDraft, DraftConfig
from .loading import load, load_draft
from .speculative import (
    GenerationResponse,
    PromptCache,
    generate,
    make_prompt_cache,
    stream_generate,
)

__version__ = "0.2.0"

__all__ = [
    "DFlashDraft",
    "DraftConfig",
    "GenerationResponse",
    "PromptCache",
    "generate",
    "load",
    "load_draft",
    "make_prompt_cache",
    "stream_generate",
    "__version__",
]
