"""Requests aiohttp refuses before routing (a request line or header over its 8 KiB limit, too many headers, bytes
that are not HTTP): answered with the gateway's JSON error shape and logged in one line, without a traceback.

aiohttp answers these itself, below the application (no middleware or signal sees them: aio-libs/aiohttp#3287),
with a plain-text 400 and an ERROR log with the parser's traceback. Its connection handler's `handle_error` is the
one place that builds that answer, so the app's server makes connection handlers that override it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong

from gateway.edge.http import json_error

log = logging.getLogger(__name__)

MAX_DETAIL_CHARS = 200  # aiohttp's message quotes the client's bytes: enough to recognise them


class JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering a request it could not parse with `{"error": {"code", "message"}}`."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or not 400 <= status < 500:
            return super().handle_error(request, status, exc, message)  # a server fault: aiohttp's own report
        if request.writer.output_size > 0:  # as aiohttp: an answer already begun cannot be replaced
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        detail = (message or exc.message or "").strip()[:MAX_DETAIL_CHARS]
        code = "line_too_long" if isinstance(exc, LineTooLong) else "bad_request"
        # Not HTTP at all (TLS, scanners) is common on a public port: as aiohttp, only worth a debug line.
        level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
        log.log(level, "refused a request from %s before routing (%d %s): %s", request.remote, status, code, detail)
        response = json_error(status, code, f"the request could not be read: {detail}")
        response.force_close()
        return response


class JsonErrorServer(web.Server):
    """aiohttp's low-level server, making `JsonErrorRequestHandler`s for its connections."""

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        handler.__class__ = JsonErrorRequestHandler  # same slots: aiohttp builds the handler, we answer its errors
        return handler


def answer_unparsed_requests_in_json(app: web.Application) -> None:
    """Make every runner of `app` (run_app, AppRunner, TestServer: all ask the app for its server) use
    `JsonErrorServer`."""
    make_server: Callable[..., web.Server] = app._make_handler

    def make_json_error_server(**kwargs: Any) -> web.Server:
        server = make_server(**kwargs)
        server.__class__ = JsonErrorServer  # no state of its own: only the handlers it makes differ
        return server

    app._make_handler = make_json_error_server  # type: ignore[method-assign]
