"""Playout events to protocol events and metrics: what the student hears, not what the engine made. The utterance
timelines hook in at each of them: the RTP timestamp of `started`, the timings due around each `segment`, the heard
report of `done`."""

from __future__ import annotations

from collections.abc import Callable

from gateway.media.playout_events import MarkerReached, PlayoutEvent, UtteranceFinished, UtteranceStarted
from gateway.rtc import protocol
from gateway.rtc.timeline import SentenceStart, UtteranceTimelines
from gateway.rtc.utterance import Utterance
from gateway.service.metrics import Metrics


class PlayoutReporter:
    """`started` when an utterance's first audio leaves (with where its time went), `segment` at each
    sentence's first sample, `done` after its last; a finished utterance leaves the session's table."""

    def __init__(self, metrics: Metrics, utterances: dict[str, Utterance],
                 send: Callable[[protocol.Event], None], timelines: UtteranceTimelines) -> None:
        self.metrics = metrics
        self.utterances = utterances
        self.send = send
        self.timelines = timelines

    def on_playout_event(self, event: PlayoutEvent) -> None:
        match event:
            case UtteranceStarted():
                self.send(self._started(event, self.utterances.get(event.utterance_id)))
            case MarkerReached(marker=SentenceStart(index=index, text=text)):
                self.timelines.before_segment(event.utterance_id, index)
                self.send(protocol.Segment(id=event.utterance_id, index=index, text=text))
                self.timelines.segment_playing(event.utterance_id, index, event.pts)
            case UtteranceFinished():
                self._finished(event)

    def _finished(self, event: UtteranceFinished) -> None:
        self.utterances.pop(event.utterance_id, None)
        self.metrics.utterances_total.labels("done").inc()
        self.metrics.underruns_total.inc(event.underruns)
        self.metrics.underrun_seconds_total.inc(event.underrun_ms / 1000)
        self.metrics.late_frames_total.inc(event.late_frames)
        heard = self.timelines.finished(event.utterance_id, event.audio_ms)  # sends the timings still due first
        self.send(protocol.Done(id=event.utterance_id, audio_ms=event.audio_ms, underruns=event.underruns,
                                underrun_ms=event.underrun_ms, underrun_at_ms=list(event.underrun_at_ms),
                                late_frames=event.late_frames, max_late_ms=event.max_late_ms,
                                played_ms=heard.played_ms, heard_text=heard.heard_text, last_word=heard.last_word))

    def _started(self, event: UtteranceStarted, utterance: Utterance | None) -> protocol.Started:
        rtp_timestamp = self.timelines.started(event.utterance_id, event.pts)
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
