"""Kernel source for a verify's exact attention: one body, two dialects.

A plain step attends one query row over the filled keys, with no mask, through
``mx.fast.scaled_dot_product_attention``; a verify attends its block of rows.
This kernel computes each verify row at position p as that one-row call over
keys 0..p computes it, so the row comes out bit for bit as the plain step's.
A draft tree's node at depth d likewise, over the keys the plain step
producing its token reads: the context, then its ancestors at depths 0..d in
order (ROWS: a row's keys, the one difference between the two variants).

The orders replicated, read from MLX's sources (github.com/ml-explore/mlx;
the Metal kernels from the installed 0.32.4's
mlx/backend/metal/kernels/sdpa_vector.h, the dispatch from
mlx/backend/metal/scaled_dot_product_attention.cpp and
mlx/backend/cuda/scaled_dot_product_attention.cu of the 0.32 tree; each
machine checks before use, see exact_attention.py):

- Metal, the choice (``ScaledDotProductAttention::eval_gpu``, one query row,
  no mask, so not causal): ``sdpa_vector_2pass`` where the architecture name
  ends in 'd' or 's' and N >= 1024, or under GQA where N >= 4096; else
  ``sdpa_vector``. The 2-pass block count (``sdpa_vector_2pass``, n_simds =
  the GQA factor for one row): 's': 64, or where N > 1024 and n_simds > 4,
  128 to N <= 8192, 256 to 32768, 512 to 65536, else 1024; 'd': 128, 256
  where n_simds <= 2 and N > 8192, or where n_simds >= 6 512 from N = 16384
  and 1024 from 65536; any other: 64 where n_simds >= 4, else 32. GQA 8 at
  head dim 64/128, or 12 and 16 at 128, from N = 8192 takes
  ``sdpa_vector_2pass_1_gqa`` for the first kernel (below, GQA_BODY; the
  heads a simdgroup from MLX's instantiations: 8 at GQA 8 and head dim 64, 4
  at GQA 8 and 12 at 128, 2 at GQA 16).
- Metal, a stream (both kernels): a simdgroup takes keys s, s + S, s + 2S, ...
  below N (``sdpa_vector``: s its simdgroup of 32, S = 32; the 2-pass's first
  kernel: s its block, S the block count); a lane takes head-dim values
  lane * D/32 ..; q is read as ``float(scale) * q`` once; per key ``score +=
  q[j] * k[j]`` over the lane's values in order, ``simd_sum``, then the online
  softmax from max -FLT_MAX, sum 0: ``new_max = max(max, score)``, ``factor =
  fast::exp(max - new_max)``, ``exp_score = fast::exp(score - new_max)``,
  ``sum = sum * factor + exp_score``, ``o = o * factor + exp_score * v``.
- Metal ``sdpa_vector``'s merge of its 32 streams: lane l holds stream l's
  max; ``new_max = simd_max``, ``factor = fast::exp(max_l - new_max)``, ``sum
  = simd_sum(sum_l * factor)``; each output element ``simd_sum(o_l * factor)``
  over the 32 streams, divided by the sum unless it is 0, rounded once.
- Metal ``sdpa_vector_2pass``: the first kernel writes each block's o
  rounded to T, its max and sum in float; the second, lane l takes blocks l,
  l + 32, ...: its max of their maxes from -FLT_MAX, ``simd_max``; its ``sum
  += factor * sums[b]`` in order, ``simd_sum``; each element its ``o +=
  factor * float(partial[b])`` in order, ``simd_sum`` over the lanes (the
  transposition through threadgroup memory lands stream class l on lane l),
  divided by the sum unless it is 0, rounded once.
- CUDA (``sdpa_vector_1pass_fallback``, N <= 1024; MLX's 2-pass from 1025,
  and cuDNN for 256 keys or more of a cache's buffer: neither is served):
  the stream and merge of Metal's ``sdpa_vector`` with q scaled by ``float(scale
  * M_LOG2E)`` (a double product), ``exp2f`` for the exponentials,
  ``cg::reduce`` (xor butterfly) for the warp sums and max, and the merge's
  sum applied as ``* __frcp_rn(sum)``.

The rows MLX's one-pass kernel takes run in one launch of its 32 simdgroups
over a tile of rows (a key read once for the tile, the merge in threadgroup
memory); where the buffer is long enough for a row to take the two-pass
kernel, two more launches take those rows (the host cannot tell which: a
row's position is on the device).

Whether a compiler contracts a multiply and an add in MLX's binary is the
compiler's to say: FORM 0 writes each multiply-add as MLX does (the compiler's
to contract), 1 contracts each as clang does (the first product fused into
the add), 2 keeps every rounding apart; the self-check keeps the form that
matches.
"""

