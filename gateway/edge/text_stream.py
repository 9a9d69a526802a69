"""Streaming text in, audio and word timings out, for the WebSocket doors: the contexts of one socket.

A context is one utterance (`gateway.rtc.utterance.Utterance`, the `speak` + `more: true` path): text pieces are
appended as they come, each sentence starts as soon as it is complete, and the last piece (or a flush) closes it.
Its audio comes from the shared `Synthesizer` as it is made, at the rate and sample format the client asked for
(`gateway.media.pcm_out.PcmOutput`); when a sentence's audio is complete its word timings are made
(`gateway.edge.word_times.WordClock`) and sent on the context's audio clock.

Every context ends exactly once, with `done` (all its audio was sent), `cancelled` (the client cancelled it or
the socket closed: its engine request is aborted), or an error (refused at admission, the engine failed). A
context holds an admission slot (the gateway's in-flight utterance limit) from its first text to its end.

The wire protocol (Cartesia's, `cartesia_ws`) maps its messages onto `ContextSet` and renders `StreamEvents`.
Owns: `ContextOptions`, `StreamContext`, `ContextSet`, `StreamEvents`, `DoorError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.edge.state import GatewayState
from gateway.edge.word_times import TimedWord, WordClock
from gateway.media.pcm_out import PcmOutput
from gateway.rtc.utterance import Utterance
from gateway.service.admission import Slot
from gateway.service.errors import CapacityError
from gateway.speech.errors import InvalidRequestError
from gateway.speech.synthesizer import Synthesizer, UtteranceStats
from gateway.speech.utterance_text import check_text

log = logging.getLogger(__name__)

# Outcomes: how a context ended (its one end event).
DONE = "done"
CANCELLED = "cancelled"
FAILED = "failed"


# A piece that ends a sentence here: the next piece, if it starts without a space, starts a new sentence (clients that
# send whole sentences, such as pipecat's, send none between them; token streams carry their own spaces).
_SENTENCE_END = tuple(".!?…;:。！？")


def joined(before: str, piece: str) -> str:
    """`piece` as appended to `before`: with a space in front where `before` ends a sentence and `piece` starts a
    word."""
    if before.endswith(_SENTENCE_END) and piece[:1].isalnum():
        return " " + piece
    return piece


class DoorError(Exception):
    """Bad input on a door (HTTP-less: it becomes the protocol's error message, the socket stays open)."""

    def __init__(self, code: str, message: str, status: int = 400, context_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.context_id = context_id  # the context it concerns (set by the wire protocol), None for the socket


@dataclass(frozen=True)
class ContextOptions:
    """What a context is made with (fixed at its first message)."""

    voice: str
    sample_rate: int
    encoding: str
    timestamps: bool


class StreamEvents(Protocol):
    """What a context tells its socket; each call sends one message (or none)."""

    async def audio(self, context: StreamContext, data: bytes) -> None: ...

    async def words(self, context: StreamContext, words: list[TimedWord]) -> None: ...

    async def ended(self, context: StreamContext, outcome: str, code: str | None, message: str | None) -> None: ...


@dataclass(eq=False)
class StreamContext:
    """One context: its text (an `Utterance`), its synthesis task and its output."""

    id: str
    options: ContextOptions
    utterance: Utterance
    slot: Slot
    task: asyncio.Task[None] | None = None
    outcome: str | None = None
    stats: UtteranceStats = field(default_factory=UtteranceStats)

    @property
    def closed(self) -> bool:
        return self.utterance.closed


class ContextSet:
    """The contexts of one socket, at most `max_contexts` at once, on the gateway's shared synthesizer."""

    def __init__(self, gateway: GatewayState, events: StreamEvents, path: str) -> None:
        self.gateway = gateway
        self.events = events
        self.path = path  # the metrics' label of this door
        self.max_contexts = gateway.config.max_queued_utterances
        self.contexts: dict[str, StreamContext] = {}
        self._send_lock = asyncio.Lock()  # one message at a time on the socket

    def synthesizer(self) -> Synthesizer:
        synthesizer = self.gateway.synthesizer
        if synthesizer is None or not self.gateway.ready:
            raise DoorError("engine_unavailable", "the speech engine is not ready", 503)
        return synthesizer

    def resolve_voice(self, voice: str | None, language: str | None = None) -> str:
        """The voice a context's `voice` and/or `language` (BCP-47 or ISO 639-1) route to, as the speech route's."""
        try:
            return self.synthesizer().resolve_voice(voice, language)
        except InvalidRequestError as exc:
            raise DoorError(exc.code, str(exc)) from None

    def append(self, context_id: str, text: str, more: bool, options: Callable[[], ContextOptions]) -> None:
        """Add text to context `context_id`, opening it (with `options()`) if it is not open; `more` False
        closes it. DoorError for text over the limit, a closed context, too many contexts or no capacity."""
        context = self.contexts.get(context_id)
        if context is not None and context.closed:
            raise DoorError("context_closed", f"context {context_id!r} has all its text; use a new context_id")
        so_far = context.utterance.text_chars if context is not None else 0
        try:
            check_text(text, self.gateway.config.max_text_chars, so_far=so_far, allow_empty=True)
        except InvalidRequestError as exc:
            if context is not None:  # an open context's text would be cut: the context ends with this error
                self._end_now(context)
            raise DoorError(exc.code, str(exc)) from None
        if context is None:
            context = self._open(context_id, options())
        context.utterance.add_text(joined(context.utterance.text, text), more)

    def cancel(self, context_id: str) -> None:
        context = self.contexts.get(context_id)
        if context is None:
            raise DoorError("unknown_context", f"no open context {context_id!r} to cancel")
        context.utterance.cancelled = True
        if context.task is not None:
            context.task.cancel()

    async def close(self) -> None:
        """The socket closed: cancel every open context (their engine requests are aborted) and wait for them."""
        tasks = []
        for context in list(self.contexts.values()):
            context.utterance.cancelled = True
            if context.task is not None:
                context.task.cancel()
                tasks.append(context.task)
        if tasks:
            await asyncio.wait(tasks)

    # --- internals ------------------------------------------------------------------------------------
    def _open(self, context_id: str, options: ContextOptions) -> StreamContext:
        if len(self.contexts) >= self.max_contexts:
            raise DoorError("too_many_contexts", f"at most {self.max_contexts} contexts may be open on one socket")
        self.synthesizer()  # refuse before taking a slot
        try:
            slot = self.gateway.admission.admit_stream(options.voice)
        except CapacityError as exc:
            self.gateway.metrics.refused(exc)
            raise DoorError(exc.code, str(exc), 503) from None
        utterance = Utterance(context_id, options.voice, time.monotonic())
        context = StreamContext(context_id, options, utterance, slot, stats=UtteranceStats(started=time.monotonic()))
        self.contexts[context_id] = context
        context.task = asyncio.create_task(self._run(context), name=f"context-{context_id}")
        # However the task ends, even cancelled before it ran: its slot and its id are given back.
        context.task.add_done_callback(lambda _task: self._forget(context))
        return context

    def _forget(self, context: StreamContext) -> None:
        """The context holds nothing any more; one that never ran to its end message counts as cancelled."""
        context.slot.release()
        if self.contexts.get(context.id) is context:
            del self.contexts[context.id]
        if context.outcome is None:
            context.outcome = CANCELLED
            self.gateway.metrics.stream_contexts_total.labels(CANCELLED).inc()

    def _end_now(self, context: StreamContext) -> None:
        """Refused text: the context is given up (cancelled, its engine request aborted); the caller reports."""
        context.utterance.cancelled = True
        context.outcome = FAILED  # the error the caller sends is its end
        self.gateway.metrics.stream_contexts_total.labels(FAILED).inc()
        self._forget(context)
        if context.task is not None:
            context.task.cancel()

    async def send(self, message: Awaitable[None]) -> None:
        """Send one message (an `events` call) after any being sent: the socket's messages never interleave."""
        async with self._send_lock:
            await message

    async def _run(self, context: StreamContext) -> None:
        outcome, code, message = DONE, None, None
        try:
            await self._synthesize(context)
        except (asyncio.CancelledError, ConnectionError):  # cancelled, or the client went away mid-send
            outcome = CANCELLED
        except (InvalidRequestError, RuntimeError) as exc:  # RuntimeError: an engine error or a failed SNAC decode
            log.warning("context %s failed: %s", context.id, exc)
            outcome, code, message = FAILED, getattr(exc, "code", "synthesis_failed"), str(exc)
        except Exception:  # a bug costs this context (reported), never the socket
            log.exception("context %s failed", context.id)
            outcome, code, message = FAILED, "internal_error", "the context could not be synthesised"
        finally:
            stats = context.stats
            if stats.first_audio_at is not None:
                self.gateway.metrics.observe_synthesis(stats.tokens, stats.audio_s, stats.synthesis_s)
        if context.outcome is None:  # not already ended by a refused message
            context.outcome = outcome
            self.gateway.metrics.stream_contexts_total.labels(outcome).inc()
            self._forget(context)  # before its end message: the client may reuse the id at once
            with contextlib.suppress(ConnectionError, RuntimeError):  # the socket is gone: nobody to tell
                await self.send(self.events.ended(context, outcome, code, message))

    async def _synthesize(self, context: StreamContext) -> None:
        synthesizer = self.synthesizer()
        options = context.options
        output = PcmOutput(options.sample_rate, options.encoding)
        clock = WordClock(self.gateway.config, options.voice) if options.timestamps else None
        stats = context.stats
        chunks = synthesizer.utterance(context.utterance.sentence_stream(), options.voice, stats=stats)
        first = True
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if first and stats.first_audio_at is not None:
                    self.gateway.metrics.ttfa_seconds.labels(self.path).observe(stats.first_audio_at - stats.started)
                    first = False
                data = output.feed(chunk.pcm)
                if data:
                    await self.send(self.events.audio(context, data))
                if clock is not None and (words := await clock.add(chunk)):
                    await self.send(self.events.words(context, words))
        tail = output.finish()
        if tail:
            await self.send(self.events.audio(context, tail))
