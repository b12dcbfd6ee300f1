"""`dflash-mlx train`: a DFlash drafter trained for a target by
self-distillation (the trainer is dflash_mlx.train)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .console import UserError, console, user_errors
from .options import Verbose
from .pair import model_or_builtin

EXAMPLES = """\
Examples:

$ dflash-mlx train --model Qwen/Qwen3-4B --data prompts.jsonl --out my-drafter --block-size 16 --min-block-size 4 --steps 4000

$ dflash-mlx train --model Qwen/Qwen3-4B --data prompts.jsonl --out my-drafter --steps 8000 --resume

$ dflash-mlx train --data prompts.jsonl --out builtin-drafter --steps 200   # a new drafter for the built-in target

--data holds one prompt per line: text, {"prompt": ...} or {"messages": [...]}. Then:
dflash-mlx generate --model Qwen/Qwen3-4B --draft-model my-drafter --prompt "..."
"""


class TrainingBars:
    """The trainer's progress callback: a rich bar per stage on stdout."""

    LABELS = {"distill": "target writes responses", "train": "training drafter"}

    def __init__(self):
        self.stage = None
        self.bar = None

    def __call__(self, stage: str, done: int, total: int, info: str) -> None:
        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.bar.add_task(self.LABELS.get(stage, stage), total=total, info="")
            self.bar.start()
        self.bar.update(self.task, completed=done, total=total, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _layer_ids(text: Optional[str]) -> Optional[list[int]]:
    if text is None or not text.strip():
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--target-layer-ids must be comma-separated integers such as 1,9,17, got {text!r}.") from None


def train_command(
    *,
    model: Optional[str] = typer.Option(
        None,
        "--model",
        help="Target model: local directory or Hugging Face repo id (mlx-lm format). Left out (or 'builtin'): the built-in target.",
        show_default=False,
    ),
    data: str = typer.Option(
        ..., "--data", help='JSONL of prompts: one {"prompt": ...} or {"messages": [...]} per line.'
    ),
    out: str = typer.Option(
        ...,
        "--out",
        help="Output directory for the drafter (Z Lab layout), its checkpoint and the self-distilled data.",
    ),
    block_size: int = typer.Option(
        16, "--block-size", help="Tokens per block: the anchor token plus block_size-1 drafts."
    ),
    draft_layers: int = typer.Option(5, "--draft-layers", help="Decoder layers in the drafter."),
    target_layer_ids: Optional[str] = typer.Option(
        None, "--target-layer-ids", help="Target layers to tap, comma-separated (default: Z Lab's spread rule)."
    ),
    steps: int = typer.Option(2000, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    blocks_per_seq: int = typer.Option(
        16, "--blocks-per-seq", help="Blocks (anchor positions) sampled in each sequence per step."
    ),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, warmup then cosine decay)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Prompt + response tokens per training sequence."),
    min_block_size: Optional[int] = typer.Option(
        None,
        "--min-block-size",
        help="Train on blocks of random length between this and --block-size, so one drafter serves every block size in that range (default: full blocks only).",
    ),
    val_fraction: Optional[float] = typer.Option(
        None,
        "--val-fraction",
        help="Share of the self-distilled sequences held out of training (default 0.05; none below 20 sequences); the acceptance estimate on them is shown at each checkpoint.",
        show_default=False,
    ),
    gen_batch: int = typer.Option(
        64,
        "--gen-batch",
        help="Prompts the target answers at once while writing the training data (larger is faster on a GPU).",
    ),
    gamma: Optional[float] = typer.Option(
        None, "--gamma", help="Loss decay over block position exp(-(i-1)/gamma); default 7 at block 16."
    ),
    mask_token_id: Optional[int] = typer.Option(
        None, "--mask-token-id", help="Token id of the MASK slots (default: chosen from the tokenizer)."
    ),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Use only the first N prompts."),
    save_every: int = typer.Option(200, "--save-every", help="Checkpoint every N steps."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the checkpoint in --out (the self-distilled data is reused)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for the drafter's init and the batch sampling."),
    verbose: Verbose = False,
) -> None:
    """Train a DFlash drafter for a target by self-distillation."""
    with user_errors(verbose, interrupted="interrupted; run again with --resume to continue from the last checkpoint."):
        from dflash_mlx.train.trainer import TrainConfig, train

        cfg = TrainConfig(
            model=model_or_builtin(model),
            data=data,
            out=out,
            block_size=block_size,
            draft_layers=draft_layers,
            target_layer_ids=_layer_ids(target_layer_ids),
            steps=steps,
            batch_size=batch_size,
            blocks_per_seq=blocks_per_seq,
            lr=lr,
            seq_len=seq_len,
            resume=resume,
            seed=seed,
            gamma=gamma,
            mask_token_id=mask_token_id,
            max_prompts=max_prompts,
            save_every=save_every,
            min_block_size=min_block_size,
            val_fraction=val_fraction,
            gen_batch=gen_batch,
        )
        bars = TrainingBars()
        try:
            train(cfg, log=console.print, progress=bars)
        finally:
            bars.close()
