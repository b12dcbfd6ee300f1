"""Pass 1 of block attention on the GPU's matrix units: one body, two dialects.

For 2-byte dtypes (bf16, fp16) the partial pass runs its two products,
scores = Q K^T and out += P V, as 16 x 8 tiles on the matrix units
(``mma.sync`` m16n8k16 on CUDA, ``simdgroup_matrix`` 8 x 8 pairs on Metal).
fp32 keeps the SIMT body of source.py; the merge pass is shared.

One threadgroup per (row tile, key chunk, batch x kv head) holds up to 64
query rows of one key-value head, so each key and value is read once per
chunk for all of them (a verify block of 16 rows at GQA 4 is 64 rows). Each
warp (simdgroup) owns 16 rows. A tile of KT keys and their values is staged in
threadgroup memory by the whole threadgroup; rows past the valid range are
zero-filled, so the unfilled tail of a buffer is never read and never meets a
product. ST such tiles are staged at once: on CUDA the next tiles' loads
(cp.async) are in flight while one is computed; Metal copies at once. Tiles
that every row sees whole (most of a long context) skip the mask.

Every thread holds the same four elements of each 16 x 8 score tile in both
dialects: rows ``fr`` and ``fr + 8``, columns ``fc`` and ``fc + 1`` (only the
formulas for fr and fc differ). So the mask, the online softmax and the
stores are written once below; the dialects supply the staging memory
(``STAGING``), the tile products (``LOAD_Q``, ``SCORES``, ``SCALE_OUT``,
``P_TIMES_V``), the element of an output tile (``OUT(nt, e)``) and the
reductions over a row's four threads.
"""

from __future__ import annotations

from .attention_source import GRID_PLACE, KEY_RANGE, TREE_NODES_DEPTHS, TREE_WORDS, tree_parts

HEADER = {
    "metal": """
#include <metal_simdgroup_matrix>
typedef simdgroup_matrix<float, 8, 8> tile8;
// The thread's two elements of an 8 x 8 tile (row fr, columns fc and fc + 1).
inline thread float2& el(thread tile8& m) { return reinterpret_cast<thread float2&>(m.thread_elements()); }
inline bool warp_any(bool p) { return simd_any(p); }
inline void store2(device float* p, float a, float b) { *reinterpret_cast<device float2*>(p) = float2(a, b); }
inline float row_max4(float v) {
  v = metal::max(v, simd_shuffle_xor(v, ushort(1)));
  return metal::max(v, simd_shuffle_xor(v, ushort(8)));
}
inline float row_sum4(float v) {
  v += simd_shuffle_xor(v, ushort(1));
  return v + simd_shuffle_xor(v, ushort(8));
}
// Staging: eight elements into threadgroup memory (zeros where not valid); Metal copies
// at once, so committing and waiting are no-ops.
template <typename U> inline void stage8(threadgroup U* dst, const device U* src, bool valid) {
  for (int i = 0; i < 8; ++i) dst[i] = valid ? src[i] : static_cast<U>(0.0f);
}
inline void stage_commit() {}
template <int N> inline void stage_wait() {}
""",
    "cuda": """
__device__ __forceinline__ bool warp_any(bool p) { return __any_sync(0xffffffffu, p); }
__device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ float row_max4(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float row_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// Two 16-bit elements `stride` apart, packed as one product operand (one 32-bit load
// when they are adjacent, as in every query a layer makes).
template <typename U> __device__ __forceinline__ unsigned int ld2s(const U* p, idx_t stride) {
  if (stride == 1) return *reinterpret_cast<const unsigned int*>(p);
  const unsigned int lo = *reinterpret_cast<const unsigned short*>(p);
  const unsigned int hi = *reinterpret_cast<const unsigned short*>(p + stride);
  return lo | (hi << 16);
}
__device__ __forceinline__ unsigned int shared_addr(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
// Staging: 16 bytes into shared memory without waiting (cp.async; zeros where not valid),
// so the next tile's loads are in flight while this one is computed.
template <typename U> __device__ __forceinline__ void stage8(U* dst, const U* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(shared_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void stage_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void stage_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
// Four 8 x 8 matrices of 16-bit values as the B operands of two m16n8k16 products
// (lane l gives the address of row l % 8 of matrix l / 8): rows of K as they are,
// rows of V transposed.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_addr(p)));
}
template <typename U> __device__ __forceinline__ unsigned int pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned int pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&v);
}
template <> __device__ __forceinline__ unsigned int pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&v);
}
// c (16 x 8, fp32) += a (16 x 16) . b (16 x 8), 16-bit inputs.
template <typename U> __device__ __forceinline__ void mma16816(float* c, const unsigned int* a, unsigned int b0, unsigned int b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
""",
}

