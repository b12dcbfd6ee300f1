"""Prompt caches on disk: both caches for a prefix, saved once so later runs
read only what follows it.

One safetensors file holds each layer's keys and values (a delta-net
layer's convolution and recurrent states) and metadata: the token ids, the
pair's names (informative only) and a fingerprint of the pair, which must
match on load; and checksums of its metadata and of its tensors (xxHash3,
fast enough to check a long prefix in a fraction of its prefill), which must
match too (a file without them, from an earlier release, loads with a
warning). Every tensor's shape is checked against the pair and its values
for NaN. A loaded cache decodes exactly what re-reading the prefix would. A
quantized cache is saved packed with its settings and loads only under
them; a bounded cache (``max_kv_size``) is not saved.

Saving is two steps, so a server can write after its reply: ``snapshot``
holds views of the cache's arrays (the caller's thread, MLX's), ``write_snapshot``
brings them to the host, checksums and writes them one tensor at a time (any
thread; it can pause before each, as the prefix store's writer does while a
generation decodes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten

from .. import compute_dtype
from ..draft.dflash import DFlashDraft
from ..kv import window
from ..kv.buffer import BufferKVCache
from ..kv.quantized import QuantizedBufferKVCache
from ..kv.window import WindowKVCache
from ..targets import adapt
from ..targets.hybrid import HybridCache
from ..targets.recurrent import DeltaCache
from .prompt import PromptCache

FORMAT = "dflash-mlx prompt cache"
VERSION = "1"
# A file whose sliding layers hold only their window (kv/window.py): earlier
# releases, which read every layer as holding every position, must refuse it.
WINDOWED_VERSION = "2"
TENSORS_SUM, META_SUM = "tensors_xxh3", "metadata_crc32"
OLD_TENSORS_SUM = "tensors_crc32"  # what files of earlier releases hold
# A flat JSON list of ids, matched before json.loads so that no nesting is parsed.
_TOKENS = re.compile(r"\[\s*(?:[0-9]{1,10}\s*(?:,\s*[0-9]{1,10}\s*)*)?\]")
# safetensors' names for the dtypes a cache holds
DTYPES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint8: "U8",
    mx.int8: "I8",
}
_warned: set[str] = set()


class DamagedCacheFile(ValueError):
    """A prompt-cache file that was edited, cut short or is not one."""


class ForeignCacheFile(ValueError):
    """A sound prompt-cache file made for another pair, other KV settings or
    another version of the format."""


@dataclasses.dataclass
class Snapshot:
    """A cache's tensors as (safetensors dtype, evaluated array of their
    bits), and its metadata; what ``write_snapshot`` writes. Taking one copies
    nothing: MLX writes an array in place only while nothing else holds its
    memory, so a write into the cache after it copies the buffer first and
    the snapshot keeps what it saw. The bytes reach the host as they are
    written, on the writer's thread, not the caller's."""

    tensors: dict[str, tuple[str, mx.array]]
    meta: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.tensors.values())


def _bits(a: mx.array) -> tuple[str, mx.array]:
    """(dtype name, a view of the array as numpy can hold its bytes, never
    the array itself): numpy has no bfloat16, so its bits as uint16."""
    if a.dtype not in DTYPES:
        raise ValueError(f"a prompt cache cannot hold {a.dtype} tensors.")
    return DTYPES[a.dtype], a.view(mx.uint16 if a.dtype == mx.bfloat16 else a.dtype)


def _host(a: mx.array) -> tuple[str, np.ndarray]:
    """An array as (dtype name, numpy view of its bytes)."""
    dtype, bits = _bits(a)
    return dtype, np.ascontiguousarray(bits)


def _sum_tensor(h, name: str, dtype: str, a: np.ndarray) -> None:
    h.update(f"{name}:{dtype}:{list(a.shape)};".encode())
    h.update(memoryview(a).cast("B"))


def _checksum(tensors: dict[str, tuple[str, np.ndarray]]) -> str:
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        _sum_tensor(h, name, *tensors[name])
    return h.hexdigest()


def tensors_checksum(arrays: dict[str, mx.array]) -> str:
    """An xxHash3 (64 bits) of every tensor's name, dtype, shape and bytes."""
    return _checksum({name: _host(a) for name, a in arrays.items()})


