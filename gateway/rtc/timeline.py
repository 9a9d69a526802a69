"""The utterance timelines of a session (any session, lesson or not): word timings and visemes per sentence,
where they sit in the RTP stream, what the listener heard of an utterance, playback rate, and repeats from the
session's recordings.

The path of an utterance's audio: synthesis (or a recording, for a repeat) -> `UtteranceFeed` (stretch to the
utterance's `rate` with `TimeStretcher`, pitch kept; a `SentenceStart` marker exactly at each sentence's
first stretched sample; each sentence's PCM kept as made) -> `PlayoutTrack`. Once a sentence's audio is complete its
timings are made off the event loop (`timings.TimingService`); they go out as `words` + `visemes` when they are
ready and the sentence has started playing (its `segment` left), so each carries the exact RTP timestamp of the
sentence's first sample (`RtpClock`). Hard guarantee: a sentence's `words`/`visemes` are sent after its
`segment` and before the next `segment` or the utterance's `done`; a sentence whose timings are not made by then
gets estimated ones on the spot (~1 ms). Times are on the utterance's audio timeline: ms of its played audio from
its first sample, at its rate (timings are made at rate 1 and divided by the rate).

Heard report: `cancelled` and `done` carry how much audio left the server (`played_ms`) and the whole words within
it (`heard_text`, `last_word`). `played` messages from the page go to a metric.

Owns: `UtteranceTimelines` (one per session), `Timeline` (one per playing utterance), `UtteranceFeed`,
`SentenceStart` (the playout marker at each sentence's first sample) and `Heard` (the heard report).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from aiortc import RTCPeerConnection

from gateway.media.errors import InvalidRateError
from gateway.media.output_frames import FRAME_SAMPLES, SAMPLE_RATE_OUT
from gateway.media.playout import PlayoutTrack
from gateway.media.playout_events import Marker
from gateway.media.stretch import LESSON_RATE_RANGE, TimeStretcher, check_rate
from gateway.orpheus import SAMPLE_RATE, SentenceSplitter
from gateway.rtc import protocol
from gateway.rtc.errors import ProtocolError
from gateway.rtc.protocol import Played, Repeat
from gateway.rtc.replay import Recording, ReplayCache, Sentence, plan
from gateway.rtc.rtpclock import RtpClock
from gateway.rtc.services import SessionServices
from gateway.rtc.timings import SentenceTimings, estimate, timing_service
from gateway.rtc.utterance import ReplayPlan, Utterance
from gateway.timing import split_words

log = logging.getLogger(__name__)

OUT_PER_IN = SAMPLE_RATE_OUT // SAMPLE_RATE  # the playout track's samples per sample pushed (2)
REPLAY_CHUNK = SAMPLE_RATE // 2  # a repeat's audio goes to the track in 0.5 s steps (its stretch stays short)
MAX_REPEAT_COUNTERS = 256  # ids whose repeats are counted (for "<id>#r<n>"), newest kept


@dataclass(frozen=True, slots=True)
class SentenceStart(Marker):
    """The playout marker at sentence `index`'s first sample: the `segment` event goes out when it plays."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class Heard:
    """What the listener heard of an utterance, for `done` and `cancelled`: `played_ms` of its audio left the
    server, `heard_text` is its text to the end of the last whole word within it, `last_word` that word's index."""

    played_ms: float
    heard_text: str = ""
    last_word: int = -1


@dataclass(eq=False)
class SentenceState:
    """A sentence of a playing utterance: its recording and where it is in the playout."""

    sentence: Sentence
    in_start: int  # samples as made (24 kHz, rate 1) before it in the utterance
    target: int  # where its first sample lands once stretched (24 kHz samples of the utterance)
    out_start: int | None = None  # where its segment marker was placed (normally == target)
    chunks: list[np.ndarray] = field(default_factory=list)
    rtp_timestamp: int | None = None
    playing: bool = False  # its segment left
    sent: bool = False  # its words and visemes left


@dataclass(eq=False)
class Timeline:
    """A playing utterance's sentences and timings."""

    utterance: Utterance
    language: str
    sentences: list[SentenceState] = field(default_factory=list)
    rtp_start: int | None = None

    @property
    def rate(self) -> float:
        return self.utterance.rate


