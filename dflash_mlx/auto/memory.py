"""What ``block_size="auto"`` learned, kept from one process to the next.

A chooser (block_size.py) starts knowing nothing: its first cycles probe the
block range and a plain step, and plain steps may win only after EVIDENCE
drafting cycles. A process that decodes one reply (``dflash-mlx generate``)
or the first request of a ``chat`` or ``serve`` pays that every time: on a
machine where no block pays (a CPU), a block of 16 costs about ten plain
steps, so the probes alone cost tens of tokens' time.

So at the end of each decode the chooser's state is written to a small JSON
file per pair and machine, and the first chooser a process makes for that
pair starts from it:

- the acceptance counts by draft position, scaled down to at most
  PRIOR_CYCLES cycles so that the new text soon outweighs the old;
- each block size's median cycle time, as one measurement the new ones
  outvote after two cycles (costs move with the context and the machine's load);
- sizes with a remembered time are not probed again; a time is passed on
  unmeasured for at most MEMORY_AGE processes (BlockChooser), then left out,
  so that one taken at a bad moment (a busy machine) is measured anew where
  it would otherwise make its size look too dear ever to explore.

Which block runs never changes the output (sampling.py), so a stale or
foreign memory can cost speed for a few cycles, never correctness.

The file: ``$DFLASH_MLX_HOME/auto/<key>.json`` (``DFLASH_MLX_HOME`` defaults to
``~/.cache/dflash-mlx``), the key a hash of the pair (both configs and a sample
of both models' weights), the dtype it computes in, the block range, and the
machine (MLX's version, backend, device, and whether a fast BLAS is in use).
``DFLASH_MLX_AUTO_MEMORY=0`` turns it off. A file that cannot be read is
ignored and written afresh; one that cannot be written is skipped: memory is
an optimisation, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import compute_dtype, fast_blas
from .chooser import BlockChooser, chooser_for

PRIOR_CYCLES = 64  # the most cycles of acceptance a remembered chooser starts with
VERSION = 1  # of the file's layout; another one is ignored


def enabled() -> bool:
    return os.environ.get("DFLASH_MLX_AUTO_MEMORY", "1").strip().lower() not in ("0", "false", "no", "off")


def home() -> Path:
    return Path(os.environ.get("DFLASH_MLX_HOME") or Path.home() / ".cache" / "dflash-mlx").expanduser()


def chooser(target, draft, lo: int, hi: int) -> BlockChooser:
    """The process's chooser for this pair and range (block_size.chooser_for),
    started from what an earlier process learned when it is new."""
    found = chooser_for(draft, lo, hi)
    if found.memory_path is None and enabled():
        found.memory_path = home() / "auto" / f"{fingerprint(target, draft, lo, hi)}.json"
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


def fingerprint(target, draft, lo: int, hi: int) -> str:
    """A short hash of the pair, the block range and the machine."""
    device = mx.default_device()
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # not every backend describes its device
        name = ""
    parts = {
        "draft": _config(draft.config),
        "target": _config(getattr(target.model, "args", None)),
        "weights": [_sample(draft), _sample(target.model)],
        "range": [lo, hi],
        "machine": [mx.__version__, str(device), name, platform.machine(), fast_blas.active()],
        "dtype": str(compute_dtype.computing(target.model)),  # (costs differ by dtype on a CPU)
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _config(config) -> str:
    fields = getattr(config, "__dict__", None)
    return json.dumps(fields, sort_keys=True, default=str) if fields is not None else repr(config)


def _sample(model) -> list[float]:
    """The first values of a model's first weight: two pairs of one shape but
    different weights (a fine-tune) get different keys."""
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
    """Write ``state`` whole or not at all (a temporary file renamed over the old one)."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            temporary = Path(f.name)
            json.dump({"version": VERSION, **state}, f)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