def crc32_checksum(arrays: dict[str, mx.array]) -> str:
    """The tensor checksum of earlier releases (zlib's CRC-32)."""
    crc = 0
    for name in sorted(arrays):
        a = arrays[name]
        crc = zlib.crc32(f"{name}:{a.dtype}:{a.shape};".encode(), crc)
        crc = zlib.crc32(_host(a)[1].data, crc)
    return f"{crc:08x}"


_SUMS = {TENSORS_SUM: (tensors_checksum, 16), OLD_TENSORS_SUM: (crc32_checksum, 8)}


def metadata_checksum(meta: dict[str, str]) -> str:
    """A CRC-32 of every metadata entry but the metadata's own checksum."""
    text = json.dumps({k: v for k, v in meta.items() if k != META_SUM}, sort_keys=True)
    return f"{zlib.crc32(text.encode()):08x}"


def _config_dict(obj) -> dict:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return dict(vars(obj))


def _module_digest(h, module, dtypes: bool = True) -> None:
    """Names, shapes, dtypes and the first values of every parameter: two
    different checkpoints (or adapters, or quantizations) differ here.
    ``dtypes=False``: the same weights in another float dtype (a cast of
    them, compute_dtype.py) digest alike: dtypes left out, float values
    rounded to bfloat16."""
    leaves = tree_flatten(module.parameters())
    samples = [a.reshape(-1)[:16] for _, a in leaves]
    if not dtypes:
        samples = [s.astype(mx.bfloat16) if mx.issubdtype(s.dtype, mx.floating) else s for s in samples]
    mx.eval(samples)
    for (name, a), s in zip(leaves, samples):
        h.update(
            f"{name}:{a.shape}:{a.dtype if dtypes or not mx.issubdtype(a.dtype, mx.floating) else 'float'};".encode()
        )
        h.update(np.array(s.astype(mx.float32) if s.dtype == mx.bfloat16 else s).tobytes())


def pair_fingerprint(model, draft: DFlashDraft, dtypes: bool = True) -> str:
    """A digest of the target's and the drafter's configs and weights
    (``dtypes=False``: whatever float dtype they compute in, _module_digest)."""
    target = adapt(model)
    h = hashlib.sha256()
    h.update(json.dumps(_config_dict(target.model.args), sort_keys=True, default=str).encode())
    h.update(json.dumps(_config_dict(draft.config), sort_keys=True, default=str).encode())
    _module_digest(h, target.model, dtypes)
    _module_digest(h, draft, dtypes)
    return h.hexdigest()


def pair_identity(model, draft: DFlashDraft) -> dict[str, str]:
    """What a file says of the pair it was made for (``fingerprint`` must match)."""
    return {
        "fingerprint": pair_fingerprint(model, draft),
        "dtype": compute_dtype.name(model),
        "weights": pair_fingerprint(model, draft, dtypes=False),
    }


def _savable(cache: PromptCache) -> None:
    if cache.max_kv_size is not None:
        raise ValueError(
            "a bounded prompt cache (max_kv_size) cannot be saved to a file; make the file without max_kv_size."
        )
    kinds = (BufferKVCache, WindowKVCache, QuantizedBufferKVCache, DeltaCache)
    if not all(type(c) in kinds for c in cache.target + cache.draft):
        raise ValueError("this target's caches cannot be saved to a file; run without a prompt-cache file.")


def kv_settings(cache: PromptCache) -> tuple:
    """(kv_bits, kv_group_size, quantized_kv_start): None, None, None when not quantized."""
    if cache.kv_bits is None:
        return None, None, None
    return cache.kv_bits, cache.kv_group_size, cache.quantized_kv_start


