"""Errors a client can cause, answered with one body shape that both the
OpenAI and the Anthropic clients read: {"type": "error", "error": {"message",
"type", "param", "code"}}."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("dflash_mlx.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """A request the server refuses or could not serve; ``message`` is one
    sentence naming the problem."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status, error.message, error.param, error.code),
        status_code=error.status,
        headers=error.headers,
    )


async def handle_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def handle_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own 404/405s, in the same shape."""
    if exc.status_code == 404:
        message = f"there is no endpoint {request.method} {request.url.path}; see GET /v1/models, /metrics, POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens."
    elif exc.status_code == 405:
        message = f"{request.url.path} does not accept {request.method}."
    else:
        message = str(exc.detail)
    return error_response(APIError(exc.status_code, message))


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A last guard: a failure no check foresaw still gets the JSON body
    clients read, without a traceback (the log has it)."""
    log.error("unexpected error on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(
        APIError(500, f"the server failed on this request ({type(exc).__name__}); its log says more.")
    )


EXCEPTION_HANDLERS = {APIError: handle_api_error, HTTPException: handle_http_error, Exception: handle_unexpected}