# The thread's place in a 16 x 8 tile: rows fr and fr + 8, columns fc and fc + 1.
COORDS = {
    "metal": """
  const int fr = ((lane >> 2) & 4) + ((lane >> 1) & 3);
  const int fc = ((lane >> 2) & 2) * 2 + (lane & 1) * 2;
""",
    "cuda": """
  const int fr = lane >> 2;
  const int fc = 2 * (lane & 3);
""",
}

# Q's 16 rows x D as product operands (qa, qb: the thread's two rows' data).
LOAD_Q = {
    "metal": """
  tile8 qt[2][D / 8];
  for (int kk = 0; kk < D / 8; ++kk) {
    const idx_t c = kk * 8 + fc;
    el(qt[0][kk])[0] = live_a ? float(qa[c * qsd]) : 0.0f;
    el(qt[0][kk])[1] = live_a ? float(qa[(c + 1) * qsd]) : 0.0f;
    el(qt[1][kk])[0] = live_b ? float(qb[c * qsd]) : 0.0f;
    el(qt[1][kk])[1] = live_b ? float(qb[(c + 1) * qsd]) : 0.0f;
  }
  tile8 ot[2][D / 8];
  for (int nt = 0; nt < D / 8; ++nt) {
    ot[0][nt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    ot[1][nt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
""",
    "cuda": """
  unsigned int qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    const idx_t c = kk * 16 + fc;
    qf[kk][0] = live_a ? ld2s(qa + c * qsd, qsd) : 0u;
    qf[kk][1] = live_b ? ld2s(qb + c * qsd, qsd) : 0u;
    qf[kk][2] = live_a ? ld2s(qa + (c + 8) * qsd, qsd) : 0u;
    qf[kk][3] = live_b ? ld2s(qb + (c + 8) * qsd, qsd) : 0u;
  }
  float ot[D / 8][4];
  for (int nt = 0; nt < D / 8; ++nt) ot[nt][0] = ot[nt][1] = ot[nt][2] = ot[nt][3] = 0.0f;
""",
}

# s[t][e]: the scores of the staged keys t * 8 + fc + (e & 1) for row fr (e < 2) or fr + 8.
SCORES = {
    "metal": """
    for (int t = 0; t < NT; ++t) {
      tile8 sa = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      tile8 sb = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int kk = 0; kk < D / 8; ++kk) {
        tile8 kt;  // K^T: row = head-dim element, column = key
        el(kt)[0] = float(kb[(t * 8 + fc) * DP + kk * 8 + fr]);
        el(kt)[1] = float(kb[(t * 8 + fc + 1) * DP + kk * 8 + fr]);
        simdgroup_multiply_accumulate(sa, qt[0][kk], kt, sa);
        simdgroup_multiply_accumulate(sb, qt[1][kk], kt, sb);
      }
      s[t][0] = el(sa)[0];
      s[t][1] = el(sa)[1];
      s[t][2] = el(sb)[0];
      s[t][3] = el(sb)[1];
    }
""",
    "cuda": """
    for (int t = 0; t < NT; ++t) {
      s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
      for (int kk = 0; kk < D / 16; kk += 2) {
        // keys t * 8 .. + 7 against head dims kk * 16 .. + 31: four 8 x 8 matrices
        unsigned int kf[4];
        ldmatrix_x4(kf, kb + (t * 8 + (lane & 7)) * DP + (kk + (lane >> 4)) * 16 + ((lane >> 3) & 1) * 8);
        mma16816<T>(s[t], qf[kk], kf[0], kf[1]);
        mma16816<T>(s[t], qf[kk + 1], kf[2], kf[3]);
      }
    }
""",
}