def _kv_meta(bits, group, start) -> dict[str, str]:
    return {} if bits is None else {"kv_bits": str(bits), "kv_group_size": str(group), "quantized_kv_start": str(start)}


def _describe(bits, group, start) -> str:
    if bits is None:
        return "no KV quantization"
    return f"kv_bits {bits}, kv_group_size {group}, quantized_kv_start {start}"


def cache_arrays(cache: PromptCache, n: int | None = None) -> dict[str, mx.array]:
    """Every layer's tensors for the first ``n`` positions (all it holds by
    default), by the names a file gives them; a delta-net layer's states are
    those after all of them; a sliding-window layer's, the positions it holds
    of them (the last ones: ``fill`` reads where they start from their count)."""
    n = len(cache.tokens) if n is None else n
    if n < window.earliest(cache.target):
        raise ValueError(f"this prompt cache no longer holds a window before position {n}")
    arrays = {}
    for role, layers in (("target", cache.target), ("draft", cache.draft)):
        for i, c in enumerate(layers):
            if isinstance(c, DeltaCache):
                arrays.update({f"{role}.{i}.conv": c.conv, f"{role}.{i}.ssm": c.ssm})
                continue
            held = c.row(n)
            for name, buf in (("keys", c.keys), ("values", c.values)):
                if isinstance(buf, tuple):  # quantized: packed, scales, biases
                    arrays.update({f"{role}.{i}.{name}.{j}": a[..., :held, :] for j, a in enumerate(buf)})
                else:
                    arrays[f"{role}.{i}.{name}"] = buf[..., :held, :]
    return arrays


def snapshot(
    cache: PromptCache, metadata: dict[str, str] | None = None, identity: dict[str, str] | None = None
) -> Snapshot:
    """``cache`` copied to the host with its metadata (``identity``: the
    pair's, pair_identity, computed here if not given); the cache may change
    afterwards."""
    _savable(cache)
    if not cache.consistent():
        raise ValueError("this prompt cache is in use by a generation; save it once that generation has ended.")
    n = len(cache.tokens)
    if n == 0:
        raise ValueError("this prompt cache is empty; read a prompt into it first.")
    arrays = {k: _bits(a) for k, a in cache_arrays(cache).items()}
    earliest = window.earliest(cache.target)
    mx.eval([a for _, a in arrays.values()])
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(
        format=FORMAT,
        version=WINDOWED_VERSION if earliest else VERSION,
        tokens=json.dumps(cache.tokens),
        **(identity or pair_identity(cache.model, cache.draft_model)),
        **_kv_meta(*kv_settings(cache)),
    )
    if cache.reply_from is not None and cache.reply_from <= n:
        meta["reply_from"] = str(cache.reply_from)
    if earliest:
        meta["earliest"] = str(earliest)  # (the prefix store reads it)
    return Snapshot(arrays, meta)


def _header(snap: Snapshot, names: list[str], tensors_sum: str) -> bytes:
    """The safetensors header of ``snap``'s tensors in the order of
    ``names``, with ``tensors_sum`` and the metadata's checksum, padded to 8."""
    header, offset = {}, 0
    for name in names:
        dtype, a = snap.tensors[name]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    meta = {**snap.meta, TENSORS_SUM: tensors_sum}
    meta[META_SUM] = metadata_checksum(meta)
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def write_snapshot(path: str | Path, snap: Snapshot, pause: Callable[[], None] | None = None) -> int:
    """Write ``snap`` to ``path`` as safetensors with its checksums; the file
    appears whole or not at all. Returns its size in bytes. ``pause``, when
    given, is called before each tensor is brought to the host."""
    path = Path(path)
    if pause is not None:  # nothing of the file is made before the first pause either
        pause()
    names = sorted(snap.tensors)
    # The sum heads the file but is known only after the last tensor: a
    # placeholder of its length (hex digits) first, the header rewritten in place.
    text = _header(snap, names, "0" * 16)
    summed = xxhash.xxh3_64()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.partial-{os.getpid()}-", suffix=".safetensors", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for name in names:
                if pause is not None:
                    pause()
                dtype, a = snap.tensors[name]
                host = np.ascontiguousarray(a)  # (on a GPU, where its bytes reach the host)
                _sum_tensor(summed, name, dtype, host)
                f.write(memoryview(host).cast("B"))
            final = _header(snap, names, summed.hexdigest())
            if len(final) != len(text):
                raise RuntimeError("a prompt-cache file's header changed length when its checksums were written.")
            f.seek(8)
            f.write(final)
        os.replace(tmp, path)  # never a half-written file under the real name
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return 8 + len(text) + snap.nbytes


