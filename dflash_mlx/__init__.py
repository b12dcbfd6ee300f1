"""dflash-mlx: lossless DFlash speculative decoding on MLX.

from dflash_mlx import load, generate, stream_generate
model, draft, tokenizer = load("Qwen/Qwen3-8B", draft="z-lab/Qwen3-8B-DFlash-b16")
print(generate(model, draft, tokenizer, "The capital of France is", max_tokens=64))
"""

from importlib import import_module

from . import fast_blas, moved

__version__ = "0.2.0"

moved.install()

# Imported on first use, so that `dflash-mlx --help` does not wait for MLX,
# mlx-lm and transformers to load.
_EXPORTS = {
    "DFlashDraft": "draft.dflash",
    "DraftConfig": "draft.dflash",
    "load": "loading",
    "load_draft": "loading",
    "GenerationResponse": "generation",
    "PromptCache": "cache.prompt",
    "generate": "generation",
    "make_prompt_cache": "cache.prompt",
    "stream_generate": "generation",
}

__all__ = [*_EXPORTS, "__version__", "use_fast_blas"]


def use_fast_blas() -> str | None:
    """On Linux, open the system's OpenBLAS for MLX's CPU products (MLX's CPU
    wheel carries the reference BLAS); returns the library opened. It only
    works before MLX is imported; the API's first use calls it."""
    return fast_blas.load()


def __getattr__(name):
    if name in _EXPORTS:
        use_fast_blas()  # before the export's module imports MLX
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
