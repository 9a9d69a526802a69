"""Per-session paced audio track with a per-utterance jitter buffer.

The session pushes TTS PCM (24 kHz mono int16) as it is produced; aiortc's RTP sender calls
:meth:`PlayoutTrack.recv` in a loop, so the track owns the clock: frame ``k`` leaves at ``t0 + k * 20 ms``, silence
when no audio is ready, and the RTP stream never stalls. Utterances play back to back in the order begun, each with
its own jitter buffer (it starts once ``jitter_buffer_ms`` of its audio is in, or it has ended). Running dry after the
start is an underrun (silence sent and counted; play resumes with the next whole frame, no re-buffering), except
after the last whole frame of an utterance whose end then arrives. An utterance ready while the track idles starts
at once instead of at the next slot (TTFA 0-20 ms sooner). The start counts pushed (input) audio, so the
resampler's filter delay never holds it back. Each utterance's audio is resampled and cut into whole 20 ms frames
by its `output_frames.FrameCutter`; this track decides when each frame leaves.

Call everything from the event loop that runs ``recv``, except :meth:`PlayoutTrack.lead_s` (the SNAC decoder's
thread reads it, lock-free). One consumer: fan out with ``aiortc.contrib.media.MediaRelay``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from gateway.config import JITTER_BUFFER_MAX_MS
from gateway.media.output_frames import (
    CHANNEL_LAYOUT,
    FRAME_BYTES,
    FRAME_MS,
    FRAME_SAMPLES,
    FRAME_SECONDS,
    MS_PER_SECOND,
    SAMPLE_FORMAT,
    SAMPLE_RATE_OUT,
    TIME_BASE,
    FrameCutter,
    FramePayload,
)
from gateway.media.playout_events import (
    Marker,
    MarkerReached,
    PlayoutEvent,
    PlayoutStats,
    UtteranceFinished,
    UtteranceStarted,
)
from gateway.orpheus import SAMPLE_RATE

__all__ = [
    "SAMPLE_RATE_IN",
    "PlayoutTrack",
]

logger = logging.getLogger(__name__)

# The output format (48 kHz mono s16, 20 ms frames) is `output_frames`'.
SAMPLE_RATE_IN = SAMPLE_RATE  # the input: SNAC's 24 kHz mono int16 PCM (gateway.orpheus)
MIN_JITTER_BUFFER_MS = 0  # ms of an utterance's audio queued before it starts; the maximum is the configuration's

# A frame late by less than this is sent at once and the frames after it catch up with the clock (receivers'
# jitter buffers absorb a short burst; re-anchoring on every late frame played a busy loop's audio slower than real
# time). Later than this the loop really stalled: re-anchor instead of bursting the backlog
# (docs/decisions/playout-clock.md).
REANCHOR_LATENESS_S = 10 * FRAME_SECONDS
# An audio frame handed to the sender this much after its slot counts as sent late (`late_frames`): the server's
# share of the delivery lateness a listener's jitter buffer must absorb. Half a frame, as the bench's stall tolerance.
LATE_FRAME_S = FRAME_SECONDS / 2

# Log the first few internal errors with a traceback, then only count them (no flood at 50 lines/s per track).
MAX_LOGGED_ERRORS = 5
MAX_UNDERRUNS_LISTED = 16  # underrun positions a finished utterance reports (its count has them all)

_SILENCE = bytes(FRAME_BYTES)  # built once: every silence frame copies from this


@dataclass(slots=True, eq=False)
class _Utterance:
    utterance_id: str
    start_threshold_in: int  # input samples pushed before playback may start
    cut: FrameCutter  # its pushed audio as whole output frames (`cut.frames`, `cut.in_samples`)
    # (frame index within the utterance, marker); indices are monotonic.
    markers: deque[tuple[int, Marker]] = field(default_factory=deque)
    frames_played: int = 0
    ended: bool = False
    started: bool = False
    in_underrun: bool = False
    underruns: int = 0
    underrun_frames: int = 0
    current_underrun_frames: int = 0  # frames of the underrun under way
    # Audio played (frames) when each underrun began, the first MAX_UNDERRUNS_LISTED: whether a stream runs dry at
    # its start, between sentences or waiting for its end tells which part of synthesis was late.
    underrun_at: list[int] = field(default_factory=list)
    late_frames: int = 0
    max_late_s: float = 0.0


def _startable(utt: _Utterance) -> bool:
    """An unstarted utterance may start: a whole frame is queued and its jitter buffer is full (or it has ended),
    or it ended with no audio at all (it finishes at once)."""
    if utt.cut.frames:
        return utt.ended or utt.cut.in_samples >= utt.start_threshold_in
    return utt.ended


def _resolve(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


class PlayoutTrack(MediaStreamTrack):
    """A live audio track that paces itself and plays queued utterances.

    :param on_event: called synchronously from ``recv`` with each `PlayoutEvent`;
        exceptions are logged and counted, never propagated into aiortc.
    :param pace: sleep until each frame's slot (the normal case). Tests may
        pass ``False`` to get frames as fast as they ask.
    :param clock: monotonic clock in seconds used for pacing and event
        timestamps.
    :param input_sample_rate: rate of the PCM given to :meth:`push_pcm`.
    """

    kind = "audio"

    def __init__(
        self,
        on_event: Callable[[PlayoutEvent], None] | None = None,
        *,
        pace: bool = True,
        clock: Callable[[], float] = time.monotonic,
        input_sample_rate: int = SAMPLE_RATE_IN,
    ) -> None:
        super().__init__()
        if input_sample_rate <= 0:
            raise ValueError(f"input_sample_rate must be > 0, got {input_sample_rate}")
        self._on_event = on_event
        self._pace = pace
        self._clock = clock
        self._in_rate = input_sample_rate

        self._queue: deque[_Utterance] = deque()
        self._by_id: dict[str, _Utterance] = {}
        self._pending_events: list[PlayoutEvent] = []
        self._event_time = 0.0  # clock at the current recv, shared by its events
        self._slot_lateness = 0.0  # how long after its slot the current recv's frame is handed over
        # The sleeping recv's wake-up (`_sleep_until_slot`), and whether the frame before it was silence: an
        # utterance that becomes ready while the track idles resolves it early (`_start_early`).
        self._slot_waiter: asyncio.Future[bool] | None = None
        self._last_silent = True
        # Set by clear() when the playing utterance is dropped: the next frame
        # must be silence even if another utterance is ready.
        self._force_silence = False

        # Pacing: frame n is due at _anchor_time + (n - _anchor_frame) * 20 ms.
        self._anchor_time: float | None = None
        self._anchor_frame = 0

        self._frames_sent = 0
        self._silence_frames = 0
        self._underruns = 0
        self._underrun_frames = 0
        self._reanchors = 0
        self._early_starts = 0
        self._queued_frames = 0
        self._errors = 0
        self._callback_errors = 0

    # ------------------------------------------------------------------ input

    def begin_utterance(self, utterance_id: str, jitter_buffer_ms: float) -> None:
        """Queue a new utterance behind the ones already begun.

        Raises ``ValueError`` for an out-of-range jitter buffer or an id that is
        still queued/playing.
        """
        if isinstance(jitter_buffer_ms, bool) or not (MIN_JITTER_BUFFER_MS <= jitter_buffer_ms <= JITTER_BUFFER_MAX_MS):
            raise ValueError(
                f"jitter_buffer_ms must be between {MIN_JITTER_BUFFER_MS} and "
                f"{JITTER_BUFFER_MAX_MS} ms, got {jitter_buffer_ms!r}"
            )
        if utterance_id in self._by_id:
            raise ValueError(f"utterance {utterance_id!r} is already queued")
        if self.readyState != "live":
            raise MediaStreamError("track is stopped")
        utt = _Utterance(
            utterance_id=utterance_id,
            start_threshold_in=math.ceil(jitter_buffer_ms * self._in_rate / MS_PER_SECOND),
            cut=FrameCutter(self._in_rate),
        )
        self._queue.append(utt)
        self._by_id[utterance_id] = utt

    def push_pcm(self, utterance_id: str, pcm: np.ndarray) -> bool:
        """Append mono int16 PCM (any length) to an utterance.

        Returns ``False`` (and drops the audio) if the utterance is not queued,
        e.g. it was just cleared by a barge-in while TTS was still producing.
        Raises ``ValueError`` for bad PCM or an utterance that was ended.
        """
        utt = self._by_id.get(utterance_id)
        if utt is None:
            logger.debug("push_pcm for unknown utterance %r dropped", utterance_id)
            return False
        if utt.ended:
            raise ValueError(f"utterance {utterance_id!r} was already ended")
        self._queued_frames += utt.cut.push(pcm)
        self._start_early(utt)
        return True

    def mark(self, utterance_id: str, marker: Marker) -> bool:
        """Insert a marker after the audio pushed so far to that utterance.

        It is reported when the frame containing the next sample is returned
        (or with the last frame, if no audio follows). Returns ``False`` if the
        utterance is not queued.
        """
        utt = self._by_id.get(utterance_id)
        if utt is None:
            return False
        if utt.ended:
            raise ValueError(f"utterance {utterance_id!r} was already ended")
        utt.markers.append((utt.cut.next_frame_index(), marker))
        return True

    def end_utterance(self, utterance_id: str) -> bool:
        """No more audio for this utterance: flush and pad its last frame.

        Idempotent. Returns ``False`` if the utterance is not queued.
        """
        utt = self._by_id.get(utterance_id)
        if utt is None:
            return False
        if utt.ended:
            return True
        waited_for_the_end = utt.in_underrun and not utt.cut.frames  # dry, and no whole frame came since
        self._queued_frames += utt.cut.end()
        if waited_for_the_end:
            self._uncount_underrun(utt)
        utt.ended = True
        self._start_early(utt)
        return True

    def clear(self, utterance_id: str | None = None) -> list[str]:
        """Barge-in/cancel: drop one utterance (or all) and return the dropped ids.

        Dropped utterances emit no further events. If the playing utterance is
        dropped, the next frame returned is silence.
        """
        if utterance_id is None:
            victims = list(self._queue)
        else:
            utt = self._by_id.get(utterance_id)
            victims = [] if utt is None else [utt]
        for utt in victims:
            if utt.started:
                self._force_silence = True
            self._queue.remove(utt)
            self._drop(utt)
        return [utt.utterance_id for utt in victims]

    # ------------------------------------------------------------- inspection

    @property
    def playing_utterance_id(self) -> str | None:
        """The utterance currently being played (started, not finished)."""
        if self._queue and self._queue[0].started:
            return self._queue[0].utterance_id
        return None

    def lead_s(self, utterance_id: str) -> float | None:
        """How long the listener can go on before it needs more of this utterance than is queued: once it plays,
        its queued audio; before, the audio of the utterances ahead of it plus what it will hold when it starts
        (its queued audio, at least its jitter buffer: a listener waiting for the buffer to fill cannot run dry,
        only start later); None when it is not queued (finished or dropped).

        The synthesis deadline of a listener's stream. A clock since the first audio plus the jitter buffer
        misses that playback starts once the buffer is full, sooner when the bridge fills it fast, and every
        underrun since. Read from the SNAC decoder's thread without a lock: a dict lookup, flags, deque lengths
        and one copy of the queue (a single C call under CPython's GIL; a free-threaded build would need a lock
        here); a figure off by a frame is harmless.
        """
        utt = self._by_id.get(utterance_id)
        if utt is None:
            return None
        own = len(utt.cut.frames) * FRAME_SECONDS
        if utt.started:
            return own
        ahead = 0
        for other in tuple(self._queue):
            if other is utt:
                break
            ahead += len(other.cut.frames)
        else:
            return None  # dropped or finished since the lookup above
        return ahead * FRAME_SECONDS + max(own, utt.start_threshold_in / self._in_rate)

    def lead_runs(self, utterance_id: str) -> bool:
        """Whether `lead_s` is running down now: the listener plays this utterance, or one ahead of it. Not while
        it waits for this one's first audio or for its jitter buffer to fill: that lead holds until the audio
        comes (a remote decoder, which models the lead between reports, must not run it down). True for an
        utterance not queued (nothing to hold for). Called on the event loop, unlike `lead_s`: no copy needed."""
        utt = self._by_id.get(utterance_id)
        if utt is None or utt.started:
            return True
        return bool(self._queue) and self._queue[0] is not utt and self._queue[0].started

    def played_ms(self, utterance_id: str) -> int | None:
        """Audio of a queued utterance returned so far (underrun silence not counted); None if not queued."""
        utt = self._by_id.get(utterance_id)
        return None if utt is None else utt.frames_played * FRAME_MS

    def stats(self) -> PlayoutStats:
        return PlayoutStats(
            frames_sent=self._frames_sent,
            silence_frames=self._silence_frames,
            underruns=self._underruns,
            underrun_ms=self._underrun_frames * FRAME_MS,
            reanchors=self._reanchors,
            early_starts=self._early_starts,
            queued_ms=self._queued_frames * FRAME_MS,
            queued_utterances=len(self._queue),
            errors=self._errors,
            callback_errors=self._callback_errors,
        )

    # ---------------------------------------------------------- aiortc track

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._pace:
            self._slot_lateness = await self._wait_for_slot()
            # stop() may have been called while we slept.
            if self.readyState != "live":
                raise MediaStreamError

        self._event_time = self._clock()
        # An exception escaping recv ends aiortc's sender loop for good, so
        # anything unexpected degrades to one silent frame instead.
        try:
            payload = self._next_payload()
        except Exception:
            self._count_error("choosing the next frame")
            payload = _SILENCE
        self._last_silent = payload is _SILENCE
        if payload is _SILENCE:
            self._silence_frames += 1
        try:
            frame = self._make_frame(payload)
        except Exception:
            self._count_error("building a frame")
            frame = self._make_frame(_SILENCE)
        self._frames_sent += 1
        if self._pending_events:
            self._emit_pending()
        return frame

    def stop(self) -> None:
        super().stop()
        for utt in self._queue:
            self._drop(utt)
        self._queue.clear()
        self._pending_events.clear()
        self._on_event = None

    # -------------------------------------------------------------- internals

    async def _wait_for_slot(self) -> float:
        """Sleep until this frame's slot; returns how late after it the frame is handed over (>= 0 s)."""
        now = self._clock()
        if self._anchor_time is None:
            self._anchor_time = now
            self._anchor_frame = self._frames_sent
            return 0.0
        due = self._anchor_time + (self._frames_sent - self._anchor_frame) * FRAME_SECONDS
        delay = due - now
        if delay > 0:
            if await self._sleep_until_slot(delay):  # an utterance is ready while the track idles: it goes now
                self._anchor_time = self._clock()
                self._anchor_frame = self._frames_sent
                self._early_starts += 1
                return 0.0
            return max(0.0, self._clock() - due)  # the loop may wake us late
        if -delay > REANCHOR_LATENESS_S:
            # The loop (or the consumer) stalled: sending the backlog quickly
            # would only overflow the receiver's jitter buffer.
            self._anchor_time = now
            self._anchor_frame = self._frames_sent
            self._reanchors += 1
        return -delay

    async def _sleep_until_slot(self, delay: float) -> bool:
        """`asyncio.sleep(delay)` (the same future and timer), cut short by `_start_early`: True if it was."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(delay, _resolve, waiter, False)
        self._slot_waiter = waiter
        try:
            return await waiter
        finally:
            timer.cancel()
            self._slot_waiter = None

    def _start_early(self, utt: _Utterance) -> None:
        """`utt` got audio or its end: if it is next to play, can start, and the track idles (silence went out
        last, and no barge-in silence is due), wake the recv sleeping until its slot so its first frame goes now."""
        waiter = self._slot_waiter
        if waiter is None or waiter.done() or not self._last_silent or self._force_silence:
            return
        if self._queue and self._queue[0] is utt and not utt.started and _startable(utt):
            waiter.set_result(True)

    def _make_frame(self, payload: FramePayload) -> av.AudioFrame:
        frame = av.AudioFrame(format=SAMPLE_FORMAT, layout=CHANNEL_LAYOUT, samples=FRAME_SAMPLES)
        # update() memcpys and rejects anything but exactly FRAME_BYTES.
        frame.planes[0].update(payload)
        frame.pts = self._frames_sent * FRAME_SAMPLES
        frame.sample_rate = SAMPLE_RATE_OUT
        frame.time_base = TIME_BASE
        return frame

    def _next_payload(self) -> FramePayload:
        """Pick this slot's frame, advancing utterance state and queueing events."""
        if self._force_silence:
            self._force_silence = False
            return _SILENCE
        queue = self._queue
        while queue:
            utt = queue[0]
            if not utt.started:
                if not _startable(utt):
                    return _SILENCE  # pre-roll: still filling the buffer (jitter 0 waits for 1 frame)
                utt.started = True
                self._pending_events.append(UtteranceStarted(utt.utterance_id, self._event_time, self._pts()))
            if utt.cut.frames:
                payload = utt.cut.frames.popleft()
                self._queued_frames -= 1
                index = utt.frames_played
                utt.frames_played += 1
                utt.in_underrun = False
                if self._slot_lateness > LATE_FRAME_S:
                    utt.late_frames += 1
                utt.max_late_s = max(utt.max_late_s, self._slot_lateness)
                markers = utt.markers
                while markers and markers[0][0] <= index:
                    self._queue_marker(utt, markers.popleft())
                if utt.ended and not utt.cut.frames:
                    self._finish(utt)
                return payload
            if utt.ended:
                # Ended with nothing left (e.g. an empty utterance, or the end
                # arrived during an underrun): finish and try the next one.
                self._finish(utt)
                continue
            if not utt.in_underrun:
                utt.in_underrun = True
                utt.current_underrun_frames = 0
                utt.underruns += 1
                self._underruns += 1
                if len(utt.underrun_at) < MAX_UNDERRUNS_LISTED:
                    utt.underrun_at.append(utt.frames_played)
            utt.current_underrun_frames += 1
            utt.underrun_frames += 1
            self._underrun_frames += 1
            return _SILENCE
        return _SILENCE

    def _uncount_underrun(self, utt: _Utterance) -> None:
        """The end came during an underrun: it waited for the end, not for audio (the Speaker ends an utterance
        once the synthesizer has finished, a little after its last chunk). All that follows is the flushed
        remainder, the last <= 20.7 ms of input (the partial frame and the resampler's filter delay, which only
        the end releases): the listener heard the utterance out, not a gap inside it. Only gaps inside count."""
        utt.underruns -= 1
        self._underruns -= 1
        utt.underrun_frames -= utt.current_underrun_frames
        self._underrun_frames -= utt.current_underrun_frames
        if utt.underrun_at and utt.underrun_at[-1] == utt.frames_played:  # it was listed (one per frame position)
            utt.underrun_at.pop()
        utt.in_underrun = False

    def _finish(self, utt: _Utterance) -> None:
        while utt.markers:
            self._queue_marker(utt, utt.markers.popleft())
        self._queue.popleft()
        del self._by_id[utt.utterance_id]
        self._pending_events.append(
            UtteranceFinished(
                utterance_id=utt.utterance_id,
                timestamp=self._event_time,
                audio_ms=utt.frames_played * FRAME_MS,
                underruns=utt.underruns,
                underrun_ms=utt.underrun_frames * FRAME_MS,
                underrun_at_ms=tuple(frames * FRAME_MS for frames in utt.underrun_at),
                late_frames=utt.late_frames,
                max_late_ms=round(utt.max_late_s * MS_PER_SECOND, 1),
                pts=self._pts(),
            )
        )

    def _pts(self) -> int:
        """The pts of the frame this recv returns."""
        return self._frames_sent * FRAME_SAMPLES

    def _queue_marker(self, utt: _Utterance, marker: tuple[int, Marker]) -> None:
        self._pending_events.append(MarkerReached(utt.utterance_id, self._event_time, self._pts(), marker[1]))

    def _emit_pending(self) -> None:
        # Emitted only after the frame is chosen and state is consistent, so a
        # callback may safely call clear()/begin_utterance() re-entrantly.
        events = self._pending_events
        self._pending_events = []
        callback = self._on_event
        if callback is None:
            return
        for event in events:
            try:
                callback(event)
            except Exception:
                self._callback_errors += 1
                if self._callback_errors <= MAX_LOGGED_ERRORS:
                    logger.exception("playout on_event callback raised for %s", event)

    def _drop(self, utt: _Utterance) -> None:
        self._queued_frames -= utt.cut.drop()
        utt.markers.clear()
        self._by_id.pop(utt.utterance_id, None)

    def _count_error(self, what: str) -> None:
        self._errors += 1
        if self._errors <= MAX_LOGGED_ERRORS:
            logger.exception("playout error while %s; sending silence", what)
