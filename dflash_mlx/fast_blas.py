"""A fast BLAS under MLX's CPU backend on Linux.

MLX's Linux CPU wheel carries the reference BLAS, whose float32 matrix
products cost about rows times a one-row product: verifying a block of 16
tokens then costs many plain steps, and no block pays (BENCHMARKS.md). The
system's OpenBLAS, where installed (Debian/Ubuntu: libopenblas0), takes 16
rows at about twice one row. Opened with its symbols global before MLX's
library is, it is the BLAS that MLX's products call, as LD_PRELOAD would
make it.

That only works before ``mlx.core`` is imported: the CLI calls ``load``
before any command runs, and the package's first lazy export (``load``,
``generate``, ...) calls it before importing MLX; ``import dflash_mlx``
alone opens nothing. ``DFLASH_MLX_BLAS`` names another library to open
instead, or ``off``.
"""

from __future__ import annotations

import os
import sys

# Sonames the dynamic loader finds in its usual directories (ld.so.cache).
OPENBLAS = ("libopenblas.so.0", "libopenblas.so", "libopenblasp.so.0", "libopenblaso.so.0")
SETTING = "DFLASH_MLX_BLAS"

loaded: str | None = None  # the library opened, if any
why_not = "not tried"  # why none was, for `dflash-mlx doctor`


def load() -> str | None:
    """Open a fast BLAS for MLX if this process can still use one; returns its name."""
    global loaded, why_not
    if loaded is not None:
        return loaded
    setting = os.environ.get(SETTING, "").strip()
    if not sys.platform.startswith("linux"):
        why_not = "only MLX's Linux CPU wheel needs one (macOS has Accelerate)"
    elif setting.lower() == "off":
        why_not = f"{SETTING}=off"
    elif "mlx.core" in sys.modules:
        why_not = "mlx was imported first; call dflash_mlx.use_fast_blas() before importing mlx"
    else:
        try:
            import ctypes
        except ImportError:  # a Python built without ctypes: MLX's own BLAS, never an import error
            why_not = "this Python has no ctypes"
            return None
        names = (setting,) if setting else OPENBLAS
        for name in names:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded = name
            return loaded
        why_not = (
            f"{setting} (from {SETTING}) could not be opened"
            if setting
            else "no OpenBLAS on this system (Debian/Ubuntu: apt-get install libopenblas0)"
        )
    return None


def active() -> bool:
    """Whether MLX's CPU products run on a fast BLAS: one loaded here, or
    one the user preloaded."""
    return loaded is not None or "blas" in os.environ.get("LD_PRELOAD", "").lower()


def describe() -> str:
    """One line for `dflash-mlx doctor`."""
    if loaded is not None:
        return f"{loaded} (opened by dflash_mlx for MLX's CPU products)"
    if active():
        return f"preloaded: {os.environ['LD_PRELOAD']}"
    return f"MLX's own ({why_not})"
