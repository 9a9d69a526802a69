"""A session's synthesis worker: its utterances, one after the other, from the shared synthesizer (or, for a
repeat, from a recording) through its timeline's feed (rate, sentence markers, timings) into its playout track."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Protocol

from gateway.media.playout import PlayoutTrack
from gateway.phrases.speech import CachedChunk, cached_sentences
from gateway.rtc.services import SessionServices
from gateway.rtc.timeline import UtteranceTimelines, play_recording
from gateway.rtc.timings import SentenceTimings
from gateway.rtc.utterance import Utterance
from gateway.service.errors import CapacityError
from gateway.speech.errors import EngineError, EngineUnavailableError, InvalidRequestError
from gateway.speech.synthesizer import UtteranceStats

log = logging.getLogger(__name__)

class FailUtterance(Protocol):
    """Ends an utterance with an `error` event naming it (the session's `_fail`)."""

    def __call__(self, utterance: Utterance, code: str, message: str, outcome: str = "failed",
                 retry_after_s: float | None = None) -> None: ...


class Speaker:
    """Takes queued utterances in order; each holds an admission slot while it synthesises (a repeat asks no
    engine and needs none), and a cancelled one is skipped. Cancelling the current one (`cancel_current`) closes
    its audio stream, which aborts its engine request."""

    def __init__(self, services: SessionServices, track: PlayoutTrack, jitter_buffer_ms: int, fail: FailUtterance,
                 name: str, timelines: UtteranceTimelines) -> None:
        self.services = services
        self.track = track
        self.timelines = timelines
        self.jitter_buffer_ms = jitter_buffer_ms
        self._fail = fail
        self.pending: asyncio.Queue[Utterance] = asyncio.Queue()
        self.current: Utterance | None = None
        self.skipped = 0  # utterances cancelled while they waited (never sent to the engine)
        self._task: asyncio.Task[None] | None = None
        self.worker = asyncio.create_task(self._run(), name=name)

    @property
    def waiting(self) -> int:
        """Utterances ahead of a newly queued one."""
        return self.pending.qsize() + (1 if self.current is not None else 0)

    def enqueue(self, utterance: Utterance) -> None:
        self.pending.put_nowait(utterance)
        self.services.metrics.queue_depth.inc()

    def cancel_current(self, utterance: Utterance) -> None:
        if utterance is self.current and self._task is not None:
            self._task.cancel()

    def clear_pending(self) -> None:
        while not self.pending.empty():
            self.pending.get_nowait()
            self.services.metrics.queue_depth.dec()

    def tasks(self) -> list[asyncio.Task[Any]]:
        return [t for t in (self._task, self.worker) if t is not None]

    async def _run(self) -> None:
        metrics = self.services.metrics
        while True:
            utterance = await self.pending.get()
            metrics.queue_depth.dec()
            if utterance.cancelled:
                self.skipped += 1
                continue
            slot = None
            if utterance.replay is None:
                try:
                    slot = self.services.admission.admit_stream(utterance.voice)
                except CapacityError as exc:
                    metrics.refused(exc)
                    self._fail(utterance, exc.code, str(exc), "rejected", retry_after_s=exc.retry_after_s)
                    continue
            self.current = utterance
            self._task = asyncio.create_task(self._synthesize(utterance))
            if slot is not None:  # released however the task ends, even when it is cancelled before it runs
                self._task.add_done_callback(lambda _task, slot=slot: slot.release())
            # wait() rather than await: a cancelled utterance must not look like a cancelled worker.
            await asyncio.wait([self._task])
            self.current = None
            self._task = None

    async def _synthesize(self, utterance: Utterance) -> None:
        if utterance.replay is not None:
            try:
                await play_recording(self.timelines.feed(utterance, self.jitter_buffer_ms), utterance.replay)
            except Exception:  # a bug must cost one utterance (reported), never the session's worker
                log.exception("%s: repeat %s failed", self.worker.get_name(), utterance.id)
                self._fail(utterance, "internal_error", "the utterance could not be repeated")
            return
        synthesizer = self.services.synthesizer()
        if synthesizer is None:
            self._fail(utterance, EngineUnavailableError.code, "the speech engine is still starting",
                       retry_after_s=EngineUnavailableError.retry_after_s)
            return
        feed = self.timelines.feed(utterance, self.jitter_buffer_ms)  # begins the utterance on the track
        # The decoder's deadline for this utterance is the track's: what it holds of it, or will when it starts.
        utterance.stats = stats = UtteranceStats(
            started=utterance.received_at, playout_lead_s=functools.partial(self.track.lead_s, utterance.id),
            playout_lead_runs=functools.partial(self.track.lead_runs, utterance.id))
        phrases = self.services.phrases
        # Hits from the phrase cache, misses made once; a mixed-language utterance's spans go to their own voices.
        if phrases is not None and phrases.applies(utterance.cache):
            chunks = cached_sentences(phrases, synthesizer, utterance.sentence_stream(), utterance.voice, stats=stats)
        else:
            chunks = synthesizer.utterance(utterance.sentence_stream(), utterance.voice, stats=stats)
        try:
            async for chunk in chunks:
                if chunk.first_of_sentence:
                    entry = chunk.entry if isinstance(chunk, CachedChunk) else None
                    stored = None if entry is None else SentenceTimings(entry.words, entry.visemes,
                                                                        entry.timing_source)
                    feed.sentence(chunk.sentence_index, chunk.sentence_text, stored=stored)
                feed.push(chunk.pcm, last=chunk.last_of_sentence)
            feed.end()
            self.services.metrics.observe_synthesis(stats.tokens, stats.audio_s, stats.synthesis_s)
        except (EngineError, InvalidRequestError, RuntimeError) as exc:
            # RuntimeError: the SNAC worker failed this utterance's decode batch.
            log.warning("%s: utterance %s failed: %s", self.worker.get_name(), utterance.id, exc)
            self._fail(utterance, getattr(exc, "code", "synthesis_failed"), str(exc),
                       retry_after_s=getattr(exc, "retry_after_s", None))
        except Exception:  # a bug must cost one utterance (reported), never the session's worker
            log.exception("%s: utterance %s failed", self.worker.get_name(), utterance.id)
            self._fail(utterance, "internal_error", "the utterance could not be synthesised")