def save_prompt_cache(path: str | Path, cache: PromptCache, metadata: dict[str, str] | None = None) -> None:
    """Write ``cache`` (its ``tokens`` and every layer's keys/values for them)
    to ``path`` (a .safetensors file), with ``metadata`` (str -> str) kept
    beside the pair's fingerprint."""
    write_snapshot(path, snapshot(cache, metadata))


def damaged(path, what: str) -> DamagedCacheFile:
    """The sentence for a prompt-cache file that is one but was edited or cut."""
    return DamagedCacheFile(f"{path} is damaged ({what}); make it again with `dflash-mlx cache-prompt`.")


def _missing(path: Path) -> ValueError:
    what = "is a directory" if path.is_dir() else "does not exist"
    return ValueError(f"the prompt-cache file {path} {what}; make one with `dflash-mlx cache-prompt`.")


def _check_metadata(path: Path, meta: dict[str, str]) -> None:
    if meta.get("version") not in (VERSION, WINDOWED_VERSION):
        raise ForeignCacheFile(
            f"{path} was written by another version of dflash-mlx (format {meta.get('version')}); make it again."
        )
    if META_SUM in meta and meta[META_SUM] != metadata_checksum(meta):
        raise damaged(path, "its metadata checksum does not match")
    for key, (_, digits) in _SUMS.items():
        if key in meta and not re.fullmatch(f"[0-9a-f]{{{digits}}}", meta[key]):
            raise damaged(path, "its tensor checksum is not one")
    if not token_ids(path, meta):
        raise damaged(path, "its token ids are not a list of ids")
    settings = [meta.get(k) for k in ("kv_bits", "kv_group_size", "quantized_kv_start")]
    if any(v is not None for v in settings):
        if not all(v is not None and v.isdigit() for v in settings):
            raise damaged(path, "its KV quantization settings are incomplete or not numbers")
    reply_from = meta.get("reply_from")
    if reply_from is not None and not (reply_from.isdigit() and int(reply_from) <= len(token_ids(path, meta))):
        raise damaged(path, "its reply position is not one")


