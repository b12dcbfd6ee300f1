"""The gated delta-net recurrence (Qwen3.5 / 3.6, Qwen3-Next) as one kernel
launch for all of a write's steps, on Metal and CUDA from one body.

mlx-lm runs the recurrence through its own Metal kernel on a Mac and through
a loop of small ops elsewhere (mlx_lm/models/gated_delta.py). This module
adds what a verify and its rollback need:

- on CUDA, a twin of mlx-lm's Metal kernel: the verify's T steps, a plain
  step and a replayed rollback each one launch a layer, instead of ~8 ops a
  step;
- on both, a ``steps`` limit read on the device (an int32 array [1]): the
  state after the first ``steps`` of T steps, which is the replay rollback
  in one launch with no mask.

Arithmetic: that of mlx-lm's packed Metal kernel, expression for expression
(float32 state; per step the decay, k's dot product, the delta, the update,
q's dot product). Each dot product over Dk is summed as mlx-lm's kernels sum
it: chains of Dk/32 products in order (one lane of its generic kernel), then
the ascending butterfly over the 32 chains (xor 1, 2, 4, 8, 16). Here a lane
holds 32 state elements, so Dk/32 lanes share a value row: the butterfly's
first levels run inside a lane as a pairwise tree, its last ones across the
row's lanes; the sum is the same whatever the split (IEEE addition is
commutative). The state crosses launches as float32, so T steps in one launch
equal T launches of one step bit for bit, and a replay of the first s steps
equals a plain run of them. CUDA contracts products into fused multiply-adds
as Metal may: outputs equal mlx-lm's up to each backend's float rules.

Each variant (backend, dtype, Dk) is used only after its self-check in this
process (``prepare``, outside any compiled trace): against mlx-lm's ops
path within a tolerance, one launch against step-by-step launches and a
limited run against a plain run of its prefix bit for bit, and on Metal
against mlx-lm's own kernel bit for bit (the replay must reach the states of
the plain steps mlx-lm's kernel computes). A variant that fails warns once
and is never used: its callers run mlx-lm's path (``recurrence``).

    y, state = recurrence(q, k, v, g, beta, state)             # [B, T, Hv, Dv], [B, Hv, Dv, Dk]
    _, kept = recurrence(q, k, v, g, beta, state, steps=s)     # the state after s steps (s: int32 [1])
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

from ..device import backend, constant_arange
from .attention import make_factory
from .attention_source import HEADER as BASE_HEADER
from .dispatch import TOLERANCE, CheckResult
from .launch_source import compacting
from .serving import check_once, failure
from .serving import passed as check_passed

INPUTS = ["q", "k", "v", "g", "beta", "state_in", "steps"]
OUTPUTS = ["y", "state_out"]
KEY_DIMS = (32, 64, 128, 256)  # Dk: a lane holds 32 state elements, Dk / 32 lanes a value row
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
WARPS = 2  # simdgroups per threadgroup, as mlx-lm's packed kernel
VERSION = 2  # of BODY and its inputs: a change must bump it

# The attention kernels' header (to_float, from_float, idx_t) and a butterfly step.
HEADER = {
    "metal": BASE_HEADER["metal"]
    + """
inline float gd_shuffle_xor(float x, int mask) { return simd_shuffle_xor(x, ushort(mask)); }
""",
    "cuda": BASE_HEADER["cuda"]
    + """
__device__ __forceinline__ float gd_shuffle_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
""",
}

# lane: within the simdgroup (warp); rows: the grid's y, a simdgroup's value
# rows each; n: the grid's z, batch x value head.
PRELUDE = {
    "metal": """
  const int lane = int(thread_index_in_simdgroup);
  const int row_group = int(thread_position_in_grid.y);
  const int n = int(thread_position_in_grid.z);
""",
    "cuda": """
  const int lane = int(threadIdx.x);
  const int row_group = int(blockIdx.y * blockDim.y + threadIdx.y);
  const int n = int(blockIdx.z * blockDim.z + threadIdx.z);
