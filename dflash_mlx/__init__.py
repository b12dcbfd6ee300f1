"""dflash-mlx: lossless DFlash speculative decoding on MLX.

    from dflash_mlx import load, generate, stream_generate
    model, draft, tokenizer = load("Qwen/Qwen3-8B", draft="z-lab/Qwen3-8B-DFlash-b16")
    print(generate(model, draft, tokenizer, "The capital of France is", max_tokens=64))
"""

from importlib import import_module

from . import fast_blas

# Before anything imports MLX: on Linux, MLX's CPU products then run on the
# system's OpenBLAS where there is one (fast_blas.py).
fast_blas.load()

__version__ = "0.2.0"

# Imported on first use, so that `dflash-mlx --help` does not wait for MLX,
# mlx-lm and transformers to load.
_EXPORTS = {
    "DFlashDraft": "draft",
    "DraftConfig": "draft",
    "load": "loading",
    "load_draft": "loading",
    "GenerationResponse": "speculative",
    "PromptCache": "prompt_cache",
    "generate": "speculative",
    "make_prompt_cache": "prompt_cache",
    "stream_generate": "speculative",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