from __future__ import annotations

from .attention_source import HEADER as BASE_HEADER

VERSION = 3  # of the bodies and headers: a change must bump it
SIMD = 32
ONE_PASS_INPUTS = ["queries", "keys", "values", "q_offset", "params", "dims"]
ONE_PASS_OUTPUTS = ["out"]
PARTIAL_INPUTS = ONE_PASS_INPUTS
PARTIAL_OUTPUTS = ["o_part", "m_part", "l_part"]
GQA_INPUTS = PARTIAL_INPUTS
GQA_OUTPUTS = PARTIAL_OUTPUTS
MERGE_INPUTS = ["o_part", "m_part", "l_part", "o_gqa", "m_gqa", "l_gqa", "q_offset", "dims", "first"]
MERGE_OUTPUTS = ["out"]
# A draft tree's variants (exact_attention: tree): each node's depth [N] and its
# ancestors' node indices [N, W] (column j: the ancestor at depth j), dims' W at dims[4].
TREE_INPUTS = ["depths", "ancestors"]
# The architecture a Metal device's name ends in (MLX's ``devc``), as the kernels' arch code.
ARCH = {"s": 1, "d": 2}

# MLX's one-row choice, per backend: the 2-pass block count a row of N keys
# takes at GQA g, or 0 where the one-pass kernel (32 streams) takes it.
RULES = {
    "metal": """
inline int ea_blocks(int arch, int n, int g) {
  if (!(((arch == 1 || arch == 2) && n >= 1024) || (g > 1 && n >= 4096))) return 0;
  if (arch == 1) {
    if (n > 1024 && g > 4) return n <= 8192 ? 128 : n <= 32768 ? 256 : n <= 65536 ? 512 : 1024;
    return 64;
  }
  if (arch == 2) {
    if (g <= 2 && n > 8192) return 256;
    if (g >= 6) return n >= 65536 ? 1024 : n >= 16384 ? 512 : 128;
    return 128;
  }
  return g >= 4 ? 64 : 32;
}
// Whether a row's two-pass call takes sdpa_vector_2pass_1_gqa (no mask, no sinks, one row).
inline bool ea_gqa(int arch, int n, int g, int d) {
  return n >= 8192 && ((g == 8 && (d == 64 || d == 128)) || ((g == 12 || g == 16) && d == 128));
}
""",
    "cuda": """
__device__ __forceinline__ int ea_blocks(int arch, int n, int g) { return 0; }
__device__ __forceinline__ bool ea_gqa(int arch, int n, int g, int d) { return false; }
""",
}

