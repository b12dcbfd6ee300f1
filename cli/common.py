"""What the commands share: options, error handling, loading, prompts, stats."""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.text import Text
from typing_extensions import Annotated

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

# Streamed text goes to stdout; notes, progress, stats and errors to stderr.
console = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class UserError(Exception):
    """A mistake the user can fix; shown as one red sentence."""


def default_model() -> Optional[str]:
    """The target used when --model is not given: the built-in pair shipped
    in the package (its drafter comes from the registry)."""
    from dflash_mlx import builtin

    if not builtin.available():
        return None
    err.print(Text(f"no --model given: using the {builtin.NAME}", style="dim"))
    return str(builtin.TARGET)


# -- options (names and meanings follow mlx-lm) ---------------------------------
Model = Annotated[
    Optional[str],
    typer.Option("--model", help="Target model: a local directory or a Hugging Face repo id.", show_default=False),
]
DraftModel = Annotated[
    Optional[str],
    typer.Option(
        "--draft-model",
        help="DFlash drafter: a local directory or repo id; defaults to the known drafter for --model.",
        show_default=False,
    ),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-m", help="Most tokens to generate per reply.")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the smallest set of tokens with this much probability.")]
TopK = Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens; 0 keeps all.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed, for repeatable sampling (with a fixed --block-size).", show_default=False)]
BlockSize = Annotated[
    Optional[str],
    typer.Option("--block-size", help="Tokens per verify (1 committed + drafts); defaults to the drafter's. "
                 "'auto' picks it before every cycle from the measured acceptance and cycle times.", show_default=False),
]
SystemPrompt = Annotated[Optional[str], typer.Option("--system-prompt", help="System message for the chat template.", show_default=False)]
IgnoreChatTemplate = Annotated[bool, typer.Option("--ignore-chat-template", help="Use the prompt as is, without the chat template.")]
EnableThinking = Annotated[bool, typer.Option("--enable-thinking", help="Let chat templates that have it emit a thinking section.")]
PrefillStepSize = Annotated[int, typer.Option("--prefill-step-size", help="Prompt tokens per prefill step.", hidden=True)]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="More detail, and a traceback on errors.")]


# -- errors ------------------------------------------------------------------------
def _sentence(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}."
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError):
        msg = f"missing key {msg}"
    return msg


def fail(message: str) -> "typer.Exit":
    err.print(Text(f"error: {message}", style="bold red"), soft_wrap=True)
    return typer.Exit(1)


@contextmanager
def user_errors(verbose: bool = False) -> Iterator[None]:
    """Turn what users can cause into one red sentence and exit code 1; a
    traceback only with --verbose."""
    try:
        yield
    except (typer.Exit, typer.Abort, click_exceptions.ClickException):
        raise
    except KeyboardInterrupt:
        err.print(Text("\ninterrupted", style="yellow"))
        raise typer.Exit(130)
    except (UserError, ValueError, OSError, KeyError) as e:
        if verbose:
            traceback.print_exc(file=sys.stderr)
        raise fail(_sentence(e))
    except Exception as e:  # a bug, not a user mistake: still no traceback by default
        if verbose:
            traceback.print_exc(file=sys.stderr)
            raise fail(f"unexpected {type(e).__name__}: {_sentence(e)}")
        raise fail(f"unexpected {type(e).__name__}: {_sentence(e)} (rerun with --verbose for the traceback)")


def note(message: str) -> None:
    err.print(Text(message, style="dim"), soft_wrap=True)


# -- checks before anything slow ------------------------------------------------------
def check_args(max_tokens: int, temp: float, top_p: float, top_k: int, block_size: Optional[str]) -> int | str | None:
    """Checks the generation flags; returns --block-size parsed (an int, "auto" or None)."""
    from dflash_mlx.sampling import check_sampling

    if max_tokens < 1:
        raise UserError(f"--max-tokens must be a positive integer, got {max_tokens}.")
    parsed: int | str | None = None
    if block_size is not None:
        text = str(block_size).strip().lower()
        if text == "auto":
            parsed = "auto"
        else:
            try:
                parsed = int(text)
            except ValueError:
                raise UserError(f"--block-size must be an integer of at least 2 or 'auto', got {block_size!r}.") from None
            if parsed < 2:
                raise UserError(f"--block-size must be at least 2 (one committed token plus drafts), got {parsed}.")
    try:
        check_sampling(temp, top_p, top_k)
    except ValueError as e:
        raise UserError(f"bad sampling flags (--temp/--top-p/--top-k): {e}") from None
    return parsed


def resolve_model(model: Optional[str]) -> str:
    model = model or default_model()
    if model is None:
        raise UserError("no model given and the built-in pair is not installed; pass --model <target directory or Hugging Face repo id>.")
    return model


