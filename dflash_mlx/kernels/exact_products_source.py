"""Kernel source for a verify's dense products: one body, two dialects.

A verify multiplies its 2-32 rows by every bf16/fp16 (or float32) weight of
the target. MLX's one-row product (a plain step's) reads each weight once a
row; this kernel reads each weight once for all the rows and reduces every
row exactly as the one-row kernel of its backend does, so a verify row comes
out bit for bit as the plain step would compute it. The body (which lane
reads which part of K, the rows, the reductions, the store) is shared; each
header gives its backend's multiply-add, shuffle and bias.

The orders replicated, read from MLX's sources (github.com/ml-explore/mlx at
the 0.32.2 tree, Aug 2026; mlx/backend/metal/kernels/gemv.h and
mlx/backend/cuda/gemms/gemv.h equal the installed 0.32.4's headers; each
machine checks before use, see exact_products.py):

- Metal (``x @ w.T`` of one row: matmul.cpp ``Matmul::eval_gpu`` sends M == 1
  to ``gemv``, never ``gemv_wide`` or steel; ``gemv_axbpy`` picks the
  template, kernels/gemv.h ``GEMVKernel::run`` computes): an output's K is
  split among BN simdgroups and SN lanes each, TN = 4 values a lane a step:
  lane ``l`` of simdgroup part ``s`` takes ``(s * SN + l) * 4 + t`` of every
  step of ``BN * SN * 4`` values, t = 0..3 in order, into a float
  ``result += inter[t] * v_coeff[t]`` (the weight in its type, x as float).
  The last partial step loads zeros past K and every lane still adds its
  products (``load_safe``). Then ``result += simd_shuffle_down(result, o)``
  for o = SN / 2 .. 1, then, where BN > 1, part 0 adds parts 1 .. BN - 1 in
  order through threadgroup memory; one rounding to T (``static_cast``), or
  with a bias (``AddMM``: ``gemv_axbpy`` with ``kDoAxpby``) ``T(result) +
  bias`` in T. ``gemv_axbpy`` chooses: K <= 64: SN = 4 (8 outputs a
  simdgroup); else K >= 16 N: BN = 8, SN = 32; else BN = 1, SN = 32. Its
  BM, SM and TM (outputs a threadgroup, a simdgroup, a lane) and the tail
  shift do not change any output's order, so they are this kernel's own.
- CUDA (cuda/matmul.cpp ``gemm_and_bias``: one row with no bias goes to
  ``cu::gemv``, gemms/gemv.cu ``gemv_impl``; with a bias to cuBLASLt, whose
  order no kernel can know): a warp an output, lane ``l`` takes the VPT
  values at ``l * VPT + j * 32 * VPT``, j = 0, 1, ... while inside K, VPT = 4
  where K % 128 == 0, 2 where K % 64 == 0, else 1 (the weight and x aligned,
  as a contiguous weight and its row views are); each ``sum += float(w) *
  float(x)`` in float, which nvcc contracts to an fma (FORM 1; else two
  roundings, FORM 2: the self-check keeps whichever matches MLX's binary);
  then ``cg::reduce`` over the warp: ``v + shfl_xor(v, o)``, o = 16 .. 1,
  which leaves lane 0 the sum that shuffling down gives it; one rounding.

Whether a compiler contracts a multiply and an add alike in our kernel and in
MLX's is not the source's to promise (MLX's Metal library is built with
-fno-fast-math, custom kernels in MLX's default safe math mode): the self-check
on the device decides, trying each form (FORM: as written, fused, apart).
"""

from __future__ import annotations

from .attention_source import HEADER as BASE_HEADER
from .attention_source import PRELUDE

VERSION = 4  # of BODY and the headers: a change must bump it
SIMD = 32
INPUTS = ["x", "w", "bias"]
OUTPUTS = ["y"]

HEADER = {
    "metal": BASE_HEADER["metal"]
    + """
template <typename T>
inline float ep_madd_apart(T w, float x, float acc) {
#pragma clang fp contract(off)
  acc += w * x;
  return acc;
}
template <int FORM, typename T>
inline float ep_madd(T w, float x, float acc) {
  if (FORM == 1) return metal::fma(static_cast<float>(w), x, acc);
  if (FORM == 2) return ep_madd_apart(w, x, acc);
  acc += w * x;
  return acc;
}
inline float ep_shuffle_down(float v, int o) { return simd_shuffle_down(v, ushort(o)); }
template <typename T> inline T ep_zero() { return static_cast<T>(0); }
template <typename T> inline T ep_with_bias(float v, T b) { return static_cast<T>(v) + b; }
""",
    "cuda": BASE_HEADER["cuda"]
    + """
template <int FORM, typename T>
__device__ __forceinline__ float ep_madd(T w, float x, float acc) {
  if (FORM == 1) return __fmaf_rn(to_float(w), x, acc);
  if (FORM == 2) return __fadd_rn(acc, __fmul_rn(to_float(w), x));
  acc += to_float(w) * x;
  return acc;
}
__device__ __forceinline__ float ep_shuffle_down(float v, int o) { return __shfl_down_sync(0xffffffffu, v, o); }
template <typename T> __device__ __forceinline__ T ep_zero() { return from_float<T>(0.0f); }
template <typename T> __device__ __forceinline__ T ep_with_bias(float v, T b) {
  return from_float<T>(to_float(from_float<T>(v)) + to_float(b));
}
""",
}

