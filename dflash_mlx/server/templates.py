"""Requests to prompt token ids: messages through the model's chat template
(tools and the thinking switch included), raw prompts as they are, and the
Anthropic message shapes mapped onto the OpenAI ones the templates know."""

from __future__ import annotations

import json
from typing import Any, Optional

from mlx_lm.server import convert_chat, process_message_content

from .errors import APIError


# -- OpenAI shapes -------------------------------------------------------------------
def chat_prompt(tokenizer, messages: list[dict], tools: Optional[list[dict]], template_kwargs: dict) -> list[int]:
    """Token ids of ``messages`` rendered for a reply, as mlx-lm's server does."""
    try:
        process_message_content(messages)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    except (TypeError, AttributeError):  # a part, a tool call or its function that is not an object
        raise APIError(
            400,
            "messages: content must be a string or a list of text parts, and tool_calls a list of "
            "objects with a function object.",
            param="messages",
        ) from None
    if not getattr(tokenizer, "has_chat_template", False):
        return _not_empty(_encode(tokenizer, convert_chat(messages)), "messages")
    try:
        ids = list(
            tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **template_kwargs
            )
        )
    except Exception as e:  # jinja errors: a message shape this template cannot render
        raise APIError(
            400, f"the chat template cannot render these messages ({type(e).__name__}: {e}).", param="messages"
        ) from None
    return _not_empty(ids, "messages")


def text_prompt(tokenizer, prompt: str | list, vocab_size: Optional[int]) -> list[int]:
    """A raw completion prompt: text (with the tokenizer's BOS unless the
    text starts with it), one text in a list, or token ids."""
    if isinstance(prompt, list) and all(issubclass(k, int) for k in set(map(type, prompt))):
        if prompt and (min(prompt) < 0 or (vocab_size is not None and max(prompt) >= vocab_size)):
            bad = next(t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size))
            raise APIError(
                400, f"prompt: the token id {bad} is outside the vocabulary [0, {vocab_size}).", param="prompt"
            )
        return _not_empty(list(prompt), "prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(
                400, "prompt: give one prompt (this server answers one completion per request).", param="prompt"
            )
        prompt = prompt[0]
    bos = tokenizer.bos_token
    return _not_empty(
        _encode(tokenizer, prompt, add_special_tokens=bos is None or not prompt.startswith(bos)), "prompt"
    )


def _encode(tokenizer, text: str, **kwargs) -> list[int]:
    try:
        return tokenizer.encode(text, **kwargs)
    except Exception as e:  # text the tokenizer cannot read
        raise APIError(
            400, f"the tokenizer cannot read this prompt ({type(e).__name__}: {e}).", param="prompt"
        ) from None


def _not_empty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError(400, "the prompt is empty; give at least one token of text.", param=param)
    return ids


def rendered_chat(
    tokenizer, messages: list[dict], tools: Optional[list[dict]], template_kwargs: dict
) -> tuple[list[int], bool]:
    """(prompt ids, whether the reply begins as reasoning): all the work of
    a chat prompt, in one call for a preparing thread."""
    ids = chat_prompt(tokenizer, messages, tools, template_kwargs)
    return ids, starts_in_reasoning(tokenizer, ids)


def starts_in_reasoning(tokenizer, ids: list[int]) -> bool:
    """Whether the rendered prompt leaves a thinking section open, so the
    reply begins as reasoning (a template that opens <think> itself)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


# -- Anthropic shapes ----------------------------------------------------------------
def _bad_block(what: str) -> APIError:
    return APIError(400, f"messages: {what}", param="messages")


def _text_of(content: Any, where: str = "content") -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _bad_block(f"{where} must be a string or a list of text blocks, got {type(content).__name__}.")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad_block(f"content blocks of type {kind!r} are not supported in {where}; send text.")
        parts.append(_string(block, "text"))
    return "".join(parts)


def _string(block: dict, key: str) -> str:
    value = block.get(key, "")
    if not isinstance(value, str):
        raise _bad_block(f"the {key!r} of a {block.get('type')} block must be a string, got {type(value).__name__}.")
    return value


def _anthropic_turn(role: str, content: Any) -> list[dict]:
    """One Anthropic message as OpenAI-style messages: text, tool_use blocks
    as tool_calls, tool_result blocks as tool messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text, calls, results = [], [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            text.append(_string(block, "text"))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise _bad_block(f"the input of a tool_use block must be an object, got {type(arguments).__name__}.")
            calls.append(
                {
                    "id": _string(block, "id"),
                    "type": "function",
                    "function": {"name": _string(block, "name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(block, "tool_use_id"),
                    "content": _text_of(block.get("content"), "a tool_result's content"),
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):
            raise _bad_block(f"content blocks of type {kind!r} are not supported; send text, tool_use or tool_result.")
    turn = (
        [{"role": role, "content": "".join(text), **({"tool_calls": calls} if calls else {})}] if text or calls else []
    )
    return results + turn


def anthropic_messages(system: Any, messages: list) -> list[dict]:
    out = [{"role": "system", "content": _text_of(system, "system")}] if system else []
    for m in messages:
        out.extend(_anthropic_turn(m.role, m.content))
    return out


def anthropic_tools(tools: Optional[list]) -> Optional[list[dict]]:
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema or {}},
        }
        for t in tools
    ]


def anthropic_thinking(thinking: Optional[dict]) -> dict:
    """{"type": "enabled"|"adaptive"|"disabled"} as the templates' switch."""
    if not thinking:
        return {}
    return {"enable_thinking": thinking.get("type") != "disabled"}
