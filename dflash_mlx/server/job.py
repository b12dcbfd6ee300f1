"""One request's generation as the worker sees it, and the events it sends
back to the request's handler (thread -> event loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Optional, Union

from starlette.requests import Request

from .errors import APIError
from .reply import Delta


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    dflash: dict


@dataclass
class Done:
    finish_reason: str  # "stop" (end of text or a stop string), "length" or "tool_calls"
    stop_sequence: Optional[str]
    usage: Usage
    delta: Delta = field(default_factory=Delta)  # the last of the output


@dataclass
class Failed:
    error: APIError


@dataclass
class Progress:
    """Prompt tokens prefilled so far, of those the request has to prefill:
    a stream's keep-alive before its first token."""

    done: int
    total: int


Event = Union[Delta, Done, Failed, Progress]


@dataclass
class GenerationParams:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: Optional[int]
    logprobs: Optional[int] = None  # None: none; k: each token's log-prob and the top k


@dataclass
class Job:
    prompt: list[int]
    params: GenerationParams
    stops: list[str] = field(default_factory=list)
    structured: bool = False  # split reasoning and tool calls out of the text
    starts_in_reasoning: bool = False
    tools: Optional[list[dict]] = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    answered: bool = False  # its Done or Failed is posted: its client may already send the next request

    def __post_init__(self):
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    # -- worker thread side --
    def post(self, event: Event) -> None:
        self.answered = self.answered or isinstance(event, (Done, Failed))
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def prefill_progress(self, done: int, total: int) -> None:
        """A prefill callback (stream_generate's ``prompt_progress``): posts
        Progress while more of the prompt is left, none once it is done (the
        first token follows at once)."""
        if done < total:
            self.post(Progress(done, total))

    # -- event loop side --
    def cancel(self) -> None:
        self.cancelled.set()

    async def events(self, request: Optional[Request] = None, poll_s: float = 0.1) -> AsyncIterator[Event]:
        """The job's events up to Done or Failed. With ``request``, a client
        that goes away cancels the job (checked every ``poll_s``)."""
        checked = self._loop.time()
        while True:
            try:
                event = await asyncio.wait_for(self._events.get(), timeout=poll_s)
            except asyncio.TimeoutError:
                event = None
            if request is not None and self._loop.time() - checked >= poll_s:
                checked = self._loop.time()
                if await request.is_disconnected():
                    self.cancel()
                    return
            if event is None:
                continue
            yield event
            if isinstance(event, (Done, Failed)):
                return


class QuietJob(Job):
    """A job with no handler: its events go nowhere and nothing cancels it.
    A follower rank runs rank 0's jobs so (server/ranks.py), off any event loop."""

    def __post_init__(self):
        pass

    def post(self, event: Event) -> None:
        pass
