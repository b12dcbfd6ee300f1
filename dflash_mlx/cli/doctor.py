"""`dflash-mlx doctor`: what this machine is, whether the attention kernels
check out on it, and how fast DFlash decodes here next to plain decoding."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time
import traceback
from importlib import metadata
from typing import Annotated

import typer
from rich.console import Console

from .console import UserError, user_errors

EXAMPLES = """\
Examples:

$ dflash-mlx doctor

$ dflash-mlx doctor --seconds 5      # a shorter decoding probe

$ dflash-mlx doctor --seconds 0      # machine and kernel checks only

$ dflash-mlx doctor --recheck        # run every kernel check again, not trusting earlier passes
"""

PROMPT = "def fibonacci(n):"
PROBE_TOKENS = 128  # a run's reply, as benchmarks/bench_builtin.py's; runs repeat until the time is spent


def doctor_command(
    seconds: Annotated[
        float,
        typer.Option(
            "--seconds",
            help=f"Time for the decoding probe: runs of {PROBE_TOKENS} tokens, plain decoding "
            "and DFlash in turn, after one untimed run of each; 0 skips it.",
        ),
    ] = 30.0,
    recheck: Annotated[
        bool,
        typer.Option(
            "--recheck",
            help="Forget the kernel checks this machine passed before and run every one again "
            "(later processes then trust these results).",
        ),
    ] = False,
):
    """Check this machine: MLX backend, kernel self-checks, a decoding probe.

    Run it first when DFlash is slow or wrong here, and paste the block it
    ends with into the bug report.
    """
    with user_errors():
        if not 0 <= seconds < math.inf:
            raise UserError(f"--seconds must be a finite number, 0 or more (0 skips the probe), got {seconds:g}.")
        if recheck:
            forget_kept_checks()
    out = Console(highlight=False)
    report: list[tuple[str, str]] = []

    def line(key: str, value: str, style: str = "") -> None:
        report.append((key, value))
        out.print(f"  {key:<22} " + (f"[{style}]{value}[/]" if style else value), soft_wrap=True)

    out.print("[bold]machine[/]")
    for key, value in machine():
        line(key, value)

    out.print("\n[bold]block-attention kernels[/]")
    kernels(line, out.print, recheck)

    out.print("\n[bold]matrix products[/] (a verify multiplies a block of rows; one row is a plain step)")
    products(line)

    out.print("\n[bold]decoding probe[/] (built-in pair, greedy)")
    if seconds > 0:
        probe(line, seconds)
    else:
        line("probe", "skipped (--seconds 0)")

    out.print("\n[bold]Paste this into a bug report:[/]")
    width = max(len(k) for k, _ in report)
    block = "\n".join(f"{k:<{width}}  {v}" for k, v in report)
    out.print("```\n" + block + "\n```", markup=False, soft_wrap=True)


def machine() -> list[tuple[str, str]]:
    import mlx.core as mx

    from dflash_mlx import __version__
    from dflash_mlx.device import device_info
    from dflash_mlx.kernels import backend

    info = device_info()
    rows = [
        ("dflash-mlx", __version__),
        ("os", f"{platform.system()} {platform.release()} ({platform.machine()})"),
        ("python", platform.python_version()),
        ("mlx", _version("mlx", mx.__version__)),
        ("mlx-lm", _version("mlx-lm")),
        ("backend", f"{backend()} (default device {mx.default_device()})"),
        ("chip", str(info.get("device_name") or _cpu_name())),
    ]
    mem = info.get("memory_size") or info.get("total_memory") or _ram_bytes()
    if mem:
        rows.append(("memory", f"{mem / 2**30:.1f} GiB"))
    if info.get("max_recommended_working_set_size"):
        rows.append(("gpu working set", f"{info['max_recommended_working_set_size'] / 2**30:.1f} GiB"))
    return rows


# What a first run on a machine pays before the check lines come, per backend.
COLD_BUILDS = {"cuda": "; a machine's first run compiles them, which takes minutes on CUDA"}


def forget_kept_checks() -> None:
    """Forget the kernel checks this machine passed before (--recheck)."""
    from dflash_mlx.kernels import passed_checks

    try:
        passed_checks.forget()
    except OSError as e:
        raise UserError(
            f"cannot forget the kernel checks kept in {passed_checks.path_here()} ({e.strerror}); "
            "remove that file by hand or set DFLASH_MLX_HOME to a writable folder."
        ) from None


def kernels(line, note, recheck: bool = False) -> None:
    """A line per kernel variant's self-check, each as it completes (a pass
    an earlier process kept here says so; with ``recheck``, forgotten before);
    ``note`` prints to the console only (not the paste block)."""
    from dflash_mlx.kernels import backend, passed_checks, self_check_all

    where = backend()
    if where == "cpu":
        line("kernels", "none: on the CPU every attention takes mx.fast.scaled_dot_product_attention")
        return
    kept = passed_checks.current().path
    note(f"  (each variant is built and checked in turn{COLD_BUILDS.get(where, '')})")
    if kept is not None and not recheck:
        note(f"  (a variant an earlier process passed here is taken from {kept} unchecked: --recheck checks it)")

    def attention_line(r) -> None:
        check_line(line, f"check {r.dtype} d{r.head_dim}{' win' if r.window else ''}", r, "fused op used")

    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the lines say the same, once per case
            results = self_check_all(report=attention_line)
    except Exception as e:  # doctor reports, it does not crash
        line("self-check", f"could not run: {type(e).__name__}: {e}", "red")
        return
    results += small_kernel_checks(line)
    results += quantized_checks(line)
    failed = sum(not r.ok for r in results)
    remembered = sum(passed_checks.recalled(r) for r in results)
    earlier = f" ({remembered} remembered from earlier checks here)" if remembered else ""
    line(
        "kernel checks",
        f"{len(results) - failed} of {len(results)} passed{earlier}",
        "green" if not failed else "red",
    )
    decided(line)


def decided(line) -> None:
    """This machine's measured decisions, kernel against MLX's own path (ms per
    call), a line each; the verify's common case (bf16, head dim 128) is
    measured first where it never was."""
    import mlx.core as mx

    from dflash_mlx.kernels import decisions, dispatch, exact_attention, exact_products, quantized_gather  # noqa: F401

    store = decisions.current()
    where = f"in {store.path}" if store.path is not None else "in memory only (DFLASH_MLX_AUTO_MEMORY=off)"
    policy = "exact" if store.exact_everywhere else store.policy
    first = ", exactness first here" if store.exact_first(dispatch.backend()) else ""
    line("decisions", f"policy {policy} (DFLASH_MLX_KERNELS){first}, kept {where}")
    try:
        dispatch.measure(dispatch.backend(), mx.bfloat16, 128, None)
    except Exception as e:  # doctor reports, it does not crash
        line("measuring", f"failed: {type(e).__name__}: {e}", "red")
    from dflash_mlx.draft.precision import DECISION as DRAFT_PRECISION
    from dflash_mlx.targets.recurrent import ROLLBACK_DECISION

    # the strategies' two sides; a kernel's other side is MLX's own path
    sides = {ROLLBACK_DECISION: ("replay", "per-step"), DRAFT_PRECISION: ("quantized", "as stored")}
    exact_first = store.exact_first(dispatch.backend())
    for d in store.all():
        ours, theirs = sides.get(d.kernel, ("kernel", "MLX"))
        verdict = ours if d.faster else ("MLX's own" if theirs == "MLX" else theirs)
        if exact_first and d.kernel in decisions.EXACT_KERNELS:  # it serves whatever its time
            verdict = f"kernel, exactness first ({d.ours / max(d.mlx, 1e-12):.1f}x MLX's time)"
        line(
            f"{d.kernel} {d.case}",
            f"{ours} {d.ours * 1e3:.3f} ms, {theirs} {d.mlx * 1e3:.3f} ms: {verdict}",
            "green" if d.faster else "",
        )


def quantized_checks(line) -> list:
    """The quantized verify products' checks (Metal, CUDA), dense at a Qwen3-8B
    4-bit layer's K and experts at a Qwen3-30B-A3B expert's, affine 4 and 8
    bits and mxfp4, a line each; their results."""
    import warnings

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from dflash_mlx.kernels import quantized, quantized_gather

    if quantized.backend() not in quantized.BUILDERS:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the lines say it)
            for bits, group, mode in ((4, 64, "affine"), (8, 64, "affine"), (4, 32, "mxfp4")):
                layer = nn.QuantizedLinear(4096, 4096, bias=False, group_size=group, bits=bits, mode=mode)
                layer.set_dtype(mx.bfloat16)
                quantized.prepare(layer, mx.bfloat16)
                experts = QuantizedSwitchLinear(2048, 768, 8, bias=False, group_size=group, bits=bits, mode=mode)
                experts.set_dtype(mx.bfloat16)
                quantized_gather.prepare(experts, mx.bfloat16)
        dense, gathered = quantized.self_check_all(), quantized_gather.self_check_all()
    except Exception as e:  # doctor reports, it does not crash
        line("self-check", f"could not run: {type(e).__name__}: {e}", "red")
        return []
    for r in dense:
        check_line(line, f"check quantized {r.variant.case}", r, "MLX's quantized_matmul used")
    for r in gathered:
        check_line(line, f"check quantized experts {r.variant.case}", r, "MLX's gather_qmm used")
    return dense + gathered


def check_line(line, name: str, result, fallback: str) -> None:
    """A kernel check's line: ok (remembered: an earlier process's pass here),
    or FAILED naming what runs instead."""
    from dflash_mlx.kernels import passed_checks

    if not result.ok:
        verdict = f"FAILED ({fallback}), "
    else:
        verdict = "ok (remembered), " if passed_checks.recalled(result) else "ok, "
    line(name, verdict + result.detail, "green" if result.ok else "red")


def small_kernel_checks(line) -> list:
    """The q/k norm + RoPE kernel's checks (Metal, CUDA), the block-product
    kernel's (CUDA), the gated delta-net recurrence's and the exact verify
    attention's, a line each; their results."""
    import warnings

    from dflash_mlx.kernels import exact_attention, gated_delta, norm_rope
    from dflash_mlx.kernels.cuda import products as block_products

    results = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the lines below say it)
            for label, module, fallback in (
                ("norm+rope", norm_rope, "MLX's rms_norm and rope used"),
                ("products", block_products, "MLX's products used"),
                ("gated delta", gated_delta, "mlx-lm's recurrence used"),
                ("exact attention", exact_attention, "MLX's attention used"),
            ):

                def small_line(r, label=label, fallback=fallback) -> None:
                    check_line(
                        line, f"check {label} {r.dtype}" + (f" d{r.head_dim}" if r.head_dim else ""), r, fallback
                    )

                results += module.self_check_all(report=small_line)
    except Exception as e:  # doctor reports, it does not crash
        line("self-check", f"could not run: {type(e).__name__}: {e}", "red")
    return results


