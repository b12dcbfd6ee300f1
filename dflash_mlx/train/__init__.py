"""Training DFlash drafters in MLX (the command is cli/train.py, ``dflash-mlx train``).

data.py     the target's self-distilled responses to the prompts (cached on disk)
forward.py  the drafter's training forward: many blocks of a sequence in one pass
trainer.py  loss, optimizer loop, checkpoints: prepare -> fit -> summarize

Kept import-light: nothing heavy is imported until a function is called.
"""
