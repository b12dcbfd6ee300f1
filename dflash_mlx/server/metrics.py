"""GET /metrics: the server's counters and gauges in Prometheus' text
exposition format (version 0.0.4), written out by hand."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Generation:
    """What the decode loop did for one request (a cancelled one included)."""

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int = 0
    cycles: Counter = field(default_factory=Counter)  # block size -> cycles
    drafted_tokens: int = 0  # proposed by the drafter: block size - 1 per drafting cycle
    accepted_tokens: int = 0
    generation_tps: float = 0.0

    def add_cycle(self, block_size: int, accepted: int) -> None:
        self.cycles[block_size] += 1
        if block_size > 1:
            self.drafted_tokens += block_size - 1
            self.accepted_tokens += accepted


class Metrics:
    """Counters written by the worker thread and the event loop alike, so
    every update holds the lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> requests
        self.in_flight = 0
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self.cycles: Counter = Counter()
        self.drafted_tokens = self.accepted_tokens = 0
        self.last_tps = 0.0
        self.last: Generation | None = None
        # by path ("dflash": one request at a time; "batched": mlx-lm's batch)
        self.path_requests: Counter = Counter()
        self.path_tokens: Counter = Counter()

    def request_started(self) -> None:
        with self.lock:
            self.in_flight += 1

    def request_ended(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.in_flight -= 1
            self.requests[endpoint, status] += 1

    def record(self, g: Generation, path: str = "dflash") -> None:
        with self.lock:
            self.last = g
            self.path_requests[path] += 1
            self.path_tokens[path] += g.generated_tokens
            self.prompt_tokens += g.prompt_tokens
            self.cached_tokens += g.cached_tokens
            self.generated_tokens += g.generated_tokens
            self.cycles.update(g.cycles)
            self.drafted_tokens += g.drafted_tokens
            self.accepted_tokens += g.accepted_tokens
            self.last_tps = g.generation_tps

    def render(self, queued: int, pool, choice=None) -> str:
        """The exposition text; ``pool`` is the prompt-cache pool, ``choice``
        the PathChoice whose estimates are shown."""
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                out.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")

        with self.lock:
            requests = sorted(self.requests.items())
            family(
                "dflash_requests_total",
                "counter",
                "HTTP requests answered, by endpoint and status.",
                [({"endpoint": e, "status": s}, n) for (e, s), n in requests],
            )
            family("dflash_requests_in_flight", "gauge", "HTTP requests being answered now.", [({}, self.in_flight)])
            family("dflash_queue_depth", "gauge", "Requests waiting for the decode worker.", [({}, queued)])
            family(
                "dflash_prompt_tokens_total", "counter", "Prompt tokens of requests served.", [({}, self.prompt_tokens)]
            )
            family(
                "dflash_prompt_cached_tokens_total",
                "counter",
                "Prompt tokens read from a kept prompt cache instead of prefilled.",
                [({}, self.cached_tokens)],
            )
            family(
                "dflash_generated_tokens_total",
                "counter",
                "Tokens generated (EOS included).",
                [({}, self.generated_tokens)],
            )
            family(
                "dflash_cycles_total",
                "counter",
                "Decode cycles by block size (1: a plain target step).",
                [({"block_size": b}, n) for b, n in sorted(self.cycles.items())],
            )
            family(
                "dflash_drafting_cycles_total",
                "counter",
                "Decode cycles that verified a drafted block.",
                [({}, sum(n for b, n in self.cycles.items() if b > 1))],
            )
            family("dflash_draft_tokens_total", "counter", "Tokens the drafter proposed.", [({}, self.drafted_tokens)])
            family(
                "dflash_accepted_tokens_total",
                "counter",
                "Drafted tokens the target accepted (rate: this over dflash_draft_tokens_total).",
                [({}, self.accepted_tokens)],
            )
            family(
                "dflash_last_generation_tokens_per_second",
                "gauge",
                "Generation speed of the last request served.",
                [({}, self.last_tps)],
            )
            paths = ("dflash", "batched")
            family(
                "dflash_path_requests_total",
                "counter",
                "Requests served by path (dflash: one at a time; batched: mlx-lm's batched plain decoding).",
                [({"path": p}, self.path_requests[p]) for p in paths],
            )
            family(
                "dflash_path_generated_tokens_total",
                "counter",
                "Tokens generated by path.",
                [({"path": p}, self.path_tokens[p]) for p in paths],
            )
        if choice is not None:
            dflash, batched = choice.estimates()
            estimates = [({"path": "dflash", "batch_size": 1}, dflash)]
            estimates += [({"path": "batched", "batch_size": n}, v) for n, v in sorted(batched.items())]
            family(
                "dflash_path_tokens_per_second",
                "gauge",
                "The running estimate of generated tokens/s in total the path gives at that batch size.",
                [(labels, v) for labels, v in estimates if v is not None],
            )
            family(
                "dflash_path_clients",
                "gauge",
                "The batch size the path choice weighs: the most requests in the server together lately.",
                [({}, choice.clients())],
            )
        family(
            "dflash_prompt_cache_hits_total",
            "counter",
            "Requests that continued a kept prompt cache.",
            [({}, pool.hits)],
        )
        family(
            "dflash_prompt_cache_misses_total",
            "counter",
            "Requests that started a fresh prompt cache.",
            [({}, pool.misses)],
        )
        family("dflash_prompt_caches", "gauge", "Prompt caches kept in the pool.", [({}, len(pool))])
        family(
            "dflash_prefix_cache_hits_total",
            "counter",
            "Requests that started from a kept prefix, by where it was kept (memory: the pool; disk: the store).",
            [({"tier": "memory"}, pool.memory_hits), ({"tier": "disk"}, pool.disk_hits)],
        )
        family(
            "dflash_prefix_cache_misses_total",
            "counter",
            "Requests no kept prefix served.",
            [({}, pool.misses)],
        )
        family(
            "dflash_prefix_cache_reused_tokens_total",
            "counter",
            "Prompt tokens served from a kept prefix, either tier.",
            [({}, pool.reused_tokens)],
        )
        store = pool.store
        if store is not None:
            family(
                "dflash_prefix_cache_disk_bytes",
                "gauge",
                "Bytes of prefix-cache files in the directory.",
                [({}, store.disk_bytes)],
            )
            family("dflash_prefix_cache_disk_entries", "gauge", "This pair's prefix-cache files.", [({}, len(store))])
            family("dflash_prefix_cache_writes_total", "counter", "Prefix-cache files written.", [({}, store.writes)])
            family(
                "dflash_prefix_cache_refused_total",
                "counter",
                "Prefix-cache files skipped as damaged or made for another pair or settings.",
                [({}, store.refused)],
            )
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class RequestCounter:
    """ASGI middleware: counts every HTTP request by endpoint and status, and
    the requests in flight (a stream until its last byte). Paths outside
    ``endpoints`` count as "other", so clients cannot add labels at will."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: dict[str, str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    def endpoint(self, path: str) -> str:
        if path in self.endpoints:
            return self.endpoints[path]
        prefix = next((p for p in self.endpoints if p.endswith("/") and path.startswith(p)), None)
        return self.endpoints[prefix] if prefix else "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what a failure before any response is answered with

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.request_started()
        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.request_ended(self.endpoint(scope["path"]), status)