""",
}

# Template constants: InT (q, k, v, y), Dk, LIMITED (read ``steps``). Shapes
# are read at run time: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta
# [B, T, Hv] (g float32); state [B, Hv, Dv, Dk] float32.
BODY = """
  constexpr int LANES = Dk / 32;  // lanes per value row
  constexpr int ROWS = 32 / LANES;  // value rows per simdgroup
  constexpr int CHAIN = Dk / 32;  // products one lane of mlx-lm's generic kernel sums in order
  constexpr int PARTS = 32 / CHAIN;  // chains per lane here: 32 elements
  const int T = q_shape[1];
  const int Hk = q_shape[2];
  const int Hv = v_shape[2];
  const int Dv = v_shape[3];
  if (row_group * ROWS >= Dv) return;  // whole simdgroups past the last row
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane_in_row = lane % LANES;
  const int dv = row_group * ROWS + lane / LANES;
  const int first = lane_in_row * 32;

  auto q_ = q + (idx_t(b) * T * Hk + hk) * Dk + first;
  auto k_ = k + (idx_t(b) * T * Hk + hk) * Dk + first;
  auto v_ = v + (idx_t(b) * T * Hv + hv) * Dv;
  auto y_ = y + (idx_t(b) * T * Hv + hv) * Dv;
  const idx_t g0 = idx_t(b) * T * Hv + hv;
  const idx_t row = (idx_t(n) * Dv + dv) * Dk + first;

  float state[32];
  for (int i = 0; i < 32; ++i) {
    state[i] = to_float(state_in[row + i]);
  }
  int count = T;
  if (LIMITED) {
    count = steps[0] < 0 ? 0 : (steps[0] < T ? steps[0] : T);
  }
  for (int t = 0; t < count; ++t) {
    const float gt = to_float(g[g0 + idx_t(t) * Hv]);
    float part[PARTS];
    for (int c = 0; c < PARTS; ++c) {
      float acc = 0.0f;
      for (int i = 0; i < CHAIN; ++i) {
        const int e = c * CHAIN + i;
        state[e] = state[e] * gt;
        acc += state[e] * to_float(k_[e]);
      }
      part[c] = acc;
    }
    for (int w = 1; w < PARTS; w <<= 1) {
      for (int c = 0; c < PARTS; c += 2 * w) {
        part[c] = part[c] + part[c + w];
      }
    }
    float kv_mem = part[0];
    for (int m = 1; m < LANES; m <<= 1) {
      kv_mem += gd_shuffle_xor(kv_mem, m);
    }

    const float delta = (to_float(v_[dv]) - kv_mem) * to_float(beta[g0 + idx_t(t) * Hv]);

    for (int c = 0; c < PARTS; ++c) {
      float acc = 0.0f;
      for (int i = 0; i < CHAIN; ++i) {
        const int e = c * CHAIN + i;
        state[e] = state[e] + to_float(k_[e]) * delta;
        acc += state[e] * to_float(q_[e]);
      }
      part[c] = acc;
    }
    for (int w = 1; w < PARTS; w <<= 1) {
      for (int c = 0; c < PARTS; c += 2 * w) {
        part[c] = part[c] + part[c + w];
      }
    }
    float out = part[0];
    for (int m = 1; m < LANES; m <<= 1) {
      out += gd_shuffle_xor(out, m);
    }
    if (lane_in_row == 0) {
      y_[dv] = from_float<InT>(out);
    }
    q_ += Hk * Dk;
    k_ += Hk * Dk;
    v_ += Hv * Dv;
    y_ += Hv * Dv;
  }
  for (int i = 0; i < 32; ++i) {
    state_out[row + i] = state[i];
  }
"""


def source(backend_name: str) -> str:
    return PRELUDE[backend_name] + BODY


def rows_per_simdgroup(key_dim: int) -> int:
    return 32 // (key_dim // 32)


def fits(q: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> bool:
    """Whether the kernel takes these inputs: scalar gates, a float32 state,
    Dk one of KEY_DIMS, whole simdgroups of value rows (v in device memory)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    return (
        key_dim in KEY_DIMS
        and value_dim >= 8
        and value_dim % rows_per_simdgroup(key_dim) == 0
        and q.dtype in DTYPES
        and g.ndim == 3
        and g.dtype == mx.float32
        and state.dtype == mx.float32
        and beta.dtype == q.dtype
        and v.shape[-2] % q.shape[-2] == 0
    )


class GatedDeltaKernel:
    """The kernel for one backend, compiled by MLX per (dtype, Dk, limited)."""

    def __init__(self, backend_name: str, factory=None):
        factory = compacting(factory or make_factory(backend_name), backend_name)
        # (the version in the name: MLX caches built kernels by name, not by source)
        self.kernel = factory(
            name=f"dflash_gated_delta_v{VERSION}",
            input_names=INPUTS,
            output_names=OUTPUTS,
            source=source(backend_name),
            header=HEADER[backend_name],
        )
        self._all_steps = mx.zeros((1,), mx.int32)  # (read by no variant: LIMITED is false)

    def __call__(self, q, k, v, g, beta, state, *, steps: mx.array | None = None):
        """(y [B, T, Hv, Dv], the state after all T steps, or after the first
        ``steps`` (int32 [1]); y's rows from ``steps`` on are not written)."""
        B, T, _, key_dim = q.shape
        Hv, Dv = v.shape[2:]
        groups = Dv // rows_per_simdgroup(key_dim)
        warps = WARPS if groups % WARPS == 0 else 1
        return self.kernel(
            inputs=[q, k, v, g, beta, state, self._all_steps if steps is None else steps],
            template=[("InT", q.dtype), ("Dk", key_dim), ("LIMITED", steps is not None)],
            grid=(32, groups, B * Hv),
            threadgroup=(32, warps, 1),
            output_shapes=[(B, T, Hv, Dv), state.shape],
            output_dtypes=[q.dtype, mx.float32],
        )


