"""The block-product kernel's CUDA source (built, launched and checked by
products.py)."""

VERSION = 9  # of BODY and its inputs: a change must bump it (MLX caches built kernels by name)

# Template constants: T, the launch shape (NT, KW, U), HEADS (x [heads, M, D]
# read as the rows [M, heads * D]), HAS_BIAS, HAS_RESIDUAL (else b, r are
# placeholders), SWIGLU (NT = 2: w is gate/up [2 N, K], y = silu(gate) * up),
# HAS_NORM (y is the product of RMSNorm(x) with weight nw, eps's bits EPS_BITS).
# x [M <= 16, K], w [N, K] row contiguous, K a multiple of 32; unaligned views
# are read as 2-byte elements. Rounding follows MLX's ops step by step: the
# bias is added before the product's rounding, a residual after it (rounded
# again); the SwiGLU and the norm round each step as MLX's own kernels do.
BODY = """
  const int lane = int(threadIdx.x) & 31;
  const int wk = int(threadIdx.x) >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int M = HEADS ? x_shape[1] : x_shape[0];
  const int D = HEADS ? x_shape[2] : 1;  // (a multiple of 8: a 16-byte load stays in one head)
  const int K = HEADS ? x_shape[0] * x_shape[2] : x_shape[1];
  const int N = SWIGLU ? w_shape[0] / 2 : w_shape[0];
  const int n0 = int(blockIdx.x) * 8 * (SWIGLU ? 1 : NT);
  // the output element: the product rounded, plus the residual (rounded again) where there is one
  auto finish = [](float p, const T* res, idx_t i) -> T {
    return HAS_RESIDUAL ? from_float<T>(to_float(from_float<T>(p)) + to_float(res[i])) : from_float<T>(p);
  };
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // (K is a multiple of 32, so every row starts as aligned as its matrix does)
  const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w) |
                         (HAS_NORM ? reinterpret_cast<size_t>(nw) : 0)) & 15) == 0;
  // row m's elements k..k+7 (k a multiple of 8)
  auto row_at = [&](int m, int k) -> const T* {
    return HEADS ? x + (idx_t(k / D) * M + m) * D + k % D : x + idx_t(m) * K + k;
  };
  // HAS_NORM: each row's rsqrt(mean square + eps), a warp a row
  __shared__ float norm_scale[16];
  if (HAS_NORM) {
    for (int m = wk; m < M; m += KW) {
      float sq = 0.0f;
      for (int k = 8 * lane; k < K; k += 256) sq = add_squares(load16(row_at(m, k), aligned), sq);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      if (lane == 0) norm_scale[m] = rsqrtf(sq / K + __int_as_float(EPS_BITS));
    }
    __syncthreads();
  }
  const float scale_g = HAS_NORM && g < M ? norm_scale[g] : 0.0f;  // rows g and g + 8's
  const float scale_g8 = HAS_NORM && g + 8 < M ? norm_scale[g + 8] : 0.0f;
  const T* wr[NT];
  bool live[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int col = SWIGLU ? n0 + g : n0 + 8 * i + g;  // the output column this lane's weight row serves
    live[i] = col < N;
    wr[i] = w + idx_t(live[i] ? (SWIGLU ? col + i * N : col) : 0) * K + 8 * t;
  }
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  // U steps' loads issued before their products, so that each warp keeps
  // several in flight (one step's 16-byte loads per lane are too few to
  // cover the memory's latency at the warps a product has)
  for (int kb0 = 32 * wk; kb0 < K; kb0 += 32 * KW * U) {
    uint4 u[U], v[U], wv[U][NT], nv[U];
#pragma unroll
    for (int s = 0; s < U; ++s) {
      const int kb = kb0 + s * 32 * KW;
      const bool in = kb < K;
      u[s] = in && g < M ? load16(row_at(g, kb + 8 * t), aligned) : zero;
      v[s] = in && g + 8 < M ? load16(row_at(g + 8, kb + 8 * t), aligned) : zero;
      if (HAS_NORM) nv[s] = in ? load16(nw + kb + 8 * t, aligned) : zero;
#pragma unroll
      for (int i = 0; i < NT; ++i) wv[s][i] = in && live[i] ? load16(wr[i] + kb, aligned) : zero;
    }
#pragma unroll
    for (int s = 0; s < U; ++s) {
      if (HAS_NORM) {
        u[s] = normed(u[s], nv[s], scale_g);
        v[s] = normed(v[s], nv[s], scale_g8);
      }
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        MMA16816(acc[i], u[s].x, v[s].x, u[s].y, v[s].y, wv[s][i].x, wv[s][i].y);
        MMA16816(acc[i], u[s].z, v[s].z, u[s].w, v[s].w, wv[s][i].z, wv[s][i].w);
      }
    }
  }
  __shared__ float part[KW][NT][4][32];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) part[wk][i][j][lane] = acc[i][j];
  }
  __syncthreads();
  if (wk != 0) return;
  if constexpr (SWIGLU) {
    // silu(gate) * up, each of MLX's steps rounded: the products, the sigmoid, silu, the product
    auto swiglu = [](float gs, float us) -> T {
      const float gate = to_float(from_float<T>(gs));
      const float e = expf(-fabsf(gate));  // (no cancellation for a negative gate)
      const float sig = to_float(from_float<T>(gate < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e)));
      const float silu = to_float(from_float<T>(gate * sig));
      return from_float<T>(silu * to_float(from_float<T>(us)));
    };
    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = part[0][i][j][lane];
#pragma unroll
        for (int o = 1; o < KW; ++o) s[i][j] += part[o][i][j][lane];
      }
    }
    const int n = n0 + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = g + 8 * h;
      if (m < M) {
        if (n < N) y[idx_t(m) * N + n] = swiglu(s[0][2 * h], s[1][2 * h]);
        if (n + 1 < N) y[idx_t(m) * N + n + 1] = swiglu(s[0][2 * h + 1], s[1][2 * h + 1]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      float s[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[j] = part[0][i][j][lane];
#pragma unroll
        for (int o = 1; o < KW; ++o) s[j] += part[o][i][j][lane];
      }
      const int n = n0 + 8 * i + 2 * t;
      const float b0 = HAS_BIAS && n < N ? to_float(b[n]) : 0.0f;
      const float b1 = HAS_BIAS && n + 1 < N ? to_float(b[n + 1]) : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = g + 8 * h;
        if (m < M) {
          if (n < N) y[idx_t(m) * N + n] = finish(s[2 * h] + b0, r, idx_t(m) * N + n);
          if (n + 1 < N) y[idx_t(m) * N + n + 1] = finish(s[2 * h + 1] + b1, r, idx_t(m) * N + n + 1);
        }
      }
    }
  }
"""

