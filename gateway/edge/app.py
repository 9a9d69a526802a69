"""The gateway's aiohttp application: middleware (JSON errors, origin and token checks, CORS), health, readiness,
voices, metrics and the avatar page; the speech route (`speech_api`), the streaming text-in WebSocket
(`cartesia_ws`), WebRTC signalling (`signalling`) and WHEP (`whep`) are mounted here.

Errors are JSON everywhere: `{"error": {"code": ..., "message": ...}}` with a 4xx/5xx status.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.edge.cartesia_ws import CARTESIA_PATH, cartesia_websocket, request_api_key
from gateway.edge.errors import AuthError
from gateway.edge.http import GATEWAY_KEY, ICE_SERVERS_PATH, OFFER_PATH, SUBJECT_KEY, json_error
from gateway.edge.prefetch_api import PREFETCH_PATH, prefetch
from gateway.edge.signalling import add_signalling_routes
from gateway.edge.speech_api import SPEECH_PATH, speech
from gateway.edge.state import GatewayState
from gateway.edge.unparsed import answer_unparsed_requests_in_json
from gateway.edge.whep import add_whep_routes
from gateway.service.admission import StreamCounts
from gateway.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.service.metrics import METRICS_PATH
from gateway.speech.synthesizer import Synthesizer

log = logging.getLogger(__name__)

# Access: these stay open whatever the auth settings (probes, the public page); everything else needs a token.
PUBLIC_PATHS = frozenset({"/", "/healthz", "/readyz"})
PUBLIC_PREFIXES = ("/static/",)
QUERY_TOKEN_PATHS = frozenset({OFFER_PATH, ICE_SERVERS_PATH})  # clients that cannot set headers: ?token= here
BEARER_PREFIX = "bearer "
FORWARDED_HOST_HEADER = "X-Forwarded-Host"
CORS_ALLOW_METHODS = "GET, POST, DELETE, PATCH, OPTIONS"  # PATCH: a WHEP player's trickle (refused, but readably)
CORS_ALLOW_HEADERS = "Authorization, Content-Type, If-Match"  # If-Match: WHEP's PATCH
# Location, ETag, Link: what a WHEP player in another origin reads from the 201 (its session, the ICE servers).
CORS_EXPOSE_HEADERS = "Retry-After, X-Sample-Rate, Location, ETag, Link"
CORS_MAX_AGE_S = 600


# --- middleware --------------------------------------------------------------------------------------

@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (404, 405, 413, ...) into JSON bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
        return json_error(exc.status, code, exc.reason)


def _needs_token(path: str, config: GatewayConfig) -> bool:
    if path == METRICS_PATH:
        return config.protect_metrics
    return path not in PUBLIC_PATHS and not path.startswith(PUBLIC_PREFIXES)


def _request_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header[:len(BEARER_PREFIX)].lower() == BEARER_PREFIX:
        return header[len(BEARER_PREFIX):].strip()
    if request.path in QUERY_TOKEN_PATHS:
        return request.query.get("token")
    if request.path == CARTESIA_PATH:  # Cartesia's clients send their key their way
        return request_api_key(request)
    return None


@web.middleware
async def access_control(request: web.Request, handler: Any) -> web.StreamResponse:
    """Browser origin first (403), then CORS preflight, then the token (401) where the route needs one."""
    gateway = request.app[GATEWAY_KEY]
    origin = request.headers.get("Origin")
    try:
        gateway.access.check_origin(origin, (request.host, request.headers.get(FORWARDED_HOST_HEADER)))
        if request.method == "OPTIONS" and origin is not None and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={"Access-Control-Allow-Methods": CORS_ALLOW_METHODS,
                                                     "Access-Control-Allow-Headers": CORS_ALLOW_HEADERS,
                                                     "Access-Control-Max-Age": str(CORS_MAX_AGE_S)})
        if _needs_token(request.path, gateway.config):
            subject = gateway.access.authenticate(_request_token(request))
            request[SUBJECT_KEY] = subject
            if subject is not None:
                log.debug("%s %s for %s", request.method, request.path, subject)
    except AuthError as exc:
        gateway.metrics.rejections_total.labels(exc.code).inc()
        headers = {"WWW-Authenticate": 'Bearer realm="orpheus-gateway"'} if exc.status == 401 else None
        return json_error(exc.status, exc.code, str(exc), headers)
    return await handler(request)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """CORS for listed origins, on every response (streamed ones too: this runs before headers are sent)."""
    origin = request.headers.get("Origin")
    if origin is None or not request.app[GATEWAY_KEY].access.listed_origin(origin):
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE_HEADERS
    response.headers.add("Vary", "Origin")


# --- routes ------------------------------------------------------------------------------------------

routes = web.RouteTableDef()


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    if gateway.ready:
        return web.json_response({"status": "ready"})
    if gateway.failure is not None:
        return web.json_response({"status": "failed", "reason": gateway.failure}, status=503)
    synthesizer = gateway.synthesizer
    if synthesizer is None:
        return web.json_response({"status": "loading"}, status=503)
    waiting = synthesizer.not_ready_engines()
    state = next(iter(waiting.values())) if waiting else "waiting_for_snac"
    body: dict[str, object] = {"status": state}
    if synthesizer.table.several:
        body["models"] = {name: engine.state.value for name, engine in synthesizer.engines.items()}
    return web.json_response(body, status=503)


@routes.get("/v1/voices")
async def voices(request: web.Request) -> web.Response:
    config = request.app[GATEWAY_KEY].config
    table = config.model_table
    return web.json_response({"voices": config.voice_list, "default": config.voice,
                              "aliases": config.voice_aliases, "models": table.listing(),
                              "languages": table.languages})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    return web.Response(body=gateway.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


# --- the avatar page (gateway/web/) ------------------------------------------------------------------------

WEB_DIR = Path(__file__).resolve().parents[1] / "web"  # gateway/web/, installed as package data
# Explicit types: aiohttp's guess for .js is application/javascript from the system's mime.types.
WEB_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                     ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml",
                     ".json": "application/json"}


async def web_file(request: web.Request) -> web.FileResponse:
    """`GET /` is web/index.html; `GET /static/{name}` a file of gateway/web/ (flat: the name has no '/')."""
    name = request.match_info.get("name", "index.html")
    path = WEB_DIR / name
    content_type = WEB_CONTENT_TYPES.get(path.suffix)
    if content_type is None or not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Content-Type": content_type, "Cache-Control": "no-cache"})


def create_app(config: GatewayConfig, synthesizer: Synthesizer | None = None, *,
               webrtc: bool = True, session_id_prefix: str = "",
               stream_counts: StreamCounts | None = None) -> web.Application:
    """The gateway's aiohttp application. Pass a started `synthesizer` to share one (tests, benchmarks);
    `session_id_prefix` names this process in its session ids and `stream_counts` holds every worker's
    utterances (`serve --workers`)."""
    app = web.Application(middlewares=[json_errors, access_control], client_max_size=config.max_body_bytes)
    gateway = GatewayState(config, synthesizer, session_id_prefix, stream_counts)
    app[GATEWAY_KEY] = gateway
    app.add_routes(routes)
    app.router.add_post(SPEECH_PATH, speech)
    app.router.add_post(PREFETCH_PATH, prefetch)
    app.router.add_get(CARTESIA_PATH, cartesia_websocket)
    app.router.add_get("/", web_file)
    app.router.add_get(r"/static/{name:[A-Za-z0-9_.-]+\.[a-z]+}", web_file)
    if webrtc:
        add_signalling_routes(app)
        add_whep_routes(app, config.whep_path)  # WHEP paths are not public: with auth on, they need a token
    app.on_response_prepare.append(add_cors_headers)
    answer_unparsed_requests_in_json(app)  # a request aiohttp cannot read gets a JSON error too
    app.on_startup.append(gateway.startup)
    app.on_cleanup.append(gateway.cleanup)
    return app
