"""Published DFlash checkpoints -> MLX (``dflash-mlx convert``).

from dflash_mlx.convert.weights import convert
convert("z-lab/Qwen3-8B-DFlash-b16", "Qwen3-8B-DFlash-b16-4bit", quantize=True)
"""
