"""The Starlette application and running it on uvicorn."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .anthropic_api import count_tokens, messages
from .config import ServerConfig
from .errors import EXCEPTION_HANDLERS
from .hosts import AllowedHosts, HostCheck
from .metrics import CONTENT_TYPE, RequestCounter
from .openai_api import chat_completions, completions, models
from .ranks import Leader
from .responses_api import responses, retrieve
from .service import Service


async def health(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.service.health())


async def metrics(request: Request) -> Response:
    service = request.app.state.service
    service.authorize(request)
    text = service.metrics.render(service.worker.queued, service.worker.decoder.pool, service.choice)
    return Response(text, media_type=CONTENT_TYPE)


def create_app(model, draft, tokenizer, config: ServerConfig | None = None, group=None) -> Starlette:
    """The HTTP API over one loaded (model, draft, tokenizer) pair; its
    decode worker runs while the app is being served. ``group``: the ranks
    the target is split across, this one rank 0, the others in
    ``ranks.Follower`` (None: one machine)."""
    leader = Leader(group) if group is not None else None
    service = Service(model, draft, tokenizer, config or ServerConfig(), leader)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        service.worker.start()
        yield
        service.worker.stop()
        if service.store is not None:
            service.store.close()  # queued writes finish first
        service.prepare_pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
    # the metrics' endpoint label: a route's path, its parameters left as {names}
    endpoints = {r.path.split("{", 1)[0]: r.path for r in routes}
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(RequestCounter, metrics=service.metrics, endpoints=endpoints),
            Middleware(HostCheck, allowed=AllowedHosts(service.config.host, service.config.allowed_hosts)),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.service = service
    return app


def run(app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


@contextmanager
def running_in_thread(
    app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "warning"
) -> Iterator[str]:
    """Serves ``app`` from a thread of this process (tests, benchmarks);
    yields the base URL once it accepts connections, stops it on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="dflash-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}.")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
