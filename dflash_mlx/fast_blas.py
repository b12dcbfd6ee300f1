"""A fast BLAS under MLX's CPU backend on Linux.

MLX's Linux CPU wheel carries the reference BLAS, whose multi-row products
cost about rows times one row, so verifying a block never pays. The system's
OpenBLAS, opened with global symbols before ``mlx.core`` is imported, becomes
the BLAS MLX calls, as LD_PRELOAD would. ``DFLASH_MLX_BLAS`` names another
library, or ``off``.
"""

from __future__ import annotations

import os
import sys

OPENBLAS = ("libopenblas.so.0", "libopenblas.so", "libopenblasp.so.0", "libopenblaso.so.0")
SETTING = "DFLASH_MLX_BLAS"

loaded: str | None = None
why_not = "not tried"  # for `dflash-mlx doctor`


def load() -> str | None:
    """Open a fast BLAS for MLX if this process can still use one; returns its
    name. Tries once: a later call keeps the first call's answer and reason."""
    global loaded, why_not
    if loaded is not None or why_not != "not tried":
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
        except ImportError:
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
    """Whether MLX's CPU products run on a fast BLAS, loaded here or preloaded."""
    return loaded is not None or "blas" in os.environ.get("LD_PRELOAD", "").lower()


def describe() -> str:
    """One line for `dflash-mlx doctor`."""
    if loaded is not None:
        return f"{loaded} (opened by dflash_mlx for MLX's CPU products)"
    if active():
        return f"preloaded: {os.environ['LD_PRELOAD']}"
    return f"MLX's own ({why_not})"