HEADER = {
    "metal": BASE_HEADER["metal"]
    + RULES["metal"]
    + """
#define EA_FINITE_MIN (-0x1.fffffep+127f)
inline float ea_exp(float x) { return metal::fast::exp(x); }
inline float ea_max(float a, float b) { return a < b ? b : a; }
inline float ea_norm(float s, float sum) { return sum == 0 ? s : s / sum; }
inline float ea_mul_add_apart(float a, float b, float c) {
#pragma clang fp contract(off)
  return a * b + c;
}
inline float ea_two_apart(float a, float b, float c, float d) {
#pragma clang fp contract(off)
  return a * b + c * d;
}
// acc + a * b (MLX: ``score += q * k``, ``sum += factor * s``, ``o += factor * p``)
template <int FORM> inline float ea_madd(float acc, float a, float b) {
  if (FORM == 1) return metal::fma(a, b, acc);
  if (FORM == 2) return ea_mul_add_apart(a, b, acc);
  acc += a * b;
  return acc;
}
// a * b + c (MLX: ``sum * factor + exp_score``)
template <int FORM> inline float ea_scale_add(float a, float b, float c) {
  if (FORM == 1) return metal::fma(a, b, c);
  if (FORM == 2) return ea_mul_add_apart(a, b, c);
  return a * b + c;
}
// a * b + c * d (MLX: ``o * factor + exp_score * v``)
template <int FORM> inline float ea_two(float a, float b, float c, float d) {
  if (FORM == 1) return metal::fma(a, b, c * d);
  if (FORM == 2) return ea_two_apart(a, b, c, d);
  return a * b + c * d;
}
""",
    "cuda": BASE_HEADER["cuda"]
    + RULES["cuda"]
    + """
#define EA_FINITE_MIN (-0x1.fffffep+127f)
__device__ __forceinline__ float ea_exp(float x) { return exp2f(x); }
__device__ __forceinline__ float ea_max(float a, float b) { return a < b ? b : a; }
__device__ __forceinline__ float ea_norm(float s, float sum) { return s * (sum == 0 ? 0.0f : __frcp_rn(sum)); }
template <int FORM> __device__ __forceinline__ float ea_madd(float acc, float a, float b) {
  if (FORM == 2) return __fadd_rn(acc, __fmul_rn(a, b));
  acc += a * b;
  return acc;
}
template <int FORM> __device__ __forceinline__ float ea_scale_add(float a, float b, float c) {
  if (FORM == 2) return __fadd_rn(__fmul_rn(a, b), c);
  return a * b + c;
}
template <int FORM> __device__ __forceinline__ float ea_two(float a, float b, float c, float d) {
  if (FORM == 2) return __fadd_rn(__fmul_rn(a, b), __fmul_rn(c, d));
  return a * b + c * d;
}
""",
}

# A row's keys: EA_COUNT(i) the keys row i's one-row call reads, EA_KEY(i, k)
# the buffer row holding its key k. A block's row i sits at q_offset + i over
# keys 0..that; a tree's node at depth d reads the context, then its ancestors
# at depths 0..d (itself last), written at q_offset + their node index.
ROWS = {
    False: """
#define EA_TREE 0
#define EA_COUNT(i) (q_offset[0] + (i) + 1)
#define EA_KEY(i, k) (k)
""",
    True: """
#define EA_TREE 1
#define EA_COUNT(i) (q_offset[0] + depths[i] + 1)
#define EA_KEY(i, k) ((k) < q_offset[0] ? (k) : q_offset[0] + ancestors[(i) * dims[4] + (k) - q_offset[0]])
""",
}

PRELUDE = {
    "metal": """
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int tg_x = int(threadgroup_position_in_grid.x);
  const int tg_y = int(threadgroup_position_in_grid.y);
""",
    "cuda": """
  const int lane = int(threadIdx.x) & 31;
  const int warp = int(threadIdx.x) >> 5;
  const int tg_x = int(blockIdx.x);
  const int tg_y = int(blockIdx.y);
""",
}

