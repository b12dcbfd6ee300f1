"""Kernel source for a verify's quantized products: one body, two dialects.

A verify multiplies its 2-32 rows by every quantized weight of the target.
MLX's one-row kernel (a plain step's) reads each weight once a row; this
kernel reads each weight once for all the rows, from device memory into
registers, and reduces every row exactly as the one-row kernel of its
backend reduces it, so a verify row comes out bit for bit as the plain step
would compute it. The body (which lane reads which part of K, the weights in
registers, the rows, the reduction across the simdgroup, the store) is shared;
each backend's header gives the per-lane arithmetic of its own one-row kernel.

The orders replicated, read from MLX's sources (github.com/ml-explore/mlx, the
tree of 0.32.2, Aug 2026; the installed 0.32.4 is checked on each machine
before use, see quantized.py):

- Lanes (both backends, every mode): a simdgroup (warp) of 32 lanes owns one
  output; lane l takes the VPT consecutive values at ``l * VPT + j * 32 * VPT``
  for j = 0, 1, ... in that order while they lie inside K (a last partial
  block: only the lanes it reaches), VPT = PACKS uint32 words of values.
  Metal: ``qmv_fast_impl`` / ``fp_qmv_fast_impl`` (kernels/quantized.h,
  fp_quantized.h; packs_per_thread 2: VPT 16 at 4 bits, 8 at 8 bits), the
  kernel MLX picks for one row where N % 8 == 0 and K is whole blocks of
  32 * VPT, else ``qmv_impl`` / ``fp_qmv_impl`` (packs_per_thread 1; their
  ``remaining`` tail is a whole VPT or nothing a lane, since K is whole groups)
  (quantized.cpp: ``qmv``; K of 64 or 128 takes ``qmv_quad``, not served).
  CUDA: ``qmv_kernel_impl`` (cuda/quantized/qmm/qmv.cu: elems_per_thread 16
  for 16-bit activations and weights of at most 4 bits, else 8, i.e. PACKS 2;
  its ``has_residue_k`` tile is the loop's last, partial step), the kernel MLX
  picks for one row on sm80 and sm90 (quantized.cpp: on sm90 only while N and
  K are at most 16384; beyond, one row takes the CUTLASS GEMM, whose order
  this kernel cannot match: its self-check fails there and MLX's product
  stays).
- Per lane, Metal affine (``load_vector`` + ``qdot``): float ``sum`` of the x
  values (4 bits: ``x[i] + x[i+1] + x[i+2] + x[i+3]`` in the activation's
  type, then added), x pre-divided by 16, 256, 4096; the masked packed nibbles
  (not shifted) times x summed in float, four at a time; then
  ``result += scale * accum + sum * bias``. Metal mxfp4 (fp ``qdot``): x as
  float, e2m1 values times x four at a time, ``result += scale * accum`` with
  the e8m0 scale as float. The expressions are MLX's own, split into
  functions where MLX's are, so the compiler contracts them alike.
- Per lane, CUDA (``dequant_fma``, CUTLASS arrays on sm80+): 4-bit weights
  (affine and mxfp4) keep 16 accumulators in the activation's type: each value
  dequantized in that type (``__hmul2`` by the scale, ``__hadd2`` of the bias),
  then ``__hfma2`` into its accumulator; 8-bit weights dequantize alike and
  keep float accumulators (``fmaf`` of the float-converted x and weight). The
  lane's total is its accumulators added in order in float. On sm90 those
  ``__hmul2`` and ``__hadd2`` are PTX ``mul``/``add`` without a rounding
  modifier, which ptxas may fuse into one ``fma``: the dequantization here is
  either (FUSED) one ``__hfma2`` or ``__hmul2_rn`` then ``__hadd2_rn`` (never
  fused), and the self-check keeps whichever matches MLX's binary.
- CUDA, an mxfp4 expert's one row (the gather, quantized_gather.py): MLX
  0.32.4's one-row ``gather_qmm`` of mxfp4 is ``fp_gather_qmv<T, 8, 4, 4, 32,
  true>`` (cuda/quantized/qmm/fp_qmv.cu; absent from the 0.32.2 tree, read
  from the PTX the 0.32.4 wheel ships), ``fp_qmv``'s order on the pair's
  expert, not qmv's: lane l takes the 32 values at ``l * 32 + j * 1024``
  (n_per_thread 4: PACKS 4), one scale group a step; each step two float sums
  from zero, the even values' and the odd values', each ``fma(x, value, sum)``
  in order (x and the e2m1 value as float, exact); then the lane's total
  ``fma(even + odd, scale, total)``, the e8m0 scale as float (0: 2^-127).
  After the butterfly, a product by the global scale (1 for mxfp4, exact).
- Across the simdgroup: Metal ``simd_sum``; CUDA ``cg::reduce`` over the warp,
  a butterfly ``v + shfl_xor(v, o)`` for o = 16, 8, 4, 2, 1 (HEADER's
  ``simd_sum``). Then one rounding to the activation's type.

Whether a compiler fuses a multiply and an add the same way in our kernel as
in MLX's is not something the source can promise (MLX's Metal library is built
with -fno-fast-math, custom kernels in the default safe math; ptxas may fuse
``mul.bf16x2`` and ``add.bf16x2``): the self-check on the device decides.
"""

