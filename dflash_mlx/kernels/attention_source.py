"""Kernel source for split-key block attention: one body, two dialects.

The Metal kernel (``mx.fast.metal_kernel``) and its CUDA twin
(``mx.fast.cuda_kernel``) are built from the same two bodies below; only the
header (types, warp primitives, barriers) and the prelude (thread and
threadgroup indices) differ. What is measured and checked on an NVIDIA GPU is
therefore what a Mac runs, name for name.

Pass 1, ``partial`` (fp32; bf16 and fp16 run source_tiles.py's pass 1 on the
matrix units instead): one threadgroup per (row tile, key chunk, batch x kv
head). Each simdgroup (warp) owns RW query rows of one GQA group, lanes own keys:
scores for 32 keys at a time, an online softmax in base 2, then lanes own
head-dim slices for P @ V. It writes an unnormalised partial output and its
running max and sum per (row, chunk). Keys >= kv_length, and those the causal
or window rules hide, are never read.

Pass 2, ``merge`` (every dtype): one threadgroup per query row, one thread per head-dim
element; it rescales the chunks' partials to a common max (and adds the
attention sink to the denominator) and writes the output in the input dtype.

A draft tree's variant of either partial pass (``tree``: kv/tree.py's layout
as two more inputs) is the same body with the tree's rows (``TREE_ROWS``: each
row at its depth, its ancestors as bits) and rule (``SEES``) filled in.

Layouts are those of mx.fast.scaled_dot_product_attention's callers, so no
copy comes before or after: queries are read through their strides (a rotated
query is a transposed view of the projection), and the output is written as
[B, L, Hq, D], handed back as its [B, Hq, L, D] transpose, so the layer's
transpose back and reshape are free.
"""

from __future__ import annotations

LOG2E = 1.4426950408889634

# Warps per threadgroup come from the row count; rows per warp and lanes are fixed.
ROWS_PER_WARP = 4
SIMD = 32

HEADER = {
    "metal": """
#define DEV device
typedef int64_t idx_t;  // strides, element offsets
#define TG_MEM threadgroup
#define TG_PTR threadgroup
#define TG_ALIGN
#define WARP_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)
#define TG_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define NEG_INF (-INFINITY)
inline float bk_exp2(float x) { return metal::exp2(x); }
inline float bk_max(float a, float b) { return metal::max(a, b); }
template <typename U> inline float to_float(U x) { return static_cast<float>(x); }
template <typename U> inline U from_float(float x) { return static_cast<U>(x); }
template <typename U> inline void load4(const device U* p, thread float* o) {
  o[0] = float(p[0]); o[1] = float(p[1]); o[2] = float(p[2]); o[3] = float(p[3]);
}
template <typename U> inline void load4(const threadgroup U* p, thread float* o) {
  o[0] = float(p[0]); o[1] = float(p[1]); o[2] = float(p[2]); o[3] = float(p[3]);
}
template <typename U> inline void copy4(threadgroup U* dst, const device U* src) {
  dst[0] = src[0]; dst[1] = src[1]; dst[2] = src[2]; dst[3] = src[3];
}
""",
    "cuda": """
#define DEV
typedef long long idx_t;  // strides, element offsets
#define TG_MEM __shared__
#define TG_PTR
#define TG_ALIGN __align__(16)
#define WARP_BARRIER() __syncwarp()
#define TG_BARRIER() __syncthreads()
#define NEG_INF (-cuda::std::numeric_limits<float>::infinity())
// One MUFU instruction (exp2f adds range fixes for denormal results, which a
// softmax weight does not need); 2^-inf = 0.
__device__ __forceinline__ float bk_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float bk_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename U> __device__ __forceinline__ U from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ void load4(const float* p, float* o) {
  const float4 u = *reinterpret_cast<const float4*>(p);
  o[0] = u.x; o[1] = u.y; o[2] = u.z; o[3] = u.w;
}
__device__ __forceinline__ void load4(const __half* p, float* o) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float* o) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  o[0] = __uint_as_float(u.x << 16); o[1] = __uint_as_float(u.x & 0xffff0000u);
  o[2] = __uint_as_float(u.y << 16); o[3] = __uint_as_float(u.y & 0xffff0000u);
}
template <typename U> __device__ __forceinline__ void copy4(U* dst, const U* src) {
  if (sizeof(U) == 2) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else {
    *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
  }
}
__device__ __forceinline__ float simd_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float simd_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float simd_shuffle(float v, int j) { return __shfl_sync(0xffffffffu, v, j); }
""",
}

