"""q/k RMS norms and RoPE in one kernel launch, for qwen3-shaped attention.

A Qwen3 layer (and a DFlash drafter's) normalizes each head of its queries
and keys (``q_norm``, ``k_norm``) and rotates them (RoPE) before attention.
Through MLX's ops that is six launches in a verify: a copy each of q and k
(views into the fused q/k/v product, whose rows ``rms_norm`` cannot read
through strides), the two norms and the two rotations. A cycle at real model
sizes is bound by the host launching kernels, so this kernel does the six in
one: a warp per (token, head) row of q or k, read through the views' strides,
written as the [B, heads, L, D] arrays attention reads. Row l is rotated at
``offset + l``, or at ``offset[l]`` where offset is an array [L] (a draft
tree's verify rotates each node at its depth past the committed length).

Its arithmetic is MLX's: the norm in float32, rounded to the dtype (as the
norm's output is), then the rotation in float32 at MLX's frequencies (pair i,
non-traditional: x_i with x_{i+D/2}, angle scale * position * 2^(-(i/(D/2)) *
log2 base), with the cosine and sine MLX's own rope kernels take), rounded
again. Sums and products in another order leave some elements one unit in the
last place apart, so on a GPU, as with fused products and the attention
kernel, a near-tie between two greedy tokens can fall the other way from
mlx-lm's own decoding. Like the block-attention kernel (dispatch.py), a
variant (backend, dtype, head dim) is used only after matching the ops path on
random cases in this process, checked outside any compiled trace
(``prepare``); where exactness comes first (a Mac: decisions.exact_first) only
if it matched them bit for bit, since MLX's row-wise norm and rope give a row
of a verify what they give it alone. On the CPU, for a rotation other than
nn.RoPE's own (scaled variants, partial or traditional) and for variants that
failed, the ops path runs.

    q, k = norm_rope(q, k, q_norm, k_norm, rope, offset)     # q, k: [B, L, heads, D]
    q, k = norm_rope(q, k, q_norm, k_norm, rope, positions)  # positions: int32 [L]
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from . import decisions
from .attention import _int1, make_factory
from .attention_source import HEADER
from .dispatch import CheckResult, backend, compare_with_ops
from .launch_source import compacting
from .ops import DTYPES, HEAD_DIMS
from .serving import check_once
from .serving import passed as check_passed

INPUTS = ["q", "k", "q_weight", "k_weight", "offset", "params"]
OUTPUTS = ["q_out", "k_out"]
WARPS = 4  # rows (warps) per threadgroup
VERSION = 2  # of BODY and its inputs: a change must bump it

PRELUDE = {
    "metal": """
  const int gid = int(thread_position_in_grid.x);
  const int lane = int(thread_index_in_simdgroup);
#define NR_RSQRT metal::precise::rsqrt
#define NR_EXP2 metal::exp2
#define NR_COS metal::fast::cos
#define NR_SIN metal::fast::sin
""",
    "cuda": """
  const int gid = int(blockIdx.x * blockDim.x + threadIdx.x);
  const int lane = int(threadIdx.x) & 31;
#define NR_RSQRT rsqrtf
#define NR_EXP2 exp2f
#define NR_COS cosf
#define NR_SIN sinf
""",
}

# Template constants: T (dtype), D (head dim, a multiple of 64), PER_ROW (offset
# holds each row's position, [L], as a draft tree's verify rotates its nodes;
# else one int, the first row's). params: eps, the rotation's scale, log2 of
# its base. A warp per row; rows are the q rows (b, l, h) then the k rows, and
# whole warps past the last row return.
BODY = """
  constexpr int DL = D / 32;
  const int B = q_shape[0];
  const int L = q_shape[1];
  const int HQ = q_shape[2];
  const int HK = k_shape[2];
  int row = gid / 32;
  const int q_rows = B * L * HQ;
  if (row >= q_rows + B * L * HK) return;
  const bool is_q = row < q_rows;
  if (!is_q) row -= q_rows;
  const int H = is_q ? HQ : HK;
  const int h = row % H;
  const int l = (row / H) % L;
  const int b = row / (H * L);
  const DEV T* src = is_q ? q + b * q_strides[0] + l * q_strides[1] + h * q_strides[2]
                          : k + b * k_strides[0] + l * k_strides[1] + h * k_strides[2];
  const idx_t step = is_q ? q_strides[3] : k_strides[3];
  const DEV T* w = is_q ? q_weight : k_weight;
  DEV T* dst = (is_q ? q_out : k_out) + (idx_t(b * H + h) * L + l) * D;

  float x[DL];
  float ss = 0.0f;
  for (int j = 0; j < DL; ++j) {
    x[j] = to_float(src[(lane + 32 * j) * step]);
    ss += x[j] * x[j];
  }
  ss = simd_sum(ss);
  const float inv = NR_RSQRT(ss / float(D) + params[0]);
  for (int j = 0; j < DL; ++j) {
    x[j] = to_float(from_float<T>(to_float(w[lane + 32 * j]) * (x[j] * inv)));
  }
  const float position = params[1] * float(PER_ROW ? offset[l] : offset[0] + l);
  for (int j = 0; j < DL / 2; ++j) {
    const int i = lane + 32 * j;
    const float theta = position * NR_EXP2(-(float(i) / float(D / 2)) * params[2]);
    const float c = NR_COS(theta);
    const float s = NR_SIN(theta);
    const float a = x[j];
    const float z = x[j + DL / 2];
    dst[i] = from_float<T>(a * c - z * s);
    dst[i + D / 2] = from_float<T>(a * s + z * c);
  }
