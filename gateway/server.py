"""aiohttp routes: health, voices, streaming speech over HTTP, metrics, and WebRTC signalling.

Errors are JSON everywhere: `{"error": {"code": ..., "message": ...}}` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import struct
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from gateway.admission import Admission, CapacityError
from gateway.auth import AccessPolicy, AuthError
from gateway.config import GatewayConfig
from gateway.engine import EngineDeadError, EngineState, EngineUnavailableError
from gateway.http import (
    GATEWAY_KEY,
    ICE_SERVERS_PATH,
    OFFER_PATH,
    SUBJECT_KEY,
    capacity_error,
    json_error,
    read_json_object,
)
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import METRICS_PATH, Metrics
from gateway.orpheus import SAMPLE_RATE
from gateway.synthesizer import InvalidRequestError, Synthesizer, UtteranceStats

log = logging.getLogger(__name__)

SPEECH_FORMATS = ("wav", "pcm")
WAV_STREAMING_SIZE = 0xFFFFFFFF  # unknown length: players read a streamed WAV up to the end
GC_GEN0_THRESHOLD = 50_000  # young-generation collections are cheap; rare ones avoid stream-wide stalls
ENGINE_RETRY_AFTER_S = 5  # an engine (re)start takes tens of seconds; ask again soon, not in a tight loop

# Access: these stay open whatever the auth settings (probes, the public page); everything else needs a token.
PUBLIC_PATHS = frozenset({"/", "/healthz", "/readyz"})
PUBLIC_PREFIXES = ("/static/",)
QUERY_TOKEN_PATHS = frozenset({OFFER_PATH, ICE_SERVERS_PATH})  # clients that cannot set headers: ?token= here
BEARER_PREFIX = "bearer "
FORWARDED_HOST_HEADER = "X-Forwarded-Host"
CORS_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_ALLOW_HEADERS = "Authorization, Content-Type"
CORS_EXPOSE_HEADERS = "Retry-After, X-Sample-Rate"
CORS_MAX_AGE_S = 600


def wav_header(sample_rate: int = SAMPLE_RATE, data_bytes: int = WAV_STREAMING_SIZE) -> bytes:
    """RIFF/WAVE header for 16-bit mono PCM; `data_bytes` unknown while streaming."""
    riff_size = WAV_STREAMING_SIZE if data_bytes == WAV_STREAMING_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


class Gateway:
    """What the routes share: configuration, the synthesizer (and its one engine), metrics, sessions."""

    def __init__(self, config: GatewayConfig, synthesizer: Synthesizer | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.synthesizer = synthesizer
        self.sessions: Any = None  # set by gateway.session.SessionManager when WebRTC is mounted
        self.session_id_prefix = ""  # `w<index>-` in a worker process (gateway.workers): who owns a session
        self.admission = Admission.from_config(config)
        self.access = AccessPolicy.from_lists(config.auth_token, config.auth_secret, config.allowed_origin)
        # Refusals by error code (at_capacity, rate_limited, missing_token, ...): the operator's overload signal.
        self.rejections_total = Counter("orpheus_rejections_total", "Requests and messages refused, by code.",
                                        ["code"], registry=self.metrics.registry)
        self._owns_synthesizer = synthesizer is None
        self._start_task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.synthesizer is not None and self.synthesizer.engine.ready

    def _on_engine_state(self, state: EngineState) -> None:
        self.metrics.engine_ready.set(1 if state is EngineState.READY else 0)
        if state is EngineState.READY and self.synthesizer is not None and self.synthesizer.engine.restarts:
            self.metrics.engine_restarts_total.inc()

    async def startup(self, app: web.Application) -> None:
        if self.synthesizer is None:
            # Health answers at once; readiness waits for the engine, which loads in the background.
            self._start_task = asyncio.create_task(self._load_and_start())
        else:
            self._attach(self.synthesizer)

    def _attach(self, synthesizer: Synthesizer) -> None:
        synthesizer.decoder.on_batch = self.metrics.observe_decode_batch
        synthesizer.engine.on_state = self._on_engine_state
        self.metrics.track_in_flight(lambda: synthesizer.engine.in_flight)
        self.metrics.engine_ready.set(1 if synthesizer.engine.ready else 0)

    async def _load_and_start(self) -> None:
        try:
            synthesizer = await asyncio.to_thread(Synthesizer.load, self.config)
            self.synthesizer = synthesizer
            self._attach(synthesizer)
            await synthesizer.start()
        except Exception:
            log.exception("could not start the speech engine")
            raise
        if self.config.gc_freeze:
            freeze_startup_objects()

    async def cleanup(self, app: web.Application) -> None:
        if self.sessions is not None:
            await self.sessions.close_all()
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(BaseException):
                await self._start_task
        if self._owns_synthesizer and self.synthesizer is not None:
            await self.synthesizer.close()


def freeze_startup_objects() -> None:
    """Keep the garbage collector from pausing every stream at once (measured: 0.4-0.6 s stalls at N>=256).

    Objects alive after start-up (model, engine client, modules) move to the permanent generation, and the
    young generation is collected less often, so a full collection rarely has much to walk.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


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
        gateway.rejections_total.labels(exc.code).inc()
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
    state = gateway.synthesizer.engine.state.value if gateway.synthesizer else "loading"
    return web.json_response({"status": state}, status=503)


