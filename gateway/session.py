"""WebRTC sessions: signalling routes, one aiortc peer per browser, and the data-channel protocol.

Each session owns a `PlayoutTrack` (its clock, jitter buffer and queue) and a worker that synthesises its
utterances one after the other through the shared `Synthesizer`. The playout track reports when audio
actually leaves (`started`, `segment`, `done`), so events describe what the student hears, not what the
engine made.

Protocol (data channel `control`, one JSON object per message, <= 16 KiB):
  client -> server  speak {id, text, voice?, interrupt?, more?} | cancel {id?} | ping
  server -> client  ready | queued | started | segment | done | cancelled | pong | error {id?, code, message}

Every utterance ends in exactly one of `done`, `cancelled` or an `error` naming its id (`at_capacity` when the
engine is full, `engine_dead`, ...); a session closed by the gateway gets an `error` saying why first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiortc import RTCConfiguration, RTCDataChannel, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from gateway.admission import CapacityError, Slot, TokenBucket
from gateway.encoder import OpusTrack
from gateway.engine import EngineError
from gateway.http import (
    GATEWAY_KEY,
    ICE_SERVERS_PATH,
    OFFER_PATH,
    SUBJECT_KEY,
    capacity_error,
    json_error,
    read_json_object,
)
from gateway.ice import client_id, ice_servers, uses_turn_secret
from gateway.orpheus import SentenceSplitter
from gateway.playout import MAX_JITTER_BUFFER_MS, SAMPLE_RATE_OUT, PlayoutEvent, PlayoutEventKind, PlayoutTrack
from gateway.synthesizer import InvalidRequestError, UtteranceStats

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

log = logging.getLogger(__name__)

CONTROL_LABEL = "control"
MAX_MESSAGE_BYTES = 16 * 1024
MAX_ID_CHARS = 128
SEGMENT_MARKER = "segment"
RATE_LIMITED = "rate_limited"
NETWORK_RETRY_AFTER_S = 5
MAX_ERROR_DETAIL_CHARS = 300  # an exception's text echoed to the client: enough to debug, not a whole SDP
RATE_ERROR_INTERVAL_S = 1.0  # other than a refused speak (always answered), one rate_limited error per second
WATCH_CHECKS_PER_TIMEOUT = 4  # a timeout is noticed within 1/4 of its length
CLOSE_FLUSH_TIMEOUT_S = 1.0  # how long a closing session waits for its last events (why it closes) to leave
MAX_ABANDONED_IDS = 256  # ids of utterances ended while their text was still arriving (later pieces are ignored)


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, utterance_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.utterance_id = utterance_id


@dataclass(eq=False)
class Utterance:
    """One `speak` id: its text (possibly still arriving), its voice and what became of it."""

    id: str
    voice: str
    received_at: float  # the speak message, for time to first audio
    splitter: SentenceSplitter
    sentences: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    text_chars: int = 0
    closed: bool = False  # all its text has arrived
    cancelled: bool = False
    stats: UtteranceStats | None = None

    def add_text(self, text: str, more: bool) -> None:
        self.text_chars += len(text)
        for sentence in self.splitter.feed(text):
            self.sentences.put_nowait(sentence)
        if not more:
            for sentence in self.splitter.flush():
                self.sentences.put_nowait(sentence)
            self.sentences.put_nowait(None)
            self.closed = True

    async def sentence_stream(self) -> AsyncIterator[str]:
        while (sentence := await self.sentences.get()) is not None:
            yield sentence


def _check_str(msg: dict[str, Any], key: str, *, required: bool, max_chars: int | None = None,
               utterance_id: str | None = None) -> str | None:
    value = msg.get(key)
    if value is None:
        if required:
            raise ProtocolError("invalid_message", f"'{key}' is required", utterance_id)
        return None
    if not isinstance(value, str):
        raise ProtocolError("invalid_message", f"'{key}' must be a string", utterance_id)
    if max_chars is not None and len(value) > max_chars:
        raise ProtocolError("invalid_message", f"'{key}' is longer than {max_chars} characters", utterance_id)
    return value


def _check_bool(msg: dict[str, Any], key: str, utterance_id: str | None) -> bool:
    value = msg.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError("invalid_message", f"'{key}' must be true or false", utterance_id)
    return value


class Session:
    """One browser peer: its connection, its playout track, its utterance queue."""

    def __init__(self, manager: SessionManager, pc: RTCPeerConnection, voice: str, jitter_buffer_ms: int,
                 slot: Slot | None = None, session_id: str | None = None) -> None:
        self.manager = manager
        self.gateway = manager.gateway
        self.id = session_id or manager.new_session_id()
        config = self.gateway.config
        self.pc = pc
        self.voice = voice
        self.jitter_buffer_ms = jitter_buffer_ms
        self.track = PlayoutTrack(on_event=self._on_playout_event)
        self.channel: RTCDataChannel | None = None
        self.created_at = time.monotonic()
        self.last_message_at = self.created_at
        self.heartbeat_armed = False  # set by the first ping: a client that pings must keep pinging
        self.closed = False
        self._slot = slot  # this session's place in the gateway's admission count
        self._rate = TokenBucket(config.max_messages_per_second, config.message_burst)
        self._rate_error_at = -RATE_ERROR_INTERVAL_S
        self._pending: asyncio.Queue[Utterance] = asyncio.Queue()
        self._utterances: dict[str, Utterance] = {}  # queued, synthesising or playing
        self._abandoned: dict[str, None] = {}  # insertion-ordered set, trimmed to MAX_ABANDONED_IDS
        self._synthesizing: Utterance | None = None
        self._synth_task: asyncio.Task[None] | None = None
        self._worker = asyncio.create_task(self._run(), name=f"session-{self.id[:8]}")
        self._watchdog = asyncio.create_task(self._watch(), name=f"session-watch-{self.id[:8]}")

        # aiortc sends what the Opus stage returns; the playout track stays the one place that keeps time.
        self.media = OpusTrack(self.track, bitrate=config.opus_bitrate, complexity=config.opus_complexity)
        pc.addTrack(self.media)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    # --- peer -------------------------------------------------------------------------------------
    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != CONTROL_LABEL:
            return
        self.channel = channel
        channel.on("message", self._on_message)
        if channel.readyState == "open":
            self._send_ready()
        else:
            channel.on("open", self._send_ready)

    def _send_ready(self) -> None:
        self.send({"type": "ready", "session_id": self.id, "voices": self.gateway.config.voice_list,
                   "voice": self.voice, "sample_rate": SAMPLE_RATE_OUT, "jitter_buffer_ms": self.jitter_buffer_ms})

    async def _on_connection_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            await self.close()

    def send(self, message: dict[str, Any]) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(json.dumps(message, ensure_ascii=False))

    def send_error(self, code: str, message: str, utterance_id: str | None = None, **extra: Any) -> None:
        event: dict[str, Any] = {"type": "error", "code": code, "message": message, **extra}
        if utterance_id is not None:
            event["id"] = utterance_id
        self.send(event)

    # --- protocol ---------------------------------------------------------------------------------
    def _on_message(self, raw: str | bytes) -> None:
        self.last_message_at = time.monotonic()
        if not self._rate.take():
            self._refuse_rate_limited(raw)
            return
        try:
            self.handle(raw)
        except ProtocolError as exc:
            self.send_error(exc.code, str(exc), exc.utterance_id)
        except Exception:  # a bug must cost one message, never the session
            log.exception("session %s: message handling failed", self.id)
            self.send_error("internal_error", "the message could not be handled")

    def _refuse_rate_limited(self, raw: str | bytes) -> None:
        """Drop a message over the rate; a refused speak is always answered, so no utterance is lost silently."""
        self.gateway.rejections_total.labels(RATE_LIMITED).inc()
        utterance_id = _speak_id(raw)
        now = time.monotonic()
        if utterance_id is None and now - self._rate_error_at < RATE_ERROR_INTERVAL_S:
            return  # a flood must not be doubled by our replies
        self._rate_error_at = now
        rate = self.gateway.config.max_messages_per_second
        self.send_error(RATE_LIMITED, f"more than {rate:g} messages per second; this message was dropped",
                        utterance_id)

    def handle(self, raw: str | bytes) -> None:
        if isinstance(raw, bytes):
            raise ProtocolError("invalid_message", "messages must be JSON text, not binary")
        if len(raw.encode("utf-8", "surrogatepass")) > MAX_MESSAGE_BYTES:
            raise ProtocolError("message_too_large", f"messages are limited to {MAX_MESSAGE_BYTES} bytes")
        try:
            msg = json.loads(raw)
        except ValueError:
            raise ProtocolError("invalid_json", "message is not valid JSON") from None
        if not isinstance(msg, dict):
            raise ProtocolError("invalid_message", "message must be a JSON object")
        kind = msg.get("type")
        if kind == "speak":
            self._speak(msg)
        elif kind == "cancel":
            self._cancel(_check_str(msg, "id", required=False, max_chars=MAX_ID_CHARS))
        elif kind == "ping":
            self.heartbeat_armed = True
            self.send({"type": "pong", "t": msg.get("t") if isinstance(msg.get("t"), (int, float, str)) else None})
        else:
            raise ProtocolError("unknown_type", f"unknown message type {kind!r}; expected speak, cancel or ping")

    def _speak(self, msg: dict[str, Any]) -> None:
        utterance_id = _check_str(msg, "id", required=True, max_chars=MAX_ID_CHARS)
        assert utterance_id is not None
        if not utterance_id:
            raise ProtocolError("invalid_message", "'id' must not be empty")
        text = _check_str(msg, "text", required=True, utterance_id=utterance_id)
        assert text is not None
        voice_name = _check_str(msg, "voice", required=False, max_chars=MAX_ID_CHARS, utterance_id=utterance_id)
        interrupt = _check_bool(msg, "interrupt", utterance_id)
        more = _check_bool(msg, "more", utterance_id)
        synthesizer = self.gateway.synthesizer
        if synthesizer is None:
            raise ProtocolError("engine_unavailable", "the speech engine is still starting", utterance_id)
        limit = self.gateway.config.max_text_chars

        if utterance_id in self._abandoned:
            # The rest of an utterance cancelled or failed while its text was arriving: speaking the tail as a
            # new utterance would be wrong. Its last piece (more false) frees the id for reuse.
            if not more:
                del self._abandoned[utterance_id]
            raise ProtocolError("utterance_ended", f"utterance {utterance_id!r} has already ended (cancelled or "
                                "failed); this piece of its text is ignored", utterance_id)
        existing = self._utterances.get(utterance_id)
        if existing is not None:
            if existing.closed:
                raise ProtocolError("duplicate_id", f"utterance {utterance_id!r} already exists", utterance_id)
            if existing.text_chars + len(text) > limit:
                raise ProtocolError("text_too_long", f"utterance text is limited to {limit} characters", utterance_id)
            existing.add_text(text, more)  # a further piece of text still being written
            return

        try:
            voice = synthesizer.resolve_voice(voice_name or self.voice)
        except InvalidRequestError as exc:
            raise ProtocolError(exc.code, str(exc), utterance_id) from None
        if len(text) > limit:
            raise ProtocolError("text_too_long", f"utterance text is limited to {limit} characters", utterance_id)
        if not more and not text.strip():
            raise ProtocolError("empty_text", "text is empty", utterance_id)
        if interrupt:
            self._cancel(None)
        elif self._pending.qsize() >= self.gateway.config.max_queued_utterances:
            raise ProtocolError("queue_full", "too many utterances are waiting; cancel or wait", utterance_id)

        utterance = Utterance(utterance_id, voice, time.monotonic(),
                              SentenceSplitter(self.gateway.config.max_sentence_chars))
        utterance.add_text(text, more)
        self._utterances[utterance_id] = utterance
        self._pending.put_nowait(utterance)
        self.gateway.metrics.queue_depth.inc()
        self.send({"type": "queued", "id": utterance_id, "position": self._pending.qsize()
                   + (1 if self._synthesizing is not None else 0) - 1})

    def _cancel(self, utterance_id: str | None) -> None:
        """Stop the named utterance (or the current one and everything queued) at once."""
        if utterance_id is not None and utterance_id not in self._utterances:
            raise ProtocolError("unknown_id", f"no utterance {utterance_id!r} is queued or playing", utterance_id)
        victims = [self._utterances[utterance_id]] if utterance_id else list(self._utterances.values())
        for utterance in victims:
            self._drop(utterance)
            self.send({"type": "cancelled", "id": utterance.id})
            self.gateway.metrics.utterances_total.labels("cancelled").inc()

    def _drop(self, utterance: Utterance) -> None:
        utterance.cancelled = True
        self._utterances.pop(utterance.id, None)
        self.track.clear(utterance.id)
        if not utterance.closed:
            self._abandon(utterance.id)
        if utterance is self._synthesizing and self._synth_task is not None:
            self._synth_task.cancel()  # closes the audio stream, which aborts the engine request

    def _abandon(self, utterance_id: str) -> None:
        self._abandoned[utterance_id] = None
        while len(self._abandoned) > MAX_ABANDONED_IDS:
            del self._abandoned[next(iter(self._abandoned))]

    def _fail(self, utterance: Utterance, code: str, message: str, outcome: str = "failed", **extra: Any) -> None:
        """End an utterance with an `error` event naming it."""
        self._utterances.pop(utterance.id, None)
        self.track.clear(utterance.id)
        if not utterance.closed:
            self._abandon(utterance.id)
        self.send_error(code, message, utterance.id, **extra)
        self.gateway.metrics.utterances_total.labels(outcome).inc()

    # --- synthesis worker -------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            utterance = await self._pending.get()
            self.gateway.metrics.queue_depth.dec()
            if utterance.cancelled:
                continue
            try:
                slot = self.gateway.admission.admit_stream()
            except CapacityError as exc:
                self.gateway.rejections_total.labels(exc.code).inc()
                self._fail(utterance, exc.code, str(exc), "rejected", retry_after_s=exc.retry_after_s)
                continue
            self._synthesizing = utterance
            self._synth_task = asyncio.create_task(self._synthesize(utterance))
            # Released however the task ends, even when it is cancelled before it starts running.
            self._synth_task.add_done_callback(lambda _task, slot=slot: slot.release())
            # wait() rather than await: a cancelled utterance must not look like a cancelled worker.
            await asyncio.wait([self._synth_task])
            self._synthesizing = None
            self._synth_task = None

    async def _synthesize(self, utterance: Utterance) -> None:
        synthesizer = self.gateway.synthesizer
        assert synthesizer is not None
        track = self.track
        track.begin_utterance(utterance.id, self.jitter_buffer_ms)
        utterance.stats = stats = UtteranceStats(started=utterance.received_at)
        try:
            async for chunk in synthesizer.utterance(utterance.sentence_stream(), utterance.voice, stats=stats):
                if chunk.first_of_sentence:
                    track.mark(utterance.id, SEGMENT_MARKER, (chunk.sentence_index, chunk.sentence_text))
                track.push_pcm(utterance.id, chunk.pcm)
            track.end_utterance(utterance.id)
            metrics = self.gateway.metrics
            metrics.tokens_total.inc(stats.tokens)
            metrics.audio_seconds_total.inc(stats.audio_s)
            if stats.finished_at is not None and stats.audio_s > 0:
                metrics.rtf.observe((stats.finished_at - stats.started) / stats.audio_s)
        except (EngineError, InvalidRequestError, RuntimeError) as exc:
            # RuntimeError: the SNAC worker failed this utterance's decode batch.
            log.warning("session %s: utterance %s failed: %s", self.id, utterance.id, exc)
            self._fail(utterance, getattr(exc, "code", "synthesis_failed"), str(exc))
        except Exception:  # a bug must cost one utterance (reported), never the session's worker
            log.exception("session %s: utterance %s failed", self.id, utterance.id)
            self._fail(utterance, "internal_error", "the utterance could not be synthesised")

    def _on_playout_event(self, event: PlayoutEvent) -> None:
        utterance = self._utterances.get(event.utterance_id)
        if event.kind is PlayoutEventKind.STARTED:
            stages: dict[str, float | None] = {"ttfa_ms": None}
            if utterance is not None:
                since = utterance.received_at
                stats = utterance.stats
                # Where first audio's time went: first token from the engine, first window to SNAC, first audio out.
                stages = {"ttft_ms": _ms_since(since, stats.first_token_at if stats else None),
                          "ttfw_ms": _ms_since(since, stats.first_window_at if stats else None),
                          "ttfa_ms": _ms_since(since, event.timestamp)}
                self.gateway.metrics.ttfa_seconds.labels("webrtc").observe(event.timestamp - since)
            self.send({"type": "started", "id": event.utterance_id, **stages})
        elif event.kind is PlayoutEventKind.MARKER and event.label == SEGMENT_MARKER:
            index, text = event.data
            self.send({"type": "segment", "id": event.utterance_id, "index": index, "text": text})
        elif event.kind is PlayoutEventKind.FINISHED:
            self._utterances.pop(event.utterance_id, None)
            metrics = self.gateway.metrics
            metrics.utterances_total.labels("done").inc()
            metrics.underruns_total.inc(event.underruns)
            metrics.underrun_seconds_total.inc(event.underrun_ms / 1000)
            self.send({"type": "done", "id": event.utterance_id, "audio_ms": event.audio_ms,
                       "underruns": event.underruns, "underrun_ms": event.underrun_ms})

    # --- lifetime ---------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Close sessions that never connected, went quiet (idle, or a vanished peer) or ran too long."""
        config = self.gateway.config
        timeouts = [t for t in (config.session_idle_timeout_s, config.heartbeat_timeout_s,
                                config.session_connect_timeout_s, config.max_session_s) if t > 0]
        if not timeouts:
            return
        check_every = min(timeouts) / WATCH_CHECKS_PER_TIMEOUT
        while not self.closed:
            await asyncio.sleep(check_every)
            reason = self._expired(config, time.monotonic())
            if reason is not None:
                code, message = reason
                log.info("session %s: %s (%s); closing", self.id, message, code)
                await self.end(code, message)
                return

    def _expired(self, config: GatewayConfig, now: float) -> tuple[str, str] | None:
        """(code, message) of the limit this session has run past, if any."""
        age, quiet = now - self.created_at, now - self.last_message_at
        if self.channel is None and 0 < config.session_connect_timeout_s < age:
            return "connect_timeout", f"the data channel did not open within {config.session_connect_timeout_s:g} s"
        if 0 < config.max_session_s < age:
            return "session_time_limit", f"sessions are limited to {config.max_session_s:g} s; connect again"
        if self.heartbeat_armed and 0 < config.heartbeat_timeout_s < quiet:
            return "heartbeat_timeout", f"no ping for {quiet:.1f} s"
        if 0 < config.session_idle_timeout_s < quiet and not self._utterances:
            return "idle_timeout", "session closed after being idle"
        return None

    async def end(self, code: str, message: str) -> None:
        """Close the session at the gateway's initiative, telling the client why first."""
        if self.closed:
            return
        self.send_error(code, message)
        await self._flush()
        await self.close()

    async def _flush(self) -> None:
        """Let queued events leave before closing: the close aborts SCTP, dropping anything still queued."""
        channel = self.channel
        if channel is None or channel.readyState != "open" or channel.bufferedAmount == 0:
            return
        drained = asyncio.Event()
        channel.once("bufferedamountlow", drained.set)  # threshold 0: everything queued has been sent
        try:
            await asyncio.wait_for(drained.wait(), CLOSE_FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            channel.remove_listener("bufferedamountlow", drained.set)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for utterance in list(self._utterances.values()):
            self._drop(utterance)
        while not self._pending.empty():
            self._pending.get_nowait()
            self.gateway.metrics.queue_depth.dec()
        current = asyncio.current_task()
        for task in (self._synth_task, self._worker, self._watchdog):
            if task is not None and task is not current and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.media.stop()  # stops the playout track too
        try:
            await self.pc.close()
        except Exception:  # aiortc can fail to close a peer whose negotiation failed half way (fuzzing found it)
            log.debug("session %s: closing the peer connection failed", self.id, exc_info=True)
        finally:
            if self._slot is not None:
                self._slot.release()
            self.manager.forget(self)


class SessionManager:
    """All sessions of this gateway process."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.sessions: dict[str, Session] = {}

    def new_session_id(self) -> str:
        return self.gateway.session_id_prefix + uuid.uuid4().hex

    def ice_configuration(self, session_id: str) -> RTCConfiguration:
        """The gateway's side: the configured servers, with TURN credentials minted for this session."""
        servers = [RTCIceServer(urls=list(s.urls), username=s.username, credential=s.credential)
                   for s in ice_servers(self.gateway.config, session_id)]
        return RTCConfiguration(iceServers=servers)  # [] (not None): no public STUN server is contacted

    async def open(self, offer: RTCSessionDescription, voice: str, jitter_buffer_ms: int, slot: Slot) -> Session:
        try:
            # The id comes first: the gateway's TURN username (`<expiry>:<session id>`) names the session.
            session_id = self.new_session_id()
            pc = RTCPeerConnection(self.ice_configuration(session_id))
            session = Session(self, pc, voice, jitter_buffer_ms, slot, session_id)
        except BaseException:
            slot.release()
            raise
        self.sessions[session.id] = session
        self.gateway.metrics.sessions_active.inc()
        self.gateway.metrics.sessions_total.inc()
        try:
            await pc.setRemoteDescription(offer)
            answer = await pc.createAnswer()
            await pc.setLocalDescription(answer)  # aiortc gathers every candidate here (no trickle)
        except BaseException:
            await session.close()
            raise
        return session

    def forget(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.gateway.metrics.sessions_active.dec()

    async def close_all(self) -> None:
        await asyncio.gather(*(s.end("shutting_down", "the gateway is shutting down; connect again shortly")
                               for s in list(self.sessions.values())), return_exceptions=True)


def _speak_id(raw: str | bytes) -> str | None:
    """The id of a speak message, if `raw` is one (for answering a message that is otherwise dropped)."""
    if not isinstance(raw, str) or len(raw) > MAX_MESSAGE_BYTES:
        return None
    try:
        msg = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("type") != "speak":
        return None
    utterance_id = msg.get("id")
    return utterance_id if isinstance(utterance_id, str) and 0 < len(utterance_id) <= MAX_ID_CHARS else None


# --- signalling routes -------------------------------------------------------------------------------

async def offer(request: web.Request) -> web.Response:
    """`{sdp, type: "offer", voice?, jitter_buffer_ms?}` -> `{sdp, type: "answer", session_id}`."""
    gateway = request.app[GATEWAY_KEY]
    body = await read_json_object(request, gateway.config.max_body_bytes)
    sdp, kind = body.get("sdp"), body.get("type")
    if not isinstance(sdp, str) or not sdp.strip():
        return json_error(400, "invalid_offer", "'sdp' (a string) is required")
    if kind != "offer":
        return json_error(400, "invalid_offer", "'type' must be \"offer\"")
    if "m=audio" not in sdp or "m=application" not in sdp:
        return json_error(400, "invalid_offer",
                          "the offer must receive audio and open a data channel (m=audio and m=application)")
    jitter = body.get("jitter_buffer_ms", gateway.config.jitter_buffer_ms)
    if isinstance(jitter, bool) or not isinstance(jitter, int) or not 0 <= jitter <= MAX_JITTER_BUFFER_MS:
        return json_error(400, "invalid_jitter_buffer",
                          f"jitter_buffer_ms must be an integer in 0..{MAX_JITTER_BUFFER_MS}")
    voice = body.get("voice") or gateway.config.voice
    if not isinstance(voice, str) or voice not in gateway.config.voice_list:
        return json_error(400, "unknown_voice", f"unknown voice {voice!r}; known voices: {gateway.config.voice_list}")
    manager: SessionManager = gateway.sessions
    try:
        slot = gateway.admission.admit_session()
    except CapacityError as exc:
        gateway.rejections_total.labels(exc.code).inc()
        return capacity_error(exc)
    try:
        session = await manager.open(RTCSessionDescription(sdp=sdp, type="offer"), voice, jitter, slot)
    except OSError:
        log.exception("could not set up a peer connection")
        return json_error(503, "network_unavailable", "the gateway could not open a peer connection",
                          {"Retry-After": str(NETWORK_RETRY_AFTER_S)})
    except Exception as exc:  # aiortc rejects malformed SDP with many exception types
        log.info("offer refused: %r", exc)
        return json_error(400, "invalid_sdp", f"the offer could not be used: {exc}"[:MAX_ERROR_DETAIL_CHARS])
    local = session.pc.localDescription
    return web.json_response({"sdp": local.sdp, "type": local.type, "session_id": session.id})


async def get_ice_servers(request: web.Request) -> web.Response:
    """`{ice_servers: [RTCIceServer...], ttl_s}`: what the browser passes to `new RTCPeerConnection`.

    Behind the same access check as the offer. TURN credentials are minted per call when a TURN secret is set
    (`ttl_s` is then how long they can start a relay; null for static ones); the secret itself never leaves.
    """
    config = request.app[GATEWAY_KEY].config
    servers = ice_servers(config, client_id(request.get(SUBJECT_KEY)))
    ttl_s = config.turn_credential_ttl_s if uses_turn_secret(config) else None
    # no-store: the answer holds credentials, which no shared cache may keep or hand to someone else.
    return web.json_response({"ice_servers": [s.to_json() for s in servers], "ttl_s": ttl_s},
                             headers={"Cache-Control": "no-store"})


async def end_session(request: web.Request) -> web.Response:
    manager: SessionManager = request.app[GATEWAY_KEY].sessions
    session = manager.sessions.get(request.match_info["session_id"])
    if session is None:
        return json_error(404, "unknown_session", "no such session")
    await session.close()
    return web.Response(status=204)


def mount_webrtc(app: web.Application, gateway: Gateway) -> None:
    gateway.sessions = SessionManager(gateway)
    app.router.add_get(ICE_SERVERS_PATH, get_ice_servers)
    app.router.add_post(OFFER_PATH, offer)
    app.router.add_delete("/v1/webrtc/sessions/{session_id}", end_session)


def _ms_since(start: float, at: float | None) -> float | None:
    return None if at is None else round((at - start) * 1000, 1)