# Above this, 16 rows cost so many plain steps that no drafter can win.
SLOW_ROWS = 4.0


def products(line) -> None:
    """Which BLAS MLX's CPU products run on, and how a 16-row matrix product
    costs against a 1-row one, per dtype: a verify's cost against a plain
    step's. On a CPU whose BLAS does not amortize rows (MLX's Linux wheel
    ships the reference BLAS), say what helps."""
    from dflash_mlx import fast_blas
    from dflash_mlx.kernels import backend

    line("BLAS", fast_blas.describe(), "" if fast_blas.active() or not sys.platform.startswith("linux") else "yellow")
    try:
        ratios = {name: product_scaling(name) for name in ("bfloat16", "float32")}
    except Exception as e:  # doctor reports, it does not crash
        line("16 rows / 1 row", f"could not run: {type(e).__name__}: {e}", "red")
        return
    slow = min(ratios.values()) > SLOW_ROWS
    line(
        "16 rows / 1 row",
        ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()) + " (1024 x 1024)",
        "yellow" if slow else "",
    )
    if backend() != "cpu":
        return
    if slow:
        hint = (
            "a verify of 16 tokens costs many plain steps here, so DFlash runs slower than plain decoding "
            "on this CPU; use a GPU (Apple silicon) for speed"
        )
        if sys.platform.startswith("linux"):
            hint += (
                "; on Linux, MLX's CPU wheel uses the reference BLAS: install OpenBLAS (Debian/Ubuntu: "
                "apt-get install libopenblas0), which dflash_mlx then opens for MLX and computes in float32"
            )
        line("hint", hint, "yellow")
    elif fast_blas.active():
        line(
            "dtype",
            "auto: float32 on this CPU (its products reach the fast BLAS; --dtype with the checkpoint's "
            "own dtype, e.g. bfloat16, computes in that instead)",
        )