# The rows MLX's one-pass kernel takes (``sdpa_vector``; CUDA's ``sdpav``
# one-pass): a threadgroup of its 32 simdgroups, simdgroup s MLX's stream s,
# over a tile of RT rows of one KV head, so each key is read once for the tile;
# then, row by row, MLX's merge through threadgroup memory. Template constants:
# T, D, FORM, RT (rows a tile). The grid's x is the row tiles, its y (batch x
# KV head). dims, params: as the two-pass kernels' below. Rows the one-pass
# kernel does not take are not written (the two-pass merge writes them).
ONE_PASS_BODY = """
  constexpr int DL = D / 32;
  const int L = queries_shape[2];
  const int HQ = queries_shape[1];
  const int HKV = keys_shape[1];
  const int G = HQ / HKV;
  const int R = G * L;
  const int b = tg_y / HKV;
  const int hk = tg_y % HKV;
  TG_MEM float tg_m[32];
  TG_MEM float tg_l[32];
  TG_MEM float tg_o[32 * 32];
  float q[RT][DL];
  float o[RT][DL];
  float m[RT];
  float l[RT];
  int n[RT];
  int node[RT];
  int most = 0;
  for (int rr = 0; rr < RT; ++rr) {
    const int r = tg_x * RT + rr;
    const int h = hk * G + (r < R ? r / L : 0);
    const int i = r < R ? r % L : 0;
    node[rr] = i;
    n[rr] = EA_COUNT(i);
    if (r >= R || ea_blocks(dims[3], n[rr], G) > 0) n[rr] = 0;
    most = n[rr] > most ? n[rr] : most;
    const DEV T* qp = queries + b * queries_strides[0] + h * queries_strides[1] + i * queries_strides[2];
    for (int j = 0; j < DL; ++j) {
      q[rr][j] = params[0] * to_float(qp[(lane * DL + j) * queries_strides[3]]);
      o[rr][j] = 0.0f;
    }
    m[rr] = EA_FINITE_MIN;
    l[rr] = 0.0f;
  }
  const DEV T* kp = keys + b * keys_strides[0] + hk * keys_strides[1] + lane * DL;
  const DEV T* vp = values + b * values_strides[0] + hk * values_strides[1] + lane * DL;
  for (int k = warp; k < most; k += 32) {
    const DEV T* kk = kp + idx_t(k) * keys_strides[2];
    const DEV T* vv = vp + idx_t(k) * values_strides[2];
    float kf[DL];
    float vf[DL];
    for (int j = 0; j < DL; ++j) {
      kf[j] = to_float(kk[j]);
      vf[j] = to_float(vv[j]);
    }
    for (int rr = 0; rr < RT; ++rr) {
      if (k < n[rr]) {
        if (EA_TREE && k >= q_offset[0]) {  // (a tree's node reads its own ancestor there)
          const idx_t at = idx_t(EA_KEY(node[rr], k));
          for (int j = 0; j < DL; ++j) {
            kf[j] = to_float(kp[at * keys_strides[2] + j]);
            vf[j] = to_float(vp[at * values_strides[2] + j]);
          }
        }
        float score = 0.0f;
        for (int j = 0; j < DL; ++j) score = ea_madd<FORM>(score, q[rr][j], kf[j]);
        score = simd_sum(score);
        const float new_m = ea_max(m[rr], score);
        const float factor = ea_exp(m[rr] - new_m);
        const float e = ea_exp(score - new_m);
        m[rr] = new_m;
        l[rr] = ea_scale_add<FORM>(l[rr], factor, e);
        for (int j = 0; j < DL; ++j) o[rr][j] = ea_two<FORM>(o[rr][j], factor, e, vf[j]);
      }
    }
  }
  for (int rr = 0; rr < RT; ++rr) {
    if (lane == 0) {
      tg_m[warp] = m[rr];
      tg_l[warp] = l[rr];
    }
    TG_BARRIER();
    const float mm = tg_m[lane];
    const float factor = ea_exp(mm - simd_max(mm));
    const float sum = simd_sum(tg_l[lane] * factor);
    const int r = tg_x * RT + rr;
    for (int j = 0; j < DL; ++j) {
      tg_o[lane * 32 + warp] = o[rr][j];
      TG_BARRIER();
      const float s = simd_sum(tg_o[warp * 32 + lane] * factor);
      TG_BARRIER();
      if (lane == 0 && n[rr] > 0) {
        const int h = hk * G + r / L;
        out[idx_t((b * HQ + h) * L + r % L) * D + warp * DL + j] = from_float<T>(ea_norm(s, sum));
      }
    }
  }
"""

