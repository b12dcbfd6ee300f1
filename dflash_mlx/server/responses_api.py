"""The OpenAI Responses endpoint, /v1/responses: input items through the chat
template, output as reasoning, message and function_call items, streamed as
the Responses events or whole; finished replies are kept (bounded) so that
``previous_response_id`` continues a conversation."""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError, error_body
from .job import Done, Event, Failed, Job, Progress, Usage
from .reply import Delta
from .schemas import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest, TextPart
from .service import Service, event_stream, keep_alive, sse
from .templates import rendered_chat


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(items) -> list[dict]:
    """Responses input items as the chat messages templates know: a
    function_call joins the assistant turn before it as a tool call, its
    output becomes a tool message, reasoning items are left out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            # "developer" is the Responses API's name for system instructions
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def reply_message(delta: Delta) -> dict:
    """A reply as the assistant message the next turn's template renders."""
    message = {"role": "assistant", "content": delta.content}
    if delta.tool_calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in delta.tool_calls
        ]
    return message


def chat_tools(body: ResponsesRequest) -> Optional[list[dict]]:
    if not body.tools or body.tool_choice == "none":
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in body.tools
    ]


def responses_prompt(service: Service, body: ResponsesRequest, messages: list[dict], tools) -> tuple[list[int], bool]:
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    effort = body.reasoning.effort if body.reasoning else None
    kwargs = service.template_kwargs(None, reasoning_effort=effort)
    # rendering parses tool-call arguments in place: the kept conversation stays as sent
    return rendered_chat(service.tokenizer, copy.deepcopy(system + messages), tools, kwargs)


class _Turn:
    """One request's reply: its id, its conversation and the response body."""

    def __init__(self, service: Service, body: ResponsesRequest, messages: list[dict], job: Job):
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.service, self.body, self.messages = service, body, messages
        self.params = job.params

    def response(self, status: str, output: list[dict], done: Optional[Done] = None) -> dict:
        b = self.body
        incomplete = done is not None and done.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "completed_at": int(time.time()) if done is not None else None,
            "model": self.service.config.model_name,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": self.params.max_tokens,
            "previous_response_id": b.previous_response_id,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "store": b.store is not False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "user": b.user,
            "usage": usage_body(done.usage) if done is not None else None,
        }

    def keep(self, delta: Delta, body: dict) -> None:
        if self.body.store is not False:
            self.service.responses.put(self.id, self.messages + [reply_message(delta)], body)


def usage_body(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "dflash": usage.dflash,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: dict, arguments: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": call["name"],
        "arguments": arguments,
        "status": status,
    }


def output_items(delta: Delta) -> list[dict]:
    """A whole reply's output items: reasoning, the message, the calls."""
    out = [reasoning_item(_new_id("rs"), delta.reasoning)] if delta.reasoning else []
    if delta.content or not delta.tool_calls:
        out.append(message_item(_new_id("msg"), delta.content))
    return out + [call_item(_new_id("fc"), c, json.dumps(c["arguments"], ensure_ascii=False)) for c in delta.tool_calls]


class _ItemStream:
    """The Responses events of one streamed reply, numbered in order: at most
    one reasoning or message item open at a time, each added, filled with
    deltas and done; each function call arrives whole."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []
        self.open: Optional[dict] = None  # the open item
        self.text = ""

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _add(self, item: dict) -> str:
        self.open, self.text = item, ""
        return self.event("response.output_item.added", output_index=len(self.output), item=item)

    def close(self) -> str:
        item = self.open
        if item is None:
            return ""
        where, text = self._where(), self.text
        if item["type"] == "reasoning":
            part, done = {"type": "reasoning_text", "text": text}, reasoning_item(item["id"], text)
            out = self.event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            done = message_item(item["id"], text)
            part = done["content"][0]
            out = self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
        out += self.event("response.content_part.done", **where, content_index=0, part=part)
        out += self.event("response.output_item.done", output_index=len(self.output), item=done)
        self.output.append(done)
        self.open = None
        return out

    def _text(self, kind: str, text: str) -> str:
        out = ""
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            if kind == "reasoning":
                item, part = reasoning_item(_new_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""}
            else:
                item = message_item(_new_id("msg"), None, "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._add(item)
            out += self.event("response.content_part.added", **self._where(), content_index=0, part=part)
        self.text += text
        if kind == "reasoning":
            return out + self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        return out + self.event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])

    def _call(self, call: dict) -> str:
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        out = self.close() + self._add(call_item(_new_id("fc"), call, "", "in_progress"))
        where = self._where()
        out += self.event("response.function_call_arguments.delta", **where, delta=arguments)
        out += self.event("response.function_call_arguments.done", **where, name=call["name"], arguments=arguments)
        done = call_item(self.open["id"], call, arguments)
        out += self.event("response.output_item.done", output_index=len(self.output), item=done)
        self.output.append(done)
        self.open = None
        return out

    def delta(self, delta: Delta) -> str:
        out = self._text("reasoning", delta.reasoning) if delta.reasoning else ""
        out += self._text("message", delta.content) if delta.content else ""
        return out + "".join(self._call(c) for c in delta.tool_calls)

    def finish(self, final: Delta) -> str:
        """The last events before response.completed; an empty reply still
        gets its (empty) message."""
        out = self.delta(final)
        if self.open is None and not self.output:
            out += self._text("message", "")
        return out + self.close()


async def response_stream(turn: _Turn, events: AsyncIterator[Event]) -> AsyncIterator[str]:
    items = _ItemStream()
    started = turn.response("in_progress", [])
    yield items.event("response.created", response=started)
    yield items.event("response.in_progress", response=started)
    whole = Delta()
    async for event in events:
        if isinstance(event, Progress):
            yield keep_alive(event)
            continue
        if isinstance(event, Failed):
            error = error_body(event.error.status, event.error.message)
            yield items.event("error", **error)
            return
        if isinstance(event, Done):
            whole = whole.merge(event.delta)
            yield items.finish(event.delta)
            body = turn.response("completed", items.output, event)
            turn.keep(whole, body)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield items.event(kind, response=body)
            return
        whole = whole.merge(event)
        yield items.delta(event)


async def responses_job(service: Service, body: ResponsesRequest) -> tuple[Job, _Turn]:
    history: list[dict] = []
    if body.previous_response_id is not None:
        stored = service.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"there is no stored response {body.previous_response_id!r} (this server keeps the last "
                f"{service.config.stored_responses}, in memory, unless store was false); send the whole input instead.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = stored[0]
    messages = history + input_messages(body.input)
    tools = chat_tools(body)
    ids, reasoning = await service.off_loop(responses_prompt, service, body, messages, tools)
    job = Job(ids, service.params(body), structured=True, starts_in_reasoning=reasoning, tools=tools)
    service.fit_to_context(job, body.max_output_tokens, "max_output_tokens")
    return job, _Turn(service, body, messages, job)


async def responses(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.accept(request, ResponsesRequest)
    job, turn = await responses_job(service, body)
    events = await service.start(job, request)
    if events is None:  # the client left before the first token
        return Response(status_code=499)
    if body.stream:
        return event_stream(job, response_stream(turn, events))
    delta, done = await service.collect(events)
    reply = turn.response("completed", output_items(delta), done)
    turn.keep(delta, reply)
    return JSONResponse(reply)


async def retrieve(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response."""
    service: Service = request.app.state.service
    service.authorize(request)
    response_id = request.path_params["response_id"]
    stored = service.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"there is no stored response {response_id!r}.", code="response_not_found")
    return JSONResponse(stored[1])