def _open(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata of a prompt-cache file, its metadata checked."""
    path = Path(path)
    if not path.is_file():
        raise _missing(path)
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception:
        raise DamagedCacheFile(
            f"{path} is not a safetensors file, or is cut short; make a prompt cache with `dflash-mlx cache-prompt`."
        ) from None
    if not isinstance(arrays, dict) or meta.get("format") != FORMAT:
        raise DamagedCacheFile(
            f"{path} is not a dflash-mlx prompt-cache file; make one with `dflash-mlx cache-prompt`."
        )
    _check_metadata(path, meta)
    return arrays, meta


def read_header(path: str | Path) -> dict[str, str]:
    """A prompt-cache file's metadata, checked, from its header alone (a
    file shorter than its header says is refused as cut short)."""
    path = Path(path)
    if not path.is_file():
        raise _missing(path)
    cut = DamagedCacheFile(
        f"{path} is not a safetensors file, or is cut short; make a prompt cache with `dflash-mlx cache-prompt`."
    )
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise cut
        try:
            header = json.loads(f.read(length))
            meta = header.pop("__metadata__")
            end = max((t["data_offsets"][1] for t in header.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise cut from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DamagedCacheFile(
            f"{path} is not a dflash-mlx prompt-cache file; make one with `dflash-mlx cache-prompt`."
        )
    if not isinstance(end, int) or 8 + length + end != size:
        raise cut
    _check_metadata(path, meta)
    return meta


def token_ids(path, meta: dict[str, str]) -> list[int]:
    """The file's token ids, read only from a flat list of ints."""
    text = meta.get("tokens")
    if text is None:
        raise damaged(path, "its metadata has no readable token ids")
    if not isinstance(text, str) or not _TOKENS.fullmatch(text.strip()):
        raise damaged(path, "its token ids are not a list of ids")
    return json.loads(text)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a prompt-cache file (checked to be one)."""
    return _open(path)[1]


def _tensors(
    path,
    arrays: dict[str, mx.array],
    name: str,
    n: int,
    dims: tuple[int, int] | None,
    packing: tuple | None,
    *,
    least: int | None = None,
) -> mx.array | tuple:
    """One layer's keys or values, as saved (a packed triple when ``packing``,
    (bits, group size), is given), checked to hold ``n`` positions of one
    sequence with ``dims``, (KV heads, head dim), where known; a sliding
    layer's, the last ``least`` to ``n`` of them."""
    least = n if least is None else least
    names = [f"{name}.{j}" for j in range(3)] if packing else [name]
    missing = [k for k in names if k not in arrays]
    if missing:
        raise damaged(path, f"the tensor {missing[0]} is missing")
    parts = [arrays[k] for k in names]
    for j, (k, a) in enumerate(zip(names, parts)):
        dtype_ok = a.dtype == mx.uint32 if packing and j == 0 else mx.issubdtype(a.dtype, mx.floating)
        shape_ok = a.ndim == 4 and a.shape[0] == 1 and least <= a.shape[2] <= n and a.shape[:3] == parts[0].shape[:3]
        if not (dtype_ok and shape_ok):
            raise damaged(
                path,
                f"the tensor {k} is {_kind(a)} of shape {'x'.join(map(str, a.shape))}, which does not "
                f"hold {n} cached positions for this pair",
            )
        if dims is not None:
            heads, dim = dims
            if packing:
                dim = dim * packing[0] // 32 if j == 0 else dim // packing[1]
            if a.shape[1] != heads:
                raise damaged(path, f"the tensor {k} has {a.shape[1]} KV heads, and this pair's layer has {heads}")
            if a.shape[3] != dim:
                what = "a packed head dim" if packing else "a head dim"
                raise damaged(path, f"the tensor {k} has {what} of {a.shape[3]}, and this pair's layer has {dim}")
    return tuple(parts) if packing else parts[0]