from __future__ import annotations

import textwrap

from .attention_source import HEADER as BASE_HEADER
from .attention_source import PRELUDE

VERSION = 3  # of BODY and the headers: a change must bump it
SIMD = 32
INPUTS = ["x", "w", "scales", "biases"]
OUTPUTS = ["y"]

# e2m1 and e8m0 values, exact in float on both backends.
_FORMATS = """
inline float qv_fp4(unsigned b) {
  const unsigned e = (b >> 1) & 3u;
  const unsigned m = b & 1u;
  const float mag = e == 0u ? 0.5f * float(m) : float(2u + m) * float(1u << e) * 0.25f;
  return (b & 8u) ? -mag : mag;
}
"""

HEADER = {
    "metal": BASE_HEADER["metal"]
    + _FORMATS
    + """
inline float qv_e8m0(uint8_t e) { return as_type<float>(e == 0 ? 0x400000u : uint(e) << 23); }
struct qv_x {
  float v[16];
  float sum;
};
#define QV_X qv_x
#define QV_ACC float
#define QV_UNROLL
inline void qv_zero(thread float& a) { a = 0; }
inline float qv_total(thread float& a) { return a; }
template <typename T, int BITS, bool MXFP4, int VPT>
inline void qv_stage(threadgroup T* xs, threadgroup float& staged_sum, const device T* x, bool live) {
  typedef float U;
  U sum = 0;
  for (int i = 0; i < VPT; i++) {
    xs[i] = live ? x[i] : static_cast<T>(0);
  }
  if (live && !MXFP4) {
    if (BITS == 4) {
      for (int i = 0; i < VPT; i += 4) {
        sum += x[i] + x[i + 1] + x[i + 2] + x[i + 3];
      }
    } else {
      for (int i = 0; i < VPT; i++) {
        sum += x[i];
      }
    }
  }
  staged_sum = sum;
}
template <typename T, int BITS, bool MXFP4, int VPT>
inline void qv_load(thread qv_x& xs, const threadgroup T* x, float sum) {
  typedef float U;
  thread U* x_thread = xs.v;
  if (BITS == 4 && !MXFP4) {
    for (int i = 0; i < VPT; i += 4) {
      x_thread[i] = x[i];
      x_thread[i + 1] = x[i + 1] / 16.0f;
      x_thread[i + 2] = x[i + 2] / 256.0f;
      x_thread[i + 3] = x[i + 3] / 4096.0f;
    }
  } else {
    for (int i = 0; i < VPT; i++) {
      x_thread[i] = x[i];
    }
  }
  xs.sum = sum;
}
template <int BITS, int VPT>
inline float qv_qdot(thread const uint32_t* w, const thread float* x_thread, float scale, float bias, float sum) {
  typedef float U;
  U accum = 0;
  if (BITS == 4) {
    for (int i = 0; i < (VPT / 4); i++) {
      const uint16_t ws = uint16_t(w[i / 2] >> (16 * (i % 2)));
      accum +=
          (x_thread[4 * i] * (ws & 0x000f) + x_thread[4 * i + 1] * (ws & 0x00f0) +
           x_thread[4 * i + 2] * (ws & 0x0f00) + x_thread[4 * i + 3] * (ws & 0xf000));
    }
  } else {
    for (int i = 0; i < VPT; i++) {
      accum += x_thread[i] * uint8_t(w[i / 4] >> (8 * (i % 4)));
    }
  }
  return scale * accum + sum * bias;
}
template <int VPT>
inline float qv_qdot_fp4(thread const uint32_t* w, const thread float* x_thread, float scale) {
  typedef float U;
  U accum = 0;
  for (int i = 0; i < (VPT / 4); i++) {
    const uint16_t ws = uint16_t(w[i / 2] >> (16 * (i % 2)));
    accum +=
        (x_thread[4 * i] * qv_fp4(ws) + x_thread[4 * i + 1] * qv_fp4(ws >> 4) +
         x_thread[4 * i + 2] * qv_fp4(ws >> 8) + x_thread[4 * i + 3] * qv_fp4(ws >> 12));
  }
  return scale * accum;
}
inline float qv_scale(uint8_t e) { return qv_e8m0(e); }
template <typename S> inline float qv_scale(S s) { return s; }
struct qv_w {
  uint32_t w[2];
  float s;
  float b;
};
#define QV_W qv_w
template <typename T, int BITS, bool MXFP4, int VPT, bool FUSED, typename S>
inline void qv_weights(thread qv_w& q, const device uint32_t* w, S sc, T bi) {
  for (int p = 0; p < VPT * BITS / 32; ++p) q.w[p] = w[p];
  q.s = qv_scale(sc);
  q.b = bi;
}
template <typename T, int BITS, bool MXFP4, int VPT>
inline void qv_add(thread float& result, thread const qv_x& xs, thread const qv_w& q) {
  if (MXFP4) {
    result += qv_qdot_fp4<VPT>(q.w, xs.v, q.s);
  } else {
    result += qv_qdot<BITS, VPT>(q.w, xs.v, q.s, q.b, xs.sum);
  }
}
""",
    "cuda": BASE_HEADER["cuda"]
    + _FORMATS.replace("inline float", "__device__ __forceinline__ float")
    + """
template <typename T> struct qv_two;
template <> struct qv_two<__nv_bfloat16> { typedef __nv_bfloat162 type; };
template <> struct qv_two<__half> { typedef __half2 type; };
__device__ __forceinline__ __nv_bfloat162 qv_pair(__nv_bfloat16 a, __nv_bfloat16 b) { return __halves2bfloat162(a, b); }
__device__ __forceinline__ __half2 qv_pair(__half a, __half b) { return __halves2half2(a, b); }
template <typename T> struct qv_x {
  typename qv_two<T>::type p[16];  // the lane's values of a step, in pairs
};
template <typename T> struct qv_sums {
  typename qv_two<T>::type h[8];
  float f[8];
  float t;  // fp_gather_qmv's lane total
};
// MLX's one-row product of an mxfp4 expert (gather) is fp_gather_qmv: four words a lane a step.
template <bool MXFP4, int VPT> struct qv_fp_order {
  static constexpr bool value = MXFP4 && VPT == 32;
};
#define QV_X qv_x<T>
#define QV_ACC qv_sums<T>
// (the tile's row and output loops unrolled, so accumulators and weights stay in
// registers: left to nvrtc, the mxfp4 gather's wider step puts them in local memory)
#define QV_UNROLL _Pragma("unroll")
template <typename T> __device__ __forceinline__ void qv_zero(qv_sums<T>& a) {
  for (int i = 0; i < 8; ++i) {
    a.h[i] = qv_pair(from_float<T>(0.0f), from_float<T>(0.0f));
    a.f[i] = 0.0f;
  }
  a.t = 0.0f;
}
template <typename T, int BITS, bool MXFP4, int VPT>
__device__ __forceinline__ void qv_stage(T* xs, float& staged_sum, const T* x, bool live) {
  for (int i = 0; i < VPT; ++i) xs[i] = live ? x[i] : from_float<T>(0.0f);
}
template <typename T, int BITS, bool MXFP4, int VPT>
__device__ __forceinline__ void qv_load(qv_x<T>& xs, const T* x, float sum) {
  typedef typename qv_two<T>::type T2;
  for (int h = 0; h < VPT / 8; ++h) {
    const uint4 u = reinterpret_cast<const uint4*>(x)[h];
    xs.p[4 * h] = *reinterpret_cast<const T2*>(&u.x);
    xs.p[4 * h + 1] = *reinterpret_cast<const T2*>(&u.y);
    xs.p[4 * h + 2] = *reinterpret_cast<const T2*>(&u.z);
    xs.p[4 * h + 3] = *reinterpret_cast<const T2*>(&u.w);
  }
}
template <typename T> __device__ __forceinline__ T qv_scale_as(uint8_t e) {
  return from_float<T>(__uint_as_float(e == 0 ? 0x400000u : unsigned(e) << 23));
}
template <typename T> __device__ __forceinline__ T qv_scale_as(T s) { return s; }
// An e2m1 value in the activation's type (exact), from its bits: magnitudes
// 0.5 * 2^(e-1) * (2 + m) where e > 0, 0.5 * m where e == 0.
template <typename T> __device__ __forceinline__ T qv_fp4_as(unsigned b);
template <> __device__ __forceinline__ __nv_bfloat16 qv_fp4_as<__nv_bfloat16>(unsigned b) {
  const unsigned v = b & 7u;
  const unsigned mag = v == 0u ? 0u : v == 1u ? 0x3f00u : (v + 252u) << 6;
  return __ushort_as_bfloat16((unsigned short)(mag | ((b & 8u) << 12)));
}
template <> __device__ __forceinline__ __half qv_fp4_as<__half>(unsigned b) {
  const unsigned v = b & 7u;
  const unsigned mag = v == 0u ? 0u : v == 1u ? 0x3800u : (v + 28u) << 9;
  return __ushort_as_half((unsigned short)(mag | ((b & 8u) << 12)));
}
// cutlass's float_ue8m0_t as float: 0 is 2^-127, 255 NaN.
__device__ __forceinline__ float qv_scale_float(uint8_t e) {
  return __uint_as_float(e == 0 ? 0x400000u : e == 255 ? 0x7fffffffu : unsigned(e) << 23);
}
template <typename S> __device__ __forceinline__ float qv_scale_float(S s) { return to_float(s); }
// A step's weights of one output, dequantized in the activation's type once for
// every row (fp_gather_qmv: the e2m1 values, exact, and the group's scale as float).
template <typename T> struct qv_w {
  typename qv_two<T>::type q[16];
  float s;
};
#define QV_W qv_w<T>
template <typename T, int BITS, bool MXFP4, int VPT, bool FUSED, typename S>
__device__ __forceinline__ void qv_weights(qv_w<T>& d, const uint32_t* w, S sc, T bi) {
  typedef typename qv_two<T>::type T2;
  if (qv_fp_order<MXFP4, VPT>::value) {
    for (int i = 0; i < 32; i += 2) {
      const unsigned lo = (w[i / 8] >> (4 * (i % 8))) & 0xfu;
      const unsigned hi = (w[i / 8] >> (4 * (i % 8 + 1))) & 0xfu;
      d.q[i / 2] = qv_pair(qv_fp4_as<T>(lo), qv_fp4_as<T>(hi));
    }
    d.s = qv_scale_float(sc);
    return;
  }
  const T s = qv_scale_as<T>(sc);
  const T2 s2 = qv_pair(s, s);
  const T2 b2 = qv_pair(bi, bi);
  if (BITS == 8) {
    for (int i = 0; i < 8; i += 2) {
      T2 q = qv_pair(from_float<T>(float((w[i / 4] >> (8 * (i % 4))) & 0xffu)),
                     from_float<T>(float((w[i / 4] >> (8 * (i % 4 + 1))) & 0xffu)));
      d.q[i / 2] = FUSED ? __hfma2(q, s2, b2) : __hadd2_rn(__hmul2_rn(q, s2), b2);
    }
  } else {
    for (int i = 0; i < 16; i += 2) {
      const unsigned lo = (w[i / 8] >> (4 * (i % 8))) & 0xfu;
      const unsigned hi = (w[i / 8] >> (4 * (i % 8 + 1))) & 0xfu;
      T2 q = MXFP4 ? qv_pair(from_float<T>(qv_fp4(lo)), from_float<T>(qv_fp4(hi)))
                   : qv_pair(from_float<T>(float(lo)), from_float<T>(float(hi)));
      d.q[i / 2] = MXFP4 ? __hmul2_rn(q, s2) : FUSED ? __hfma2(q, s2, b2) : __hadd2_rn(__hmul2_rn(q, s2), b2);
    }
  }
}
template <typename T, int BITS, bool MXFP4, int VPT>
__device__ __forceinline__ void qv_add(qv_sums<T>& a, const qv_x<T>& xs, const qv_w<T>& d) {
  if (qv_fp_order<MXFP4, VPT>::value) {
    // even values into one float sum, odd into another, then the lane total += (both) * scale
    float ex = 0.0f, od = 0.0f;
    for (int i = 0; i < 16; ++i) {
      ex = __fmaf_rn(to_float(xs.p[i].x), to_float(d.q[i].x), ex);
      od = __fmaf_rn(to_float(xs.p[i].y), to_float(d.q[i].y), od);
    }
    a.t = __fmaf_rn(__fadd_rn(ex, od), d.s, a.t);
  } else if (BITS == 8) {
    for (int i = 0; i < 8; i += 2) {
      a.f[i] = __fmaf_rn(to_float(xs.p[i / 2].x), to_float(d.q[i / 2].x), a.f[i]);
      a.f[i + 1] = __fmaf_rn(to_float(xs.p[i / 2].y), to_float(d.q[i / 2].y), a.f[i + 1]);
    }
  } else {
    for (int i = 0; i < 8; ++i) a.h[i] = __hfma2(xs.p[i], d.q[i], a.h[i]);
  }
}
template <typename T, int BITS, bool MXFP4, int VPT>
__device__ __forceinline__ float qv_sum(const qv_sums<T>& a) {
  float sum = 0.0f;
  if (qv_fp_order<MXFP4, VPT>::value) {
    sum = a.t;
  } else if (BITS == 8) {
    for (int i = 0; i < 8; ++i) sum += a.f[i];
  } else {
    for (int i = 0; i < 8; ++i) {
      sum += to_float(a.h[i].x);
      sum += to_float(a.h[i].y);
    }
  }
  return sum;
}
#define qv_total(a) qv_sum<T, BITS, MXFP4, VPT>(a)
""",
}

