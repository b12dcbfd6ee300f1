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
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    if not getattr(tokenizer, "has_chat_template", False):
        return tokenizer.encode(convert_chat(messages))
    try:
        return list(tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **template_kwargs
        ))
    except Exception as e:  # jinja errors: a message shape this template cannot render
        raise APIError(400, f"the chat template cannot render these messages ({type(e).__name__}: {e}).", param="messages") from None


def text_prompt(tokenizer, prompt: str | list) -> list[int]:
    """A raw completion prompt: text (with the tokenizer's BOS unless the
    text starts with it), one text in a list, or token ids."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "prompt: give one prompt (this server answers one completion per request).", param="prompt")
        prompt = prompt[0]
    bos = tokenizer.bos_token
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


def starts_in_reasoning(tokenizer, ids: list[int]) -> bool:
    """Whether the rendered prompt leaves a thinking section open, so the
    reply begins as reasoning (a template that opens <think> itself)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


def check_context(ids: list[int], context_length: Optional[int]) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty; give at least one token of text.", param="messages")
    if context_length is not None and len(ids) >= context_length:
        raise APIError(
            400,
            f"the prompt is {len(ids)} tokens, and this model's context is {context_length} tokens; shorten it.",
            code="context_length_exceeded",
        )


# -- Anthropic shapes ----------------------------------------------------------------
def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if block.get("type") != "text":
            raise APIError(400, f"content blocks of type {block.get('type')!r} are not supported here; send text.", param="messages")
        parts.append(block.get("text", ""))
    return "".join(parts)


def _anthropic_turn(role: str, content: Any) -> list[dict]:
    """One Anthropic message as OpenAI-style messages: text, tool_use blocks
    as tool_calls, tool_result blocks as tool messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text, calls, results = [], [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input", {})}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _text_of(block.get("content"))})
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"content blocks of type {kind!r} are not supported; send text, tool_use or tool_result.", param="messages")
    turn = [{"role": role, "content": "".join(text), **({"tool_calls": calls} if calls else {})}] if text or calls else []
    return results + turn


def anthropic_messages(system: Any, messages: list) -> list[dict]:
    out = [{"role": "system", "content": _text_of(system)}] if system else []
    for m in messages:
        out.extend(_anthropic_turn(m.role, m.content))
    return out


def anthropic_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools]


def anthropic_thinking(thinking: Optional[dict]) -> dict:
    """{"type": "enabled"|"adaptive"|"disabled"} as the templates' switch."""
    if not thinking:
        return {}
    return {"enable_thinking": thinking.get("type") != "disabled"}
