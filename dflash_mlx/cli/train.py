"""`dflash-mlx train`: a DFlash drafter trained for a target by
self-distillation (the trainer is dflash_mlx.train)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .console import UserError, console, user_errors
from .option_groups import flags, takes_groups
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


@dataclass(frozen=True, kw_only=True)
class TrainFlags:
    """The command's flags: TrainConfig's fields, --target-layer-ids as text."""

    model: Annotated[
        Optional[str],
        typer.Option(
            "--model",
            help="Target model: local directory or Hugging Face repo id (mlx-lm format). Left out (or 'builtin'): the built-in target.",
            show_default=False,
        ),
    ] = None
    data: Annotated[
        str, typer.Option("--data", help='JSONL of prompts: one {"prompt": ...} or {"messages": [...]} per line.')
    ]
    out: Annotated[
        str,
        typer.Option(
            "--out", help="Output directory for the drafter (Z Lab layout), its checkpoint and the self-distilled data."
        ),
    ]
    block_size: Annotated[
        int, typer.Option("--block-size", help="Tokens per block: the anchor token plus block_size-1 drafts.")
    ] = 16
    draft_layers: Annotated[int, typer.Option("--draft-layers", help="Decoder layers in the drafter.")] = 5
    target_layer_ids: Annotated[
        Optional[str],
        typer.Option(
            "--target-layer-ids", help="Target layers to tap, comma-separated (default: Z Lab's spread rule)."
        ),
    ] = None
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 2000
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 8
    blocks_per_seq: Annotated[
        int, typer.Option("--blocks-per-seq", help="Blocks (anchor positions) sampled in each sequence per step.")
    ] = 16
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, warmup then cosine decay).")] = 6e-4
    seq_len: Annotated[int, typer.Option("--seq-len", help="Prompt + response tokens per training sequence.")] = 512
    min_block_size: Annotated[
        Optional[int],
        typer.Option(
            "--min-block-size",
            help="Train on blocks of random length between this and --block-size, so one drafter serves every block size in that range (default: full blocks only).",
        ),
    ] = None
    val_fraction: Annotated[
        Optional[float],
        typer.Option(
            "--val-fraction",
            help="Share of the self-distilled sequences held out of training (default 0.05; none below 20 sequences); the acceptance estimate on them is shown at each checkpoint.",
            show_default=False,
        ),
    ] = None
    gen_batch: Annotated[
        int,
        typer.Option(
            "--gen-batch",
            help="Prompts the target answers at once while writing the training data (larger is faster on a GPU).",
        ),
    ] = 64
    gamma: Annotated[
        Optional[float],
        typer.Option("--gamma", help="Loss decay over block position exp(-(i-1)/gamma); default 7 at block 16."),
    ] = None
    mask_token_id: Annotated[
        Optional[int],
        typer.Option("--mask-token-id", help="Token id of the MASK slots (default: chosen from the tokenizer)."),
    ] = None
    max_prompts: Annotated[Optional[int], typer.Option("--max-prompts", help="Use only the first N prompts.")] = None
    save_every: Annotated[int, typer.Option("--save-every", help="Checkpoint every N steps.")] = 200
    resume: Annotated[
        bool,
        typer.Option("--resume", help="Continue from the checkpoint in --out (the self-distilled data is reused)."),
    ] = False
    seed: Annotated[int, typer.Option("--seed", help="Seed for the drafter's init and the batch sampling.")] = 0


@takes_groups
def train_command(*, settings: TrainFlags = flags(TrainFlags), verbose: Verbose = False) -> None:
    """Train a DFlash drafter for a target by self-distillation."""
    with user_errors(verbose, interrupted="interrupted; run again with --resume to continue from the last checkpoint."):
        from dflash_mlx.train.trainer import TrainConfig, train

        chosen = dict(model=model_or_builtin(settings.model), target_layer_ids=_layer_ids(settings.target_layer_ids))
        cfg = TrainConfig(**{**asdict(settings), **chosen})
        bars = TrainingBars()
        try:
            train(cfg, log=console.print, progress=bars)
        finally:
            bars.close()
