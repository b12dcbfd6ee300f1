"""GPU kernels for the verify and drafter passes, each used only where it
has checked itself against MLX's own ops in this process:

- block attention (dispatch.py, kernel.py, source*.py): a split-key two-pass
  kernel (Metal and a CUDA twin from one source) where it is faster; the
  fused mx.fast.scaled_dot_product_attention with a position mask elsewhere;

    from dflash_mlx.kernels import block_attention
    out = block_attention(q, k_buf, v_buf, scale=d ** -0.5, q_offset=pos, kv_length=pos + L, causal=True)

- norm_rope.py: a qwen3 layer's q/k norms and RoPE in one launch (Metal, CUDA);
- block_products.py (its source: block_products_source.py): a verify's
  2-16-row products in one launch each (CUDA), a gate/up product's SwiGLU in
  the same launch;
- which backend MLX computes on is dflash_mlx/device.py's to say (the caches
  ask it too).
"""

from .dispatch import KERNEL_WINS, CheckResult, backend, block_attention, reset, self_check_all
from .ops import ops_attention

__all__ = ["KERNEL_WINS", "CheckResult", "backend", "block_attention", "ops_attention", "reset", "self_check_all"]