# Template constants: T (activations' dtype), S (scales' dtype: T, or uint8 for
# mxfp4's e8m0), BITS, GROUP, MXFP4, PACKS (uint32 words a lane takes a step),
# FUSED (CUDA's affine dequantization in one rounding; Metal's reads none),
# MR (x rows a threadgroup), RS (outputs a simdgroup), GROUPS (simdgroups a
# threadgroup), SR (x rows staged at a time). x [rows, K] row-contiguous;
# w [N, K * BITS / 32] uint32; scales and biases [N, K / GROUP] (biases: any T
# array for mxfp4, never read). N is whole threadgroups of GROUPS * RS outputs
# and K whole groups (quantized.variant_of).
#
# A step's weights are loaded once for all the tile's rows (and on CUDA
# dequantized once); the threadgroup stages the step's x rows, SR at a time,
# in threadgroup memory (on Metal with each lane's sum of its values, as the
# one-row kernel's load_vector adds them), zeros past K and past M; a lane then
# adds each row as the one-row kernel adds it. Rows past M are skipped whole,
# so every lane of a simdgroup reaches the reduction; every thread runs every
# step, so all reach the barriers.
# The dense and gather bodies share these steps and differ only in the holes:
# ROWS_M and OUTPUTS_N (M and N), X_ROW (tile row m's x row), and where a
# step's weights are loaded (BEFORE_ROWS, once a step; IN_ROW, before a row).
_STEPS = """
  constexpr int VPT = PACKS * (BITS == 8 ? 4 : 8);
  constexpr int BLOCK = 32 * VPT;
  constexpr int THREADS = GROUPS * 32;
  const int M = ROWS_M;
  const int K = x_shape[1];
  const int N = OUTPUTS_N;
  const int KW = K * BITS / 32;
  const int KG = K / GROUP;
  const int m0 = tg_y * MR;
  const int n0 = (tg_x * GROUPS + warp) * RS;
  TG_MEM TG_ALIGN T xs[SR * BLOCK];
  TG_MEM float sums[SR * 32];
  QV_ACC acc[MR][RS];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < RS; ++r) qv_zero(acc[m][r]);
  }
  const int steps = (K + BLOCK - 1) / BLOCK;
  for (int s = 0; s < steps; ++s) {
    const int k = s * BLOCK + lane * VPT;
    QV_W wq[RS];
BEFORE_ROWS
    QV_UNROLL
    for (int h = 0; h < MR; h += SR) {
      TG_BARRIER();
      for (int i = tid; i < SR * 32; i += THREADS) {
        const int m = h + i / 32;
        const int at = s * BLOCK + (i % 32) * VPT;
        const bool live = m0 + m < M && at < K;
        qv_stage<T, BITS, MXFP4, VPT>(xs + i * VPT, sums[i], live ? x + X_ROW * K + at : x, live);
      }
      TG_BARRIER();
      if (k < K) {
        QV_UNROLL
        for (int m = h; m < h + SR; ++m) {
          if (m0 + m < M) {
IN_ROW
            QV_X xv;
            qv_load<T, BITS, MXFP4, VPT>(xv, xs + ((m - h) * 32 + lane) * VPT, sums[(m - h) * 32 + lane]);
            QV_UNROLL
            for (int r = 0; r < RS; ++r) qv_add<T, BITS, MXFP4, VPT>(acc[m][r], xv, wq[r]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    if (m0 + m < M) {
      for (int r = 0; r < RS; ++r) {
        const float v = simd_sum(qv_total(acc[m][r]));
        if (lane == 0) y[(m0 + m) * N + n0 + r] = from_float<T>(v);
      }
    }
  }
"""