def _kind(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _state(path, arrays: dict[str, mx.array], name: str, shape: tuple | None) -> mx.array:
    """A delta-net layer's saved state, checked to be floats of ``shape`` where known."""
    if name not in arrays:
        raise damaged(path, f"the tensor {name} is missing")
    a = arrays[name]
    if not mx.issubdtype(a.dtype, mx.floating) or (shape is not None and tuple(a.shape) != tuple(shape)):
        raise damaged(
            path,
            f"the tensor {name} is {_kind(a)} of shape {'x'.join(map(str, a.shape))}, which is not this pair's state",
        )
    return a


def _target_shapes(cache: PromptCache) -> list | None:
    """Each target layer's expected tensors: ((KV heads, key dim), (KV heads,
    value dim)) for attention, (conv shape, state shape) for a delta-net
    layer; read from the shapes one lazy forward step gives a fresh cache
    (nothing is evaluated); None where a target's caches do not show them."""
    try:
        fresh = cache.adapter.make_cache()
        cache.adapter(mx.array([[0]]), fresh, taps=[0])
        return [
            (c.conv.shape, c.ssm.shape)
            if isinstance(c, DeltaCache)
            else ((c.keys.shape[1], c.keys.shape[3]), (c.values.shape[1], c.values.shape[3]))
            for c in fresh
        ]
    except Exception:
        return None


def _finite(path, loaded: dict) -> None:
    """Refuse NaN or infinity in a file's float tensors (one evaluation)."""
    names, flags = [], []
    for key, v in loaded.items():
        for j, a in enumerate(v if isinstance(v, tuple) else (v,)):
            if mx.issubdtype(a.dtype, mx.floating):
                names.append(f"{key}.{j}" if isinstance(v, tuple) else key)
                flags.append(mx.all(mx.isfinite(a)))
    bad = [k for k, ok in zip(names, mx.stack(flags).tolist()) if not ok] if flags else []
    if bad:
        raise damaged(path, f"the tensor {bad[0]} holds NaN or infinity")


def _check_pair(path, meta: dict[str, str], cache: PromptCache) -> None:
    model, draft = cache.model, cache.draft_model
    if meta.get("fingerprint") != pair_fingerprint(model, draft):
        same_weights = meta.get("weights") == pair_fingerprint(model, draft, dtypes=False)
        now = compute_dtype.name(model)
        if same_weights and meta.get("dtype", now) != now:  # (the same pair cast: compute_dtype.py)
            raise ForeignCacheFile(
                f"{path} was made with the pair computing in {meta['dtype']}, and this one computes in "
                f'{now}; load it with --dtype {meta["dtype"]} (dtype="{meta["dtype"]}" in Python) '
                "to read the file, or make the prompt cache again."
            )
        made = " and ".join(f"{meta[k]}" for k in ("model", "draft_model") if meta.get(k))
        older = (
            ""
            if "dtype" in meta or not compute_dtype.on_fast_blas(compute_dtype.computing(model))
            else " (a file made before this CPU computed in float32 reads with --dtype and the checkpoint's own dtype)"
        )
        raise ForeignCacheFile(
            f"{path} was made for another model pair{f' ({made})' if made else ''}; "
            f"make a prompt cache for this pair with `dflash-mlx cache-prompt`{older}."
        )


def read_prompt_cache(path: str | Path, cache: PromptCache, fingerprint: str | None = None) -> dict[str, str]:
    """Fill ``cache``, fresh, with what ``path`` saved; returns the file's
    metadata. ``fingerprint``: the pair's, when the caller has it. Raises
    ForeignCacheFile or DamagedCacheFile (ValueErrors) in one sentence."""
    arrays, meta = _open(path)
    _savable(cache)
    if fingerprint is None or meta.get("fingerprint") != fingerprint:
        _check_pair(path, meta, cache)
    made = (
        (int(meta["kv_bits"]), int(meta["kv_group_size"]), int(meta["quantized_kv_start"]))
        if "kv_bits" in meta
        else (None, None, None)
    )
    if made != kv_settings(cache):
        raise ForeignCacheFile(
            f"{path} was made with {_describe(*made)}, not {_describe(*kv_settings(cache))}; "
            "use the settings it was made with, or make it again with these."
        )
    tokens = token_ids(path, meta)
    n = len(tokens)
    if max(tokens) >= cache.adapter.vocab_size:
        raise damaged(path, f"a token id is past the vocabulary of {cache.adapter.vocab_size}")
    # a quantized cache's target is saved packed once it held quantized_kv_start positions
    packed = made[0] is not None and "target.0.keys.0" in arrays
    cfg = cache.draft_model.config
    target_shapes = _target_shapes(cache)
    expected, loaded = set(), {}
    for role, layers in (("target", cache.target), ("draft", cache.draft)):
        for i, c in enumerate(layers):
            if isinstance(c, DeltaCache):
                shapes = target_shapes[i] if target_shapes else (None, None)
                for name, shape in zip(("conv", "ssm"), shapes):
                    loaded[f"{role}.{i}.{name}"] = _state(path, arrays, f"{role}.{i}.{name}", shape)
                    expected.add(f"{role}.{i}.{name}")
                continue
            packing = (made[0], made[1]) if packed and role == "target" else None
            if role == "draft":
                dims = [(cfg.num_key_value_heads, cfg.head_dim)] * 2
            else:
                dims = target_shapes[i] if target_shapes else [None, None]
            # a sliding layer holds at least the window before position n
            least = min(n, c.window - 1) if isinstance(c, WindowKVCache) else None
            for name, d in zip(("keys", "values"), dims):
                key = f"{role}.{i}.{name}"
                loaded[key] = _tensors(path, arrays, key, n, d, packing, least=least)
                expected.update([f"{key}.{j}" for j in range(3)] if packing else [key])
            if least is not None and loaded[f"{role}.{i}.keys"].shape[2] != loaded[f"{role}.{i}.values"].shape[2]:
                raise damaged(path, f"the tensors {role}.{i}.keys and {role}.{i}.values hold different positions")
    extra = sorted(set(arrays) - expected)
    if extra:
        raise damaged(path, f"it holds the tensor {extra[0]}, which this pair has no layer for")
    summed = next((k for k in _SUMS if k in meta), None)
    if summed is not None and _SUMS[summed][0](arrays) != meta[summed]:
        raise damaged(path, "its tensor checksum does not match")
    _finite(path, loaded)
    if summed is None and str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(
            f"{path} has no checksums (an earlier dflash-mlx made it); it loads with its tensors' shapes "
            "and values checked, and `dflash-mlx cache-prompt` makes it again with checksums.",
            stacklevel=3,
        )
    reply_from = int(meta["reply_from"]) if "reply_from" in meta else None
    fill(cache, loaded, tokens, reply_from, (made[1], made[0]) if packed else None)
    return meta


def fill(cache: PromptCache, arrays: dict, tokens: list[int], reply_from: int | None, packed: tuple | None) -> None:
    """Make ``cache``, fresh, hold ``tokens`` from ``arrays`` (named as
    cache_arrays names them, quantized parts as tuples; ``packed``: the
    target's (group size, bits) when its keys are). Buffers are new arrays,
    as large as the cache expects to grow (PromptCache.expect)."""
    n = len(tokens)
    if packed:
        cache.target[:] = [QuantizedBufferKVCache(*packed) if type(c) is BufferKVCache else c for c in cache.target]

    def padded(a: mx.array, room: int) -> mx.array:
        return mx.pad(a, [(0, 0), (0, 0), (0, room - n), (0, 0)])

    for role, layers in (("target", cache.target), ("draft", cache.draft)):
        for i, c in enumerate(layers):
            if isinstance(c, DeltaCache):
                c.conv, c.ssm = arrays[f"{role}.{i}.conv"], arrays[f"{role}.{i}.ssm"]
                c.offset = c.bound = n
                c.saved = [(0, None, None), (n, c.conv, c.ssm)]
                continue
            room = c.room(n)  # (its floor: what the caller expects it to hold)
            k, v = arrays[f"{role}.{i}.keys"], arrays[f"{role}.{i}.values"]
            if isinstance(c, WindowKVCache):
                c.hold(k, v, n - k.shape[2])
            elif isinstance(c, QuantizedBufferKVCache):
                c.keys, c.values = (tuple(padded(a, room) for a in parts) for parts in (k, v))
            else:
                c.keys, c.values = padded(k, room), padded(v, room)
            c.set_length(n)
    if isinstance(cache.target, HybridCache):  # where a re-read of a cut-back state starts
        cache.target.log = [(0, mx.array(tokens, mx.int32), True)]  # (re-read as a prompt)
    mx.eval(cache.arrays())
    cache.tokens = list(tokens)
    cache.reply_from = reply_from
    cache.settle()


def load_prompt_cache(
    path: str | Path,
    model,
    draft: DFlashDraft,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> tuple[PromptCache, dict[str, str]]:
    """A PromptCache for ``model`` and ``draft`` holding what ``path`` saved,
    and the file's metadata. A file made for another pair, or with other KV
    cache settings than ``kv_bits`` etc. (as for make_prompt_cache), is refused;
    so is a damaged one (edited metadata, a tensor missing or of another
    shape), each in one sentence."""
    cache = PromptCache(model, draft, kv_bits, kv_group_size, quantized_kv_start)
    return cache, read_prompt_cache(path, cache)
