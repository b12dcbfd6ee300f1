"""Published DFlash checkpoints -> MLX (``dflash-mlx convert``)."""
