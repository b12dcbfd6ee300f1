"""`dflash-mlx generate`: one prompt, text streamed to stdout, stats to stderr."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.text import Text
from typing_extensions import Annotated

from .console import UserError, err, note, user_errors
from .options import (
    BlockSize, DraftModel, EnableThinking, IgnoreChatTemplate, MaxTokens, Model, PrefillStepSize, Seed,
    SystemPrompt, Temp, TopK, TopP, Verbose, check_args,
)
from .pair import load_pair
from .progress import PrefillProgress
from .prompts import prompt_ids, read_prompt, thinking_note
from .status import stats_line

EXAMPLES = """\
Examples:

$ dflash-mlx generate --model Qwen/Qwen3-8B --prompt "Write a haiku about the sea"

$ dflash-mlx generate --model ./qwen3-8b --draft-model ./qwen3-8b-dflash --prompt "Explain RoPE" -m 512 --temp 0.7 --seed 1

$ cat question.txt | dflash-mlx generate --model Qwen/Qwen3-8B --prompt - --ignore-chat-template

Without --draft-model the drafter comes from the known pairs (dflash-mlx models).
"""


def generate_command(
    model: Model = None,
    draft_model: DraftModel = None,
    prompt: Annotated[
        Optional[str], typer.Option("--prompt", "-p", help="The prompt; '-' reads it from stdin.", show_default=False)
    ] = None,
    max_tokens: MaxTokens = 256,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    block_size: BlockSize = None,
    system_prompt: SystemPrompt = None,
    ignore_chat_template: IgnoreChatTemplate = False,
    enable_thinking: EnableThinking = False,
    prefill_step_size: PrefillStepSize = 2048,
    verbose: Verbose = False,
):
    """Generate a reply to one prompt with DFlash speculative decoding.

    The text streams to stdout as it is produced; a stats line (tokens, tok/s,
    acceptance length and rate, peak memory) follows on stderr.
    """
    with user_errors(verbose):
        text = read_prompt(prompt)
        block_size = check_args(max_tokens, temp, top_p, top_k, block_size)
        if prefill_step_size < 1:
            raise UserError(f"--prefill-step-size must be positive, got {prefill_step_size}.")
        from dflash_mlx import stream_generate

        target, draft, tokenizer = load_pair(model, draft_model)
        thinking_note(tokenizer, enable_thinking, ignore_chat_template)
        ids = prompt_ids(
            tokenizer, text, system_prompt=system_prompt,
            ignore_chat_template=ignore_chat_template, enable_thinking=enable_thinking,
        )
        if verbose:
            note(f"prompt: {len(ids)} tokens: {tokenizer.decode(ids)!r}")
        progress = PrefillProgress()
        last = None
        out = sys.stdout
        try:
            for last in stream_generate(
                target, draft, tokenizer, ids,
                max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k,
                block_size=block_size, seed=seed, prompt_progress=progress,
                prefill_step_size=prefill_step_size,
            ):
                out.write(last.text)
                out.flush()
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            progress.close()
            err.print(Text("interrupted", style="yellow"))
            if last is not None:
                note(stats_line(last))
            raise typer.Exit(130)
        finally:
            progress.close()
        out.write("\n")
        out.flush()
        if last is not None:
            err.print(Text(stats_line(last), style="dim"), soft_wrap=True)
