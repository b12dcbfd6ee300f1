"""The model pair a command runs: --model (the built-in pair when it is not
given) and --draft-model, loaded once by dflash_mlx.load with its Hub
downloads drawn as bars under a spinner."""

from __future__ import annotations

from typing import Optional

from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn

from .console import UserError, err, note
from .progress import hub_progress_class


def model_or_builtin(model: Optional[str]) -> str:
    """--model, or the built-in pair shipped in the package (said once)."""
    if model is not None:
        return model
    from dflash_mlx import builtin

    if not builtin.available():
        raise UserError("no model given and the built-in pair is not installed; pass --model <target directory or Hugging Face repo id>.")
    note(f"no --model given: using the {builtin.NAME}")
    return str(builtin.TARGET)


def load_pair(model: Optional[str], draft: Optional[str]):
    """(model, drafter, tokenizer) for --model (see ``model_or_builtin``) and
    --draft-model. dflash_mlx.load fetches the drafter and the target's config
    first, so a pair that cannot work fails before the target's weights are
    downloaded."""
    from dflash_mlx import loading

    model = model_or_builtin(model)

    columns = (SpinnerColumn(), TextColumn("[dim]{task.description}"), BarColumn(), TaskProgressColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        progress.add_task(f"loading {model}", total=None)
        return loading.load(model, draft, tqdm_class=hub_progress_class(progress))