SCALE_OUT = {
    "metal": """
    for (int nt = 0; nt < D / 8; ++nt) {
      el(ot[0][nt]) *= corr_a;
      el(ot[1][nt]) *= corr_b;
    }
""",
    "cuda": """
    for (int nt = 0; nt < D / 8; ++nt) {
      ot[nt][0] *= corr_a; ot[nt][1] *= corr_a;
      ot[nt][2] *= corr_b; ot[nt][3] *= corr_b;
    }
""",
}

# out += P V over the staged tile; P is s after the softmax.
P_TIMES_V = {
    "metal": """
    for (int t = 0; t < NT; ++t) {
      tile8 pa, pb;
      el(pa)[0] = s[t][0];
      el(pa)[1] = s[t][1];
      el(pb)[0] = s[t][2];
      el(pb)[1] = s[t][3];
      for (int nt = 0; nt < D / 8; ++nt) {
        tile8 vt;  // V: row = key, column = head-dim element
        el(vt)[0] = float(vb[(t * 8 + fr) * DP + nt * 8 + fc]);
        el(vt)[1] = float(vb[(t * 8 + fr) * DP + nt * 8 + fc + 1]);
        simdgroup_multiply_accumulate(ot[0][nt], pa, vt, ot[0][nt]);
        simdgroup_multiply_accumulate(ot[1][nt], pb, vt, ot[1][nt]);
      }
    }
""",
    "cuda": """
    for (int j = 0; j < NT / 2; ++j) {
      const unsigned int pf[4] = {
          pack2<T>(s[2 * j][0], s[2 * j][1]), pack2<T>(s[2 * j][2], s[2 * j][3]),
          pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]), pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3])};
      for (int nt = 0; nt < D / 8; nt += 2) {
        unsigned int vf[4];
        ldmatrix_x4_trans(vf, vb + (j * 16 + (lane & 15)) * DP + nt * 8 + (lane >> 4) * 8);
        mma16816<T>(ot[nt], pf, vf[0], vf[1]);
        mma16816<T>(ot[nt + 1], pf, vf[2], vf[3]);
      }
    }
""",
}

# ST staging buffers of KT keys and KT values: static on Metal (under its 32 KB),
# dynamic shared memory on CUDA (sized by the launch, past the 48 KB static limit).
STAGING = {
    "metal": """
  threadgroup T ks[ST * KT * DP];
  threadgroup T vs[ST * KT * DP];
""",
    "cuda": """
  extern __shared__ __align__(16) unsigned char stage_mem[];
  T* ks = reinterpret_cast<T*>(stage_mem);
  T* vs = ks + ST * KT * DP;
""",
}

OUT = {"metal": "el(ot[(e) >> 1][nt])[(e) & 1]", "cuda": "ot[nt][e]"}  # element e of output tile nt

