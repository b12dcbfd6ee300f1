"""Training DFlash drafters in MLX (``dflash-mlx train``): data.py makes the
target's self-distilled responses, forward.py the training forward,
trainer.py the loop. Import-light: nothing heavy is imported here."""