# Metal names its thread indices by attribute (MLX finds them in the body's text).
PRELUDE = {
    "metal": """
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int tg_x = int(threadgroup_position_in_grid.x);
  const int tg_y = int(threadgroup_position_in_grid.y);
  const int tg_z = int(threadgroup_position_in_grid.z);
  const int n_tg_y = int(threadgroups_per_grid.y);
""",
    "cuda": """
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int tg_x = int(blockIdx.x);
  const int tg_y = int(blockIdx.y);
  const int tg_z = int(blockIdx.z);
  const int n_tg_y = int(gridDim.y);
""",
}

# Template constants: T (dtype), D (head dim), NW (warps), RW (rows per warp),
# CAUSAL, WINDOW (0 = none). Shapes and the key chunks (the grid's y) are read at
# run time, so a growing buffer does not compile new variants.
PARTIAL_INPUTS = ["queries", "keys", "values", "q_offset", "kv_length", "params"]
PARTIAL_OUTPUTS = ["o_part", "m_part", "l_part"]
# Both partial passes (this one and attention_tiles' on the matrix units) begin
# alike: the shapes, read at run time, and the threadgroup's place in the grid,
# (row tile, key chunk, batch x kv head).
GRID_PLACE = """
  const int Lq = queries_shape[2];
  const int HQ = queries_shape[1];
  const int HKV = keys_shape[1];
  const int NK = keys_shape[2];
  const int G = HQ / HKV;
  const int R = G * Lq;
  const int nch = n_tg_y;  // key chunks: the grid's y
  const int C = (NK + nch - 1) / nch;
  const int b = tg_z / HKV;
  const int hk = tg_z % HKV;
  const int chunk = tg_y;
  const int qoff = q_offset[0];
  const int kvlen = kv_length[0] < NK ? kv_length[0] : NK;
  const float qscale = params[0];
"""

# The keys a threadgroup reads, in both partial passes: its chunk, cut to what
# its rows (at positions pmin .. pmax) may see.
KEY_RANGE = """
  int lo = chunk * C;
  int hi = lo + C < kvlen ? lo + C : kvlen;
  if (CAUSAL && hi > pmax + 1) hi = pmax + 1;
  if (WINDOW > 0) {
    if (lo < pmin - WINDOW + 1) lo = pmin - WINDOW + 1;
    if (!CAUSAL && hi > pmax + WINDOW) hi = pmax + WINDOW;
  }
"""

