"""Block attention for the verify and drafter passes.

    from dflash_mlx.kernels import block_attention
    out = block_attention(q, k_buf, v_buf, scale=d ** -0.5, q_offset=pos, kv_length=pos + L, causal=True)

A split-key two-pass kernel (Metal and a CUDA twin from one source, see
source.py) where it is faster and has checked itself; the fused
mx.fast.scaled_dot_product_attention with a position mask everywhere else.
"""

from .dispatch import KERNEL_WINS, CheckResult, backend, block_attention, reset, self_check_all
from .ops import ops_attention

__all__ = ["KERNEL_WINS", "CheckResult", "backend", "block_attention", "ops_attention", "reset", "self_check_all"]