# Template constants: T (bf16 or fp16), D (head dim), NW (warps of 16 rows),
# KT (keys per staged tile), ST (staging buffers), CAUSAL, WINDOW (0 = none);
# the key chunks are the grid's y. Inputs and outputs are those of
# source.PARTIAL_* (params: the scale, and on CUDA whether to write the output
# itself, STORE).
BODY = (
    """
  constexpr int DP = D + 8;  // staged row pitch: rows stay 16-byte aligned and fall on distinct banks
  constexpr int NT = KT / 8;
  constexpr float RESCALE = 8.0f;"""
    + GRID_PLACE
    + """
STAGING
COORDS
  const int rt0 = tg_x * NW * 16;
  const int ra = rt0 + warp * 16 + fr;
  const int rb = ra + 8;
  const bool live_a = ra < R;
  const bool live_b = rb < R;
  int pos_a = qoff + (live_a ? ra % Lq : 0);
  int pos_b = qoff + (live_b ? rb % Lq : 0);
  const idx_t qsd = queries_strides[3];
  const DEV T* qa = queries + b * queries_strides[0] + (hk * G + (live_a ? ra / Lq : 0)) * queries_strides[1]
                    + (live_a ? ra % Lq : 0) * queries_strides[2];
  const DEV T* qb = queries + b * queries_strides[0] + (hk * G + (live_b ? rb / Lq : 0)) * queries_strides[1]
                    + (live_b ? rb % Lq : 0) * queries_strides[2];
  // The key range is the threadgroup's (all its rows), so every warp runs the same tiles.
  // Row r sits at qoff + r % Lq: rows rt0 .. rt1 - 1 cover every position of the block
  // once they span Lq rows or wrap past its end, else rt0 % Lq .. (rt1 - 1) % Lq.
  const int rt1 = rt0 + NW * 16 < R ? rt0 + NW * 16 : R;
  const bool all_positions = rt1 - rt0 >= Lq || rt0 % Lq > (rt1 - 1) % Lq;
  int pmin = qoff + (all_positions ? 0 : rt0 % Lq);
  int pmax = qoff + (all_positions ? Lq - 1 : (rt1 - 1) % Lq);
TREE_ROWS"""
    + KEY_RANGE
    + """
  float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;  // l: this thread's share of the row sum
  const idx_t head = (idx_t(b) * HKV + hk) * idx_t(NK) * D;
  float s[NT][4];
  // ST staging buffers: while tile `it` is computed, tiles it + 1 .. it + ST - 1 are
  // loading (cp.async on CUDA; Metal copies at once, so there the buffers only take
  // turns). Every iteration commits one group, empty or not, so the wait counts hold.
  const int ntiles = lo < hi ? (hi - lo + KT - 1) / KT : 0;
  // A tile is KT rows of D / 8 pieces of 16 bytes. Thread tid stages piece
  // tid % (D / 8) of rows tid / (D / 8), + ROWS_PER_PASS, ... of every tile.
  constexpr int ROW_PIECES = D / 8;
  constexpr int ROWS_PER_PASS = NW * 32 / ROW_PIECES;
  static_assert(KT % ROWS_PER_PASS == 0, "a tile is a whole number of passes");
  const int srow = tid / ROW_PIECES;
  const int scol = (tid % ROW_PIECES) * 8;
  const DEV T* kfirst = keys + head;  // a readable address for rows past the end
  const DEV T* vfirst = values + head;
  const DEV T* kthread = kfirst + idx_t(srow) * D + scol;
  const DEV T* vthread = vfirst + idx_t(srow) * D + scol;
#define STAGE_TILE(i)                                                              \
  {                                                                                \
    const int k_ = lo + (i) * KT;                                                  \
    const DEV T* kg = kthread + idx_t(k_) * D;                                     \
    const DEV T* vg = vthread + idx_t(k_) * D;                                     \
    TG_PTR T* kd = ks + ((i) % ST) * KT * DP + srow * DP + scol;                   \
    TG_PTR T* vd = vs + ((i) % ST) * KT * DP + srow * DP + scol;                   \
    for (int j = 0; j < KT / ROWS_PER_PASS; ++j) {                                 \
      const bool valid = k_ + srow + j * ROWS_PER_PASS < hi;                       \
      stage8(kd + j * ROWS_PER_PASS * DP, valid ? kg + j * ROWS_PER_PASS * D : kfirst, valid); \
      stage8(vd + j * ROWS_PER_PASS * DP, valid ? vg + j * ROWS_PER_PASS * D : vfirst, valid); \
    }                                                                              \
  }
  for (int i = 0; i < ST - 1; ++i) {
    if (i < ntiles) STAGE_TILE(i);
    stage_commit();
  }
  // The queries load while the first tiles do.
LOAD_Q
  for (int it = 0; it < ntiles; ++it) {
    stage_wait<ST - 2>();
    TG_BARRIER();  // tile it is staged, and every warp is done with tile it - 1's buffer
    if (it + ST - 1 < ntiles) STAGE_TILE(it + ST - 1);
    stage_commit();
    const int k0 = lo + it * KT;
    const TG_PTR T* kb = ks + (it % ST) * KT * DP;
    const TG_PTR T* vb = vs + (it % ST) * KT * DP;
    // A tile every row sees whole (most of a long context) skips the mask.
    const bool whole = k0 + KT <= hi && (!CAUSAL || k0 + KT - 1 <= pmin) &&
                       (WINDOW == 0 || (pmax - k0 < WINDOW && (CAUSAL || k0 + KT - 1 - pmin < WINDOW)));
SCORES
    // Scores stay unscaled until the exponent (qscale > 0 keeps their order), so
    // scaling and subtracting the max are one fused multiply-add.
    float mx_a = NEG_INF, mx_b = NEG_INF;
    if (whole) {
      for (int t = 0; t < NT; ++t) {
        mx_a = bk_max(mx_a, bk_max(s[t][0], s[t][1]));
        mx_b = bk_max(mx_b, bk_max(s[t][2], s[t][3]));
      }
    } else {
      for (int t = 0; t < NT; ++t) {
        for (int e = 0; e < 4; ++e) {
          const int k = k0 + t * 8 + fc + (e & 1);
          const int p_ = e < 2 ? pos_a : pos_b;
          bool vis = (e < 2 ? live_a : live_b) && k < hi;
SEES
          s[t][e] = vis ? s[t][e] : NEG_INF;
          if (e < 2) mx_a = bk_max(mx_a, s[t][e]); else mx_b = bk_max(mx_b, s[t][e]);
        }
      }
    }
    // The running max moves only when a row's scores pass it by more than RESCALE
    // (base 2): until then probabilities stay under 2^RESCALE and the output is not
    // rescaled, which most tiles of a long context skip. Decided per warp.
    const float top_a = row_max4(mx_a) * qscale;
    const float top_b = row_max4(mx_b) * qscale;
    if (warp_any(top_a > m_a + RESCALE || top_b > m_b + RESCALE)) {
      const float mn_a = bk_max(m_a, top_a);
      const float mn_b = bk_max(m_b, top_b);
      const float corr_a = mn_a == NEG_INF ? 1.0f : bk_exp2(m_a - mn_a);
      const float corr_b = mn_b == NEG_INF ? 1.0f : bk_exp2(m_b - mn_b);
      l_a *= corr_a;
      l_b *= corr_b;
      m_a = mn_a;
      m_b = mn_b;
SCALE_OUT
    }
    float sum_a = 0.0f, sum_b = 0.0f;
    if (whole) {
      for (int t = 0; t < NT; ++t) {
        s[t][0] = bk_exp2(s[t][0] * qscale - m_a);
        s[t][1] = bk_exp2(s[t][1] * qscale - m_a);
        s[t][2] = bk_exp2(s[t][2] * qscale - m_b);
        s[t][3] = bk_exp2(s[t][3] * qscale - m_b);
        sum_a += s[t][0] + s[t][1];
        sum_b += s[t][2] + s[t][3];
      }
    } else {
      for (int t = 0; t < NT; ++t) {
        for (int e = 0; e < 4; ++e) {
          const float m = e < 2 ? m_a : m_b;
          const float p = (m != NEG_INF && s[t][e] != NEG_INF) ? bk_exp2(s[t][e] * qscale - m) : 0.0f;
          s[t][e] = p;
          if (e < 2) sum_a += p; else sum_b += p;
        }
      }
    }
    l_a += sum_a;
    l_b += sum_b;
P_TIMES_V
  }
#undef STAGE_TILE
  l_a = row_sum4(l_a);
  l_b = row_sum4(l_b);

  for (int h = 0; h < 2; ++h) {
    const int r = h ? rb : ra;
    if (!(h ? live_b : live_a)) continue;
    const size_t row = (size_t(b) * HQ + hk * G + r / Lq) * Lq + r % Lq;
    const size_t idx = row * nch + chunk;
STORE
  }
"""
)