PARTIAL_BODY = (
    """
  constexpr int DL = D / 32;"""
    + GRID_PLACE
    + """  const int r0 = (tg_x * NW + warp) * RW;

  TG_MEM float qs[NW * RW * D];
  TG_MEM TG_ALIGN float ps[NW * RW * 32];
  int pos[RW];
  bool live[RW];
  for (int rr = 0; rr < RW; ++rr) {
    const int r = r0 + rr;
    live[rr] = r < R;
    const int i = live[rr] ? r % Lq : 0;
    const int hq = hk * G + (live[rr] ? r / Lq : 0);
    pos[rr] = qoff + i;
    const DEV T* qp = queries + b * queries_strides[0] + hq * queries_strides[1] + i * queries_strides[2];
    for (int d = lane; d < D; d += 32) {
      qs[(warp * RW + rr) * D + d] = live[rr] ? to_float(qp[d * queries_strides[3]]) * qscale : 0.0f;
    }
  }
  WARP_BARRIER();

  // The key range is the threadgroup's (all its rows), so that every warp runs
  // the same tiles and the staging barriers stay uniform.
  const int rt0 = tg_x * NW * RW;
  const int rt1 = rt0 + NW * RW < R ? rt0 + NW * RW : R;
  int pmin = 2147483647;
  int pmax = -2147483647;
  for (int r = rt0; r < rt1; ++r) {
    const int p_ = qoff + r % Lq;
    pmin = p_ < pmin ? p_ : pmin;
    pmax = p_ > pmax ? p_ : pmax;
  }
TREE_ROWS"""
    + KEY_RANGE
    + """
  float m[RW];
  float l[RW];
  float acc[RW][DL];
  for (int rr = 0; rr < RW; ++rr) {
    m[rr] = NEG_INF;
    l[rr] = 0.0f;
    for (int t = 0; t < DL; ++t) acc[rr][t] = 0.0f;
  }
  const size_t head = (size_t(b) * HKV + hk) * size_t(NK) * D;
  const DEV T* kbase = keys + head;
  const DEV T* vbase = values + head + lane * DL;

  for (int k0 = lo; k0 < hi; k0 += 32) {
    const int k = k0 + lane;
    float s[RW];
    for (int rr = 0; rr < RW; ++rr) s[rr] = 0.0f;
    if (k < hi) {
      const DEV T* kp = kbase + size_t(k) * D;
      SCORE_KEY
    }
    float p[RW];
    for (int rr = 0; rr < RW; ++rr) {
      bool vis = live[rr] && k < hi;
SEES
      const float sv = vis ? s[rr] : NEG_INF;
      const float mnew = bk_max(m[rr], simd_max(sv));
      p[rr] = 0.0f;
      if (mnew == NEG_INF) continue;
      const float corr = bk_exp2(m[rr] - mnew);
      p[rr] = vis ? bk_exp2(sv - mnew) : 0.0f;
      l[rr] = l[rr] * corr + simd_sum(p[rr]);
      for (int t = 0; t < DL; ++t) acc[rr][t] *= corr;
      m[rr] = mnew;
    }
    // P @ V: the warp's probabilities through threadgroup memory, 4 keys a step.
    for (int rr = 0; rr < RW; ++rr) ps[(warp * RW + rr) * 32 + lane] = p[rr];
    WARP_BARRIER();
    const int kend = hi - k0 < 32 ? hi - k0 : 32;
    for (int j = 0; j < kend; j += 4) {
      float vv[4][DL];
      for (int u = 0; u < 4; ++u) {
        const DEV T* vp = vbase + size_t(k0 + j + u) * D;
        if (j + u >= kend) {
          for (int t = 0; t < DL; ++t) vv[u][t] = 0.0f;
        } else if (DL % 4 == 0) {
          for (int t = 0; t < DL; t += 4) load4(vp + t, vv[u] + t);
        } else {
          for (int t = 0; t < DL; ++t) vv[u][t] = to_float(vp[t]);
        }
      }
      for (int rr = 0; rr < RW; ++rr) {
        const TG_PTR float* pr = ps + (warp * RW + rr) * 32 + j;
        const float p0 = pr[0], p1 = pr[1], p2 = pr[2], p3 = pr[3];
        for (int t = 0; t < DL; ++t) acc[rr][t] += p0 * vv[0][t] + p1 * vv[1][t] + p2 * vv[2][t] + p3 * vv[3][t];
      }
    }
    WARP_BARRIER();
  }

  for (int rr = 0; rr < RW; ++rr) {
    if (!live[rr]) continue;
    const int r = r0 + rr;
    const size_t row = (size_t(b) * HQ + hk * G + r / Lq) * Lq + r % Lq;
    const size_t idx = row * nch + chunk;
    for (int t = 0; t < DL; ++t) o_part[idx * D + lane * DL + t] = acc[rr][t];
    if (lane == 0) {
      m_part[idx] = m[rr];
      l_part[idx] = l[rr];
    }
  }
"""
)