def product_scaling(dtype: str, n: int = 1024, reps: int = 10) -> float:
    """Seconds of a [16, n] x [n, n] product over a [1, n] x [n, n] one."""
    import mlx.core as mx

    w = mx.random.normal((n, n)).astype(getattr(mx, dtype))
    rows = {b: mx.random.normal((b, n)).astype(w.dtype) for b in (1, 16)}
    mx.eval(w, rows)

    def seconds(x):
        mx.eval(x @ w)
        tic = time.perf_counter()
        for _ in range(reps):
            mx.eval(x @ w)
        return time.perf_counter() - tic

    return seconds(rows[16]) / seconds(rows[1])


def probe(line, seconds: float) -> None:
    """Plain decoding and DFlash (its default, ``auto`` block) on the
    built-in pair: one untimed run of each first (a fresh process builds its
    kernels and graphs there, as a server's first request does), then runs
    of PROBE_TOKENS tokens of each in turn until ``seconds`` have passed,
    so that both are timed over the same lengths, and neither by the one-off
    builds of lengths the other did not reach."""
    try:
        import mlx_lm

        from dflash_mlx import load, stream_generate

        model, draft, tokenizer = load("builtin")
        runs = {
            "plain": lambda: mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=PROBE_TOKENS),
            "dflash": lambda: stream_generate(model, draft, tokenizer, PROMPT, max_tokens=PROBE_TOKENS),
        }
        for run in runs.values():
            _last(run())
        tokens, spent = {name: 0 for name in runs}, {name: 0.0 for name in runs}
        drafted = committed = 0  # DFlash's drafting cycles and the tokens they committed
        tic = time.perf_counter()
        while True:
            for name, run in runs.items():
                n, took, last = _timed(run())
                tokens[name] += n
                spent[name] += took
                if name == "dflash":
                    cycles = last.cycles - last.plain_cycles
                    drafted += cycles
                    committed += last.acceptance_length * cycles
            if time.perf_counter() - tic >= seconds:
                break
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        line("probe", f"failed: {type(e).__name__}: {e} ({where.filename}:{where.lineno} in {where.name})", "red")
        return
    rate = {name: tokens[name] / max(spent[name], 1e-9) for name in runs}
    line("plain decoding", f"{rate['plain']:.1f} tok/s ({tokens['plain']} tokens)")
    line(
        "dflash",
        f"{rate['dflash']:.1f} tok/s ({tokens['dflash']} tokens, acceptance length "
        f"{committed / max(drafted, 1):.2f}, block auto up to {draft.config.block_size})",
    )
    ratio = rate["dflash"] / max(rate["plain"], 1e-9)
    line("dflash / plain", f"{ratio:.2f}x", "green" if ratio >= 1 else "yellow")


def _last(responses):
    """The last response from a stream."""
    return _timed(responses)[2]


def _timed(responses):
    """(tokens after the first, the seconds they took, the last response) of
    a stream, on one clock for both libraries (the first token's time is the
    prompt's)."""
    first = last = None
    count = 0
    for last in responses:
        count += len(last.tokens) if hasattr(last, "tokens") else 1  # (ours: a cycle's; mlx-lm's: one)
        if first is None:
            first, count = time.perf_counter(), 0
    if last is None:
        raise RuntimeError("the generator produced nothing")
    return count, time.perf_counter() - first, last


def _version(dist: str, fallback: str | None = None) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return fallback or "not installed"


def _cpu_name() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except Exception:
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for row in f:
                if row.startswith("model name"):
                    return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
