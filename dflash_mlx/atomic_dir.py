"""Putting a finished directory in place in one step: readers see the old
directory or the new one, never a half-written one. Work in progress lives
in ``.NAME.partial-PID-*`` beside the destination; what a killed process
left there is cleared by the next writer into the same parent."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:partial-(?P<pid>\d+)-.*|old-(?P<old_pid>\d+))$")


def file_in_the_way(path: Path) -> Path | None:
    """The file standing where a directory above ``path`` would have to be
    made (checked before slow work, so the writer fails at once), or None."""
    there = next(p for p in path.absolute().parents if p.exists())
    return None if there.is_dir() else there


def _runs(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_leftovers(parent: Path) -> None:
    """Remove the partial directories in ``parent`` of writers that no longer
    run; a destination set aside by a killed ``replace_dir`` is put back if
    nothing replaced it, so a kill never loses the old copy."""
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        m = _LEFTOVER.match(p.name)
        if not m or _runs(int(m["pid"] or m["old_pid"])):
            continue
        final = parent / m["name"]
        if m["old_pid"] and not (final.exists() or final.is_symlink()):
            os.rename(p, final)
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def partial_dir(final: Path) -> Path:
    """A new empty directory beside ``final`` to build it in, after clearing
    the leftovers of dead writers there."""
    remove_dead_leftovers(final.parent)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-{os.getpid()}-", dir=final.parent))


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