"""


def source(backend_name: str) -> str:
    return PRELUDE[backend_name] + BODY


class NormRopeKernel:
    """The kernel for one backend, compiled by MLX per (dtype, head dim)."""

    def __init__(self, backend_name: str, factory=None):
        factory = compacting(factory or make_factory(backend_name), backend_name)
        # (the version in the name: MLX caches built kernels on disk by name, not by source)
        self.kernel = factory(
            name=f"dflash_norm_rope_v{VERSION}",
            input_names=INPUTS,
            output_names=OUTPUTS,
            source=source(backend_name),
            header=HEADER[backend_name],
            ensure_row_contiguous=False,
        )
        self._params: dict[tuple, mx.array] = {}

    def __call__(self, q, k, q_weight, k_weight, *, eps: float, scale: float, base: float, offset):
        B, L, HQ, D = q.shape
        HK = k.shape[2]
        each_row = per_row(offset, L)
        key = (eps, scale, base)
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = mx.array([eps, scale, math.log2(base)], dtype=mx.float32)
        rows = B * L * (HQ + HK)
        group = WARPS * 32
        q_out, k_out = self.kernel(
            inputs=[q, k, q_weight, k_weight, _int1(offset), params],
            template=[("T", q.dtype), ("D", D), ("PER_ROW", each_row)],
            grid=(-(-rows * 32 // group) * group, 1, 1),
            threadgroup=(group, 1, 1),
            output_shapes=[(B, HQ, L, D), (B, HK, L, D)],
            output_dtypes=[q.dtype, q.dtype],
        )
        return q_out, k_out


def ops_norm_rope(q, k, q_norm: nn.Module, k_norm: nn.Module, rope, offset):
    """What MLX's own ops compute (and what a layer without the kernel runs):
    q, k [B, L, heads, D] -> normed, transposed, rotated [B, heads, L, D]."""
    q = q_norm(q).transpose(0, 2, 1, 3)
    k = k_norm(k).transpose(0, 2, 1, 3)
    return rotate(rope, q, offset), rotate(rope, k, offset)


def rotate(rope, x: mx.array, offset) -> mx.array:
    """``rope`` over x [B, heads, L, D] at positions offset.. (an int or a
    scalar array), or at ``offset[i]`` for row i in every batch entry (an
    array [L]: a tree's depths). MLX's rope takes one offset per leading
    entry, so rows become them."""
    if not per_row(offset, x.shape[-2]):
        return rope(x, offset=offset)
    B, H, L, D = x.shape
    if B == 1:
        return rope(x.swapaxes(0, 2), offset=offset).swapaxes(0, 2)
    rows = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
    return rope(rows, offset=offset).reshape(L, B, H, D).transpose(1, 2, 0, 3)


def per_row(offset, rows: int) -> bool:
    """Whether ``offset`` holds each of ``rows`` rows' own position (an array
    [rows]) rather than the first row's (an int or a one-element array)."""
    if not isinstance(offset, mx.array) or offset.size == 1:
        return False
    if offset.shape != (rows,):
        raise ValueError(
            f"RoPE takes one offset or one position a row (an array of shape ({rows},)), not shape {offset.shape}."
        )
    return True


def plain_rope(rope, head_dim: int) -> bool:
    """Whether ``rope`` is nn.RoPE's own rotation over the whole head (the
    kernel's); mlx-lm's scaled variants are other classes."""
    return type(rope) is nn.RoPE and not rope.traditional and rope.dims == head_dim


BUILDERS = {"metal": NormRopeKernel, "cuda": NormRopeKernel}
_kernels: dict[str, NormRopeKernel] = {}
_checks: dict[tuple, CheckResult] = {}


def reset() -> None:
    _kernels.clear()
    _checks.clear()


def prepare(dtype, head_dim: int) -> None:
    """Check this backend's variant for (dtype, head dim) once, so that
    ``norm_rope`` may use it (inside compiled traces too)."""
    where = backend()
    if where == "cpu" or dtype not in DTYPES or head_dim not in HEAD_DIMS:
        return
    check_once(
        _checks,
        (where, dtype, head_dim),
        lambda: self_check(where, dtype, head_dim),
        lambda r: (
            f"dflash_mlx: the {where} {r.dtype} head_dim={head_dim} q/k norm + RoPE kernel failed its "
            f"self-check ({r.detail}); using MLX's rms_norm and rope for it instead."
        ),
        kernel="q/k norm + RoPE",
    )


