"""Choose the kernel or the fused op per call; check each kernel variant once.

A kernel variant (backend, dtype, head dim, window kind) is used only after it
has matched the portable ops path on a small random case in this process. A
build error or a mismatch sends that variant to the ops path for good, with
one warning naming the case. After the check nothing here reads the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import mlx.core as mx

from ..device import backend
from .attention import BlockAttentionKernel
from .ops import DTYPES, HEAD_DIMS, check_inputs, ops_attention

# When the kernel beats the fused op (mx.fast.scaled_dot_product_attention with
# the position mask that a fixed buffer needs), by query rows per key-value head
# (GQA group x block rows): (most rows, fewest keys, None: never). The first entry
# whose rows cover the call decides; keys are the buffer's, or kv_length when it is
# a Python int. Measured on an NVIDIA H200 (MLX 0.32.4 CUDA), device time of 36
# calls over distinct buffers (benchmarks/gpu_time.py attention), kernel / fused op:
#   4 rows (one decode row at GQA 4): 2.2 / 1.1 ms at 512 keys, 3.3 / 2.7 at 4k: never
#   (session 6's kernel);
#   64 rows (a 16-token verify at GQA 4): 1.06 / 2.24 at 1k, 1.31 / 3.84 at 2k,
#   2.54 / 19.07 at 16k, 3.33 / 36.26 at 32k; 1.5 / 1.5 at 512 (session 6).
#   128 rows (GQA 8, two row tiles): 1.7 / 2.8 at 1k, 2.5 / 6.2 at 4k, 5.1 / 19.6 at 16k
#   (session 6).
# From 1k keys the whole cycle gains too (benchmarks/cycle.py, qwen3-8b shapes, a 1k
# prompt, block 16: 7.53 and 7.55 ms with the kernel from 1k, 8.31 and 7.78 from 2k).
# Under 1k keys, 17-128 rows (a block of 16 at GQA 2-8) take the kernel too on CUDA:
# its device time equals the fused op's at 512 keys for 64 rows, and its two launches
# cost the host less than the fused op's one and the mask it needs (cuDNN's attention:
# ~30 us, benchmarks/host_cost.py; a custom kernel: 3-5 us, launch_cost.py); the
# built-in pair's cycle after 256 tokens (GQA 2, 32 rows): 2.35-2.36 ms against
# 2.62-2.86 with the fused op on one boot, 2.82-2.99 against 3.02-3.04 on another
# (H100, session 15, BENCHMARKS.md). Up to 16 rows (a block of 4 at GQA 4) the kernel's
# device time is the higher one under 1k keys (2.27 / 1.23 ms at 512), so they keep the
# fused op there. More rows are unmeasured and keep the fused op.
KERNEL_WINS = ((4, None), (16, 1024), (128, 0))
# Metal launches cheaply, so the host's reason for the kernel under 1k keys is CUDA's;
# until a Mac measures it, Metal takes the kernel from this many keys at the least.
METAL_FEWEST_KEYS = 1024

TOLERANCE = {mx.float32: 2e-3, mx.float16: 4e-3, mx.bfloat16: 3e-2}

BUILDERS = {"metal": BlockAttentionKernel, "cuda": BlockAttentionKernel}


@dataclass
class CheckResult:
    backend: str
    dtype: str
    head_dim: int
    window: bool
    ok: bool
    detail: str

    @property
    def case(self) -> str:
        kind = "sliding window" if self.window else "full"
        return f"{self.backend} {self.dtype} head_dim={self.head_dim} {kind}"


_kernels: dict[str, object] = {}
_checks: dict[tuple, CheckResult] = {}


def reset() -> None:
    """Forget built kernels and check results (tests, or after changing BUILDERS)."""
    _kernels.clear()
    _checks.clear()


def block_attention(queries, keys, values, *, scale, q_offset, kv_length, causal, window=None, sinks=None):
    """Attention of a block of query rows over a fixed-capacity K/V buffer.

    queries [B, Hq, L, D]; keys, values [B, Hkv, N, D] (Hq a multiple of Hkv,
    D in 64/128/256, one dtype of bf16/fp16/fp32). Query row i sits at
    position q_offset + i, key j at position j; keys at j >= kv_length are
    never attended. causal: j <= q_offset + i. window: also
    (q_offset + i) - j < window, and j - (q_offset + i) < window when not
    causal. sinks: per-query-head sink logits [Hq]. q_offset and kv_length may
    be ints or one-element int arrays (never read back to the host).
    """
    check_inputs(queries, keys, values, q_offset, kv_length, window, sinks)
    kw = dict(scale=scale, q_offset=q_offset, kv_length=kv_length, causal=causal, window=window, sinks=sinks)
    where = backend()
    keys_hint = kv_length if isinstance(kv_length, int) else keys.shape[2]
    if where == "cpu" or not kernel_wins(queries.shape[1] // keys.shape[1] * queries.shape[2], keys_hint, where):
        return ops_attention(queries, keys, values, **kw)
    kernel = checked_kernel(where, queries.dtype, queries.shape[3], window is not None)
    if kernel is None:
        return ops_attention(queries, keys, values, **kw)
    return kernel(queries, keys, values, **kw)


def kernel_wins(rows_per_kv_head: int, keys: int, where: str = "cuda") -> bool:
    """Whether the measured table (KERNEL_WINS) picks the kernel on backend
    ``where`` (Metal: from METAL_FEWEST_KEYS keys at the least)."""
    for most_rows, fewest_keys in KERNEL_WINS:
        if rows_per_kv_head <= most_rows:
            if fewest_keys is None:
                return False
            if where == "metal":
                fewest_keys = max(fewest_keys, METAL_FEWEST_KEYS)
            return keys >= fewest_keys
    return False


def passed_kernel(where: str, dtype, head_dim: int, windowed: bool):
    """The backend's kernel if this variant has already passed its self-check,
    else None; never runs a check (so it is safe inside a compiled trace)."""
    result = _checks.get((where, dtype, head_dim, windowed))
    return _kernels.get(where) if result is not None and result.ok else None


def checked_kernel(where: str, dtype, head_dim: int, windowed: bool):
    """The backend's kernel if this variant passed its self-check, else None."""
    key = (where, dtype, head_dim, windowed)
    result = _checks.get(key)
    if result is None:
        result = _checks[key] = self_check(where, dtype, head_dim, windowed)
        if not result.ok:
            warnings.warn(
                f"dflash_mlx: the {result.case} block-attention kernel failed its self-check ({result.detail}); "
                "using mx.fast.scaled_dot_product_attention for it instead.",
                RuntimeWarning,
                stacklevel=3,
            )
    return _kernels.get(where) if result.ok else None


