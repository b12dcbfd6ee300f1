"""Kernels only MLX's CUDA backend runs; imported only there."""
