"""`GET /tts/websocket`: Cartesia's streaming TTS WebSocket, so voice-agent frameworks use the gateway unchanged
(pipecat `CartesiaTTSService(url="ws://<gateway>/tts/websocket")`, LiveKit `cartesia.TTS(base_url="http://<gateway>")`).

Client -> gateway, one JSON object per text message (at most `config.max_body_bytes`):
- `{"context_id", "transcript", "continue"?: false, "voice"?: {"mode": "id", "id": "tara"}, "model_id"?: any,
  "output_format"?: {"container": "raw", "encoding": "pcm_s16le" | "pcm_f32le", "sample_rate": 8000..48000},
  "add_timestamps"?: false, "language"?}`: text for context `context_id` (opened by its first message, whose voice,
  output format and timestamps hold for the whole context); `continue: true` says more text follows, `false` (or
  absent) closes it (an empty transcript with `continue: false` is the flush). `language` (Cartesia's ISO code,
  `en`, `pt`, or any BCP-47 tag) routes as the speech route's does (`gateway.model_table`): alone, that language's
  model speaks with its default voice; with a voice, that voice's model must serve it. Ignored: `model_id` (the
  voice names its model), `generation_config`, `max_buffer_delay_ms`, `use_normalized_timestamps`,
  `add_phoneme_timestamps`, `pronunciation_dict_id`.
- `{"context_id", "cancel": true}`: stop that context now; its engine request is aborted.

Gateway -> client (every message has `context_id`, `status_code`, `done`):
- `{"type": "chunk", "data": base64 PCM, "step_time": ms since the context's first text}`;
- `{"type": "timestamps", "word_timestamps": {"words", "start", "end"}}` (seconds from the context's first sample,
  one message per sentence once its audio is out, when `add_timestamps` asked for them);
- `{"type": "done", "done": true}`: the context's last message, once (after a cancel too, with `"cancelled": true`;
  an extension: Cartesia's clients ignore messages of a context they cancelled);
- `{"type": "error", "done": true, "status_code", "error": message, "code": the gateway's code}`: for a context
  (its end) or for a message that names none (`context_id: null`); the socket stays open.

The gateway's access rules hold (a token in `X-API-Key`, where Cartesia's clients put their key, in
`Authorization: Bearer`, or `?api_key=`), its in-flight utterance limit (each open context holds a slot), its text
limit per context and its message rate per socket. Closing the socket cancels its open contexts.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import WSMsgType, web

from gateway.edge.http import GATEWAY_KEY
from gateway.edge.text_stream import CANCELLED, DONE, ContextOptions, ContextSet, DoorError, StreamContext
from gateway.edge.word_times import TimedWord
from gateway.media.pcm_out import PCM_ENCODINGS, PCM_RATES
from gateway.orpheus import SAMPLE_RATE
from gateway.service.admission import TokenBucket

CARTESIA_PATH = "/tts/websocket"
API_KEY_HEADER = "X-API-Key"  # where Cartesia's clients send their key
API_KEY_QUERY = "api_key"
STATUS_STREAMING = 206  # Cartesia's status_code on a context's messages before its end
STATUS_DONE = 200
MAX_CONTEXT_ID_CHARS = 256
# An oversize message is still read (up to this many times the limit) so it gets an error message, not a close.
READ_LIMIT_FACTOR = 4


def request_api_key(request: web.Request) -> str | None:
    """The token a Cartesia client sent (header or query), for the gateway's access check."""
    return request.headers.get(API_KEY_HEADER) or request.query.get(API_KEY_QUERY)


