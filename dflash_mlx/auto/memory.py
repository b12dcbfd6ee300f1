"""What ``block_size="auto"`` learned, kept from one process to the next in
``$DFLASH_MLX_HOME/auto/<key>.json`` (``~/.cache/dflash-mlx`` by default),
keyed by the pair, dtype, block range and machine; ``DFLASH_MLX_AUTO_MEMORY=0``
turns it off. Memory only costs or saves speed: I/O errors are ignored."""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import compute_dtype, fast_blas
from ..device import device_name
from ..home import home, remembers, write_json
from .chooser import BlockChooser, chooser_for

PRIOR_CYCLES = 64  # the most cycles of acceptance a remembered chooser starts with
VERSION = 1  # of the file's layout; another one is ignored


def chooser(target, draft, lo: int, hi: int, trees: bool = False) -> BlockChooser:
    """The process's chooser, started from an earlier process's when new."""
    found = chooser_for(draft, lo, hi, trees)
    if found.memory_path is None and remembers():
        found.memory_path = home() / "auto" / f"{fingerprint(target, draft, lo, hi, trees)}.json"
        if found.cycles == 0:
            state = _read(found.memory_path)
            if state is not None:
                found.restore(state, PRIOR_CYCLES)
    return found


def remembered(steps: Iterator, chooser: BlockChooser) -> Iterator:
    """``steps``, with ``chooser``'s state written when they end or are closed."""
    try:
        yield from steps
    finally:
        if chooser.memory_path is not None and chooser.cycles:
            _write(chooser.memory_path, chooser.state())


def fingerprint(target, draft, lo: int, hi: int, trees: bool = False) -> str:
    device = mx.default_device()
    name = device_name()
    parts = {
        "draft": _config(draft.config),
        "target": _config(getattr(target.model, "args", None)),
        "weights": [_sample(draft), _sample(target.model)],
        "range": [lo, hi],
        "machine": [mx.__version__, str(device), name, platform.machine(), fast_blas.active()],
        "dtype": str(compute_dtype.computing(target.model)),
    }
    if trees:  # a tree chooser's sizes are rows (blocks' files keep their names)
        parts["trees"] = True
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _config(config) -> str:
    fields = getattr(config, "__dict__", None)
    return json.dumps(fields, sort_keys=True, default=str) if fields is not None else repr(config)


def _sample(model) -> list[float]:
    """The first values of the first weight, so a fine-tune gets its own key."""
    leaves = tree_flatten(model.parameters())
    if not leaves:
        return []
    return [round(float(x), 6) for x in leaves[0][1].reshape(-1)[:16].astype(mx.float32).tolist()]


def _read(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        return None
    return state


def _write(path: Path, state: dict) -> None:
    write_json(path, {"version": VERSION, **state})