# The rows MLX's two-pass kernel takes, its first kernel: template constants
# T, D, FORM, NW (rows a threadgroup: one simdgroup a row). dims: (L, G, S,
# arch: Metal's ARCH code for the device's architecture, 0 for any other; CUDA
# 0); params: the scale q is read with (Metal: the scale; CUDA: scale *
# log2(e)). The grid's x is (block, row tile), its y (batch x KV head): the rows
# of a tile read the same keys at once. Row r of a KV head is query head hk * G
# + r / L, verify row r % L, at position q_offset + r % L: its one-row call reads
# N = that + 1 keys. A block past the row's count is not written (the merge
# never reads it), nor a row the one-pass or the GQA kernel takes. queries [B, HQ, L, D],
# keys and values [B, HKV, >= N, D], read through their strides (the head dim
# contiguous); o_part [rows, S, D] in T (as MLX stores it),
# m_part, l_part [rows, S].
PARTIAL_BODY = """
  constexpr int DL = D / 32;
  const int L = queries_shape[2];
  const int HQ = queries_shape[1];
  const int HKV = keys_shape[1];
  const int G = HQ / HKV;
  const int R = G * L;
  const int tiles = (R + NW - 1) / NW;
  const int S = dims[2];
  const int stream = tg_x / tiles;  // (the grid's x: S streams x tiles)
  const int r = (tg_x % tiles) * NW + warp;
  const int b = tg_y / HKV;
  const int hk = tg_y % HKV;
  if (r < R) {
    const int h = hk * G + r / L;
    const int i = r % L;
    const int n = EA_COUNT(i);
    const int blocks = ea_blocks(dims[3], n, G);
    if (stream < blocks && !ea_gqa(dims[3], n, G, D)) {
      const DEV T* qp = queries + b * queries_strides[0] + h * queries_strides[1] + i * queries_strides[2];
      float q[DL];
      float o[DL];
      for (int j = 0; j < DL; ++j) {
        q[j] = params[0] * to_float(qp[(lane * DL + j) * queries_strides[3]]);
        o[j] = 0.0f;
      }
      float m = EA_FINITE_MIN;
      float l = 0.0f;
      const DEV T* kp = keys + b * keys_strides[0] + hk * keys_strides[1] + lane * DL;
      const DEV T* vp = values + b * values_strides[0] + hk * values_strides[1] + lane * DL;
      for (int k = stream; k < n; k += blocks) {
        const DEV T* kk = kp + idx_t(EA_KEY(i, k)) * keys_strides[2];
        const DEV T* vv = vp + idx_t(EA_KEY(i, k)) * values_strides[2];
        float score = 0.0f;
        for (int j = 0; j < DL; ++j) score = ea_madd<FORM>(score, q[j], to_float(kk[j]));
        score = simd_sum(score);
        const float new_m = ea_max(m, score);
        const float factor = ea_exp(m - new_m);
        const float e = ea_exp(score - new_m);
        m = new_m;
        l = ea_scale_add<FORM>(l, factor, e);
        for (int j = 0; j < DL; ++j) o[j] = ea_two<FORM>(o[j], factor, e, to_float(vv[j]));
      }
      const idx_t at = idx_t((b * HQ + h) * L + i) * S + stream;
      for (int j = 0; j < DL; ++j) {
        o_part[at * D + lane * DL + j] = from_float<T>(o[j]);
      }
      if (lane == 0) {
        m_part[at] = m;
        l_part[at] = l;
      }
    }
  }
"""

