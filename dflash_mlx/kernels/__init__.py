"""GPU kernels for the verify and drafter passes, each used only after it has
matched MLX's own ops in this process: block attention (dispatch.py), q/k
norms with RoPE (norm_rope.py) and, on CUDA, a verify's products (cuda/)."""

from .dispatch import KERNEL_WINS, CheckResult, backend, block_attention, reset, self_check_all
from .ops import ops_attention

__all__ = ["KERNEL_WINS", "CheckResult", "backend", "block_attention", "ops_attention", "reset", "self_check_all"]