# load16: 8 consecutive 2-byte elements; normed: (x * scale) rounded, times w,
# rounded, as MLX's rms_norm writes them; MMA16816: one m16n8k16 product.
MMA_HEADER = {
    ab: """
__device__ __forceinline__ uint4 load16(const void* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(p);
  const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
  return make_uint4(h[0] | (unsigned(h[1]) << 16), h[2] | (unsigned(h[3]) << 16),
                    h[4] | (unsigned(h[5]) << 16), h[6] | (unsigned(h[7]) << 16));
}
"""
    + f"""
__device__ __forceinline__ float add_pair_squares(unsigned x, float sq) {{
  const float2 a = {to2}(*reinterpret_cast<const {pair}*>(&x));
  return fmaf(a.y, a.y, fmaf(a.x, a.x, sq));
}}
__device__ __forceinline__ float add_squares(uint4 x, float sq) {{
  return add_pair_squares(x.w, add_pair_squares(x.z, add_pair_squares(x.y, add_pair_squares(x.x, sq))));
}}
__device__ __forceinline__ unsigned normed_pair(unsigned x, unsigned w, float scale) {{
  const float2 a = {to2}(*reinterpret_cast<const {pair}*>(&x));
  const {pair} y = __hmul2(*reinterpret_cast<const {pair}*>(&w), {from2}(a.x * scale, a.y * scale));
  return *reinterpret_cast<const unsigned*>(&y);
}}
__device__ __forceinline__ uint4 normed(uint4 x, uint4 w, float scale) {{
  return make_uint4(normed_pair(x.x, w.x, scale), normed_pair(x.y, w.y, scale), normed_pair(x.z, w.z, scale),
                    normed_pair(x.w, w.w, scale));
}}
"""
    + f"""
#define MMA16816(c, a0, a1, a2, a3, b0, b1) \\
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, "  \\
               "{{%0,%1,%2,%3}};\\n"                                                                                \\
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                     \\
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
"""
    for ab, pair, to2, from2 in (
        ("bf16", "__nv_bfloat162", "__bfloat1622float2", "__floats2bfloat162_rn"),
        ("f16", "__half2", "__half22float2", "__floats2half2_rn"),
    )
}
