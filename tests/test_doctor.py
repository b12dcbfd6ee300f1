"""`dflash-mlx doctor` through the registered app: machine, kernel checks,
a short probe, and the block for a bug report."""

import re

import mlx.core as mx
from typer.testing import CliRunner

from dflash_mlx.cli import doctor
from dflash_mlx.cli.app import app
from dflash_mlx.kernels import dispatch


def run(*args):
    result = CliRunner().invoke(app, ["doctor", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_doctor_reports_machine_kernels_probe_and_a_paste_block():
    out = run("--seconds", "1")
    for key in ("dflash-mlx", "os", "python", "mlx", "mlx-lm", "backend", "chip", "memory"):
        assert re.search(rf"^  {re.escape(key)} +\S", out, re.M), key
    assert f"  mlx                    {mx.__version__}" in out
    assert "backend                cpu" in out
    assert "none: on the CPU every attention takes mx.fast.scaled_dot_product_attention" in out
    plain = re.search(r"plain decoding +([\d.]+) tok/s \((\d+) tokens\)", out)
    dflash = re.search(r"dflash +([\d.]+) tok/s \((\d+) tokens, acceptance length ([\d.]+), block auto up to 16\)", out)
    assert plain and dflash and float(plain[1]) > 0 and float(dflash[1]) > 0 and float(dflash[3]) >= 1
    assert int(plain[2]) > 0 and int(dflash[2]) > 0
    assert re.search(r"dflash / plain +[\d.]+x", out)
    assert re.search(r"16 rows / 1 row +bfloat16 [\d.]+x, float32 [\d.]+x", out)
    paste = out.split("Paste this into a bug report:")[1]
    block = paste.split("```")[1]
    assert "mlx-lm" in block and "plain decoding" in block and "dflash / plain" in block


def on_fake_gpu(monkeypatch, attention_kernel):
    """Doctor as if on a GPU backend named 'fake' whose block-attention
    kernel is ``attention_kernel``, measuring two shape classes whose times
    are given: the kernel wins the longer one."""
    from dflash_mlx.kernels import decisions

    dispatch.reset()
    monkeypatch.setattr(dispatch, "backend", lambda: "fake")
    monkeypatch.setattr("dflash_mlx.kernels.backend", lambda: "fake")
    monkeypatch.setitem(dispatch.BUILDERS, "fake", lambda where: attention_kernel)
    monkeypatch.setattr(dispatch, "ROW_CLASSES", (16,))
    monkeypatch.setattr(dispatch, "KEY_CLASSES", (256, 1024))
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
    decisions.reset()
    times = iter([(0.0006, 0.0005), (0.00025, 0.0005)])
    monkeypatch.setattr(decisions, "seconds_per_call", lambda ours, theirs: next(times))


def test_doctor_without_probe_lists_every_kernel_check(monkeypatch):
    """On a GPU backend each (dtype, head dim, window) variant gets a line; a
    failed one says the fused op is used. Simulated here with a kernel that
    fails the float32 checks."""
    from test_kernels import two_pass

    def fake(q, k, v, **kw):
        out = two_pass(q, k, v, **kw)
        return out + 1 if q.dtype == mx.float32 else out

    on_fake_gpu(monkeypatch, fake)
    try:
        out = run("--seconds", "0")
    finally:
        dispatch.reset()
    checks = re.findall(r"^  check (\w+) d(\d+)( win)? +(ok|FAILED)", out, re.M)
    assert len(checks) == 18  # 3 dtypes x 3 head dims x (full, window)
    assert all((status == "FAILED") == (dtype == "float32") for dtype, _, _, status in checks)
    assert "FAILED (fused op used), max relative error" in out
    assert "kernel checks          12 of 18 passed" in out
    assert "decisions              policy measure (DFLASH_MLX_KERNELS), kept in " in out
    measured = re.findall(r"^  block attention bfloat16 d128 full (rows<=16 keys<=\d+) +(kernel .*)$", out, re.M)
    assert measured == [
        ("rows<=16 keys<=256", "kernel 0.600 ms, MLX 0.500 ms: MLX's own"),
        ("rows<=16 keys<=1024", "kernel 0.250 ms, MLX 0.500 ms: kernel"),
    ]
    assert "probe                  skipped (--seconds 0)" in out


def test_doctor_names_the_exact_policy_and_where_exactness_comes_first(monkeypatch):
    from dflash_mlx.kernels import decisions

    on_fake_gpu(monkeypatch, lambda q, k, v, **kw: mx.zeros(q.shape, q.dtype))
    try:
        monkeypatch.setenv("DFLASH_MLX_KERNELS", "exact")
        decisions.reset()
        exact = run("--seconds", "0")
        monkeypatch.setenv("DFLASH_MLX_KERNELS", "measure")
        decisions.reset()
        measure = run("--seconds", "0")
    finally:
        dispatch.reset()
        decisions.reset()
    assert "policy exact (DFLASH_MLX_KERNELS), exactness first here, kept " in exact
    assert "policy measure (DFLASH_MLX_KERNELS), kept " in measure  # ('fake' is no Mac)


def test_doctor_says_an_exact_kernel_serves_whatever_its_time_where_exactness_comes_first(monkeypatch):
    """An exact verify kernel measured slower than MLX's product still serves
    where exactness comes first: doctor says so, with what it costs."""
    from dflash_mlx.kernels import decisions

    on_fake_gpu(monkeypatch, lambda q, k, v, **kw: mx.zeros(q.shape, q.dtype))
    case = "bfloat16 K=4096 lanes 32 x 4 N=4096 rows=16"
    lines = {}
    try:
        for policy in ("exact", "measure"):
            monkeypatch.setenv("DFLASH_MLX_KERNELS", policy)
            decisions.reset()
            decisions.current().record(decisions.Decision("dense verify", case, 0.002, 0.001))
            lines[policy] = re.findall(rf"^  dense verify {case} +(.*)$", run("--seconds", "0"), re.M)
    finally:
        dispatch.reset()
        decisions.reset()
    assert lines["exact"] == ["kernel 2.000 ms, MLX 1.000 ms: kernel, exactness first (2.0x MLX's time)"]
    assert lines["measure"] == ["kernel 2.000 ms, MLX 1.000 ms: MLX's own"]  # ('fake' is no Mac)


def test_doctor_says_when_row_costs_rule_dflash_out(monkeypatch):
    """A CPU whose 16-row products cost many 1-row ones gets a hint naming
    the cause and the fix; one that amortizes rows gets none."""
    monkeypatch.setattr(doctor, "product_scaling", lambda dtype: {"bfloat16": 8.0, "float32": 12.0}[dtype])
    out = run("--seconds", "0")
    assert "16 rows / 1 row        bfloat16 8.0x, float32 12.0x" in out
    assert "DFlash runs slower than plain decoding on this CPU" in out
    assert "apt-get install libopenblas0" in out and "reference BLAS" in out
    assert "BLAS                   MLX's own (DFLASH_MLX_BLAS=off)" in out
    monkeypatch.setattr(doctor, "product_scaling", lambda dtype: {"bfloat16": 8.0, "float32": 1.5}[dtype])
    out = run("--seconds", "0")
    assert "float32 1.5x" in out and "hint" not in out and "dtype" not in out


def test_doctor_names_the_blas_it_opened_and_the_dtype_that_follows(monkeypatch):
    from dflash_mlx import fast_blas

    monkeypatch.setattr(fast_blas, "loaded", "libopenblas.so.0")
    monkeypatch.setattr(doctor, "product_scaling", lambda dtype: {"bfloat16": 7.0, "float32": 1.5}[dtype])
    out = run("--seconds", "0")
    assert "BLAS                   libopenblas.so.0 (opened by dflash_mlx for MLX's CPU products)" in out
    assert "auto: float32 on this CPU" in out and "hint" not in out


def test_doctor_lists_the_block_product_kernels_checks(monkeypatch):
    """On CUDA the block-product kernel's check gets a line per dtype; a
    failed one says MLX's products are used, and counts in the total."""
    from test_block_products import kernel_arithmetic, norm_arithmetic, swiglu_arithmetic
    from test_kernels import two_pass

    from dflash_mlx.kernels.cuda import products as bp
    from dflash_mlx.layers import linear

    def products(x, w, b=None, r=None, heads=False, swiglu=False, norm=None):
        if norm is not None:
            x = norm_arithmetic(x, norm)
        if swiglu:
            return swiglu_arithmetic(x, w)
        if heads:
            x = x.transpose(0, 2, 1, 3).reshape(1, x.shape[2], -1)
        out = kernel_arithmetic(x, w, b, r)
        return out + 1 if x.dtype == mx.float16 else out

    bp.reset()
    on_fake_gpu(monkeypatch, two_pass)
    monkeypatch.setattr(bp, "backend", lambda: "fake")
    monkeypatch.setattr(linear, "backend", lambda: "fake")
    monkeypatch.setitem(bp.BUILDERS, "fake", lambda where: products)
    try:
        out = run("--seconds", "0")
    finally:
        dispatch.reset()
        bp.reset()
    assert re.search(r"^  check products bfloat16 +ok, max relative error", out, re.M)
    assert re.search(r"^  check products float16 +FAILED \(MLX's products used\), max relative error", out, re.M)
    # the SwiGLU epilogue is checked where the products passed
    assert re.search(r"^  check products bfloat16 \+ SwiGLU +ok, max relative error", out, re.M)
    assert "float16 + SwiGLU" not in out.replace("bfloat16 + SwiGLU", "")
    # and the RMSNorm prologue
    assert re.search(r"^  check products bfloat16 \+ RMSNorm +ok, max relative error", out, re.M)
    assert "float16 + RMSNorm" not in out.replace("bfloat16 + RMSNorm", "")
    from dflash_mlx.kernels.ops import DTYPES, HEAD_DIMS

    # attention (full, window), then products, then bfloat16's SwiGLU epilogue and RMSNorm prologue
    total = len(DTYPES) * len(HEAD_DIMS) * 2 + len(bp.DTYPES) + 2
    assert f"kernel checks          {total - 1} of {total} passed" in out
