"""What every endpoint shares: the loaded pair, the server's defaults, the
API key, the model's name, and handing jobs to the worker."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import StreamingResponse

from dflash_mlx import make_prompt_cache

from .cache_pool import PromptCachePool
from .decoder import Decoder
from .errors import APIError
from .job import Done, Event, Failed, GenerationParams, Job
from .reply import Delta
from .schemas import Sampling, parse_body
from .worker import Worker


@dataclass
class ServerConfig:
    model_name: str = "default_model"
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    block_size: int | str | None = None
    prefill_step_size: int = 2048
    api_key: Optional[str] = None
    chat_template_args: dict = field(default_factory=dict)
    prompt_cache_size: int = 10
    prompt_cache_bytes: Optional[int] = None
    # every prompt cache of the pool is made with these (make_prompt_cache's meanings)
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    max_kv_size: Optional[int] = None


def context_length(model) -> Optional[int]:
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def _presented_key(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


class Service:
    def __init__(self, model, draft, tokenizer, config: ServerConfig):
        self.tokenizer, self.config = tokenizer, config
        # a bounded cache (max_kv_size) runs past the context length, as the CLI's do
        self.context_length = None if config.max_kv_size is not None else context_length(model)

        def new_cache():
            return make_prompt_cache(model, draft, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size,
                                     quantized_kv_start=config.quantized_kv_start, max_kv_size=config.max_kv_size)

        new_cache()  # settings this pair cannot use: a ValueError now, not on every request
        pool = PromptCachePool(new_cache, config.prompt_cache_size, config.prompt_cache_bytes)
        self.worker = Worker(Decoder(model, draft, tokenizer, pool, config.block_size, config.prefill_step_size))

    # -- checks --------------------------------------------------------------------
    async def accept(self, request: Request, schema: type[Sampling]) -> Sampling:
        """The request's body once the key, the JSON and the model are checked."""
        self.authorize(request)
        body = await parse_body(request, schema)
        self.check_model(body.model)
        return body

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = _presented_key(request)
        if given is None:
            raise APIError(401, "this server needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'.", code="missing_api_key")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "the API key is wrong.", code="invalid_api_key")

    def check_model(self, name: Optional[str]) -> None:
        if name in (None, "", self.config.model_name, "default_model"):
            return
        raise APIError(404, f"the model {name!r} does not exist; this server serves {self.config.model_name!r} (see GET /v1/models).",
                       param="model", code="model_not_found")

    def params(self, body: Sampling, max_tokens: Optional[int] = None) -> GenerationParams:
        """The request's sampling, the server's defaults where it has none."""
        c = self.config
        want = max_tokens or body.max_tokens or c.max_tokens
        return GenerationParams(
            max_tokens=want,
            temperature=c.temperature if body.temperature is None else body.temperature,
            top_p=c.top_p if body.top_p is None else body.top_p,
            top_k=c.top_k if body.top_k is None else body.top_k,
            seed=c.seed if body.seed is None else body.seed,
        )

    def fit_to_context(self, job: Job) -> None:
        """Shortens max_tokens to the room the context leaves after the prompt."""
        if self.context_length is not None:
            job.params.max_tokens = max(1, min(job.params.max_tokens, self.context_length - len(job.prompt)))

    def template_kwargs(self, request_kwargs: Optional[dict], enable_thinking: Optional[bool] = None) -> dict:
        kwargs = {**self.config.chat_template_args, **(request_kwargs or {})}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return kwargs

    # -- running jobs ------------------------------------------------------------
    async def start(self, job: Job, request: Request) -> Optional[AsyncIterator[Event]]:
        """Queues ``job`` and waits for its first output, so a request the
        decode loop refuses gets its error status before any stream begins.
        None if the client left first."""
        self.worker.submit(job)
        events = job.events(request)
        first = await anext(events, None)
        if first is None:
            return None
        if isinstance(first, Failed):
            raise first.error
        return _chain(first, events)

    @staticmethod
    async def collect(events: AsyncIterator[Event]) -> tuple[Delta, Done]:
        """All of a reply at once (non-streamed responses)."""
        out = Delta()
        async for event in events:
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Done):
                return out.merge(event.delta), event
            out = out.merge(event)
        raise APIError(500, "the reply ended without finishing.")

    def health(self) -> dict:
        active = self.worker.active
        return {
            "status": "ok" if self.worker.thread.is_alive() else "worker stopped",
            "model": self.config.model_name,
            "busy": active is not None,
            "queued": self.worker.queued,
            "served": self.worker.served,
            "prompt_caches": len(self.worker.decoder.pool),
        }


async def _chain(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event


def sse(data: dict | str, event: Optional[str] = None) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def event_stream(job: Job, chunks: AsyncIterator[str]) -> StreamingResponse:
    """A server-sent-event response that stops ``job`` when the stream ends
    early (the client went away: Starlette cancels the stream)."""

    async def cancelling() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            job.cancel()

    return StreamingResponse(cancelling(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