@routes.get("/v1/voices")
async def voices(request: web.Request) -> web.Response:
    config = request.app[GATEWAY_KEY].config
    return web.json_response({"voices": config.voice_list, "default": config.voice})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    return web.Response(body=gateway.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


@routes.post("/v1/audio/speech")
async def speech(request: web.Request) -> web.StreamResponse:
    """OpenAI-style speech: `{model?, input, voice?, response_format?: wav|pcm, speed? (ignored)}`.

    Audio streams as it is made (chunked transfer). The response starts only once the first audio exists,
    so an engine that is down still gets a clean 503 rather than a truncated 200.
    """
    gateway = request.app[GATEWAY_KEY]
    body = await read_json_object(request, gateway.config.max_body_bytes)
    synthesizer = gateway.synthesizer
    if synthesizer is None or not gateway.ready:
        gateway.metrics.speech_requests_total.labels("503").inc()
        return json_error(503, "engine_unavailable", "the speech engine is not ready",
                          {"Retry-After": str(ENGINE_RETRY_AFTER_S)})
    fmt = body.get("response_format", "wav")
    if fmt not in SPEECH_FORMATS:
        return json_error(400, "invalid_response_format", f"response_format must be one of {list(SPEECH_FORMATS)}")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        return json_error(400, "invalid_speed", "speed must be a number")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return json_error(400, "invalid_model", "model must be a string")
    voice = body.get("voice")
    if voice is not None and not isinstance(voice, str):
        return json_error(400, "invalid_voice", "voice must be a string")
    if "input" not in body:
        return json_error(400, "missing_input", "input (the text to speak) is required")
    try:
        synthesizer.check_text(body["input"])
        voice = synthesizer.resolve_voice(voice)
    except InvalidRequestError as exc:
        return json_error(400, exc.code, str(exc))
    try:
        slot = gateway.admission.admit_stream()
    except CapacityError as exc:
        gateway.metrics.speech_requests_total.labels("503").inc()
        gateway.rejections_total.labels(exc.code).inc()
        return capacity_error(exc)

    stats = UtteranceStats()
    chunks = synthesizer.utterance(body["input"], voice, stats=stats)
    response: web.StreamResponse | None = None
    try:
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except (EngineUnavailableError, EngineDeadError) as exc:  # (re)starting: worth retrying shortly
            gateway.metrics.speech_requests_total.labels("503").inc()
            return json_error(503, exc.code, str(exc), {"Retry-After": str(ENGINE_RETRY_AFTER_S)})
        except RuntimeError as exc:  # another engine error, or the SNAC worker failed this request's batch
            gateway.metrics.speech_requests_total.labels("500").inc()
            log.warning("speech request failed before its first audio: %s", exc)
            return json_error(500, getattr(exc, "code", "synthesis_failed"), str(exc))
        response = web.StreamResponse(headers={
            "Content-Type": "audio/wav" if fmt == "wav" else "audio/pcm",
            "X-Sample-Rate": str(SAMPLE_RATE), "Cache-Control": "no-store"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if fmt == "wav":
            await response.write(wav_header())
        if first is not None:
            gateway.metrics.ttfa_seconds.labels("http").observe(time.monotonic() - stats.started)
            await response.write(first.pcm.tobytes())
            async for chunk in chunks:
                await response.write(chunk.pcm.tobytes())
        await response.write_eof()
        gateway.metrics.speech_requests_total.labels("200").inc()
        _observe_utterance(gateway.metrics, stats)
        return response
    except RuntimeError:  # EngineError, or a failed SNAC decode
        # Mid-stream failure: the status is already sent; cut the connection so the client sees a truncated
        # transfer rather than a complete, shorter file.
        gateway.metrics.speech_requests_total.labels("500").inc()
        log.exception("speech stream failed")
        if request.transport is not None:
            request.transport.close()
        return response or json_error(500, "engine_error", "speech failed")
    finally:
        await chunks.aclose()
        slot.release()


def _observe_utterance(metrics: Metrics, stats: UtteranceStats) -> None:
    metrics.tokens_total.inc(stats.tokens)
    metrics.audio_seconds_total.inc(stats.audio_s)
    if stats.audio_s > 0 and stats.finished_at is not None:
        metrics.rtf.observe((stats.finished_at - stats.started) / stats.audio_s)


# --- the avatar page (web/) ---------------------------------------------------------------------------

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
# Explicit types: aiohttp's guess for .js is application/javascript from the system's mime.types.
WEB_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                     ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


async def web_file(request: web.Request) -> web.FileResponse:
    """`GET /` is web/index.html; `GET /static/{name}` a file of web/ (flat: the name pattern has no '/')."""
    name = request.match_info.get("name", "index.html")
    path = WEB_DIR / name
    content_type = WEB_CONTENT_TYPES.get(path.suffix)
    if content_type is None or not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Content-Type": content_type, "Cache-Control": "no-cache"})


def create_app(config: GatewayConfig, synthesizer: Synthesizer | None = None, *,
               webrtc: bool = True) -> web.Application:
    """The gateway's aiohttp application. Pass a started `synthesizer` to share one (tests, benchmarks)."""
    app = web.Application(middlewares=[json_errors, access_control], client_max_size=config.max_body_bytes)
    gateway = Gateway(config, synthesizer)
    app[GATEWAY_KEY] = gateway
    app.add_routes(routes)
    app.router.add_get("/", web_file)
    app.router.add_get(r"/static/{name:[A-Za-z0-9_-]+\.[a-z]+}", web_file)
    if webrtc:
        from gateway.session import mount_webrtc

        mount_webrtc(app, gateway)
    app.on_response_prepare.append(add_cors_headers)
    app.on_startup.append(gateway.startup)
    app.on_cleanup.append(gateway.cleanup)
    return app
