"""fast_blas.py: the API's first use (or ``use_fast_blas()``) opens a fast
BLAS for MLX's CPU products before MLX loads, or says why not; importing
dflash_mlx alone opens nothing. Each case runs in a fresh Python, since only
one that has not imported MLX yet can take it (this one has)."""

import ctypes.util
import json
import os
import subprocess
import sys

import numpy as np

REPORT = """
import json, sys
{first}
from dflash_mlx import fast_blas
import mlx.core as mx
a = mx.array({a}, mx.float32)
b = mx.array({b}, mx.float32)
print(json.dumps({{"loaded": fast_blas.loaded, "why_not": fast_blas.why_not, "active": fast_blas.active(),
                  "describe": fast_blas.describe(), "product": (a @ b).tolist()}}))
"""


def report(setting: str | None, first: str = "from dflash_mlx import load") -> dict:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(16, 48)).round(3), rng.normal(size=(48, 24)).round(3)
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_MLX_BLAS", "LD_PRELOAD")}
    if setting is not None:
        env["DFLASH_MLX_BLAS"] = setting
    code = REPORT.format(first=first, a=a.tolist(), b=b.tolist())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(np.array(result["product"]), a @ b, rtol=1e-4, atol=1e-4)
    return result


def test_the_named_library_is_opened_before_mlx_and_products_stay_right():
    libm = ctypes.util.find_library("m")  # any shared library shows the mechanism
    r = report(libm)
    assert r["loaded"] == libm and r["active"]
    assert libm in r["describe"]


def test_the_systems_openblas_is_opened_where_there_is_one():
    r = report(None)
    if r["loaded"] is None:  # this machine has none: it says how to get one
        assert "apt-get install libopenblas0" in r["why_not"] and not r["active"]
    else:
        assert "openblas" in r["loaded"] and r["active"]


def test_nothing_is_opened_once_mlx_is_imported():
    r = report(ctypes.util.find_library("m"), first="import mlx.core\nimport dflash_mlx\ndflash_mlx.use_fast_blas()")
    assert r["loaded"] is None and not r["active"]
    assert "before importing mlx" in r["why_not"] and "before importing mlx" in r["describe"]


def test_importing_the_package_opens_nothing_and_the_explicit_call_does():
    libm = ctypes.util.find_library("m")
    r = report(libm, first="import dflash_mlx")
    assert r["loaded"] is None and r["why_not"] == "not tried"
    r = report(libm, first="import dflash_mlx\ndflash_mlx.use_fast_blas()")
    assert r["loaded"] == libm


def test_off_opens_nothing_and_a_missing_library_is_named():
    r = report("off")
    assert r["loaded"] is None and r["why_not"] == "DFLASH_MLX_BLAS=off"
    r = report("/nowhere/libnoblas.so")
    assert r["loaded"] is None and not r["active"]
    assert "/nowhere/libnoblas.so (from DFLASH_MLX_BLAS) could not be opened" in r["why_not"]
