"""The Anthropic Messages endpoint, /v1/messages: text, system, thinking,
stop sequences and tool use, streamed as Anthropic's events or not."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import error_body
from .job import Done, Event, Failed, Job, Progress, Usage
from .reply import Delta
from .schemas import AnthropicRequest, CountTokensRequest
from .service import Service, event_stream, keep_alive, sse
from .templates import anthropic_messages, anthropic_thinking, anthropic_tools, rendered_chat

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(done: Done) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(done.finish_reason, "end_turn")


def usage_body(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "dflash": usage.dflash,
    }


def anthropic_prompt(service: Service, body: CountTokensRequest) -> tuple[list[int], bool, Optional[list[dict]]]:
    """(prompt ids, whether the reply begins as reasoning, tools) of a
    Messages request: for a preparing thread."""
    tools = None if (body.tool_choice or {}).get("type") == "none" else anthropic_tools(body.tools)
    messages = anthropic_messages(body.system, body.messages)
    kwargs = service.template_kwargs(None, **anthropic_thinking(body.thinking))
    return (*rendered_chat(service.tokenizer, messages, tools, kwargs), tools)


async def messages_job(service: Service, body: AnthropicRequest) -> Job:
    ids, reasoning, tools = await service.off_loop(anthropic_prompt, service, body)
    job = Job(
        ids,
        service.params(body),
        list(body.stop_sequences or []),
        structured=True,
        starts_in_reasoning=reasoning,
        tools=tools,
    )
    service.fit_to_context(job, body.max_tokens)
    return job


def content_blocks(delta: Delta) -> list[dict]:
    blocks = []
    if delta.reasoning:
        blocks.append({"type": "thinking", "thinking": delta.reasoning, "signature": ""})
    if delta.content:
        blocks.append({"type": "text", "text": delta.content})
    blocks += [
        {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]} for c in delta.tool_calls
    ]
    return blocks


def message_body(message_id: str, model: str, content: list[dict], done: Optional[Done], usage: dict) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": done and stop_reason(done),
        "stop_sequence": done and done.stop_sequence,
        "usage": usage,
    }


class _BlockStream:
    """Anthropic's streamed content blocks: one open at a time, each started,
    filled with deltas and stopped."""

    DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}

    def __init__(self):
        self.index, self.open_kind = -1, None

    def _start(self, block: dict) -> str:
        self.index += 1
        self.open_kind = block["type"]
        return sse({"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start")

    def close(self) -> str:
        if self.open_kind is None:
            return ""
        self.open_kind = None
        return sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def text(self, kind: str, text: str) -> str:
        out = ""
        if self.open_kind != kind:
            out += self.close()
            start = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            out += self._start(start)
        delta_type, field = self.DELTAS[kind]
        return out + sse(
            {"type": "content_block_delta", "index": self.index, "delta": {"type": delta_type, field: text}},
            "content_block_delta",
        )

    def tool_use(self, call: dict) -> str:
        out = self.close() + self._start({"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}})
        partial = json.dumps(call["arguments"], ensure_ascii=False)
        out += sse(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": partial},
            },
            "content_block_delta",
        )
        return out + self.close()

    def delta(self, delta: Delta) -> str:
        out = self.text("thinking", delta.reasoning) if delta.reasoning else ""
        out += self.text("text", delta.content) if delta.content else ""
        return out + "".join(self.tool_use(c) for c in delta.tool_calls)


async def message_stream(
    message_id: str, service: Service, job: Job, events: AsyncIterator[Event]
) -> AsyncIterator[str]:
    start = message_body(
        message_id, service.config.model_name, [], None, {"input_tokens": len(job.prompt), "output_tokens": 0}
    )
    yield sse({"type": "message_start", "message": start}, "message_start")
    blocks = _BlockStream()
    async for event in events:
        if isinstance(event, Progress):  # Anthropic's keep-alive, after a comment with the progress
            yield keep_alive(event) + sse({"type": "ping"}, "ping")
            continue
        if isinstance(event, Failed):
            yield sse(error_body(event.error.status, event.error.message), "error")
            return
        delta = event.delta if isinstance(event, Done) else event
        if delta:
            yield blocks.delta(delta)
        if isinstance(event, Done):
            yield blocks.close()
            yield sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(event), "stop_sequence": event.stop_sequence},
                    "usage": usage_body(event.usage),
                },
                "message_delta",
            )
            yield sse({"type": "message_stop"}, "message_stop")


async def messages(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.accept(request, AnthropicRequest)
    job = await messages_job(service, body)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    events = await service.start(job, request)
    if events is None:
        return Response(status_code=499)
    if body.stream:
        return event_stream(job, message_stream(message_id, service, job, events))
    delta, done = await service.collect(events)
    return JSONResponse(
        message_body(message_id, service.config.model_name, content_blocks(delta), done, usage_body(done.usage))
    )


async def count_tokens(request: Request) -> Response:
    """Anthropic's /v1/messages/count_tokens: the prompt's length as
    /v1/messages would render it."""
    service: Service = request.app.state.service
    body = await service.accept(request, CountTokensRequest)
    ids, _, _ = await service.off_loop(anthropic_prompt, service, body)
    return JSONResponse({"input_tokens": len(ids)})
