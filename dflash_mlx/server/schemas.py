"""The request bodies the server accepts, checked with pydantic in strict
mode ("7" is not an integer, "yes" not a boolean). Every field a client
sends is either used, accepted as metadata (documented), accepted only at
its neutral value, or refused with a 400 naming it: nothing is dropped
without saying so."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from ..generation import MAX_TOP_LOGPROBS
from .errors import APIError

Stop = Optional[Union[str, list[str]]]

# The only keys a request may pass to the chat template: the ones templates
# read as switches. A request's own "chat_template" (or any other key) could
# make rendering run for ever or fill the memory, so it is refused.
TEMPLATE_KEYS = ("enable_thinking", "reasoning_effort", "thinking")

DISTRIBUTION = "it would change the target's output distribution, which DFlash reproduces exactly"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def refusals(self) -> Optional[tuple[str, str]]:
        """(field, sentence) for a value the server cannot honour, or None."""
        return None


class Sampling(_Body):
    """Fields every generation endpoint shares."""

    model: Optional[str] = None
    stream: bool = False
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # nothing is obfuscated here: accepted, no effect


class TemplateKwargs(_Body):
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[str] = Field(None, max_length=32)
    thinking: Optional[bool] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None


def _not_neutral(body: BaseModel, neutral: dict[str, tuple], why: dict[str, str]) -> Optional[tuple[str, str]]:
    for name, values in neutral.items():
        value = getattr(body, name)
        if value is not None and value not in values:
            return name, f"{name}: {why[name]}"
    return None


class _OpenAI(Sampling):
    """What the OpenAI endpoints share, with the fields the official client
    commonly sends: metadata (accepted, no effect) and options the server
    supports only at their neutral value."""

    stop: Stop = None
    n: int = 1
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "n": (1,),
        "frequency_penalty": (0,),
        "presence_penalty": (0,),
        "repetition_penalty": (1,),
        "logit_bias": ({},),
    }
    WHY: ClassVar[dict[str, str]] = {
        "n": "this server answers one choice per request (n=1).",
        "frequency_penalty": f"penalties are not applied ({DISTRIBUTION}); remove it or send 0.",
        "presence_penalty": f"penalties are not applied ({DISTRIBUTION}); remove it or send 0.",
        "repetition_penalty": f"penalties are not applied ({DISTRIBUTION}); remove it or send 1.",
        "logit_bias": f"logit_bias is not applied ({DISTRIBUTION}); remove it.",
    }

    def refusals(self) -> Optional[tuple[str, str]]:
        return _not_neutral(self, self.NEUTRAL, self.WHY)


class FunctionSpec(BaseModel):
    """A chat tool's function: what the template renders checked, any other
    key a client adds passed on as sent."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    """A chat completion's tool: a function, as the template renders it."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(_OpenAI):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[str] = Field(None, max_length=32)
    logprobs: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None

    def refusals(self) -> Optional[tuple[str, str]]:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                return "top_logprobs", f"top_logprobs: give an integer from 0 to {MAX_TOP_LOGPROBS}."
            if self.top_logprobs and not self.logprobs:
                return "top_logprobs", "top_logprobs: send logprobs: true with it."
        if self.response_format not in (None, {"type": "text"}):
            return (
                "response_format",
                'response_format: structured output is not supported; remove it or send {"type": "text"}.',
            )
        return super().refusals()


