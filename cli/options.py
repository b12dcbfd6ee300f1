"""The options the commands share (names and meanings follow mlx-lm), and
the checks of their values that run before anything slow."""

from __future__ import annotations

from typing import Optional

import typer
from typing_extensions import Annotated

from .console import UserError

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
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed (any integer): fixes a sampled reply's text, whatever the block size.", show_default=False)]
BlockSize = Annotated[
    Optional[str],
    typer.Option("--block-size", help="Tokens per verify (1 committed + drafts), at most the drafter's trained block. "
                 "Default 'auto': picked before every cycle (plain steps included) from the measured acceptance and "
                 "cycle times.", show_default=False),
]
SystemPrompt = Annotated[Optional[str], typer.Option("--system-prompt", help="System message for the chat template.", show_default=False)]
IgnoreChatTemplate = Annotated[bool, typer.Option("--ignore-chat-template", help="Use the prompt as is, without the chat template.")]
EnableThinking = Annotated[bool, typer.Option("--enable-thinking", help="Let chat templates that have it emit a thinking section.")]
PrefillStepSize = Annotated[int, typer.Option("--prefill-step-size", help="Prompt tokens per prefill step.", hidden=True)]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="More detail, and a traceback on errors.")]


def check_args(max_tokens: int, temp: float, top_p: float, top_k: int, block_size: Optional[str],
               seed: Optional[int] = None) -> int | str | None:
    """Checks the generation flags with the library's own rules
    (dflash_mlx.arguments); returns --block-size parsed (an int or "auto")."""
    from dflash_mlx.arguments import check_generation_args

    try:
        args = check_generation_args(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k,
                                     block_size=block_size, seed=seed, trained_block_size=None, flags=True)
    except ValueError as e:
        raise UserError(str(e)) from None
    return args.block_size