def self_check(where: str, dtype, head_dim: int, windowed: bool) -> CheckResult:
    """Run the kernel on small random cases against the ops path."""

    def outputs(kernel):
        for q, k, v, kw in _check_cases(dtype, head_dim, windowed):
            yield kernel(q, k, v, **kw), ops_attention(q, k, v, **kw)

    return compare_with_ops(where, dtype, head_dim, windowed, _kernels, BUILDERS, outputs)


def compare_with_ops(
    where: str, dtype, head_dim: int, windowed: bool, kernels: dict, builders: dict, outputs
) -> CheckResult:
    """A kernel variant's self-check: ``where``'s kernel, built once by
    ``builders`` and kept in ``kernels``, passes if every (kernel's, ops
    path's) output pair that ``outputs(kernel)`` yields agrees within
    TOLERANCE (the largest difference over the largest element); a build or
    launch error fails it, named."""
    name = str(dtype).split(".")[-1]
    try:
        kernel = kernels.get(where)
        if kernel is None:
            kernel = kernels[where] = builders[where](where)
        worst = 0.0
        for got, want in outputs(kernel):
            got, want = got.astype(mx.float32), want.astype(mx.float32)
            if got.shape != want.shape:
                return CheckResult(where, name, head_dim, windowed, False, f"output shape {got.shape} != {want.shape}")
            err = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()
            if not err == err:  # NaN
                err = float("inf")
            worst = max(worst, err)
        ok = worst <= TOLERANCE[dtype]
        detail = f"max relative error {worst:.1e}" + ("" if ok else f" > {TOLERANCE[dtype]:.0e}")
        return CheckResult(where, name, head_dim, windowed, ok, detail)
    except Exception as e:  # a build or launch error: the kernel is not used
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CheckResult(where, name, head_dim, windowed, False, f"{type(e).__name__}: {msg[:200]}")


