"""The prompt cache a conversation reuses (prompt.py), its files (files.py)
and a store of them on disk found by the longest common prefix (store.py),
whose writer waits while any generation decodes (decoding.py), over the KV
buffers of dflash_mlx/kv/."""

from importlib import import_module

_EXPORTS = {
    "PromptCache": "prompt",
    "make_prompt_cache": "prompt",
    "save_prompt_cache": "files",
    "load_prompt_cache": "files",
    "PrefixStore": "store",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