# -- loading ---------------------------------------------------------------------------
def hub_progress_class():
    """A tqdm class for huggingface_hub whose bars are tasks of one shared,
    transient rich Progress on stderr (rich allows one live display at a
    time, and a snapshot download opens several bars)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
    from tqdm.std import tqdm as std_tqdm

    class HubProgress(std_tqdm):
        shared: Optional[Progress] = None
        open_bars = 0

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["gui"] = True  # tqdm draws nothing itself; display() feeds rich
            super().__init__(*args, **kwargs)
            if self.disable:
                return
            cls = type(self)
            if cls.shared is None:
                cls.shared = Progress(
                    TextColumn("[dim]{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                    console=err, transient=True,
                )
                cls.shared.start()
            cls.open_bars += 1
            self._task = cls.shared.add_task(self.desc or "", total=self.total)

        def display(self, *args, **kwargs):
            task = getattr(self, "_task", None)
            if task is not None and type(self).shared is not None:
                type(self).shared.update(task, completed=self.n, total=self.total, description=self.desc or "")

        def clear(self, *args, **kwargs):
            pass

        def close(self):
            task = getattr(self, "_task", None)
            if task is None:
                return super().close()
            self.display()
            self._task = None
            super().close()
            cls = type(self)
            cls.open_bars -= 1
            if cls.shared is not None and cls.open_bars <= 0:
                cls.shared.stop()
                cls.shared, cls.open_bars = None, 0

    return HubProgress


def fetch(repo: Optional[str], allow_patterns: Optional[list[str]] = None) -> None:
    """Download a Hub repo with a rich progress bar, so that loading it next
    is quiet. Local paths and cached repos are left alone; failures are left
    to the loader, which explains them in one sentence."""
    if repo is None or Path(repo).expanduser().exists() or repo.count("/") != 1:
        return
    from huggingface_hub import snapshot_download

    from dflash_mlx import loading

    cache_dir = loading.hub_cache()
    try:
        snapshot_download(repo, allow_patterns=allow_patterns, cache_dir=cache_dir, local_files_only=True)
        return
    except Exception:
        pass
    if loading.hub_offline():
        return
    try:
        err.print(Text(f"downloading {repo}", style="dim"))
        snapshot_download(repo, allow_patterns=allow_patterns, cache_dir=cache_dir, tqdm_class=hub_progress_class())
    except Exception:
        pass


def load_pair(model: Optional[str], draft: Optional[str]):
    """(model, drafter, tokenizer): Hub downloads under rich progress bars
    (the small drafter and the target's config first, so a pair that cannot
    work fails before the target's weights are fetched), then a spinner."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from dflash_mlx import loading

    target = resolve_model(model)
    draft_repo = draft
    if draft is None:
        found = loading.find_drafter(target)
        draft_repo = str(found) if found is not None else None
    if draft_repo is not None:
        fetch(draft_repo, ["*.json", "*.safetensors", "*.md"])
        loading.check_family(target)
        fetch(target, DEFAULT_ALLOW_PATTERNS)
    with err.status(f"loading {target}", spinner="dots"):
        return loading.load(target, draft)


# -- prompts -------------------------------------------------------------------------------
def encode_text(tokenizer, text: str, first: bool = True) -> list[int]:
    """Raw text as ids, special tokens added the way dflash_mlx.generate does."""
    bos = tokenizer.bos_token
    add = first and (bos is None or not text.startswith(bos))
    return tokenizer.encode(text, add_special_tokens=add)


def uses_template(tokenizer, ignore_chat_template: bool) -> bool:
    return not ignore_chat_template and bool(getattr(tokenizer, "has_chat_template", False))


def render_chat(tokenizer, messages: list[dict], enable_thinking: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(
    tokenizer,
    prompt: str,
    *,
    system_prompt: Optional[str] = None,
    ignore_chat_template: bool = False,
    enable_thinking: bool = False,
    quiet: bool = False,
) -> list[int]:
    """The prompt through the chat template (as mlx-lm does), or as is."""
    if uses_template(tokenizer, ignore_chat_template):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return render_chat(tokenizer, messages, enable_thinking)
    if not quiet and not ignore_chat_template:
        note("the tokenizer has no chat template; using the prompt as is.")
    if not quiet and system_prompt:
        note("--system-prompt needs a chat template; ignored.")
    return encode_text(tokenizer, prompt)


def supports_thinking(tokenizer) -> bool:
    """Whether the chat template has a thinking section to turn on or off."""
    if getattr(tokenizer, "has_thinking", False):
        return True
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "enable_thinking" in template


def thinking_note(tokenizer, enable_thinking: bool, ignore_chat_template: bool) -> None:
    if enable_thinking and not (uses_template(tokenizer, ignore_chat_template) and supports_thinking(tokenizer)):
        note("this model's chat template has no thinking section; --enable-thinking changes nothing.")


# -- progress and stats ------------------------------------------------------------------
class PrefillProgress:
    """prompt_progress callback: a transient rich bar on stderr, shown only
    when the new part of the prompt takes more than one prefill step."""

    def __init__(self):
        self.bar = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if done >= total:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[dim]prefill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                console=err, transient=True,
            )
            self.task = self.bar.add_task("prefill", total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def stats_line(r) -> str:
    """The one-line summary of a DFlash GenerationResponse."""
    return (
        f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s · "
        f"generated {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s · "
        f"acceptance length {r.acceptance_length:.2f} · acceptance rate {r.acceptance_rate:.1%} · "
        f"peak memory {r.peak_memory:.2f} GB"
    )


def status_text(r, block_size: int | str | None = None, final: bool = False) -> str:
    """The chat status line for a GenerationResponse."""
    block = f"auto ({r.block_size})" if block_size == "auto" else (block_size or r.block_size)
    if r.cycles == 0 and not final:
        return f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.0f} tok/s · block {block}"
    lead = f"{r.generation_tokens} tokens · " if final else ""
    return (
        f"{lead}{r.generation_tps:.1f} tok/s · τ {r.acceptance_length:.2f} · accept {r.acceptance_rate:.0%} · "
        f"block {block} · {r.peak_memory:.2f} GB"
    )