def _load_weights(index: str, row: str, indent: int) -> str:
    """A step's weights of a lane's RS outputs into wq (weight row ``row`` for
    output r, indexed in type ``index``), where the lane's values lie inside K."""
    return textwrap.indent(
        f"""if (k < K) {{
  QV_UNROLL
  for (int r = 0; r < RS; ++r) {{
    const {index} row = {row};
    const {index} at = row * KW + k * BITS / 32;
    const T bias = MXFP4 ? from_float<T>(0.0f) : biases[row * KG + k / GROUP];
    qv_weights<T, BITS, MXFP4, VPT, FUSED>(wq[r], w + at, scales[row * KG + k / GROUP], bias);
  }}
}}""",
        " " * indent,
    )


def _body(rows: str, outputs: str, x_row: str, before_rows: str = "", in_row: str = "") -> str:
    """_STEPS with its holes filled (an empty piece leaves no line)."""
    text = _STEPS
    for hole, piece in (("BEFORE_ROWS", before_rows), ("IN_ROW", in_row)):
        text = text.replace(f"\n{hole}\n", f"\n{piece}\n" if piece else "\n")
    return text.replace("ROWS_M", rows).replace("OUTPUTS_N", outputs).replace("X_ROW", x_row)


BODY = _body("x_shape[0]", "w_shape[0]", "(m0 + m)", before_rows=_load_weights("int", "n0 + r", 4))

# The gather variant (a MoE layer's experts, quantized_gather.py): output row p
# is x row ``lhs[p]`` times expert ``rhs[p]``'s weight, w [E, N, K * BITS / 32],
# scales and biases [E, N, K / GROUP]: MLX's one-row gather_qmv(_fast), which
# moves its pointers to the expert and runs qmv(_fast)_impl, so each row is
# reduced as BODY reduces it (on CUDA an mxfp4 expert's is fp_gather_qmv: the
# header's fp_qmv order, four words a lane a step). A step's weights are read
# again only where the tile's next row has another expert (rows sorted by
# expert share them).
GATHER_INPUTS = ["x", "lhs", "rhs", "w", "scales", "biases"]
GATHER_BODY = _body(
    "rhs_shape[0]",
    "w_shape[1]",
    "size_t(lhs[m0 + m])",
    before_rows="    int loaded = -1;",
    in_row="""        const int e = rhs[m0 + m];
        if (e != loaded) {
          loaded = e;
"""
    + _load_weights("size_t", "size_t(e) * N + n0 + r", 10)
    + """
        }""",
)


def source(backend: str, gather: bool = False) -> str:
    return PRELUDE[backend] + (GATHER_BODY if gather else BODY)