# Template constants: T (output dtype), D, HAS_SINKS.
# One key's dot product with each of the warp's query rows (kp: the key,
# in threadgroup or device memory; the two pointer kinds differ on Metal).
SCORE_KEY = """for (int d = 0; d < D; d += 4) {
        float kv[4];
        load4(kp + d, kv);
        for (int rr = 0; rr < RW; ++rr) {
          const TG_PTR float* qr = qs + (warp * RW + rr) * D + d;
          s[rr] += qr[0] * kv[0] + qr[1] * kv[1] + qr[2] * kv[2] + qr[3] * kv[3];
        }
      }"""

# Which keys a row at position ROW_POS sees within the threadgroup's key range
# (both partial passes): a block's rule, or a draft tree's (kv/tree.py): the
# context before qoff by position and window, node j's key at qoff + j where
# j is one of the row's ancestors (ROW_SEEN: their bits, the window folded in).
SEES = {
    "block": """      if (CAUSAL) vis = vis && k <= ROW_POS;
      if (WINDOW > 0) {
        vis = vis && ROW_POS - k < WINDOW;
        if (!CAUSAL) vis = vis && k - ROW_POS < WINDOW;
      }""",
    "tree": """      vis = vis && (k < qoff ? WINDOW == 0 || ROW_POS - k < WINDOW : tree_sees(ROW_SEEN, k - qoff));""",
}

# A tree's two more inputs: ancestors [N, N] bool (kv/tree.py's TreeLayout) and
# depths [N] int32, read through their strides; N (the query length) is at most
# TREE_NODES, two 32-bit words of ancestors a row.
TREE_INPUTS = ["ancestors", "depths"]
TREE_NODES = 64
TREE_HEADER = {
    "metal": """
inline unsigned int warp_or(unsigned int v) {
  for (ushort o = 16; o > 0; o >>= 1) v |= simd_shuffle_xor(v, o);
  return v;
}
""",
    "cuda": """
__device__ __forceinline__ unsigned int warp_or(unsigned int v) {
  for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
""",
}
TREE_SEES = """
// Whether a tree row whose ancestors are the bits of (w0, w1) sees node j's key.
#define tree_sees(w0, w1, j) ((j) < 32 ? (((w0) >> (j)) & 1u) != 0u : (j) < 64 && (((w1) >> ((j) - 32)) & 1u) != 0u)
"""

# A tree's rows are made by the warp together: lane l reads nodes l and l + 32,
# their depths once (TREE_NODES_DEPTHS), then for row i_ its depth_ and its
# ancestors' bits word_[2] (TREE_WORDS); a window drops the ancestors out of reach.
TREE_NODES_DEPTHS = """
  int node_depth[2];
  for (int w = 0; w < 2; ++w) {
    const int j = w * 32 + lane;
    node_depth[w] = WINDOW > 0 && j < Lq ? depths[j * depths_strides[0]] : 0;
  }"""
TREE_WORDS = """
    const int depth_ = depths[i_ * depths_strides[0]];
    unsigned int word_[2];
    for (int w = 0; w < 2; ++w) {
      const int j = w * 32 + lane;
      const bool a = j < Lq && ancestors[i_ * ancestors_strides[0] + j * ancestors_strides[1]] &&
                     (WINDOW == 0 || depth_ - node_depth[w] < WINDOW);
      word_[w] = warp_or(a ? 1u << lane : 0u);
    }"""

# The SIMT pass's tree rows: each row at its depth, the key range to the tree's end
# (pmin = qoff bounds every row's position from below).
TREE_ROWS = """
  pmin = qoff;
  pmax = qoff + Lq - 1;
  unsigned int seen[RW][2];"""
TREE_ROWS += (
    TREE_NODES_DEPTHS
    + """
  for (int rr = 0; rr < RW; ++rr) {
    const int i_ = live[rr] ? (r0 + rr) % Lq : 0;"""
)
TREE_ROWS += (
    TREE_WORDS
    + """
    pos[rr] = qoff + depth_;
    seen[rr][0] = word_[0];
    seen[rr][1] = word_[1];
  }"""
)

