"""`dflash-mlx cache-prompt`: the target's and the drafter's caches for a
prefix (a long system prompt, a document) written to a file, which
`generate --prompt-cache-file` and `chat --prompt-cache-file` load so that
they read only what follows it (dflash_mlx.prompt_cache_file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..atomic_dir import file_in_the_way
from . import options
from .console import UserError, console, note, speak_on_first_rank_only, user_errors
from .option_groups import Kv, Pair, Template, flags, takes_groups
from .pair import context_length, model_or_builtin
from .progress import PrefillProgress
from .prompt_input import read_prompt, uses_template

EXAMPLES = """\
Examples:

$ dflash-mlx cache-prompt --model Qwen/Qwen3-8B --prompt - --prompt-cache-file manual.safetensors < manual.txt

$ dflash-mlx generate --model Qwen/Qwen3-8B --prompt-cache-file manual.safetensors --prompt "What does chapter 2 say?"

$ dflash-mlx cache-prompt --system-prompt "You answer in Python only." --prompt "Task: " --prompt-cache-file py.safetensors

The file's prefix is the start of the first user message (after --system-prompt); a later --prompt continues it.
A file made for another model pair, or with other --kv-bits settings, is refused; --kv-bits here caches
the prefix quantized (give generate and chat the same --kv-bits, --kv-group-size, --quantized-kv-start).
"""


def prefix_ids(tokenizer, prefix: str, system_prompt: Optional[str], template: bool, kwargs: dict) -> list[int]:
    """The prefix as token ids: with the chat template, the conversation up to
    the end of ``prefix`` inside the first user message (left open)."""
    from dflash_mlx.prompts import encode

    if not template:
        return encode(tokenizer, prefix)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prefix}
    ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True, **kwargs
    )
    return encode(tokenizer, text)


def rank_file(path: Optional[Path], group) -> Optional[Path]:
    """This rank's prompt-cache file under ``mlx.launch`` (``group``:
    distributed.world()): each rank holds its own share of the caches; rank 0
    keeps ``path``, rank r writes and reads NAME.rank<r>.SUFFIX beside it."""
    if path is None or group is None or group.rank() == 0:
        return path
    return path.with_name(f"{path.stem}.rank{group.rank()}{path.suffix}")


def check_rank_files(path: Optional[Path], group) -> None:
    """Under ``mlx.launch``, that every rank has its file (``rank_file``'s):
    one rank without it would leave the others waiting in the split load."""
    if path is None or group is None:
        return
    from dflash_mlx.distributed import sum_across_ranks

    missing = sum_across_ranks(int(not rank_file(path, group).is_file()), group)
    if missing:
        raise UserError(
            f"{missing} of the {group.size()} ranks have no file of --prompt-cache-file {path} (rank r reads "
            f"{path.stem}.rank<r>{path.suffix}); make it under mlx.launch with the same ranks and --split."
        )


def check_output_file(path: Path) -> None:
    """Before the load, that --prompt-cache-file can be written as a file:
    it is no directory, and no file stands where a directory must be made."""
    if path.is_dir():
        raise UserError(
            f"--prompt-cache-file {path} is a directory; name a file in it, e.g. {path / 'prefix.safetensors'}."
        )
    there = file_in_the_way(path)
    if there is not None:
        raise UserError(f"--prompt-cache-file {path} lies under {there}, which is a file; choose another path.")


def read_cache_file(path: Path) -> dict:
    """The prefix a prompt-cache file holds: its text, system prompt and
    template settings (from the file's metadata), checked before any load."""
    from dflash_mlx.cache.files import damaged, read_metadata

    meta = read_metadata(path)
    try:
        template_kwargs = json.loads(meta.get("template_kwargs") or "{}")
    except (ValueError, RecursionError):  # (RecursionError: nested past any template's settings)
        template_kwargs = None
    if not isinstance(template_kwargs, dict):
        raise damaged(path, "its chat template settings are not a JSON object")
    return {
        "prompt": meta.get("prompt", ""),
        "system_prompt": meta.get("system_prompt") or None,
        "template_kwargs": template_kwargs,
    }


def open_cache(path: Path, target, draft, ids: list[int], kv: tuple = (None, 64, 0)):
    """The PromptCache the file holds, for this pair (another pair's file, or
    one made with other --kv-bits settings ``kv``, is refused), with a note
    when the prompt reuses less than all of it."""
    from dflash_mlx.cache.files import load_prompt_cache

    try:
        cache, _ = load_prompt_cache(path, target, draft, *kv)
    except ValueError as e:
        raise UserError(options.flag_names(str(e))) from None
    shared = next((i for i, (a, b) in enumerate(zip(cache.tokens, ids)) if a != b), min(len(cache.tokens), len(ids)))
    if shared < len(cache.tokens) - 1:
        note(
            f"the prompt shares only {shared} of the {len(cache.tokens)} cached tokens (another system prompt or "
            "template?); the rest is read again."
        )
    return cache


@takes_groups
def cache_prompt_command(
    *,
    pair: Pair = flags(Pair),
    prompt: options.PrefixPrompt = None,
    prompt_cache_file: Annotated[
        Optional[Path], typer.Option("--prompt-cache-file", help="The file to write (safetensors).", show_default=False)
    ] = None,
    system_prompt: options.SystemPrompt = None,
    template: Template = flags(Template, "ignore_chat_template", "chat_template_config"),
    adapter_path: options.AdapterPath = None,
    trust_remote_code: options.TrustRemoteCode = False,
    prefill_step_size: options.PrefillStepSize = 2048,
    kv: Kv = flags(Kv, "kv_bits", "kv_group_size", "quantized_kv_start"),
    split: options.Split = "auto",
    verbose: options.Verbose = False,
):
    """Cache a prompt prefix (a long system prompt or document) in a file.

    The target's and the drafter's caches for the prefix are written with the
    token ids and a fingerprint of the model pair; generate and chat load the
    file with --prompt-cache-file and read only what follows. Leaving out
    --model uses the built-in pair. Under mlx.launch each rank writes its own
    share, rank r beside the file as NAME.rank<r>.SUFFIX.
    """
    from dflash_mlx import distributed

    group = distributed.world()
    speak_on_first_rank_only(group)
    with user_errors(verbose):
        if prompt_cache_file is None:
            raise UserError(
                "no --prompt-cache-file given; name the file to write, e.g. --prompt-cache-file prefix.safetensors."
            )
        check_output_file(prompt_cache_file)
        text = read_prompt(prompt)
        kwargs = template.kwargs()
        if prefill_step_size < 1:
            raise UserError(f"--prefill-step-size must be a positive integer, got {prefill_step_size}.")
        kv.check()
        from dflash_mlx import make_prompt_cache, stream_generate
        from dflash_mlx.cache.files import save_prompt_cache

        name = model_or_builtin(pair.model, pair.draft_model)
        if group is None:
            target, draft, tokenizer = pair.load(name, adapter_path=adapter_path, trust_remote_code=trust_remote_code)
        else:
            target, draft, tokenizer = pair.load_split(
                group, split, adapter_path=adapter_path, trust_remote_code=trust_remote_code
            )
        chat = uses_template(tokenizer, template.ignore_chat_template)
        ids = prefix_ids(tokenizer, text, system_prompt, chat, kwargs)
        limit = context_length(target)
        if limit is not None and len(ids) >= limit:
            raise UserError(
                f"the prefix ({len(ids)} tokens) fills the target's context of {limit} positions; shorten it."
            )
        cache = kv.cache(target, draft) or make_prompt_cache(target, draft)
        progress = PrefillProgress()
        try:
            for _ in stream_generate(
                target,
                draft,
                tokenizer,
                ids,
                max_tokens=1,
                prompt_cache=cache,
                prefill_step_size=prefill_step_size,
                prompt_progress=progress,
            ):
                pass
        finally:
            progress.close()
        meta = {
            "model": name if pair.model is not None else "builtin",
            "draft_model": pair.draft_model or "",
            "prompt": text,
            "system_prompt": (system_prompt or "") if chat else "",
            "template_kwargs": json.dumps(kwargs),
            "chat_template": str(chat).lower(),
        }
        written = rank_file(prompt_cache_file, group)
        written.parent.mkdir(parents=True, exist_ok=True)
        save_prompt_cache(written, cache, meta)
        size = written.stat().st_size / 1e6
        ranks = "" if group is None else f", one file a rank beside it for {group.size() - 1} more"
        console.print(f"[green]cached {len(cache.tokens)} prompt tokens in {written}[/] [dim]({size:.1f} MB{ranks})[/]")
