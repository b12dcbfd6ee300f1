"""The request bodies the server accepts, checked with pydantic. Unknown
fields are ignored, as OpenAI-compatible servers commonly do; a bad value
becomes a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from .errors import APIError

Stop = Optional[Union[str, list[str]]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Sampling(_Body):
    """Fields every generation endpoint shares."""

    model: Optional[str] = None
    stream: bool = False
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stop: Stop = None
    n: int = 1
    stream_options: Optional[StreamOptions] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    enable_thinking: Optional[bool] = None


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str]]
    stop: Stop = None
    n: int = 1
    stream_options: Optional[StreamOptions] = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class AnthropicRequest(Sampling):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stop_sequences: Optional[list[str]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


def _where(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "body"


def _validation_message(error: ValidationError) -> tuple[str, str]:
    first = error.errors()[0]
    where = _where(first["loc"])
    return f"{where}: {first['msg']}.", where


async def parse_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The JSON body checked against ``schema``, or a 400 naming the problem."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        message, where = _validation_message(e)
        raise APIError(400, message, param=where) from None