def passed(dtype, head_dim: int) -> NormRopeKernel | None:
    """This backend's kernel if the variant passed its check; never checks."""
    where = backend()
    key = (where, dtype, head_dim)
    if not check_passed(_checks, key) or (not _checks[key].bit_equal and decisions.current().exact_first(where)):
        return None
    return _kernels.get(where)


def norm_rope(q, k, q_norm: nn.Module, k_norm: nn.Module, rope, offset):
    """q, k [B, L, heads, D] (views are fine) -> normed, rotated [B, heads, L,
    D] at positions offset.. (an int or a scalar int32 array) or at offset[l]
    for row l (an int32 array [L]: a draft tree's positions): the kernel
    where its variant passed (its check covers both), else the ops path."""
    d = q.shape[-1]
    per_row(offset, q.shape[1])  # (a wrong length is refused on either path)
    kernel = passed(q.dtype, d) if plain_rope(rope, d) and isinstance(q_norm, nn.RMSNorm) else None
    if kernel is None or k.dtype != q.dtype or q_norm.weight.dtype != q.dtype or k_norm.weight.dtype != q.dtype:
        return ops_norm_rope(q, k, q_norm, k_norm, rope, offset)
    return kernel(q, k, q_norm.weight, k_norm.weight, eps=q_norm.eps, scale=rope.scale, base=rope.base, offset=offset)


def norm_rope_keys(k, k_norm: nn.Module, rope, offset):
    """``norm_rope`` for keys alone, k [B, L, heads, D] -> [B, heads, L, D]:
    one launch of the kernel with k as its queries too (the rows done twice
    are a few; MLX's ops take three launches: a copy, the norm, the
    rotation); the ops path where the kernel does not run."""
    return norm_rope(k, k, k_norm, k_norm, rope, offset)[1]


def self_check(where: str, dtype, head_dim: int) -> CheckResult:
    """The kernel against the ops path on verify-like views (rows of a fused
    q/k/v product, an array offset), a draft tree's per-row positions and a
    drafter-like int offset."""

    def outputs(kernel):
        for q, k, qn, kn, rope, offset in _check_cases(dtype, head_dim):
            got = kernel(q, k, qn.weight, kn.weight, eps=qn.eps, scale=rope.scale, base=rope.base, offset=offset)
            yield from zip(got, ops_norm_rope(q, k, qn, kn, rope, offset))

    return compare_with_ops(where, dtype, head_dim, False, kernels=_kernels, builders=BUILDERS, outputs=outputs)


# A draft tree's depths (parents 0 0 0 1 1 2 3 3 4 6 9 10): siblings share a position.
TREE_DEPTHS = [0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 5, 6]


def _check_cases(dtype, head_dim: int):
    """A verify's views at an array offset and at a tree's positions (five
    nodes and twelve: Metal passes fewer than eight in constant memory, more
    in device memory), then a drafter's contiguous rows at an int offset."""
    kq, kk, k5, k12 = mx.random.split(mx.random.key(head_dim + 7), 4)
    qn, kn = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
    qn.weight = (1 + 0.3 * mx.random.normal((head_dim,), key=kq)).astype(dtype)
    kn.weight = (1 + 0.3 * mx.random.normal((head_dim,), key=kk)).astype(dtype)
    depths = mx.array(TREE_DEPTHS, mx.int32)
    q, k = _fused_views(dtype, head_dim, 5, k5)
    yield q, k, qn, kn, nn.RoPE(head_dim, base=1_000_000.0), mx.array(4000, mx.int32)
    yield q, k, qn, kn, nn.RoPE(head_dim, base=1_000_000.0), 4000 + depths[:5]
    q12, k12 = _fused_views(dtype, head_dim, 12, k12)
    yield q12, k12, qn, kn, nn.RoPE(head_dim, base=10_000.0, scale=0.5), 300 + depths
    yield mx.contiguous(q), mx.contiguous(k), qn, kn, nn.RoPE(head_dim, base=10_000.0, scale=0.5), 17


def _fused_views(dtype, head_dim: int, rows: int, key):
    """q [1, rows, 4, D] and k [1, rows, 2, D]: views into a fused k/v/q product."""
    hq, hk = 4, 2
    fused = mx.random.normal((1, rows, (hq + 2 * hk) * head_dim), key=key).astype(dtype)
    k, _, q = mx.split(fused, [hk * head_dim, 2 * hk * head_dim], axis=-1)
    return q.reshape(1, rows, hq, head_dim), k.reshape(1, rows, hk, head_dim)


def self_check_all(report=None) -> list[CheckResult]:
    """Check every (dtype, head dim) variant on this backend (for `dflash-mlx
    doctor`); [] where the kernel does not run (the CPU). ``report(result)``,
    where given, hears each result as soon as it is known."""
    where = backend()
    if where not in BUILDERS:
        return []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            prepare(dtype, d)
            if report is not None:
                report(_checks[(where, dtype, d)])
    return [r for (w, *_), r in _checks.items() if w == where]