class CompletionRequest(_OpenAI):
    prompt: Union[str, list[int], list[str]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def refusals(self) -> Optional[tuple[str, str]]:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            return "logprobs", f"logprobs: give an integer from 0 to {MAX_TOP_LOGPROBS}."
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs: a completion takes the number of log-probs in logprobs."
        if self.echo:
            return "echo", "echo: the prompt is not echoed back; remove echo."
        if self.best_of not in (None, 1):
            return "best_of", "best_of: this server answers one completion per request (best_of=1)."
        if self.suffix:
            return "suffix", "suffix: insertion after a suffix is not supported; remove suffix."
        return super().refusals()


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class AnthropicTool(BaseModel):
    """A tool the template renders: its name and schema checked, the rest
    (cache_control, type "custom") accepted as clients send it."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None


class _AnthropicPrompt(_Body):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


class CountTokensRequest(_AnthropicPrompt):
    pass


class AnthropicRequest(Sampling, _AnthropicPrompt):
    model: str
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None


# -- the Responses API ------------------------------------------------------------------
class TextPart(_Body):
    """A text content part of a Responses message (input or earlier output)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None
    namespace: Optional[str] = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningItem(_Body):
    """An earlier reply's reasoning sent back: accepted, left out of the
    prompt (chat templates drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: Optional[list[dict[str, Any]]] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


def _item_kind(item: Any) -> Optional[str]:
    return item.get("type", "message") if isinstance(item, dict) else None


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="give a message, function_call, function_call_output or reasoning item",
    ),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ReasoningOptions(_Body):
    effort: Optional[str] = Field(None, max_length=32)  # passed to the template as reasoning_effort
    summary: Optional[str] = None  # no summaries are made: reasoning comes back as reasoning_text
    generate_summary: Optional[str] = None


class TextOptions(_Body):
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[ReasoningOptions] = None
    text: Optional[TextOptions] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    background: Optional[bool] = None
    max_tool_calls: Optional[int] = None
    top_logprobs: Optional[int] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None

    @property
    def max_tokens(self) -> Optional[int]:
        return self.max_output_tokens

    def refusals(self) -> Optional[tuple[str, str]]:
        if self.text is not None and self.text.format not in (None, {"type": "text"}):
            return "text.format", 'text.format: structured output is not supported; remove it or send {"type": "text"}.'
        if self.truncation not in (None, "disabled"):
            return "truncation", "truncation: items are never dropped to fit the context; remove it or send disabled."
        if self.background:
            return "background", "background: responses run in the foreground only; remove background."
        if self.max_tool_calls is not None:
            return "max_tool_calls", "max_tool_calls: a limit on tool calls is not supported; remove it."
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs: log probabilities are not supported yet; remove top_logprobs."
        return None


# -- reading a body --------------------------------------------------------------------
_UNION_BRANCH = re.compile(r"(str|int|bool|float|none|.*\[.*\])")
_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
# what a field that takes one of several shapes (a union) wants, by its name
_HINTS = {
    "prompt": "give a string, a list of one string, or a list of integer token ids",
    "content": "give a string or a list of content blocks (objects)",
    "system": "give a string or a list of text blocks (objects)",
    "stop": "give a string or a list of strings",
    "input": "give a string or a list of input items (objects)",
    "output": "give a string or a list of text parts (objects)",
}


def _validation_message(error: ValidationError) -> tuple[str, str]:
    errors = error.errors()
    first = errors[0]
    if first["loc"][:1] == ("input",):  # a list of items: what is wrong inside it, not that it is no string
        first = max(errors, key=lambda e: len(e["loc"]))
    loc = first["loc"]
    # a union's branch names, and the input item kinds after an item's index, are not fields
    parts = [
        str(p)
        for i, p in enumerate(loc)
        if not (
            isinstance(p, str)
            and (_UNION_BRANCH.fullmatch(p) or (p in _ITEM_KINDS and i > 0 and isinstance(loc[i - 1], int)))
        )
    ]
    in_union = len(parts) < len(loc)
    where = ".".join(parts) or "body"
    if first["type"] == "extra_forbidden":
        if parts[0] == "chat_template_kwargs":
            keys = ", ".join(TEMPLATE_KEYS)
            return f"{where}: only {keys} may reach the chat template; remove {parts[-1]!r}.", where
        return f"{where}: this server does not take this field; remove it (docs/server.md lists the fields).", where
    if in_union and parts and parts[-1] in _HINTS:
        return f"{where}: {_HINTS[parts[-1]]}.", where
    return f"{where}: {first['msg']}.", where


# a JSON escape of a UTF-16 surrogate: only then can a lone one be in the body
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(data) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json(raw: bytes, schema: type[_Body]) -> _Body:
    """The JSON body checked against ``schema``, or a 400 naming the problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}).") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply; flatten it.") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise APIError(
            400,
            "the request body holds a lone UTF-16 surrogate (such as \\ud800), which is not text; send valid Unicode.",
        )
    try:
        body = schema.model_validate(data)
    except ValidationError as e:
        message, where = _validation_message(e)
        raise APIError(400, message, param=where) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply; flatten it.") from None
    refused = body.refusals()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0])
    return body