class UtteranceTimelines:
    """One session's timings, heard reports, rates and repeats. `track` is set by the session once made."""

    def __init__(self, services: SessionServices, pc: RTCPeerConnection,
                 send: Callable[[protocol.Event], None]) -> None:
        config = services.config
        self.config = config
        self.metrics = services.metrics
        self.send = send
        self.track: PlayoutTrack | None = None
        self.timings = timing_service(config.aligner_model)
        self.cache = ReplayCache(config.replay_cache_utterances, config.replay_cache_s)
        self.rtp = RtpClock(pc)
        self.by_id: dict[str, Timeline] = {}  # utterances begun on the track, until they finish or end
        self._repeats: dict[str, int] = {}  # repeats made of each recording (for "<id>#r<n>")
        self._tasks: set[asyncio.Task[None]] = set()

    def language(self, voice: str) -> str:
        return self.config.language_of(voice)

    # --- messages -------------------------------------------------------------------------------------------
    @staticmethod
    def check_rate(value: object, utterance_id: str) -> float:
        try:
            return check_rate(value, *LESSON_RATE_RANGE, "rate")
        except InvalidRateError as exc:
            raise ProtocolError("invalid_rate", str(exc), utterance_id) from None

    def repeat(self, message: Repeat) -> Utterance:
        """A new utterance playing (words of) recording `message.id` again; ProtocolError if it cannot."""
        new_id = message.new_id or f"{message.id}#r{self._repeats.get(message.id, 0) + 1}"
        rate = self.check_rate(message.rate, new_id)
        recording = self.cache.get(message.id)
        if recording is None:
            raise ProtocolError("unknown_id", f"no recording of utterance {message.id!r} to repeat: a session keeps "
                                f"its last {self.cache.max_utterances} utterances whose audio was complete "
                                f"({self.cache.max_seconds:g} s of audio at most)", new_id)
        try:
            pieces, text_start = plan(recording, message.from_word, message.to_word,
                                      lambda s: self._timings_now(recording.text, s, recording.language))
        except ValueError as exc:
            raise ProtocolError("invalid_range", str(exc), new_id) from None
        self._repeats[message.id] = self._repeats.get(message.id, 0) + 1
        while len(self._repeats) > MAX_REPEAT_COUNTERS:  # the oldest ids' counters go (their recordings are gone)
            del self._repeats[next(iter(self._repeats))]
        utterance = Utterance(new_id, recording.voice, time.monotonic(), SentenceSplitter(), rate=rate,
                              replay=ReplayPlan(pieces, text_start))
        utterance.text = recording.text
        utterance.closed = True
        return utterance

    def played(self, message: Played) -> None:
        self.metrics.client_played_seconds.observe(message.played_ms / 1000)

    # --- audio in -------------------------------------------------------------------------------------------
    def feed(self, utterance: Utterance, jitter_buffer_ms: int) -> UtteranceFeed:
        """Begin the utterance on the track; its audio goes in through the feed."""
        assert self.track is not None
        self.track.begin_utterance(utterance.id, jitter_buffer_ms)
        timeline = Timeline(utterance, self.language(utterance.voice))
        self.by_id[utterance.id] = timeline
        return UtteranceFeed(self, timeline, self.track)

    def sentence_complete(self, timeline: Timeline, state: SentenceState) -> None:
        """The sentence's audio is all made: make its timings off the loop."""
        sentence = state.sentence
        if sentence.pcm is None:
            sentence.pcm = np.concatenate(state.chunks) if state.chunks else np.zeros(0, np.int16)
            state.chunks = []
        if sentence.timings is None:
            task = asyncio.create_task(self._make_timings(timeline, state))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _make_timings(self, timeline: Timeline, state: SentenceState) -> None:
        sentence = state.sentence
        assert sentence.pcm is not None
        text = timeline.utterance.text[sentence.char_start:sentence.char_end]
        try:
            timings = await self.timings.sentence(text, sentence.pcm, sentence.language or timeline.language)
        except Exception:  # a bug here costs this sentence's timings, made again on the spot when they are due
            log.exception("word timings failed for %r", text)
            return
        if sentence.timings is None:
            self._set_timings(sentence, _shifted(timings, sentence.char_start))
        if self.by_id.get(timeline.utterance.id) is timeline:
            self._flush(timeline, state, force=False)

    def recorded(self, timeline: Timeline) -> None:
        """All the utterance's audio is made: keep it for `repeat` (not a repeat's own)."""
        utterance = timeline.utterance
        if utterance.replay is None:
            self.cache.put(Recording(utterance.id, utterance.text, utterance.voice, timeline.language,
                                     [state.sentence for state in timeline.sentences]))

    # --- playout events -------------------------------------------------------------------------------------
    def started(self, utterance_id: str, pts: int) -> int | None:
        """The utterance's first frame left at `pts`: the RTP timestamp of its first sample."""
        timeline = self.by_id.get(utterance_id)
        rtp = self.rtp.timestamp(pts)
        if timeline is not None:
            timeline.rtp_start = rtp
        return rtp

    def before_segment(self, utterance_id: str, index: int) -> None:
        """Sentence `index` starts: every earlier sentence's timings go out first."""
        timeline = self.by_id.get(utterance_id)
        if timeline is not None:
            for state in timeline.sentences[:index]:
                self._flush(timeline, state, force=True)

    def segment_playing(self, utterance_id: str, index: int, pts: int) -> None:
        """Sentence `index`'s first sample is in the frame that left at `pts`."""
        timeline = self.by_id.get(utterance_id)
        if timeline is None or index >= len(timeline.sentences):
            return
        state = timeline.sentences[index]
        offset = (OUT_PER_IN * (state.out_start or 0)) % FRAME_SAMPLES  # the sample's place in its frame
        state.rtp_timestamp = self.rtp.timestamp(pts + offset)
        state.playing = True
        self._flush(timeline, state, force=False)

    def finished(self, utterance_id: str, audio_ms: float) -> Heard:
        """Its last frame left: what is still due goes out, then the heard report for `done`."""
        timeline = self.by_id.pop(utterance_id, None)
        if timeline is None:
            return Heard(audio_ms)
        for state in timeline.sentences:
            self._flush(timeline, state, force=True)
        return self._heard(timeline, audio_ms)

    def cancelled(self, utterance: Utterance) -> Heard:
        """The heard report for `cancelled` (call before the track drops the utterance)."""
        timeline = self.by_id.pop(utterance.id, None)
        played = self.track.played_ms(utterance.id) if self.track is not None else None
        if timeline is None or not played:
            return Heard(float(played or 0))
        return self._heard(timeline, played)

    def forget(self, utterance_id: str) -> None:
        self.by_id.pop(utterance_id, None)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.by_id.clear()

    # --- internals ------------------------------------------------------------------------------------------
    def _set_timings(self, sentence: Sentence, timings: SentenceTimings) -> None:
        sentence.timings = timings
        self.metrics.word_timings_total.labels(timings.source).inc()

    def _timings_now(self, text: str, sentence: Sentence, language: str) -> SentenceTimings:
        """The sentence's timings, estimated here and now if they are not made yet (its audio is complete)."""
        if sentence.timings is None:
            assert sentence.pcm is not None
            raw = estimate(text[sentence.char_start:sentence.char_end], sentence.pcm, sentence.language or language)
            self._set_timings(sentence, _shifted(raw, sentence.char_start))
        assert sentence.timings is not None
        return sentence.timings

    def _flush(self, timeline: Timeline, state: SentenceState, *, force: bool) -> None:
        """Send the sentence's words and visemes if it plays and they are made (`force`: make them now)."""
        if state.sent or not state.playing:
            return
        sentence = state.sentence
        if sentence.timings is None:
            if not force or sentence.pcm is None:
                return
            self._timings_now(timeline.utterance.text, sentence, timeline.language)
        timings = sentence.timings
        assert timings is not None and state.out_start is not None
        state.sent = True
        rate = timeline.rate
        base_ms = state.out_start * 1000 / SAMPLE_RATE
        uid = timeline.utterance.id
        start_ms = round(base_ms)
        self.send(protocol.Words(
            id=uid, index=sentence.index, start_ms=start_ms, rtp_timestamp=state.rtp_timestamp,
            source=timings.source, first_word=sentence.first_word,  # type: ignore[arg-type]
            words=[protocol.Word(text=w.text, char_start=w.char_start, char_end=w.char_end,
                                 start_ms=round(base_ms + w.start_ms / rate), duration_ms=round(w.duration_ms / rate))
                   for w in timings.words]))
        self.send(protocol.Visemes(
            id=uid, index=sentence.index, start_ms=start_ms, rtp_timestamp=state.rtp_timestamp,
            visemes=[protocol.Viseme(viseme=v.viseme, start_ms=round(base_ms + v.start_ms / rate),
                                     duration_ms=round(v.duration_ms / rate), word=sentence.first_word + v.word_index)
                     for v in timings.visemes]))

    def _heard(self, timeline: Timeline, played_ms: float) -> Heard:
        """The whole words within the first `played_ms` of the utterance's audio."""
        utterance = timeline.utterance
        last_word, end_char = -1, None
        for state in timeline.sentences:
            if state.out_start is None:
                break
            base_ms = state.out_start * 1000 / SAMPLE_RATE
            sentence = state.sentence
            if base_ms >= played_ms or (sentence.timings is None and sentence.pcm is None):
                break
            timings = self._timings_now(utterance.text, sentence, timeline.language)
            for k, word in enumerate(timings.words):
                if base_ms + word.end_ms / timeline.rate > played_ms:
                    break
                last_word, end_char = sentence.first_word + k, word.char_end
            else:
                continue
            break
        text_start = utterance.replay.text_start if utterance.replay is not None else 0
        heard_text = utterance.text[text_start:end_char] if end_char is not None else ""
        return Heard(float(played_ms), heard_text, last_word)


