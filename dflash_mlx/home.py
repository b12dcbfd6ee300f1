"""Where dflash-mlx keeps what it learns on a machine: ``$DFLASH_MLX_HOME``,
``~/.cache/dflash-mlx`` by default; ``DFLASH_MLX_AUTO_MEMORY=off`` writes nothing there."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("DFLASH_MLX_HOME") or Path.home() / ".cache" / "dflash-mlx").expanduser()


def remembers() -> bool:
    """Whether what is learned is written to ``home()`` for later processes."""
    return os.environ.get("DFLASH_MLX_AUTO_MEMORY", "1").strip().lower() not in ("0", "false", "no", "off")


def write_json(path: Path, state: dict) -> bool:
    """Write ``state`` whole or not at all; False where the file system refused."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            temporary = Path(f.name)
            json.dump(state, f)
        os.replace(temporary, path)
        return True
    except OSError:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        return False
