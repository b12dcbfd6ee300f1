"""The options the commands share (names and meanings follow mlx-lm), and
the checks of their values that run before anything slow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .console import UserError
from .console import click_exceptions as cx

BUILTIN_HELP = "Left out (or 'builtin'): the small built-in pair shipped with dflash-mlx, offline."

Model = Annotated[
    Optional[str],
    typer.Option(
        "--model", help=f"Target model: a local directory or a Hugging Face repo id. {BUILTIN_HELP}", show_default=False
    ),
]
DraftModel = Annotated[
    Optional[str],
    typer.Option(
        "--draft-model",
        help="DFlash drafter: a local directory or repo id; defaults to the known drafter for --model. "
        "'none': no drafter, drafts by prompt lookup alone (with --lookup on).",
        show_default=False,
    ),
]
AdapterPath = Annotated[
    Optional[str],
    typer.Option(
        "--adapter-path", help="LoRA adapters for the target (a directory written by mlx_lm.lora).", show_default=False
    ),
]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Let the target's tokenizer run code from its repo.")
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="What the pair computes in: float32, bfloat16, float16, or auto: the weights' own dtype, "
        "except float32 on a CPU whose products run on OpenBLAS (faster there; see `dflash-mlx doctor`).",
    ),
]
DraftBits = Annotated[
    str,
    typer.Option(
        "--draft-bits",
        help="The drafter's linear layers quantized at load to 4 or 8 bits (fewer bytes read a cycle), 16: as "
        "stored, or auto: beside a quantized target, quantized where this machine measured it faster "
        "(see `dflash-mlx doctor`). Output is the target's whatever the drafter's precision.",
        metavar="4|8|16|auto",
    ),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-m", help="Most tokens to generate per reply.")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[
    float, typer.Option("--top-p", help="Nucleus sampling: keep the smallest set of tokens with this much probability.")
]
MinP = Annotated[
    float,
    typer.Option(
        "--min-p", help="Min-p sampling: drop tokens less likely than this share of the most likely one; 0 keeps all."
    ),
]
TopK = Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens; 0 keeps all.")]
XtcProbability = Annotated[
    float,
    typer.Option(
        "--xtc-probability",
        help="XTC sampling: the chance, at each token, of excluding the top choices; 0 disables it.",
    ),
]
XtcThreshold = Annotated[
    float,
    typer.Option(
        "--xtc-threshold",
        help="XTC sampling: tokens at least this likely are the top choices (all but the least likely "
        "of them are excluded), in [0, 0.5].",
    ),
]
MinTokensToKeep = Annotated[
    int, typer.Option("--min-tokens-to-keep", help="Tokens min-p sampling always keeps, the most likely ones.")
]
Seed = Annotated[
    Optional[int],
    typer.Option(
        "--seed",
        help="Random seed (any integer): fixes a sampled reply's text, whatever the block size.",
        show_default=False,
    ),
]
BlockSize = Annotated[
    Optional[str],
    typer.Option(
        "--block-size",
        help="Tokens per verify (1 committed + drafts), at most the drafter's trained block. "
        "Default 'auto': picked before every cycle (plain steps included) from the measured acceptance and "
        "cycle times.",
        show_default=False,
    ),
]
LOOKUP = {"off": False, "on": True, "auto": "auto"}
Lookup = Annotated[
    str,
    typer.Option(
        "--lookup",
        help="Prompt lookup: also draft by copying what followed the last tokens earlier in the prompt or "
        "reply (on), decide per reply (auto), or not (off). See docs/lookup.md.",
    ),
]
TreeBudget = Annotated[
    Optional[str],
    typer.Option(
        "--tree-budget",
        help="Draft trees: verify N rows a cycle (1-64, the root included) on the drafter's likeliest "
        "continuations, or choose N before every cycle (auto); off by default. See docs/trees.md.",
        metavar="N|auto",
        show_default=False,
    ),
]
NumDraftTokens = Annotated[
    Optional[int],
    typer.Option(
        "--num-draft-tokens",
        help="mlx-lm's name: N drafted tokens per verify, the same as --block-size N+1.",
        show_default=False,
    ),
]
ExtraEosToken = Annotated[
    Optional[list[str]],
    typer.Option(
        "--extra-eos-token",
        help="Another token (text or id) that ends a reply; repeat for several.",
        metavar="<str>",
        show_default=False,
    ),
]


def tree_budget(text: Optional[str]) -> int | str | None:
    """--tree-budget as stream_generate takes it: None (off: blocks), "auto",
    or the rows each drafting cycle's tree verifies."""
    from dflash_mlx.arguments import MAX_TREE_BUDGET, check_tree_budget

    word = None if text is None else text.strip().lower()
    if word in (None, "off"):
        return None
    try:
        return check_tree_budget(word if word == "auto" else int(word), has_drafter=True)
    except ValueError:
        raise UserError(
            f"--tree-budget must be an integer from 1 to {MAX_TREE_BUDGET} (rows a cycle verifies) or auto, "
            f"got {text!r}."
        ) from None


def utf8_text(ctx, param, value: Optional[str]) -> Optional[str]:
    """Refuse text that is not UTF-8: the shell passes such bytes through as
    lone surrogates, which no tokenizer can encode."""
    if value is None:
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(value[e.start])
        what = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        flag = param.opts[0] if param is not None and param.opts else "the text"
        raise cx.ClickException(
            f"{flag} is not UTF-8 text ({what} at character {e.start}); pass UTF-8 text, "
            "e.g. convert it with iconv -t UTF-8."
        ) from None
    return value


