"""One browser peer: its connection, its data channel, its utterance queue, and how long it may live.

What the session hands off: message parsing to `protocol`, synthesis to its `Speaker`, playout events to its
`PlayoutReporter`, word timings, heard reports, rates and repeats to its `UtteranceTimelines`, signalling to
`gateway.edge.signalling` and the set of sessions to `SessionManager`. Every
utterance ends in exactly one of `done`, `cancelled` or an `error` naming its id; a session closed by the
gateway gets an `error` saying why first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from aiortc import RTCDataChannel, RTCPeerConnection

from gateway.config import GatewayConfig
from gateway.media.encoder import OpusTrack
from gateway.media.output_frames import SAMPLE_RATE_OUT
from gateway.media.playout import PlayoutTrack
from gateway.orpheus import SentenceSplitter
from gateway.phrases.cache import PhraseCache
from gateway.rtc import protocol
from gateway.rtc.errors import ProtocolError
from gateway.rtc.protocol import CONTROL_LABEL, Cancel, Ping, Played, Prefetch, Repeat, Speak
from gateway.rtc.reporter import PlayoutReporter
from gateway.rtc.services import SessionServices
from gateway.rtc.speaker import Speaker
from gateway.rtc.timeline import UtteranceTimelines
from gateway.rtc.utterance import Utterance
from gateway.service.admission import Slot, TokenBucket
from gateway.speech.errors import EngineUnavailableError, InvalidRequestError
from gateway.speech.language_spans import has_markup, parse_spans
from gateway.speech.synthesizer import Synthesizer
from gateway.speech.utterance_text import check_text, choose_voice, span_voices

log = logging.getLogger(__name__)

RATE_LIMITED = "rate_limited"
RATE_ERROR_INTERVAL_S = 1.0  # other than a refused speak (always answered), one rate_limited error per second
WATCH_CHECKS_PER_TIMEOUT = 4  # a timeout is noticed within 1/4 of its length
CLOSE_FLUSH_TIMEOUT_S = 1.0  # how long a closing session waits for its last events (why it closes) to leave
MARKUP_WHOLE_TEXT = "mixed-language <lang> markup needs the utterance's whole text in one speak (more false)"
_R = TypeVar("_R")
MAX_ABANDONED_IDS = 256  # ids of utterances ended while their text was still arriving (later pieces are ignored)


class Session:
    """A peer's lifetime and its utterance queue."""

    def __init__(self, services: SessionServices, pc: RTCPeerConnection, session_id: str, voice: str,
                 jitter_buffer_ms: int, slot: Slot | None = None,
                 on_closed: Callable[[Session], None] | None = None, *, expect_channel: bool = True) -> None:
        self.services = services
        self.config = config = services.config
        self.id = session_id
        self.pc = pc
        self.voice = voice
        self.jitter_buffer_ms = jitter_buffer_ms
        self.channel: RTCDataChannel | None = None
        # False for a listener that offered no data channel (a WHEP player): audio only, and the connect timeout
        # waits for the peer to connect instead of for the channel to open.
        self.expect_channel = expect_channel
        self.peer_connected = False
        self.created_at = time.monotonic()
        self.last_message_at = self.created_at
        self.heartbeat_armed = False  # set by the first ping: a client that pings must keep pinging
        self.closed = False
        self._slot = slot  # this session's place in the gateway's admission count
        self._on_closed = on_closed
        self._rate = TokenBucket(config.max_messages_per_second, config.message_burst)
        self._rate_error_at = -RATE_ERROR_INTERVAL_S
        self.utterances: dict[str, Utterance] = {}  # queued, synthesising or playing
        self._abandoned: dict[str, None] = {}  # insertion-ordered set, trimmed to MAX_ABANDONED_IDS
        self.timelines = UtteranceTimelines(services, pc, self.send)
        self.reporter = PlayoutReporter(services.metrics, self.utterances, self.send, self.timelines)
        self.track = self.timelines.track = PlayoutTrack(on_event=self.reporter.on_playout_event)
        self.speaker = Speaker(services, self.track, jitter_buffer_ms, self._fail, name=f"session-{session_id[:8]}",
                               timelines=self.timelines)
        self._prefetches: set[asyncio.Task[None]] = set()
        self._watchdog = asyncio.create_task(self._watch(), name=f"session-watch-{session_id[:8]}")

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
        self.send(protocol.Ready(session_id=self.id, voices=self.config.voice_list, voice=self.voice,
                                 sample_rate=SAMPLE_RATE_OUT, jitter_buffer_ms=self.jitter_buffer_ms))

    async def _on_connection_state(self) -> None:
        if self.pc.connectionState == "connected":
            self.peer_connected = True
        if self.pc.connectionState in ("failed", "closed"):
            await self.close()

    def send(self, event: protocol.Event) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(protocol.encode(event))

    def send_error(self, code: str, message: str, utterance_id: str | None = None,
                   retry_after_s: float | None = None) -> None:
        self.send(protocol.Error(code=code, message=message, id=utterance_id, retry_after_s=retry_after_s))

    # --- messages ---------------------------------------------------------------------------------
    def _on_message(self, raw: str | bytes) -> None:
        self.last_message_at = time.monotonic()
        if not self._rate.take():
            self._refuse_rate_limited(raw)
            return
        try:
            self.handle(raw)
        except ProtocolError as exc:
            self.send_error(exc.code, str(exc), exc.utterance_id, exc.retry_after_s)
        except Exception:  # a bug must cost one message, never the session
            log.exception("session %s: message handling failed", self.id)
            self.send_error("internal_error", "the message could not be handled")

    def _refuse_rate_limited(self, raw: str | bytes) -> None:
        """Drop a message over the rate; a refused speak is always answered, so no utterance is lost silently."""
        self.services.metrics.rejections_total.labels(RATE_LIMITED).inc()
        utterance_id = protocol.speak_id(raw)
        now = time.monotonic()
        if utterance_id is None and now - self._rate_error_at < RATE_ERROR_INTERVAL_S:
            return  # a flood must not be doubled by our replies
        self._rate_error_at = now
        rate = self.config.max_messages_per_second
        self.send_error(RATE_LIMITED, f"more than {rate:g} messages per second; this message was dropped",
                        utterance_id)

    def handle(self, raw: str | bytes) -> None:
        message = protocol.parse_client_message(raw)
        if isinstance(message, Speak):
            self.speak(message)
        elif isinstance(message, Cancel):
            self.cancel(message.id)
        elif isinstance(message, Ping):
            self.heartbeat_armed = True
            self.send(protocol.Pong(t=message.t))
        elif isinstance(message, Repeat):
            self.repeat(message)
        elif isinstance(message, Prefetch):
            self.prefetch(message)
        elif isinstance(message, Played):
            self.timelines.played(message)

    def speak(self, message: Speak) -> None:
        utterance_id = message.id
        if self.services.synthesizer() is None:
            raise ProtocolError(EngineUnavailableError.code, "the speech engine is still starting", utterance_id,
                                EngineUnavailableError.retry_after_s)
        limit = self.config.max_text_chars
        if utterance_id in self._abandoned:
            # The rest of an utterance cancelled or failed while its text was arriving: speaking the tail as a
            # new utterance would be wrong. Its last piece (more false) frees the id for reuse.
            if not message.more:
                del self._abandoned[utterance_id]
            raise ProtocolError("utterance_ended", f"utterance {utterance_id!r} has already ended (cancelled or "
                                "failed); this piece of its text is ignored", utterance_id)
        existing = self.utterances.get(utterance_id)
        if existing is not None:
            if existing.closed:
                raise ProtocolError("duplicate_id", f"utterance {utterance_id!r} already exists", utterance_id)
            _checked(check_text, message.text, limit, so_far=existing.text_chars, allow_empty=True,
                     utterance_id=utterance_id)
            if has_markup(message.text):
                raise ProtocolError("invalid_markup", MARKUP_WHOLE_TEXT, utterance_id)
            existing.add_text(message.text, message.more)  # a further piece of text still being written
            return

        voice = self._voice_of(message.voice, message.language, utterance_id)
        _checked(check_text, message.text, limit, allow_empty=message.more, utterance_id=utterance_id)
        rate = self.timelines.check_rate(message.rate, utterance_id)
        utterance = Utterance(utterance_id, voice, time.monotonic(), SentenceSplitter(self.config.max_sentence_chars),
                              rate=rate, cache=message.cache)
        if has_markup(message.text):  # mixed languages: each span by a voice of its language
            if message.more:
                raise ProtocolError("invalid_markup", MARKUP_WHOLE_TEXT, utterance_id)
            spans = _checked(parse_spans, message.text, utterance_id=utterance_id)
            voices = _checked(span_voices, self.config, spans, voice, utterance_id=utterance_id)
            utterance.add_spans(message.text, list(zip(spans, voices, strict=True)), self.config.max_sentence_chars)
        else:
            utterance.add_text(message.text, message.more)
        self._admit(utterance, message.interrupt)

    def _voice_of(self, voice: str | None, language: str | None, utterance_id: str | None) -> str:
        """The voice a message's `voice` and/or `language` route to (`speak`, `prefetch`); neither: the
        session's."""
        if not (voice or language):
            return self.voice
        return _checked(choose_voice, self.config, voice, language, utterance_id=utterance_id)

    def prefetch(self, message: Prefetch) -> None:
        """Queue the lines not in the phrase cache to be made while the engine has room; `prefetched` says which
        are ready."""
        synthesizer = self.services.synthesizer()
        if synthesizer is None:
            raise ProtocolError(EngineUnavailableError.code, "the speech engine is still starting", None,
                                EngineUnavailableError.retry_after_s)
        voice = self._voice_of(message.voice, message.language, None)
        for text in message.texts:
            _checked(check_text, text, self.config.max_text_chars, utterance_id=None)
        phrases = self.services.phrases
        if phrases is None:
            self.send(protocol.Prefetched(ready=[], pending=[], skipped=list(message.texts)))
            return
        task = asyncio.create_task(self._prefetch(phrases, synthesizer, message, voice))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)

    async def _prefetch(self, phrases: PhraseCache, synthesizer: Synthesizer, message: Prefetch, voice: str) -> None:
        try:
            ready = await phrases.prefetch(synthesizer, message.texts, voice)
        except Exception:  # a bug must cost this message, never the session
            log.exception("session %s: prefetch failed", self.id)
            self.send_error("internal_error", "the prefetch could not be handled")
            return
        marked = list(zip(message.texts, ready, strict=True))
        self.send(protocol.Prefetched(ready=[t for t, r in marked if r], pending=[t for t, r in marked if not r],
                                      skipped=[]))

    def repeat(self, message: Repeat) -> None:
        """Play (words of) a recent utterance again, from the session's recordings: no engine request."""
        utterance = self.timelines.repeat(message)  # ProtocolError: nothing to repeat, bad range or rate
        if utterance.id in self.utterances or utterance.id in self._abandoned:
            raise ProtocolError("duplicate_id", f"utterance {utterance.id!r} already exists", utterance.id)
        self._admit(utterance, message.interrupt, repeat_of=message.id)

    def _admit(self, utterance: Utterance, interrupt: bool, repeat_of: str | None = None) -> None:
        """Queue a new utterance (after cancelling everything, for a barge-in) and say so."""
        if interrupt:
            self.cancel(None)
        elif self.speaker.pending.qsize() >= self.config.max_queued_utterances:
            raise ProtocolError("queue_full", "too many utterances are waiting; cancel or wait", utterance.id)
        position = self.speaker.waiting
        self.utterances[utterance.id] = utterance
        self.speaker.enqueue(utterance)
        self.send(protocol.Queued(id=utterance.id, position=position, repeat_of=repeat_of))

    def cancel(self, utterance_id: str | None) -> None:
        """Stop the named utterance (or the current one and everything queued) at once."""
        if utterance_id is not None and utterance_id not in self.utterances:
            raise ProtocolError("unknown_id", f"no utterance {utterance_id!r} is queued or playing", utterance_id)
        victims = [self.utterances[utterance_id]] if utterance_id else list(self.utterances.values())
        for utterance in victims:
            heard = self.timelines.cancelled(utterance)  # before the track forgets how much of it played
            self._drop(utterance)
            self.send(protocol.Cancelled(id=utterance.id, played_ms=heard.played_ms, heard_text=heard.heard_text,
                                         last_word=heard.last_word))
            self.services.metrics.utterances_total.labels("cancelled").inc()

    def _drop(self, utterance: Utterance) -> None:
        utterance.cancelled = True
        self._end(utterance)
        self.speaker.cancel_current(utterance)  # closes the audio stream, which aborts the engine request

    def _end(self, utterance: Utterance) -> None:
        self.utterances.pop(utterance.id, None)
        self.track.clear(utterance.id)
        self.timelines.forget(utterance.id)
        if not utterance.closed:
            self._abandoned[utterance.id] = None
            while len(self._abandoned) > MAX_ABANDONED_IDS:
                del self._abandoned[next(iter(self._abandoned))]

    def _fail(self, utterance: Utterance, code: str, message: str, outcome: str = "failed",
              retry_after_s: float | None = None) -> None:
        """End an utterance with an `error` event naming it."""
        self._end(utterance)
        self.send_error(code, message, utterance.id, retry_after_s)
        self.services.metrics.utterances_total.labels(outcome).inc()

    # --- lifetime ---------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Close sessions that never connected, went quiet (idle, or a vanished peer) or ran too long."""
        config = self.config
        timeouts = [t for t in (config.session_idle_timeout_s, config.heartbeat_timeout_s,
                                config.session_connect_timeout_s, config.max_session_s) if t > 0]
        if not timeouts:
            return
        check_every = min(timeouts) / WATCH_CHECKS_PER_TIMEOUT
        while not self.closed:
            await asyncio.sleep(check_every)
            reason = self.expired(config, time.monotonic())
            if reason is not None:
                code, message = reason
                log.info("session %s: %s (%s); closing", self.id, message, code)
                await self.end(code, message)
                return

    def expired(self, config: GatewayConfig, now: float) -> tuple[str, str] | None:
        """(code, message) of the limit this session has run past, if any."""
        age, quiet = now - self.created_at, now - self.last_message_at
        if 0 < config.session_connect_timeout_s < age:
            if self.expect_channel and self.channel is None:
                return "connect_timeout", f"the data channel did not open within {config.session_connect_timeout_s:g} s"
            if not self.expect_channel and not self.peer_connected:
                return "connect_timeout", f"the peer did not connect within {config.session_connect_timeout_s:g} s"
        if 0 < config.max_session_s < age:
            return "session_time_limit", f"sessions are limited to {config.max_session_s:g} s; connect again"
        if self.heartbeat_armed and 0 < config.heartbeat_timeout_s < quiet:
            return "heartbeat_timeout", f"no ping for {quiet:.1f} s"
        if 0 < config.session_idle_timeout_s < quiet and not self.utterances:
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
        except TimeoutError:
            channel.remove_listener("bufferedamountlow", drained.set)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for utterance in list(self.utterances.values()):
            self._drop(utterance)
        self.speaker.clear_pending()
        self.timelines.close()
        current = asyncio.current_task()
        for task in (*self.speaker.tasks(), *self._prefetches, self._watchdog):
            if task is not current and not task.done():
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
            if self._on_closed is not None:
                self._on_closed(self)


def _checked(rule: Callable[..., _R], *args: object, utterance_id: str | None, **kwargs: object) -> _R:
    """A speech rule's verdict as a protocol error naming the utterance."""
    try:
        return rule(*args, **kwargs)
    except InvalidRequestError as exc:
        raise ProtocolError(exc.code, str(exc), utterance_id) from None
