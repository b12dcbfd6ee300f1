"""The gated delta-net recurrence kernel's source, one body for Metal and CUDA
(gated_delta.py builds and checks it): a write's steps in order, or a draft
tree's nodes, each from its parent's state.

A thread holds 32 state elements of one value row; Dk / 32 lanes share a row.
Template constants: InT (q, k, v, y), Dk; a write's LIMITED (read ``steps``);
a tree's KEEP_ALL (write every node's state, else only those a later node reads).
Shapes are read at run time: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta
[B, T, Hv] (g float32); state [B, Hv, Dv, Dk] float32; a tree's ``parents``
[T] int32 (node 0 the root, its own parent; parents before children) and its
``states`` [T + 1, B, Hv, Dv, Dk]: the state before, then each node's after
its step.
"""

from __future__ import annotations

from .attention_source import HEADER as BASE_HEADER

VERSION = 2  # of the bodies and their inputs: a change must bump it

INPUTS = ["q", "k", "v", "g", "beta", "state_in", "steps"]
OUTPUTS = ["y", "state_out"]
TREE_INPUTS = ["q", "k", "v", "g", "beta", "state_in", "parents"]
TREE_OUTPUTS = ["y", "states"]

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

# This thread's row and inputs, and its 32 state elements from state_in.
SETUP = """
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
"""

# Step t: mlx-lm's packed kernel's arithmetic (the module doc of gated_delta.py).
STEP = """
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
"""

WRITE = (
    SETUP
    + """
  int count = T;
  if (LIMITED) {
    count = steps[0] < 0 ? 0 : (steps[0] < T ? steps[0] : T);
  }
  for (int t = 0; t < count; ++t) {
"""
    + STEP
    + """
  }
  for (int i = 0; i < 32; ++i) {
    state_out[row + i] = state[i];
  }
"""
)

# A node whose parent is the node before it goes on from the registers; any
# other reads its parent's state back from ``states``, which this same thread
# wrote (a node is written there when a later node other than the next one
# is its child).
TREE = (
    SETUP
    + """
  const idx_t node_stride = idx_t(q_shape[0]) * Hv * Dv * Dk;
  if (KEEP_ALL) {
    for (int i = 0; i < 32; ++i) {
      states[row + i] = state[i];
    }
  }
  for (int t = 0; t < T; ++t) {
    const int parent = parents[t];
    if (t > 0 && parent != t - 1) {
      for (int i = 0; i < 32; ++i) {
        state[i] = states[(idx_t(parent) + 1) * node_stride + row + i];
      }
    }
"""
    + STEP
    + """
    bool keep = KEEP_ALL;
    for (int c = t + 2; c < T && !keep; ++c) {
      keep = parents[c] == t;
    }
    if (keep) {
      for (int i = 0; i < 32; ++i) {
        states[(idx_t(t) + 1) * node_stride + row + i] = state[i];
      }
    }
  }
"""
)


def source(backend_name: str, tree: bool = False) -> str:
    return PRELUDE[backend_name] + (TREE if tree else WRITE)
