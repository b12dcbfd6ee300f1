"""Prompt caches on disk: the target's and the drafter's caches for a prefix
(a long system prompt, a document), saved once and loaded by later runs so
that they read only what follows the prefix.

A file is one safetensors file: each layer's keys and values for the cached
positions (``target.{i}.keys`` ..., ``draft.{i}.keys`` ...), and metadata
naming what it was made from: the token ids, the model pair as the caller
named it (paths or repo ids, informative only), and a fingerprint of the
pair (both configs and a sample of every weight tensor), which must match
the pair that loads it. What a loaded cache decodes is exactly what the same
prompt decodes without it: the cache holds the keys and values that reading
the prefix again would write.

Only attention caches (BufferKVCache) are saved; a hybrid target's
delta-net layers are refused for now.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .draft import DFlashDraft
from .kv_cache import BufferKVCache
from .prompt_cache import PromptCache
from .targets import adapt

FORMAT = "dflash-mlx prompt cache"
VERSION = "1"


def _config_dict(obj) -> dict:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return dict(vars(obj))


def _module_digest(h, module) -> None:
    """Names, shapes, dtypes and the first values of every parameter: two
    different checkpoints (or adapters, or quantizations) differ here."""
    leaves = tree_flatten(module.parameters())
    samples = [a.reshape(-1)[:16] for _, a in leaves]
    mx.eval(samples)
    for (name, a), s in zip(leaves, samples):
        h.update(f"{name}:{a.shape}:{a.dtype};".encode())
        h.update(np.array(s.astype(mx.float32) if s.dtype == mx.bfloat16 else s).tobytes())


def pair_fingerprint(model, draft: DFlashDraft) -> str:
    """A digest of the target's and the drafter's configs and weights."""
    target = adapt(model)
    h = hashlib.sha256()
    h.update(json.dumps(_config_dict(target.model.args), sort_keys=True, default=str).encode())
    h.update(json.dumps(_config_dict(draft.config), sort_keys=True, default=str).encode())
    _module_digest(h, target.model)
    _module_digest(h, draft)
    return h.hexdigest()


def _attention_caches(cache: PromptCache) -> None:
    if not all(isinstance(c, BufferKVCache) for c in cache.target + cache.draft):
        raise ValueError(
            "prompt-cache files hold attention caches only, and this target has recurrent (delta-net) layers; "
            "run without a prompt-cache file."
        )


def save_prompt_cache(path: str | Path, cache: PromptCache, metadata: dict[str, str] | None = None) -> None:
    """Write ``cache`` (its ``tokens`` and every layer's keys/values for them)
    to ``path`` (a .safetensors file), with ``metadata`` (str -> str) kept
    beside the pair's fingerprint."""
    _attention_caches(cache)
    if not cache.consistent():
        raise ValueError("this prompt cache is in use by a generation; save it once that generation has ended.")
    n = len(cache.tokens)
    if n == 0:
        raise ValueError("this prompt cache is empty; read a prompt into it first.")
    arrays = {}
    for role, layers in (("target", cache.target), ("draft", cache.draft)):
        for i, c in enumerate(layers):
            arrays[f"{role}.{i}.keys"] = c.keys[..., :n, :]
            arrays[f"{role}.{i}.values"] = c.values[..., :n, :]
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(format=FORMAT, version=VERSION, tokens=json.dumps(cache.tokens),
                fingerprint=pair_fingerprint(cache.model, cache.draft_model))
    path = Path(path)
    tmp = path.with_name(path.name + ".partial.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata=meta)
    tmp.replace(path)  # never a half-written file under the real name


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a prompt-cache file (checked to be one)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"the prompt-cache file {path} {what}; make one with `dflash-mlx cache-prompt`.")
    try:
        _, meta = mx.load(str(path), return_metadata=True)
    except Exception:
        raise ValueError(f"{path} is not a safetensors file; make a prompt cache with `dflash-mlx cache-prompt`.") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dflash-mlx prompt-cache file; make one with `dflash-mlx cache-prompt`.")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path} was written by another version of dflash-mlx (format {meta.get('version')}); make it again.")
    return meta


def load_prompt_cache(path: str | Path, model, draft: DFlashDraft) -> tuple[PromptCache, dict[str, str]]:
    """A PromptCache for ``model`` and ``draft`` holding what ``path`` saved,
    and the file's metadata. A file made for another pair is refused."""
    meta = read_metadata(path)
    arrays = mx.load(str(path))
    cache = PromptCache(model, draft)
    _attention_caches(cache)
    if meta.get("fingerprint") != pair_fingerprint(model, draft):
        made = " and ".join(f"{meta[k]}" for k in ("model", "draft_model") if meta.get(k))
        raise ValueError(
            f"{path} was made for another model pair{f' ({made})' if made else ''}; "
            "make a prompt cache for this pair with `dflash-mlx cache-prompt`."
        )
    tokens = [int(t) for t in json.loads(meta["tokens"])]
    n = len(tokens)
    for role, layers in (("target", cache.target), ("draft", cache.draft)):
        for i, c in enumerate(layers):
            keys, values = arrays[f"{role}.{i}.keys"], arrays[f"{role}.{i}.values"]
            room = -(-n // c.step) * c.step
            pad = [(0, 0), (0, 0), (0, room - n), (0, 0)]
            c.keys, c.values = mx.pad(keys, pad), mx.pad(values, pad)
            c.set_length(n)
    mx.eval(cache.arrays())
    cache.tokens = tokens
    cache.settle()
    return cache, meta
