"""The model pair a command runs: --model (the built-in pair when it is not
given) and --draft-model, loaded once by dflash_mlx.load with its Hub
downloads drawn as bars under a spinner."""

from __future__ import annotations

from typing import Optional

from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn

from .console import UserError, err, note
from .progress import hub_progress_class


def model_or_builtin(model: Optional[str], draft: Optional[str] = None) -> str:
    """--model, or the built-in pair's target shipped in the package when it
    is left out (said once, naming ``draft``, the --draft-model given, as the
    drafter in place of the built-in one) or is 'builtin'."""
    if model is not None and model != "builtin":
        return model
    from dflash_mlx import builtin

    if not builtin.available():
        raise UserError(
            "no model given and the built-in pair is not installed; pass --model <target directory or Hugging Face repo id>."
        )
    if model is None and draft is None:
        note(f"no --model given: using the {builtin.NAME}")
    elif model is None:
        note(f"no --model given: using the built-in pair's target with the drafter {draft}")
    return str(builtin.TARGET)


def load_pair(
    model: Optional[str],
    draft: Optional[str],
    *,
    adapter_path: Optional[str] = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    draft_bits: int | str | None = "auto",
):
    """(model, drafter, tokenizer) for --model (see ``model_or_builtin``) and
    --draft-model. dflash_mlx.load fetches the drafter and the target's config
    first, so a pair that cannot work fails before the target's weights are
    downloaded."""
    from dflash_mlx import loading

    model = model_or_builtin(model, None if draft == "none" else draft)
    if draft == "none":  # lookup alone (docs/lookup.md)
        with Progress(SpinnerColumn(), TextColumn("[dim]{task.description}"), console=err, transient=True) as progress:
            progress.add_task(f"loading {model}", total=None)
            target, tokenizer = loading.load_target(
                model, adapter_path=adapter_path, trust_remote_code=trust_remote_code
            )
        return target, None, tokenizer

    columns = (SpinnerColumn(), TextColumn("[dim]{task.description}"), BarColumn(), TaskProgressColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        progress.add_task(f"loading {model}", total=None)
        pair = loading.load(
            model,
            draft,
            tqdm_class=hub_progress_class(progress),
            adapter_path=adapter_path,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            flags=True,
            draft_bits=draft_bits,
        )
    from dflash_mlx import compute_dtype

    if dtype == "auto" and compute_dtype.on_fast_blas(compute_dtype.computing(pair[0])):
        note(
            "computing in float32: this CPU's matrix products run on OpenBLAS (--dtype with the checkpoint's own "
            "dtype, e.g. bfloat16, computes in that instead)"
        )
    return pair


def load_split(
    model: Optional[str],
    draft: Optional[str],
    *,
    group,
    split: str,
    adapter_path: Optional[str] = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    draft_bits: int | str | None = "auto",
):
    """(target, drafter, tokenizer), the target split across ``group``'s ranks."""
    from dflash_mlx import loading

    if draft == "none":
        raise UserError("--draft-model none cannot run across ranks yet; name a drafter under mlx.launch.")
    return loading.load(
        model_or_builtin(model, draft),
        draft,
        adapter_path=adapter_path,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        flags=True,
        group=group,
        draft_bits=draft_bits,
        split=split,
    )


def context_length(model) -> Optional[int]:
    """The target's context length (max_position_embeddings in its config), if it says."""
    n = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def room_for_reply(model, prompt_tokens: int, max_tokens: int, bounded: bool = False) -> tuple[int, Optional[str]]:
    """(tokens the reply may have, what limits it): --max-tokens, or the room
    the target's context length leaves after the prompt, whichever is less
    (not when --max-kv-size bounds the cache: then only --max-tokens)."""
    n = None if bounded else context_length(model)
    if n is None or prompt_tokens + max_tokens <= n:
        return max_tokens, f"--max-tokens {max_tokens}"
    if prompt_tokens >= n:
        raise UserError(
            f"the prompt ({prompt_tokens} tokens) fills the target's context of {n} positions; "
            "shorten it (or /reset the conversation)."
        )
    return n - prompt_tokens, f"the target's context length ({n} positions)"