# The output: a chunk's unnormalised rows and their max and sum, for the merge;
# on CUDA, where the launch says so (params[1] != 0: one key chunk, no sinks),
# the merge's arithmetic instead (the rows over their sum), written as the merge
# writes it, [B, Lq, HQ, D] in T, into o_part's bytes (float32 [B, Lq, HQ, D /
# 2] then, viewed as T by the caller): a launch a layer fewer. A run-time flag,
# not a template constant: one compiled variant serves both, so a context that
# grows past one chunk compiles nothing new.
PARTS_STORE = """
    for (int nt = 0; nt < D / 8; ++nt) {
      const int e = 2 * h;
      store2(PARTIALS + idx * D + nt * 8 + fc, OUT_ELEM, OUT_NEXT);  // fc is even: 8-byte aligned
    }
    if (fc == 0) {
      m_part[idx] = h ? m_b : m_a;
      l_part[idx] = h ? l_b : l_a;
    }
"""
STORE = {
    "metal": PARTS_STORE.replace("PARTIALS", "o_part"),
    "cuda": """
    if (params[1] != 0.0f) {
      const float den = h ? l_b : l_a;
      T* const out = reinterpret_cast<T*>(o_part) + ((size_t(b) * Lq + r % Lq) * HQ + hk * G + r / Lq) * D + fc;
      for (int nt = 0; nt < D / 8; ++nt) {
        const int e = 2 * h;
        out[nt * 8] = from_float<T>(den > 0.0f ? OUT_ELEM / den : 0.0f);
        out[nt * 8 + 1] = from_float<T>(den > 0.0f ? OUT_NEXT / den : 0.0f);
      }
      continue;
    }
"""
    + PARTS_STORE.replace("PARTIALS", "o_part"),
}