# Template constants: T; the one-row order: LANES (lanes sharing an output's
# K: MLX's SN), VPT (consecutive values a lane takes a step: TN, or CUDA's
# n_per_thread), SPLIT (simdgroups sharing an output's K: BN), EVERY_LANE
# (Metal: a lane past K in the last step still adds its zero products);
# FORM (the multiply-add: 0 as MLX writes it, the compiler's to contract; 1
# one fma; 2 two roundings, never contracted); the launch: MR (x rows a
# threadgroup), RS (outputs a lane group), GROUPS (simdgroups a threadgroup
# per K part), AHEAD (steps a chunk); HAS_BIAS (else ``bias`` is a stand-in
# never read). x [M, K] and w [N, K] row-contiguous.
#
# The loop runs over chunks of AHEAD steps. A lane loads the next chunk's
# weights before adding the current one's, so their loads are in flight while
# it adds; the threadgroup stages the chunk's x rows in threadgroup memory as
# float (zeros past K and past M), laid out so that the lanes of a step read
# consecutive words. Each accumulator still takes its products step by step,
# value by value, as the one-row kernel does. Outputs past N load the last row
# and are not stored; rows past M are added (zeros) and not stored, so every
# lane reaches the shuffles. (The loops over registers unroll, keeping them there.)
BODY = """
  constexpr int PER_SG = (32 / LANES) * RS;
  constexpr int STEP = SPLIT * LANES * VPT;
  constexpr int SPAN = SPLIT * LANES;  // a step's lanes, VPT values each
  constexpr int CHUNK = AHEAD * STEP;  // values of a row staged at a time
  constexpr int THREADS = SPLIT * GROUPS * 32;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int part = warp % SPLIT;
  const int group = warp / SPLIT;
  const int at = lane % LANES;
  const int pos = part * LANES + at;  // the lane's place in a step
  const int n0 = (tg_x * GROUPS + group) * PER_SG + (lane / LANES) * RS;
  const int m0 = tg_y * MR;
  TG_MEM TG_ALIGN float xs[MR * CHUNK];
  TG_MEM float parts[SPLIT > 1 ? SPLIT * GROUPS * MR * PER_SG : 1];
  float acc[MR][RS];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < RS; ++r) acc[m][r] = 0.0f;
  }
  const int steps = (K + STEP - 1) / STEP;
  T wv[AHEAD][RS][VPT];
  T wn[AHEAD][RS][VPT];
  for (int s0 = 0; s0 < steps + AHEAD; s0 += AHEAD) {
    const int c0 = s0 - AHEAD;  // the chunk added in this pass; s0's weights load meanwhile
    if (c0 >= 0) {
#pragma unroll
      for (int u = 0; u < AHEAD; ++u) {
#pragma unroll
        for (int r = 0; r < RS; ++r) {
#pragma unroll
          for (int t = 0; t < VPT; ++t) wv[u][r][t] = wn[u][r][t];
        }
      }
    }
    if (s0 < steps) {
#pragma unroll
      for (int u = 0; u < AHEAD; ++u) {
        const int k = (s0 + u) * STEP + pos * VPT;
#pragma unroll
        for (int r = 0; r < RS; ++r) {
          const idx_t row = idx_t(n0 + r < N ? n0 + r : N - 1) * K;
#pragma unroll
          for (int t = 0; t < VPT; ++t) wn[u][r][t] = k + t < K ? w[row + k + t] : ep_zero<T>();
        }
      }
    }
    if (c0 < 0) continue;
    TG_BARRIER();
    for (int i = tid; i < MR * AHEAD * SPAN; i += THREADS) {
      const int p = i % SPAN;
      const int u = (i / SPAN) % AHEAD;
      const int m = i / (SPAN * AHEAD);
      const int k = (c0 + u) * STEP + p * VPT;
      for (int t = 0; t < VPT; ++t) {
        const bool inside = m0 + m < M && k + t < K;
        xs[((m * AHEAD + u) * VPT + t) * SPAN + p] = inside ? to_float(x[idx_t(m0 + m) * K + k + t]) : 0.0f;
      }
    }
    TG_BARRIER();
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) {
      const int k = (c0 + u) * STEP + pos * VPT;
      if (c0 + u < steps && (EVERY_LANE || k < K)) {
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          float xv[VPT];
#pragma unroll
          for (int t = 0; t < VPT; ++t) xv[t] = xs[((m * AHEAD + u) * VPT + t) * SPAN + pos];
#pragma unroll
          for (int r = 0; r < RS; ++r) {
#pragma unroll
            for (int t = 0; t < VPT; ++t) acc[m][r] = ep_madd<FORM>(wv[u][r][t], xv[t], acc[m][r]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MR; ++m) {
#pragma unroll
    for (int r = 0; r < RS; ++r) {
      for (int o = LANES / 2; o >= 1; o >>= 1) acc[m][r] += ep_shuffle_down(acc[m][r], o);
    }
  }
  if (SPLIT > 1) {
    const int slot = (group * MR) * PER_SG + (lane / LANES) * RS;
    if (at == 0) {
      for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < RS; ++r) parts[part * GROUPS * MR * PER_SG + slot + m * PER_SG + r] = acc[m][r];
      }
    }
    TG_BARRIER();
    if (part == 0 && at == 0) {
      for (int p = 1; p < SPLIT; ++p) {
        for (int m = 0; m < MR; ++m) {
          for (int r = 0; r < RS; ++r) acc[m][r] += parts[p * GROUPS * MR * PER_SG + slot + m * PER_SG + r];
        }
      }
    }
  }
  if (part == 0 && at == 0) {
    for (int m = 0; m < MR; ++m) {
      if (m0 + m < M) {
        for (int r = 0; r < RS; ++r) {
          const int n = n0 + r;
          if (n < N) y[idx_t(m0 + m) * N + n] = HAS_BIAS ? ep_with_bias<T>(acc[m][r], bias[n]) : from_float<T>(acc[m][r]);
        }
      }
    }
  }
"""


def source(backend: str) -> str:
    return PRELUDE[backend] + BODY
