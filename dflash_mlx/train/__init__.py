"""Training DFlash drafters in MLX (``dflash-mlx train``).

data.py     reading prompts, the target's self-distilled responses (cached on disk)
trainer.py  the drafter's training forward, loss, optimizer loop and checkpoints
command.py  the Typer command ``train_command``

Kept import-light: nothing heavy is imported until a function is called.
"""