class UtteranceFeed:
    """An utterance's audio on its way to the track: stretched to its rate, a `SentenceStart` marker exactly at each
    sentence's first sample, each sentence's audio kept (as made) for its timings and for repeats."""

    def __init__(self, timelines: UtteranceTimelines, timeline: Timeline, track: PlayoutTrack) -> None:
        self.timelines = timelines
        self.timeline = timeline
        self.track = track
        self.id = timeline.utterance.id
        rate = timeline.rate
        self.stretcher = None if rate == 1.0 else TimeStretcher(rate)
        self.in_samples = 0  # as made
        self.out_samples = 0  # pushed to the track (stretched)
        self._marks: deque[SentenceState] = deque()  # sentences whose first sample has not been pushed yet
        self._current: SentenceState | None = None
        self._words = 0  # words of the sentences so far (the next sentence's first word)

    def sentence(self, index: int, text: str, recorded: Sentence | None = None,
                 stored: SentenceTimings | None = None) -> None:
        """Sentence `index` starts here (`recorded`: a repeat's piece, its audio and timings known; `stored`: the
        phrase cache's timings of this sentence, offsets into its own text)."""
        self._complete()
        utterance = self.timeline.utterance
        if recorded is None:
            start, end = utterance.spans[index] if index < len(utterance.spans) else (0, 0)
            words = split_words(utterance.text[start:end])
            recorded = Sentence(index, text, start, end, self._words, len(words),
                                language=utterance.languages[index] if index < len(utterance.languages) else None)
            self._words += len(words)
            if stored is not None and len(stored.words) == len(words):  # the offsets of the text as sent here
                moved = [replace(w, text=t.text, char_start=t.char_start, char_end=t.char_end)
                         for w, t in zip(stored.words, words, strict=True)]
                recorded.timings = _shifted(SentenceTimings(moved, stored.visemes, stored.source), start)
        state = SentenceState(recorded, self.in_samples, round(self.in_samples / self.timeline.rate))
        self.timeline.sentences.append(state)
        self._current = state
        self._marks.append(state)
        self._push(np.zeros(0, np.int16))  # a mark due here goes in now

    def push(self, pcm: np.ndarray, last: bool = False) -> None:
        """Audio of the current sentence, as made; `last`: the sentence is complete."""
        state = self._current
        if state is None:  # audio before any sentence (not made by the synthesizer): a sentence of its own
            self.sentence(0, "")
            state = self._current
            assert state is not None
        if state.sentence.pcm is None:  # a repeat's piece already holds its audio
            state.chunks.append(pcm)
        self.in_samples += len(pcm)
        self._push(self.stretcher.process(pcm) if self.stretcher is not None else pcm)
        if last:
            self._complete()

    def end(self) -> None:
        """All audio is in: the stretcher's tail, the end of the utterance on the track, the recording kept."""
        self._complete()
        if self.stretcher is not None:
            self._push(self.stretcher.flush())
        while self._marks:  # sentences without audio (none from the synthesizer): marked at the end
            self._mark(self._marks.popleft())
        self.track.end_utterance(self.id)
        self.timelines.recorded(self.timeline)

    def _complete(self) -> None:
        state, self._current = self._current, None
        if state is not None and (state.sentence.pcm is None or state.sentence.timings is None):
            self.timelines.sentence_complete(self.timeline, state)

    def _push(self, out: np.ndarray) -> None:
        """Push stretched audio, cut where a sentence's first sample lands so its marker sits exactly there."""
        while self._marks and self._marks[0].target < self.out_samples + len(out) + (len(out) == 0):
            cut = min(len(out), max(0, self._marks[0].target - self.out_samples))
            if cut:
                self.track.push_pcm(self.id, out[:cut])
                self.out_samples += cut
                out = out[cut:]
            self._mark(self._marks.popleft())
        if len(out):
            self.track.push_pcm(self.id, out)
            self.out_samples += len(out)

    def _mark(self, state: SentenceState) -> None:
        state.out_start = self.out_samples
        sentence = state.sentence
        self.track.mark(self.id, SentenceStart(sentence.index, sentence.text))


def _shifted(timings: SentenceTimings, char_offset: int) -> SentenceTimings:
    """Timings of a sentence's text with their offsets moved into the utterance's text."""
    if not char_offset:
        return timings
    words = [replace(w, char_start=w.char_start + char_offset, char_end=w.char_end + char_offset)
             for w in timings.words]
    return SentenceTimings(words, timings.visemes, timings.source)


async def play_recording(feed: UtteranceFeed, plan_: ReplayPlan) -> None:
    """Play a repeat's pieces through its feed, yielding between steps (stretching is ~1 ms of CPU per second)."""
    for index, piece in enumerate(plan_.pieces):
        assert piece.pcm is not None
        feed.sentence(index, piece.text, recorded=piece)
        for start in range(0, max(1, len(piece.pcm)), REPLAY_CHUNK):
            feed.push(piece.pcm[start:start + REPLAY_CHUNK])
            await asyncio.sleep(0)
    feed.end()