_kernels: dict[str, GatedDeltaKernel] = {}
_checks: dict[tuple, CheckResult] = {}


def reset() -> None:
    _kernels.clear()
    _checks.clear()


def mlx_lm_kernel_runs(key_dim: int, use_kernel: bool = True) -> bool:
    """Whether mlx-lm's ``gated_delta_update`` would run its Metal kernel here (its 0.32 rule)."""
    return use_kernel and backend() == "metal" and key_dim >= 32 and key_dim % 32 == 0


def prepare(dtype, key_dim: int, value_dim: int) -> None:
    """Check this backend's variant for (dtype, Dk) once, outside compiled
    traces, so that ``recurrence`` may use it."""
    where = backend()
    if where == "cpu" or dtype not in DTYPES or key_dim not in KEY_DIMS:
        return
    if value_dim < 8 or value_dim % rows_per_simdgroup(key_dim):
        return
    instead = "mlx-lm's Metal kernel and per-step rollback" if where == "metal" else "mlx-lm's ops"
    check_once(
        _checks,
        (where, dtype, key_dim),
        lambda: self_check(where, dtype, key_dim, value_dim),
        lambda r: (
            f"dflash_mlx: the {where} {r.dtype} Dk={key_dim} gated delta-net kernel failed its "
            f"self-check ({r.detail}); using {instead} for it instead."
        ),
    )


def passed(dtype, key_dim: int) -> GatedDeltaKernel | None:
    """This backend's kernel if the variant passed its check; never checks."""
    where = backend()
    return _kernels.get(where) if check_passed(_checks, (where, dtype, key_dim)) else None


def kernel_for(q, v, g, beta, state, use_kernel: bool = True) -> GatedDeltaKernel | None:
    """The checked kernel for these inputs, or None."""
    if not use_kernel or not fits(q, v, g, beta, state):
        return None
    return passed(q.dtype, q.shape[-1])


def one_launch_replay(q, v, g, beta, state, use_kernel: bool = True) -> bool:
    """Whether a replayed rollback of these inputs is one exact kernel launch
    here (the checked kernel), so replay is the cheapest rollback."""
    return kernel_for(q, v, g, beta, state, use_kernel) is not None


def recurrence(q, k, v, g, beta, state, *, steps: mx.array | None = None, use_kernel: bool = True):
    """mlx-lm's recurrence (q, k normalized, g and beta made): y [B, T, Hv,
    Dv] and the state after all T steps, or after the first ``steps`` (an
    int32 array [1], never read back: rows of y from there on are unset).

    On Metal mlx-lm's kernel runs a whole write (a plain step is mlx-lm's own
    step); a limited run takes this module's kernel where checked, else
    mlx-lm's masked kernel. On CUDA this module's kernel runs every write
    where checked. Elsewhere, and for inputs no kernel takes: mlx-lm's ops."""
    kernel = kernel_for(q, v, g, beta, state, use_kernel)
    metal = mlx_lm_kernel_runs(q.shape[-1], use_kernel)
    if kernel is not None and (steps is not None or not metal):
        return kernel(q, k, v, g, beta, state, steps=steps)
    mask = None if steps is None else mx.broadcast_to(constant_arange(q.shape[1]) < steps, q.shape[:2])
    if metal:
        return gated_delta_kernel(q, k, v, g, beta, state, mask)
    return gated_delta_ops(q, k, v, g, beta, state, mask)


# --- self-check ----------------------------------------------------------------------------------