class CartesiaEvents:
    """Renders the contexts' events as Cartesia's messages on one socket."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(message, separators=(",", ":"), ensure_ascii=False))

    async def audio(self, context: StreamContext, data: bytes) -> None:
        await self.send({"type": "chunk", "context_id": context.id, "status_code": STATUS_STREAMING, "done": False,
                         "data": base64.b64encode(data).decode("ascii"),
                         "step_time": round((time.monotonic() - context.stats.started) * 1000, 1)})

    async def words(self, context: StreamContext, words: list[TimedWord]) -> None:
        await self.send({"type": "timestamps", "context_id": context.id, "status_code": STATUS_STREAMING,
                         "done": False, "word_timestamps": {"words": [w.text for w in words],
                                                            "start": [round(w.start_s, 3) for w in words],
                                                            "end": [round(w.end_s, 3) for w in words]}})

    async def ended(self, context: StreamContext, outcome: str, code: str | None, message: str | None) -> None:
        if outcome in (DONE, CANCELLED):
            end: dict[str, Any] = {"type": "done", "context_id": context.id, "status_code": STATUS_DONE,
                                   "done": True}
            if outcome == CANCELLED:
                end["cancelled"] = True
            await self.send(end)
        else:
            await self.error(context.id, code or "synthesis_failed", message or "", 500)

    async def error(self, context_id: str | None, code: str, message: str, status: int) -> None:
        await self.send({"type": "error", "context_id": context_id, "status_code": status, "done": True,
                         "error": message, "code": code})


def _options(message: dict[str, Any], contexts: ContextSet) -> ContextOptions:
    """A new context's voice, output format and timestamps, checked (DoorError naming the field)."""
    voice = message.get("voice")
    voice_id: Any = None
    if voice is not None:
        if not isinstance(voice, dict) or voice.get("mode", "id") != "id":
            raise DoorError("invalid_voice", 'voice must be {"mode": "id", "id": "<voice>"} (no embeddings here)')
        voice_id = voice.get("id")
        if voice_id is not None and not isinstance(voice_id, str):
            raise DoorError("invalid_voice", "voice.id must be a string")
    fmt = message.get("output_format", {})
    if not isinstance(fmt, dict):
        raise DoorError("invalid_output_format", "output_format must be an object")
    if fmt.get("container", "raw") != "raw":
        raise DoorError("invalid_output_format", 'output_format.container must be "raw"')
    encoding = fmt.get("encoding", "pcm_s16le")
    if encoding not in PCM_ENCODINGS:
        raise DoorError("invalid_output_format", f"output_format.encoding must be one of {list(PCM_ENCODINGS)}")
    rate = fmt.get("sample_rate", SAMPLE_RATE)
    if isinstance(rate, bool) or rate not in PCM_RATES:
        raise DoorError("invalid_output_format", f"output_format.sample_rate must be one of {list(PCM_RATES)}")
    timestamps = message.get("add_timestamps", False)
    if not isinstance(timestamps, bool):
        raise DoorError("invalid_add_timestamps", "add_timestamps must be true or false")
    language = message.get("language")
    if language is not None and not isinstance(language, str):
        raise DoorError("invalid_language", "language must be a language code such as en or pt")
    return ContextOptions(voice=contexts.resolve_voice(voice_id, language), sample_rate=int(rate),
                          encoding=encoding, timestamps=timestamps)


def handle_message(raw: str, contexts: ContextSet) -> str | None:
    """Apply one client message; returns its context id. DoorError (naming its context) for bad input."""
    limit = contexts.gateway.config.max_body_bytes
    if len(raw.encode("utf-8", "surrogatepass")) > limit:
        raise DoorError("message_too_large", f"messages are limited to {limit} bytes", 413)
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError):
        raise DoorError("invalid_json", "the message is not valid JSON") from None
    if not isinstance(message, dict):
        raise DoorError("invalid_json", "a message must be a JSON object")
    context_id = message.get("context_id")
    if context_id is None and not message.get("cancel"):
        context_id = uuid.uuid4().hex  # a one-shot request may name no context (Cartesia's rule)
    if not isinstance(context_id, str) or not 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS:
        raise DoorError("invalid_context_id", f"context_id must be a string of 1-{MAX_CONTEXT_ID_CHARS} characters")
    try:
        if message.get("cancel") is True:
            contexts.cancel(context_id)
            return context_id
        text = message.get("transcript")
        if not isinstance(text, str):
            raise DoorError("invalid_transcript", "transcript must be a string")
        more = message.get("continue", False)
        if not isinstance(more, bool):
            raise DoorError("invalid_continue", "continue must be true or false")
        contexts.append(context_id, text, more, lambda: _options(message, contexts))
    except DoorError as exc:
        exc.context_id = context_id
        raise
    return context_id


async def cartesia_websocket(request: web.Request) -> web.StreamResponse:
    """Upgrade to Cartesia's TTS WebSocket and serve its contexts until the client closes."""
    gateway = request.app[GATEWAY_KEY]
    config = gateway.config
    ws = web.WebSocketResponse(max_msg_size=config.max_body_bytes * READ_LIMIT_FACTOR, heartbeat=None)
    await ws.prepare(request)
    events = CartesiaEvents(ws)
    contexts = ContextSet(gateway, events, "websocket")
    bucket = TokenBucket(config.max_messages_per_second, config.message_burst)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                await contexts.send(events.error(None, "invalid_message", "send JSON as text messages", 400))
                continue
            if msg.type != WSMsgType.TEXT:
                continue
            if not bucket.take():
                gateway.metrics.rejections_total.labels("rate_limited").inc()
                await contexts.send(events.error(None, "rate_limited", "too many messages; this one was "
                                                        "dropped", 429))
                continue
            try:
                handle_message(msg.data, contexts)
            except DoorError as exc:
                await contexts.send(events.error(exc.context_id, exc.code, str(exc),
                                                        exc.status))
    finally:
        with contextlib.suppress(Exception):
            await contexts.close()
    return ws
