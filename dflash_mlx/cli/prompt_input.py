"""The command line's prompts: --prompt (or stdin), the chat template as
mlx-lm applies it, and the notes when a flag cannot apply. The encoding
rules themselves live in dflash_mlx.prompts."""

from __future__ import annotations

import sys
from typing import Optional

from dflash_mlx.prompts import apply_chat_template, encode

from .console import UserError, note


def read_prompt(prompt: Optional[str]) -> str:
    """The text of --prompt; '-' reads it from stdin (one trailing newline dropped)."""
    if prompt is None:
        raise UserError("no prompt given; pass --prompt TEXT, or --prompt - to read it from stdin.")
    if prompt == "-":
        data = (
            sys.stdin.buffer.read()
            if hasattr(sys.stdin, "buffer")
            else sys.stdin.read().encode("utf-8", "surrogateescape")
        )
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"the prompt on stdin is not UTF-8 text (at byte {e.start}); "
                "convert it first, e.g. with iconv -t UTF-8."
            ) from None
        if prompt.endswith("\n"):
            prompt = prompt[:-1]
    if not prompt.strip():
        raise UserError("the prompt is empty; pass some text with --prompt.")
    return prompt


# The template transformers gave every tokenizer without one of its own.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def use_default_template(tokenizer, use: bool) -> None:
    """--use-default-chat-template: a tokenizer without a chat template gets
    its default one (ChatML where the tokenizer names none)."""
    if not use or getattr(tokenizer, "has_chat_template", False):
        return
    tokenizer.chat_template = getattr(tokenizer, "default_chat_template", None) or CHATML
    tokenizer.has_chat_template = True


def uses_template(tokenizer, ignore_chat_template: bool) -> bool:
    return not ignore_chat_template and bool(getattr(tokenizer, "has_chat_template", False))


def prompt_ids(
    tokenizer,
    prompt: str | list[dict],
    *,
    system_prompt: Optional[str] = None,
    ignore_chat_template: bool = False,
    enable_thinking: bool = False,
    template_kwargs: Optional[dict] = None,
    prefill_response: Optional[str] = None,
    quiet: bool = False,
) -> list[int]:
    """A prompt (text, or a conversation's messages) through the chat template
    as mlx-lm does, or, without one, its (last) text as is."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if uses_template(tokenizer, ignore_chat_template):
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        kwargs = {"enable_thinking": enable_thinking, **(template_kwargs or {})}
        return apply_chat_template(tokenizer, messages, prefill=prefill_response, **kwargs)
    if not quiet and not ignore_chat_template:
        note("the tokenizer has no chat template; using the prompt as is.")
    for flag, given in (
        ("--system-prompt", system_prompt),
        ("--prefill-response", prefill_response),
        ("--chat-template-config", template_kwargs),
    ):
        if not quiet and given:
            note(f"{flag} needs a chat template; ignored.")
    return encode(tokenizer, messages[-1]["content"])


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