ROWS_PER_WARP = 16
MOST_WARPS = 4  # 64 rows: a verify block of 16 at GQA 4 in one threadgroup


# Keys per staged tile by head dim, and staging buffers, by backend. Metal: two
# tiles of 4 KB of keys and 4 KB of values, 17 KB with the pitch, under the 32 KB
# of threadgroup memory a Mac allows. CUDA: dynamic shared memory (up to 227 KB);
# 64 keys at head dims 64 and 128 (more buffers do not help), 16 at 256, where the
# output's registers leave no room.
TILE_KEYS = {"metal": {64: 32, 128: 16, 256: 8}, "cuda": {64: 64, 128: 64, 256: 16}}
STAGES = {"metal": 2, "cuda": 2}


def staging(d: int, backend: str, tile_keys: int | None = None, stages: int | None = None) -> tuple[int, int]:
    """(keys per staged tile, staging buffers) for head dim ``d``; the
    arguments override the backend's defaults (benchmarks sweep them)."""
    kt = tile_keys or TILE_KEYS[backend][d]
    st = stages or STAGES[backend]
    step = 16 if backend == "cuda" else 8  # CUDA's P V product takes 16 keys at a time
    if kt < step or kt % step or st < 2:
        raise ValueError(
            f"staging: keys per tile must be a multiple of {step} and stages at least 2, got {kt} and {st}."
        )
    return kt, st


def staging_bytes(d: int, kt: int, st: int) -> int:
    """Threadgroup memory of ``st`` staged tiles of ``kt`` keys and values (2-byte elements, pitch d + 8)."""
    return 2 * st * kt * (d + 8) * 2


def header(backend: str) -> str:
    return HEADER[backend]


# The tile pass's tree rows: the warp makes its 16 rows' words one row at a time,
# each thread keeps its two rows' (fr and fr + 8), each at its depth.
TREE_ROWS = """
  pmin = qoff;
  pmax = qoff + Lq - 1;
  unsigned int seen[2][2];"""
TREE_ROWS += (
    TREE_NODES_DEPTHS
    + """
  for (int q = 0; q < 16; ++q) {
    const int r_ = rt0 + warp * 16 + q;
    const int i_ = r_ < R ? r_ % Lq : 0;"""
)
TREE_ROWS += (
    TREE_WORDS
    + """
    if (q == fr || q == fr + 8) {
      seen[q / 8][0] = word_[0];
      seen[q / 8][1] = word_[1];
      if (q == fr) pos_a = qoff + depth_; else pos_b = qoff + depth_;
    }
  }"""
)


def partial_source(prelude: str, backend: str, tree: bool = False) -> str:
    body = tree_parts(BODY, TREE_ROWS, "p_", "seen[e >> 1][0], seen[e >> 1][1]", tree)
    for name, part in (
        ("STAGING", STAGING),
        ("COORDS", COORDS),
        ("LOAD_Q", LOAD_Q),
        ("SCORES", SCORES),
        ("SCALE_OUT", SCALE_OUT),
        ("P_TIMES_V", P_TIMES_V),
        ("STORE", STORE),
    ):
        body = body.replace(f"\n{name}\n", "\n" + part[backend].strip("\n") + "\n")
    out_next = OUT[backend].replace("(e)", "(e + 1)").replace("[e]", "[e + 1]")
    return prelude + body.replace("OUT_ELEM", OUT[backend]).replace("OUT_NEXT", out_next)
