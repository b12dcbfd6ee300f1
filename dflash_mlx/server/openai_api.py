"""The OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import error_body
from .job import Done, Event, Failed, Job, Progress, Usage
from .reply import Delta, TokenLogprob
from .schemas import ChatRequest, CompletionRequest
from .service import Service, event_stream, keep_alive, sse
from .templates import rendered_chat, text_prompt


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "dflash": usage.dflash,
    }


def tool_calls_body(calls: list[dict], first_index: int = 0, streaming: bool = False) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        body = {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
        }
        out.append({"index": first_index + i, **body} if streaming else body)
    return out


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


class _Reply:
    """The fields every response and chunk of one reply carries."""

    def __init__(self, service: Service, kind: str):
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = service.config.model_name
        self.kind = kind
        self.logprobs = False  # whether the request asked for log-probs
        self.text_offset = 0  # the completion text's length so far (legacy logprobs)

    def body(self, choice: dict, **extra) -> dict:
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
            **extra,
        }


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(reply: _Reply, entries: list[TokenLogprob]) -> dict | None:
    """A chat choice's ``logprobs``, as OpenAI's: one entry per token."""
    if not reply.logprobs:
        return None
    content = [{**_token(e.token, e.logprob), "top_logprobs": [_token(t, v) for t, v in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(reply: _Reply, entries: list[TokenLogprob]) -> dict | None:
    """A completion choice's ``logprobs`` in the legacy layout; text offsets
    count from the start of the completion."""
    if not reply.logprobs:
        return None
    offsets = []
    for e in entries:
        offsets.append(reply.text_offset)
        reply.text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


# -- chat ---------------------------------------------------------------------------
async def chat_job(service: Service, body: ChatRequest) -> Job:
    tools = None
    if body.tools is not None and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    kwargs = service.template_kwargs(
        body.chat_template_kwargs, enable_thinking=body.enable_thinking, reasoning_effort=body.reasoning_effort
    )
    ids, reasoning = await service.off_loop(rendered_chat, service.tokenizer, messages, tools, kwargs)
    params = service.params(body, body.max_completion_tokens)
    params.logprobs = (body.top_logprobs or 0) if body.logprobs else None
    job = Job(
        ids,
        params,
        _stops(body.stop),
        structured=True,
        starts_in_reasoning=reasoning,
        tools=tools,
    )
    service.fit_to_context(job, body.max_completion_tokens or body.max_tokens)
    return job


def chat_message(delta: Delta) -> dict:
    message = {"role": "assistant", "content": delta.content or None}
    if delta.reasoning:
        message["reasoning_content"] = message["reasoning"] = delta.reasoning
    if delta.tool_calls:
        message["tool_calls"] = tool_calls_body(delta.tool_calls)
    return message


def chat_delta(delta: Delta, tools_sent: int) -> dict:
    out = {}
    if delta.content:
        out["content"] = delta.content
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.tool_calls:
        out["tool_calls"] = tool_calls_body(delta.tool_calls, tools_sent, streaming=True)
    return out


async def stream_events(events: AsyncIterator[Event]) -> AsyncIterator[str | Event]:
    """A job's events for an OpenAI stream, and its end: prefill progress as
    keep-alive comments; a failure as its error event, which ends the stream;
    else [DONE] after the last event."""
    async for event in events:
        if isinstance(event, Progress):
            yield keep_alive(event)
        elif isinstance(event, Failed):
            yield sse(error_body(event.error.status, event.error.message))
            return
        else:
            yield event
    yield sse("[DONE]")


async def chat_stream(reply: _Reply, events: AsyncIterator[Event], include_usage: bool) -> AsyncIterator[str]:
    yield sse(reply.body({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
    tools_sent = 0
    async for event in stream_events(events):
        if isinstance(event, str):  # a keep-alive, the error that ends it, or [DONE]
            yield event
            continue
        delta = event.delta if isinstance(event, Done) else event
        if delta:
            choice = {"index": 0, "delta": chat_delta(delta, tools_sent), "finish_reason": None}
            if reply.logprobs:
                choice["logprobs"] = chat_logprobs(reply, delta.logprobs)
            yield sse(reply.body(choice))
            tools_sent += len(delta.tool_calls)
        if isinstance(event, Done):
            yield sse(reply.body({"index": 0, "delta": {}, "finish_reason": event.finish_reason}))
            if include_usage:
                yield sse(reply.body(None, usage=usage_body(event.usage)))


def _endpoint(schema, make_job, kind: str, choice, stream):
    """A POST handler: the body checked against ``schema``, a job made from
    it, the reply streamed or whole (``choice`` shapes one whole choice)."""

    async def handler(request: Request) -> Response:
        service: Service = request.app.state.service
        body = await service.accept(request, schema)
        job = await make_job(service, body)
        reply = _Reply(service, kind)
        reply.logprobs = job.params.logprobs is not None
        return await _respond(service, request, job, reply, body=body, choice=choice, stream=stream)

    return handler


chat_completions = _endpoint(
    ChatRequest,
    chat_job,
    "chat.completion",
    lambda reply, delta, done: {
        "index": 0,
        "message": chat_message(delta),
        "finish_reason": done.finish_reason,
        "logprobs": chat_logprobs(reply, delta.logprobs),
    },
    chat_stream,
)


# -- completions ------------------------------------------------------------------
async def completion_job(service: Service, body: CompletionRequest) -> Job:
    ids = await service.off_loop(text_prompt, service.tokenizer, body.prompt, service.vocab_size)
    params = service.params(body)
    params.logprobs = body.logprobs
    job = Job(ids, params, _stops(body.stop))
    service.fit_to_context(job, body.max_tokens)
    return job


async def completion_stream(reply: _Reply, events: AsyncIterator[Event], include_usage: bool) -> AsyncIterator[str]:
    async for event in stream_events(events):
        if isinstance(event, str):  # a keep-alive, the error that ends it, or [DONE]
            yield event
            continue
        done = event if isinstance(event, Done) else None
        delta = done.delta if done else event
        if delta.content or delta.logprobs or done:
            logprobs = completion_logprobs(reply, delta.logprobs)
            choice = {"index": 0, "text": delta.content, "finish_reason": done and done.finish_reason}
            yield sse(reply.body({**choice, "logprobs": logprobs}))
        if done and include_usage:
            yield sse(reply.body(None, usage=usage_body(done.usage)))


completions = _endpoint(
    CompletionRequest,
    completion_job,
    "text_completion",
    lambda reply, delta, done: {
        "index": 0,
        "text": delta.content,
        "finish_reason": done.finish_reason,
        "logprobs": completion_logprobs(reply, delta.logprobs),
    },
    completion_stream,
)


# -- shared -----------------------------------------------------------------------
async def _respond(service: Service, request: Request, job: Job, reply: _Reply, *, body, choice, stream) -> Response:
    events = await service.start(job, request)
    if events is None:  # the client left before the first token
        return Response(status_code=499)
    if body.stream:
        if reply.kind == "chat.completion":
            reply.kind = "chat.completion.chunk"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(job, stream(reply, events, include_usage))
    delta, done = await service.collect(events)
    return JSONResponse(reply.body(choice(reply, delta, done), usage=usage_body(done.usage)))


async def models(request: Request) -> Response:
    service: Service = request.app.state.service
    service.authorize(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": service.config.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "dflash-mlx",
                }
            ],
        }
    )