# The rows MLX's two-pass call sends to ``sdpa_vector_2pass_1_gqa`` (Metal,
# GQA 8 at head dim 64/128 or 12/16 at 128, from 8192 keys), its first kernel:
# a threadgroup per (block, verify row) and (batch x KV head) of GQ simdgroups;
# the block's keys are one run of ceil(N / blocks), cut into HPT sub-runs;
# simdgroup g takes sub-run g / (GQ / HPT) for HPT heads from (g % (GQ / HPT))
# x HPT, each head's online softmax as the other kernels'; then each head's
# sub-runs meet in threadgroup memory (outputs normalised, weighted back by
# sum x exp(max - their max) in order) and its block's output (rounded to T),
# sum and max are written as the two-pass first kernel writes them.
GQA_BODY = """
  constexpr int DL = D / 32;
  constexpr int NT = GQ / HPT;
  const int L = queries_shape[2];
  const int HQ = queries_shape[1];
  const int HKV = keys_shape[1];
  const int S = dims[2];
  const int blk = tg_x / L;
  const int i = tg_x % L;
  const int b = tg_y / HKV;
  const int hk = tg_y % HKV;
  const int n = EA_COUNT(i);
  const int blocks = ea_blocks(dims[3], n, GQ);
  TG_MEM float o_sh[GQ * HPT * D];
  TG_MEM float se_sh[GQ * HPT];
  TG_MEM float mx_sh[GQ * HPT];
  if (ea_gqa(dims[3], n, GQ, D) && blk < blocks) {
    const int cchunk = warp / NT;
    const int h0 = (warp % NT) * HPT;
    const int chunk = (n + blocks - 1) / blocks;
    const int kstart = blk * chunk;
    const int kend = kstart + chunk < n ? kstart + chunk : n;
    const int sub = (chunk + HPT - 1) / HPT;
    const int s0 = kstart + cchunk * sub;
    const int s1 = s0 + sub < kend ? s0 + sub : kend;
    float q[HPT][DL];
    float o[HPT][DL];
    float m[HPT];
    float l[HPT];
    for (int j = 0; j < HPT; ++j) {
      const DEV T* qp = queries + b * queries_strides[0] + (hk * GQ + h0 + j) * queries_strides[1] + i * queries_strides[2];
      for (int x = 0; x < DL; ++x) {
        q[j][x] = params[0] * to_float(qp[(lane * DL + x) * queries_strides[3]]);
        o[j][x] = 0.0f;
      }
      m[j] = EA_FINITE_MIN;
      l[j] = 0.0f;
    }
    const DEV T* kp = keys + b * keys_strides[0] + hk * keys_strides[1] + lane * DL;
    const DEV T* vp = values + b * values_strides[0] + hk * values_strides[1] + lane * DL;
    for (int t = s0; t < s1; ++t) {
      float kf[DL];
      float vf[DL];
      const idx_t at = idx_t(EA_KEY(i, t));
      for (int x = 0; x < DL; ++x) {
        kf[x] = to_float(kp[at * keys_strides[2] + x]);
        vf[x] = to_float(vp[at * values_strides[2] + x]);
      }
      for (int j = 0; j < HPT; ++j) {
        float score = 0.0f;
        for (int x = 0; x < DL; ++x) score = ea_madd<FORM>(score, q[j][x], kf[x]);
        score = simd_sum(score);
        const float new_m = ea_max(m[j], score);
        const float factor = ea_exp(m[j] - new_m);
        const float e = ea_exp(score - new_m);
        m[j] = new_m;
        l[j] = ea_scale_add<FORM>(l[j], factor, e);
        for (int x = 0; x < DL; ++x) o[j][x] = ea_two<FORM>(o[j][x], factor, e, vf[x]);
      }
    }
    for (int j = 0; j < HPT; ++j) {
      const int slot = (h0 + j) * HPT + cchunk;
      const float inv = l[j] > 0 ? 1 / l[j] : 0;
      for (int x = 0; x < DL; ++x) o_sh[slot * D + lane * DL + x] = o[j][x] * inv;
      if (lane == 0) {
        se_sh[slot] = l[j];
        mx_sh[slot] = m[j];
      }
    }
  }
  TG_BARRIER();
  if (ea_gqa(dims[3], n, GQ, D) && blk < blocks) {
    float gmax = EA_FINITE_MIN;
    for (int s = 0; s < HPT; ++s) gmax = ea_max(gmax, mx_sh[warp * HPT + s]);
    float denom = 0.0f;
    float acc[DL];
    for (int x = 0; x < DL; ++x) acc[x] = 0.0f;
    for (int s = 0; s < HPT; ++s) {
      const float w = se_sh[warp * HPT + s] * ea_exp(mx_sh[warp * HPT + s] - gmax);
      denom += w;
      for (int x = 0; x < DL; ++x) acc[x] = ea_madd<FORM>(acc[x], w, o_sh[(warp * HPT + s) * D + lane * DL + x]);
    }
    const idx_t at = idx_t((b * HQ + hk * GQ + warp) * L + i) * S + blk;
    for (int x = 0; x < DL; ++x) o_part[at * D + lane * DL + x] = from_float<T>(acc[x]);
    if (lane == 0) {
      l_part[at] = denom;
      m_part[at] = gmax;
    }
  }
"""

