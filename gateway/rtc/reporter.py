"""Playout events to protocol events and metrics: what the student hears, not what the engine made. The lesson
hooks in at each of them: the RTP timestamp of `started`, the timings due around each `segment`, the heard report of
`done`."""

from __future__ import annotations

from collections.abc import Callable

from gateway.media.playout import PlayoutEvent, PlayoutEventKind
from gateway.rtc import protocol
from gateway.rtc.lesson import SEGMENT_MARKER, Lesson
from gateway.rtc.utterance import Utterance
from gateway.service.metrics import Metrics


class PlayoutReporter:
    """`started` when an utterance's first audio leaves (with where its time went), `segment` at each
    sentence's first sample, `done` after its last; a finished utterance leaves the session's table."""

    def __init__(self, metrics: Metrics, utterances: dict[str, Utterance],
                 send: Callable[[protocol.Event], None], lesson: Lesson) -> None:
        self.metrics = metrics
        self.utterances = utterances
        self.send = send
        self.lesson = lesson

    def on_playout_event(self, event: PlayoutEvent) -> None:
        utterance = self.utterances.get(event.utterance_id)
        if event.kind is PlayoutEventKind.STARTED:
            self.send(self._started(event, utterance))
        elif event.kind is PlayoutEventKind.MARKER and event.label == SEGMENT_MARKER:
            index, text = event.data
            self.lesson.before_segment(event.utterance_id, index)
            self.send(protocol.Segment(id=event.utterance_id, index=index, text=text))
            self.lesson.segment_playing(event.utterance_id, index, event.pts)
        elif event.kind is PlayoutEventKind.FINISHED:
            self.utterances.pop(event.utterance_id, None)
            self.metrics.utterances_total.labels("done").inc()
            self.metrics.underruns_total.inc(event.underruns)
            self.metrics.underrun_seconds_total.inc(event.underrun_ms / 1000)
            self.metrics.late_frames_total.inc(event.late_frames)
            heard = self.lesson.finished(event.utterance_id, event.audio_ms)  # sends the timings still due first
            self.send(protocol.Done(id=event.utterance_id, audio_ms=event.audio_ms, underruns=event.underruns,
                                    underrun_ms=event.underrun_ms, underrun_at_ms=list(event.underrun_at_ms),
                                    late_frames=event.late_frames, max_late_ms=event.max_late_ms, **heard))

    def _started(self, event: PlayoutEvent, utterance: Utterance | None) -> protocol.Started:
        rtp_timestamp = self.lesson.started(event.utterance_id, event.pts)
        if utterance is None:
            return protocol.Started(id=event.utterance_id, ttfa_ms=None, rtp_timestamp=rtp_timestamp)
        since = utterance.received_at
        stats = utterance.stats
        if utterance.replay is None:  # a repeat's start says nothing about the engine
            self.metrics.ttfa_seconds.labels("webrtc").observe(event.timestamp - since)
        # Where first audio's time went: first token from the engine, first window to SNAC, first audio out.
        return protocol.Started(id=event.utterance_id, ttfa_ms=_ms_since(since, event.timestamp),
                                ttft_ms=_ms_since(since, stats.first_token_at if stats else None),
                                ttfw_ms=_ms_since(since, stats.first_window_at if stats else None),
                                rtp_timestamp=rtp_timestamp)


def _ms_since(start: float, at: float | None) -> float | None:
    return None if at is None else round((at - start) * 1000, 1)
