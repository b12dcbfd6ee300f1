"""GPU kernels for the verify and drafter passes, each used only after it has
matched MLX's own ops in this process: block attention (dispatch.py), q/k
norms with RoPE (norm_rope.py) and, on CUDA, a verify's products (cuda/)."""

from .dispatch import KERNEL_WINS, CheckResult, backend, block_attention, reset, self_check_all
from .ops import ops_attention

# Modules whose ``record_variants(factory, backend)`` launches every variant
# their kernel can through a recording factory: what scripts/check_metal_kernels.py
# and check_cuda_kernels.py compile. Adding a kernel to both checks is one line here.
RECORDED_MODULES = (
    "dflash_mlx.kernels.quantized",
    "dflash_mlx.kernels.quantized_gather",
    "dflash_mlx.kernels.gated_delta",
    "dflash_mlx.kernels.exact_products",
    "dflash_mlx.kernels.exact_attention",
)

__all__ = ["KERNEL_WINS", "CheckResult", "backend", "block_attention", "ops_attention", "reset", "self_check_all"]