# The two-pass kernel's second: one row a threadgroup of MW simdgroups,
# output element e taken by simdgroup e % MW, lane l standing for MLX's blocks
# l, l + 32, ...; a row's blocks from the GQA kernel's outputs (*_gqa) where it
# took the row, else the two-pass first kernel's; a row the one-pass kernel
# took is copied from ``first`` (its output). dims as above. out [rows, D] in
# T, rows as o_part's.
MERGE_BODY = """
  const int L = dims[0];
  const int G = dims[1];
  const int S = dims[2];
  const int row = tg_x;
  const int n = EA_COUNT(row % L);
  const int blocks = ea_blocks(dims[3], n, G);
  const idx_t base = idx_t(row) * S;
  const bool gqa = ea_gqa(dims[3], n, G, D);
  const DEV T* parts = gqa ? o_gqa : o_part;
  const DEV float* maxes = gqa ? m_gqa : m_part;
  const DEV float* sums = gqa ? l_gqa : l_part;
  if (blocks == 0) {
    for (int e = warp * 32 + lane; e < D; e += MW * 32) out[idx_t(row) * D + e] = first[idx_t(row) * D + e];
  } else {
    float m = EA_FINITE_MIN;
    for (int c = lane; c < blocks; c += 32) m = ea_max(m, maxes[base + c]);
    m = simd_max(m);
    float sum = 0.0f;
    for (int c = lane; c < blocks; c += 32) sum = ea_madd<FORM>(sum, ea_exp(maxes[base + c] - m), sums[base + c]);
    sum = simd_sum(sum);
    for (int e = warp; e < D; e += MW) {
      float acc = 0.0f;
      for (int c = lane; c < blocks; c += 32) acc = ea_madd<FORM>(acc, ea_exp(maxes[base + c] - m), to_float(parts[(base + c) * D + e]));
      const float s = simd_sum(acc);
      if (lane == 0) out[idx_t(row) * D + e] = from_float<T>(ea_norm(s, sum));
    }
  }
"""


def one_pass_source(backend: str, tree: bool = False) -> str:
    return PRELUDE[backend] + ROWS[tree] + ONE_PASS_BODY


def gqa_source(backend: str, tree: bool = False) -> str:
    return PRELUDE[backend] + ROWS[tree] + GQA_BODY


def partial_source(backend: str, tree: bool = False) -> str:
    return PRELUDE[backend] + ROWS[tree] + PARTIAL_BODY


def merge_source(backend: str, tree: bool = False) -> str:
    return PRELUDE[backend] + ROWS[tree] + MERGE_BODY
