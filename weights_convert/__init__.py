"""Z Lab safetensors -> MLX (installed as dflash_mlx.weights_convert)."""