def text_flag(*names: str, help: str):
    """A text flag, refused unless UTF-8 (``utf8_text``)."""
    return Annotated[Optional[str], typer.Option(*names, help=help, show_default=False, callback=utf8_text)]


SystemPrompt = text_flag("--system-prompt", help="System message for the chat template.")
Prompt = text_flag("--prompt", "-p", help="The prompt; '-' reads it from stdin.")
PrefixPrompt = text_flag("--prompt", "-p", help="The prefix to cache; '-' reads it from stdin.")
PrefillResponse = text_flag(
    "--prefill-response", help="Start the reply with this text (chat template); the model continues it."
)
UseDefaultChatTemplate = Annotated[
    bool,
    typer.Option(
        "--use-default-chat-template",
        help="Give a tokenizer without a chat template the default one (ChatML), as mlx-lm's server does.",
    ),
]
IgnoreChatTemplate = Annotated[
    bool, typer.Option("--ignore-chat-template", help="Use the prompt as is, without the chat template.")
]
EnableThinking = Annotated[
    bool, typer.Option("--enable-thinking", help="Let chat templates that have it emit a thinking section.")
]
ChatTemplateConfig = Annotated[
    Optional[str],
    typer.Option(
        "--chat-template-config",
        "--chat-template-args",
        help="Extra arguments for the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}'.",
        show_default=False,
    ),
]
PromptCacheFile = Annotated[
    Optional[Path],
    typer.Option(
        "--prompt-cache-file",
        help="A prefix cached by `dflash-mlx cache-prompt` for this model pair; the prompt continues it.",
        show_default=False,
    ),
]


def split_choice(ctx, param, value: str) -> str:
    """--split, refused on one machine too, where it is not used: a typo
    would otherwise surface only under mlx.launch."""
    if value not in ("auto", "pipeline", "tensor"):
        raise cx.ClickException(f"--split must be pipeline, tensor or auto, got {value!r}.")
    return value


Split = Annotated[
    str,
    typer.Option(
        "--split",
        help="Under mlx.launch, how the target is split across the ranks: pipeline, tensor or auto "
        "(pipeline where the family has it).",
        callback=split_choice,
    ),
]
PrefillStepSize = Annotated[
    int, typer.Option("--prefill-step-size", help="Prompt tokens per prefill step (lower: less peak memory).")
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="More detail, and a traceback on errors.")]


def template_args(text: Optional[str]) -> dict:
    """--chat-template-config (alias --chat-template-args): a JSON object of
    extra arguments for the chat template."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"--chat-template-config (--chat-template-args) is not valid JSON ({e.msg}); pass an object such as "
            "'{\"enable_thinking\": false}'."
        ) from None
    if not isinstance(extra, dict):
        raise UserError(
            "--chat-template-config (--chat-template-args) must be a JSON object such as '{\"enable_thinking\": false}'."
        )
    return extra


def add_eos_tokens(tokenizer, tokens: Optional[list[str]]) -> None:
    """--extra-eos-token: each a token's exact text or its id, added to the tokenizer's EOS set."""
    for token in tokens or ():
        try:
            token_id = int(token)
            if token_id not in tokenizer.get_vocab().values():  # mlx-lm would add any integer
                token_id = None
        except ValueError:
            token_id = tokenizer.convert_tokens_to_ids(token)
            unk = getattr(tokenizer, "unk_token_id", None)
            if token_id is not None and token_id == unk and token != getattr(tokenizer, "unk_token", None):
                token_id = None  # an unknown text maps to the unknown token
        if token_id is None:
            raise UserError(
                f"--extra-eos-token {token!r} is not a token of this tokenizer; pass one token's exact text or its id."
            )
        tokenizer.add_eos_token(str(token_id))


KvBits = Annotated[
    Optional[int],
    typer.Option(
        "--kv-bits",
        help="Quantize the target's KV cache to this many bits (2, 3, 4, 5, 6 or 8), as mlx-lm's "
        "QuantizedKVCache does; lossless against mlx-lm with the same settings. Default: not quantized.",
        show_default=False,
    ),
]
KvGroupSize = Annotated[
    int, typer.Option("--kv-group-size", help="Group size for KV cache quantization (32, 64 or 128).")
]
QuantizedKvStart = Annotated[
    int,
    typer.Option(
        "--quantized-kv-start",
        help="With --kv-bits: quantize once the cache holds this many tokens (mlx-lm's default, 5000).",
    ),
]


NO_BOUNDED_FILE = "a prompt-cache file holds an unbounded cache; run without --max-kv-size to use it."

MaxKvSize = Annotated[
    Optional[int],
    typer.Option(
        "--max-kv-size",
        help="Bound the target's KV cache to this many tokens, as mlx-lm's rotating cache "
        "does (the first 4 and the latest kept); lossless against mlx-lm with the same bound, and replies "
        "may then run past the target's context length. Default: unbounded.",
        show_default=False,
    ),
]


def flag_names(message: str) -> str:
    """A library sentence in the CLI's words: kv_bits -> --kv-bits ..."""
    for name in ("kv_bits", "kv_group_size", "quantized_kv_start", "max_kv_size"):
        message = message.replace(name, "--" + name.replace("_", "-"))
    return message