def _check_cases(dtype, head_dim: int, windowed: bool):
    """Verify-like (causal, array offsets, the query a transposed view as a
    layer's rotated query is; then with sinks, as gpt-oss verifies) and
    drafter-like (non-causal, sinks) cases over a buffer with an unfilled tail
    and several key chunks; then rows enough for several warps; then a buffer
    of one key chunk."""
    key = mx.random.key(head_dim)
    kq, kk, kv, ks = mx.random.split(key, 4)
    n, lq = 640, 7
    q = mx.random.normal((1, lq, 4, head_dim), key=kq).astype(dtype).transpose(0, 2, 1, 3)
    k = mx.random.normal((1, 2, n, head_dim), key=kk).astype(dtype)
    v = mx.random.normal((1, 2, n, head_dim), key=kv).astype(dtype)
    sinks = mx.random.normal((4,), key=ks)
    window = 45 if windowed else None
    scale = head_dim**-0.5
    yield q, k, v, dict(scale=scale, q_offset=mx.array(500), kv_length=mx.array(500 + lq), causal=True, window=window)
    yield (
        mx.contiguous(q),
        k,
        v,
        dict(scale=scale, q_offset=300, kv_length=300 + lq, causal=False, window=window, sinks=sinks),
    )
    yield (
        q,
        k,
        v,
        dict(
            scale=scale, q_offset=mx.array(200), kv_length=mx.array(200 + lq), causal=True, window=window, sinks=sinks
        ),
    )
    # 12 and 20 rows at GQA 2: 24 and 40 rows per kv head, the matrix-unit pass's
    # threadgroups of two and four warps (kernel.tile_warps)
    for rows in (12, 20):
        qr = mx.random.normal((1, 4, rows, head_dim), key=kq).astype(dtype)
        yield (
            qr,
            k,
            v,
            dict(scale=scale, q_offset=mx.array(600), kv_length=mx.array(600 + rows), causal=True, window=window),
        )
    # a buffer of one key chunk (256 wide), verify-like and drafter-like with no sinks: on CUDA the
    # matrix-unit pass writes the output itself, with no merge (source_tiles.STORE)
    one = k[:, :, :256], v[:, :, :256]
    yield q, *one, dict(scale=scale, q_offset=mx.array(180), kv_length=mx.array(180 + lq), causal=True, window=window)
    yield mx.contiguous(q), *one, dict(scale=scale, q_offset=200, kv_length=200 + lq, causal=False, window=window)


def self_check_all(dtypes=DTYPES, head_dims=HEAD_DIMS, report=None) -> list[CheckResult]:
    """Check every variant on this backend (for `dflash-mlx doctor`); [] on the
    CPU. ``report(result)``, where given, hears each variant's result as soon
    as it is known (a cold CUDA process compiles each variant first)."""
    where = backend()
    if where == "cpu":
        return []
    for dtype in dtypes:
        for d in head_dims:
            for windowed in (False, True):
                checked_kernel(where, dtype, d, windowed)
                if report is not None:
                    report(_checks[(where, dtype, d, windowed)])
    return [r for (w, *_), r in _checks.items() if w == where]
