"""What every endpoint shares: the loaded pair, the server's defaults and
limits, the API key, the model's name, reading a body, preparing prompts off
the event loop, and handing jobs to the worker."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

from starlette.requests import Request
from starlette.responses import StreamingResponse

from dflash_mlx.cache.decoding import decoding

from .batch import BatchDecoder, can_batch
from .config import ServerConfig, context_length, make_decoder
from .errors import APIError
from .job import Done, Event, Failed, GenerationParams, Job, Progress
from .metrics import Metrics
from .path_choice import PathChoice, check_mode
from .reply import Delta
from .schemas import Sampling, TemplateKwargs, parse_json
from .worker import Worker

if TYPE_CHECKING:
    from .ranks import Leader

RETRY_AFTER_S = 5


def _is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to pass ``limit`` bytes."""
    too_large = APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes); send a smaller one.",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _presented_key(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


class Service:
    """``leader``: with a target split across ranks, what hands each job to
    the other ranks (server/ranks.py); None on one machine."""

    def __init__(self, model, draft, tokenizer, config: ServerConfig, leader: Optional[Leader] = None):
        check_mode(config.batching)
        if config.max_batch < 1:
            raise ValueError(f"max_batch must be 1 or more; got {config.max_batch}.")
        if leader is not None:
            config.check_across_ranks()
        self.metrics = Metrics()
        decoder = make_decoder(model, draft, tokenizer, config, self.metrics)
        self.store = decoder.pool.store
        self.tokenizer, self.config = tokenizer, config
        self.ranks = 1 if leader is None else leader.group.size()
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
        self.context_length = context_length(model)
        # templates render and prompts tokenize here, never on the event loop
        self.prepare_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dflash-prepare")
        self.preparing = 0  # requests there now: on their way to the worker, company for the one it serves
        self.responses = StoredResponses(config.stored_responses)
        # the batch's caches are mlx-lm's plain ones: not with quantized or bounded caches;
        # and not across ranks, where only DFlash's jobs reach every rank
        plain_caches = config.kv_bits is None and config.max_kv_size is None
        batches = plain_caches and config.max_batch > 1 and can_batch(model) and leader is None
        batching = config.batching if batches else "off"
        self.choice = PathChoice(mode=batching, max_batch=config.max_batch)
        batcher = BatchDecoder(
            model,
            tokenizer,
            self.choice,
            max_batch=config.max_batch,
            prefill_step_size=config.prefill_step_size,
            metrics=self.metrics,
        )
        batcher = batcher if batching != "off" else None
        self.worker = Worker(decoder, batcher, self.choice, lambda: self.preparing, leader)

    # -- checks --------------------------------------------------------------------
    async def accept(self, request: Request, schema: type[Sampling]) -> Sampling:
        """The request's body once the key, the JSON and the model are checked."""
        self.authorize(request)
        if not _is_json(request.headers.get("content-type", "")):
            raise APIError(415, "send the request body as JSON, with the header 'Content-Type: application/json'.")
        raw = await read_body(request, self.config.max_body_bytes)
        body = await self.off_loop(parse_json, raw, schema)
        self.check_model(body.model)
        return body

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on a preparing thread, so that a long prompt or a slow
        template never holds up the event loop; a request past
        prepare_timeout_s gets a 400 (the thread finishes on its own)."""
        decoding.enter()  # a prompt being prepared is a request on its way: the prefix writer waits
        self.preparing += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(self.prepare_pool, fn, *args)
            return await asyncio.wait_for(future, self.config.prepare_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                400,
                f"preparing this request's prompt took longer than {self.config.prepare_timeout_s:g} s; "
                f"send a shorter one.",
            ) from None
        finally:
            decoding.leave()
            self.preparing -= 1

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = _presented_key(request)
        if given is None:
            raise APIError(
                401,
                "this server needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
                code="missing_api_key",
            )
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "the API key is wrong.", code="invalid_api_key")

    def check_model(self, name: Optional[str]) -> None:
        if name in (None, "", self.config.model_name, "default_model"):
            return
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {self.config.model_name!r} (see GET /v1/models).",
            param="model",
            code="model_not_found",
        )

    def params(self, body: Sampling, max_tokens: Optional[int] = None) -> GenerationParams:
        """The request's sampling, the server's defaults where it has none."""
        c = self.config
        want = max_tokens or body.max_tokens or c.max_tokens
        return GenerationParams(
            max_tokens=want,
            temperature=c.temperature if body.temperature is None else body.temperature,
            top_p=c.top_p if body.top_p is None else body.top_p,
            top_k=c.top_k if body.top_k is None else body.top_k,
            min_p=c.min_p if body.min_p is None else body.min_p,
            seed=c.seed if body.seed is None else body.seed,
        )

    def fit_to_context(self, job: Job, asked: Optional[int], param: str = "max_tokens") -> None:
        """A prompt must leave room in the model's context, and so must the
        reply a client ``asked`` for; the server's own default is shortened to
        the room left. With --max-kv-size a conversation and its reply run
        past the context (as generate's do): the worker bounds only the new
        prompt tokens a request reads."""
        limit, n = self.context_length, len(job.prompt)
        if limit is None or self.config.max_kv_size is not None:
            return
        if n >= limit:
            raise APIError(
                400,
                f"the prompt is {n} tokens, and this model's context is {limit} tokens; shorten it.",
                code="context_length_exceeded",
            )
        if asked is not None and n + asked > limit:
            raise APIError(
                400,
                f"input length and `{param}` exceed context limit: {n} + {asked} > {limit}, "
                f"decrease input length or `{param}` and try again.",
                param=param,
                code="context_length_exceeded",
            )
        job.params.max_tokens = min(job.params.max_tokens, limit - n)

    def template_kwargs(self, request_kwargs: Optional[TemplateKwargs], **switches) -> dict:
        """The server's template arguments, then the request's allowed ones."""
        given = request_kwargs.model_dump(exclude_none=True) if request_kwargs else {}
        given.update({k: v for k, v in switches.items() if v is not None})
        return {**self.config.chat_template_args, **given}

    # -- running jobs ------------------------------------------------------------
    async def start(self, job: Job, request: Request) -> Optional[AsyncIterator[Event]]:
        """Queues ``job`` and waits for its first output, so a request the
        decode loop refuses gets its error status before any stream begins.
        None if the client left first. A full queue is a 503 with Retry-After."""
        if self.worker.queued >= self.config.max_queue:
            raise APIError(
                503,
                f"the server already has {self.worker.queued} requests waiting (--max-queue); retry in a few seconds.",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
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
            if isinstance(event, Progress):
                continue
            if isinstance(event, Done):
                return out.merge(event.delta), event
            out = out.merge(event)
        raise APIError(500, "the reply ended without finishing.")

    def health(self) -> dict:
        return {
            "status": "ok" if self.worker.thread.is_alive() else "worker stopped",
            "model": self.config.model_name,
            "ranks": self.ranks,
            "busy": bool(self.worker.running),
            "queued": self.worker.queued,
            "served": self.worker.served,
            "prompt_caches": len(self.worker.decoder.pool),
            "stored_responses": len(self.responses),
        }


class StoredResponses:
    """Finished Responses-API replies by id, the least recently used dropped
    past ``limit``: (the conversation's messages, its last reply included;
    the response body). Touched on the event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.entries: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], body: dict) -> None:
        if self.limit < 1:
            return
        self.entries[response_id] = (messages, body)
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[tuple[list[dict], dict]]:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def __len__(self) -> int:
        return len(self.entries)


async def _chain(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event


def sse(data: dict | str, event: Optional[str] = None) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def keep_alive(progress: Progress) -> str:
    """An SSE comment: ignored by clients, it keeps proxies and timeouts
    waiting through a long prefill and shows how far it got."""
    return f": prefill {progress.done}/{progress.total}\n\n"


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
