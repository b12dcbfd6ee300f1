"""Putting a finished directory in place in one step: readers see the old
directory or the new one, never a half-written one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Move ``tmp`` to ``final``; an existing ``final`` is set aside, removed
    once the new one is in place, and put back if the move fails."""
    if not (final.exists() or final.is_symlink()):
        os.rename(tmp, final)
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()