def check_cases(dtype, key_dim: int, value_dim: int):
    """Verify-like and prefill-like inputs at (dtype, Dk, Dv): grouped heads,
    gates and betas of a real layer's range, a non-zero state; one batch of
    two with few heads (gates in Metal's constant memory)."""
    for seed, (B, T, Hk, Hv) in enumerate(((1, 7, 2, 4), (1, 33, 2, 2), (2, 3, 1, 1))):
        kq, kk, kv, ka, kb, ks = mx.random.split(mx.random.key(key_dim + value_dim + seed), 6)
        scale = key_dim**-0.5
        q = mx.random.normal((B, T, Hk, key_dim), key=kq)
        k = mx.random.normal((B, T, Hk, key_dim), key=kk)
        q = (scale * scale * mx.fast.rms_norm(q, None, 1e-6)).astype(dtype)
        k = (scale * mx.fast.rms_norm(k, None, 1e-6)).astype(dtype)
        v = mx.random.normal((B, T, Hv, value_dim), key=kv).astype(dtype)
        g = mx.exp(-mx.exp(mx.random.uniform(-3.0, 0.5, (B, T, Hv), key=ka)))
        beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=kb)).astype(dtype)
        state = 0.1 * mx.random.normal((B, Hv, value_dim, key_dim), key=ks)
        yield q, k, v, g, beta, state


def _bitwise(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


def self_check(where: str, dtype, key_dim: int, value_dim: int) -> CheckResult:
    """The kernel against mlx-lm's ops within TOLERANCE; a whole write
    against step-by-step launches and a limited run against its prefix's
    plain run bit for bit; on Metal against mlx-lm's kernel bit for bit."""
    name = str(dtype).split(".")[-1]

    def result(ok: bool, detail: str) -> CheckResult:
        return CheckResult(where, name, key_dim, False, ok, detail)

    try:
        kernel = _kernels.get(where)
        if kernel is None:
            kernel = _kernels[where] = GatedDeltaKernel(where)
        worst = 0.0
        for q, k, v, g, beta, state in check_cases(dtype, key_dim, value_dim):
            T = q.shape[1]
            y, last = kernel(q, k, v, g, beta, state)
            for got, want in zip((y, last), gated_delta_ops(q, k, v, g, beta, state)):
                got, want = got.astype(mx.float32), want.astype(mx.float32)
                if got.shape != want.shape:
                    return result(False, f"output shape {got.shape} != {want.shape}")
                err = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()
                worst = max(worst, err if err == err else float("inf"))
            if worst > TOLERANCE[dtype]:
                return result(False, f"max relative error {worst:.1e} > {TOLERANCE[dtype]:.0e}")
            stepped, ys = state, []
            for t in range(T):
                y1, stepped = kernel(
                    q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], stepped
                )
                ys.append(y1)
            if not (_bitwise(mx.concatenate(ys, axis=1), y) and _bitwise(stepped, last)):
                return result(False, "one launch of T steps differs from T launches of one step")
            for s in (0, 1, T // 2, T):
                _, kept = kernel(q, k, v, g, beta, state, steps=mx.array([s], mx.int32))
                if s == 0:
                    want = [state]
                else:
                    prefix = q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s], state
                    want = [kernel(*prefix)[1]] + ([gated_delta_kernel(*prefix)[1]] if where == "metal" else [])
                if not all(_bitwise(kept, w) for w in want):
                    return result(False, f"the state after {s} of {T} steps differs from a plain run of {s}")
            if where == "metal":
                theirs = gated_delta_kernel(q, k, v, g, beta, state)
                if not (_bitwise(y, theirs[0]) and _bitwise(last, theirs[1])):
                    return result(False, "not bit for bit mlx-lm's Metal kernel")
        mlx_lm = ", bit for bit mlx-lm's kernel" if where == "metal" else ""
        return result(True, f"max relative error {worst:.1e}, exact replay{mlx_lm}")
    except Exception as e:  # a build or launch error: the kernel is not used
        return result(False, failure(e))


def self_check_all(report=None) -> list[CheckResult]:
    """Check every (dtype, Dk) variant on this backend (for `dflash-mlx
    doctor`) at Dv = Dk; [] on the CPU. ``report(result)`` hears each."""
    where = backend()
    if where == "cpu":
        return []
    for dtype in DTYPES:
        for d in KEY_DIMS:
            prepare(dtype, d, d)
            if report is not None:
                report(_checks[(where, dtype, d)])
    return [r for (w, *_), r in _checks.items() if w == where]


def record_variants(factory, backend_name: str) -> None:
    """Launch every variant this kernel can build, through ``factory`` (a
    recorder's stand-in for mx.fast.metal_kernel or cuda_kernel, launches
    returning zeros): each dtype and Dk, limited or not, over the
    self-check's cases (gates in device and in constant memory)."""
    kernel = GatedDeltaKernel(backend_name, factory=factory)
    for dtype in DTYPES:
        for d in KEY_DIMS:
            for q, k, v, g, beta, state in check_cases(dtype, d, d):
                kernel(q, k, v, g, beta, state)
                kernel(q, k, v, g, beta, state, steps=mx.array([1], mx.int32))