MERGE_INPUTS = ["o_part", "m_part", "l_part", "sinks"]
MERGE_OUTPUTS = ["out"]
MERGE_BODY = """
  const int HQ = m_part_shape[1];
  const int Lq = m_part_shape[2];
  const int nch = m_part_shape[3];
  const size_t row = size_t(tg_x);  // (batch, head, position) of the partials
  const int d = tid;
  const size_t bh = row / Lq;
  const size_t at = ((bh / HQ * Lq + row % Lq) * HQ + bh % HQ) * D + d;  // out is [B, Lq, HQ, D]
  const float sink = HAS_SINKS ? to_float(sinks[(row / Lq) % HQ]) * LOG2E_F : 0.0f;
  PARTS_PTR mp = m_part + row * nch;
  PARTS_PTR lp = l_part + row * nch;
  const DEV float* op = o_part + row * nch * D + d;
  // Four chunks a step, so four loads are in flight rather than one.
  float mx_ = HAS_SINKS ? sink : NEG_INF;
  int c = 0;
  for (; c + 4 <= nch; c += 4) mx_ = bk_max(bk_max(mx_, bk_max(mp[c], mp[c + 1])), bk_max(mp[c + 2], mp[c + 3]));
  for (; c < nch; ++c) mx_ = bk_max(mx_, mp[c]);
  float num = 0.0f;
  float den = 0.0f;
  if (mx_ != NEG_INF) {
    // A chunk nothing was visible in (m = -inf) weighs 0.
#define CHUNK_WEIGHT(m_) ((m_) == NEG_INF ? 0.0f : bk_exp2((m_) - mx_))
    for (c = 0; c + 4 <= nch; c += 4) {
      const float w0 = CHUNK_WEIGHT(mp[c]), w1 = CHUNK_WEIGHT(mp[c + 1]);
      const float w2 = CHUNK_WEIGHT(mp[c + 2]), w3 = CHUNK_WEIGHT(mp[c + 3]);
      den += lp[c] * w0 + lp[c + 1] * w1 + lp[c + 2] * w2 + lp[c + 3] * w3;
      num += op[c * D] * w0 + op[(c + 1) * D] * w1 + op[(c + 2) * D] * w2 + op[(c + 3) * D] * w3;
    }
    for (; c < nch; ++c) {
      const float w = CHUNK_WEIGHT(mp[c]);
      den += lp[c] * w;
      num += op[c * D] * w;
    }
#undef CHUNK_WEIGHT
    if (HAS_SINKS) den += bk_exp2(sink - mx_);
  }
  out[at] = from_float<T>(den > 0.0f ? num / den : 0.0f);
"""


def header(backend: str, tree: bool = False) -> str:
    common = HEADER[backend] + f"#define LOG2E_F {LOG2E!r}f\n"
    return common + TREE_HEADER[backend] + TREE_SEES if tree else common


def partial_source(backend: str, tree: bool = False) -> str:
    body = PARTIAL_BODY.replace("SCORE_KEY", SCORE_KEY)
    return PRELUDE[backend] + tree_parts(body, TREE_ROWS, "pos[rr]", "seen[rr][0], seen[rr][1]", tree)


def tree_parts(body: str, rows: str, row_pos: str, row_seen: str, tree: bool) -> str:
    """A partial pass's body for a block or (``tree``) a draft tree: its
    TREE_ROWS hole filled with ``rows`` or nothing, SEES with the rule for a row
    at ``row_pos`` (a tree's with its ancestors' words ``row_seen``)."""
    sees = SEES["tree" if tree else "block"].replace("ROW_POS", row_pos).replace("ROW_SEEN", row_seen)
    return body.replace("\nTREE_ROWS", rows if tree else "").replace("SEES", sees)


# The merge's pointers into m_part and l_part. MLX's Metal backend passes an input
# of fewer than 8 elements in the constant address space (a merge of one chunk
# for 1-7 rows), so on Metal they take the parameter's own pointer type; a
# `const device float*` there failed to compile (scripts/check_metal_kernels.py).
PARTS_PTR = {"metal": "auto", "cuda": "const DEV float*"}


def merge_source(backend: str) -> str:
    return PRELUDE[backend] + MERGE_BODY.replace("PARTS_PTR", PARTS_PTR[backend])
