"""Tests for gateway.media.playout: frame format, pacing, resampling, jitter buffer, events."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import pytest
from aiortc.codecs.opus import OpusEncoder
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import compute_audio_level_dbov

from gateway.config import JITTER_BUFFER_MAX_MS
from gateway.media.output_frames import FRAME_MS, FRAME_SAMPLES, FRAME_SECONDS, SAMPLE_RATE_OUT
from gateway.media.playout import REANCHOR_LATENESS_S, SAMPLE_RATE_IN, PlayoutTrack
from gateway.media.playout_events import Marker, MarkerReached, PlayoutEvent, UtteranceFinished, UtteranceStarted
from tests.support import ManualClock

RATIO = SAMPLE_RATE_OUT // SAMPLE_RATE_IN
AMPLITUDE = 10000


def ms_of_pcm(ms: int, value: int = AMPLITUDE) -> np.ndarray:
    """Constant non-zero PCM at 24 kHz: easy to tell apart from silence."""
    return np.full(SAMPLE_RATE_IN * ms // 1000, value, dtype=np.int16)


def sine(n: int, freq: float = 1000.0, rate: int = SAMPLE_RATE_IN) -> np.ndarray:
    t = np.arange(n) / rate
    return np.round(AMPLITUDE * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def samples_of(frame: av.AudioFrame) -> np.ndarray:
    return frame.to_ndarray().reshape(-1)


def is_silent(frame: av.AudioFrame) -> bool:
    return not samples_of(frame).any()


@dataclass(frozen=True)
class Label(Marker):
    """A marker of these tests: a name, and what the caller wants back with it."""

    name: str
    sentence: int | None = None


def kinds(events: list[PlayoutEvent]) -> list[str]:
    names = []
    for event in events:
        match event:
            case UtteranceStarted():
                names.append("started")
            case MarkerReached(marker=Label(name=name)):
                names.append(f"marker:{name}")
            case UtteranceFinished():
                names.append("finished")
    return names


async def drain(track: PlayoutTrack, events: list[PlayoutEvent], utterance_id: str, limit: int = 10_000) -> list:
    """recv until `utterance_id` finishes; return its frames' samples."""
    out = []
    for _ in range(limit):
        frame = await track.recv()
        out.append(samples_of(frame))
        if any(isinstance(e, UtteranceFinished) and e.utterance_id == utterance_id for e in events):
            return out
    raise AssertionError(f"{utterance_id} never finished")


# ---------------------------------------------------------------- format


@pytest.mark.asyncio
async def test_frame_format_and_pts() -> None:
    track = PlayoutTrack(pace=False)
    track.begin_utterance("u", 0)
    track.push_pcm("u", sine(SAMPLE_RATE_IN // 10))
    track.end_utterance("u")
    encoder = OpusEncoder()
    for i in range(10):  # audio frames, then silence frames
        frame = await track.recv()
        assert frame.format.name == "s16"
        assert frame.layout.name == "mono"
        assert frame.samples == FRAME_SAMPLES == 960
        assert frame.sample_rate == SAMPLE_RATE_OUT == 48000
        assert frame.time_base == Fraction(1, 48000)
        assert frame.pts == i * FRAME_SAMPLES
        assert frame.planes[0].buffer_size == FRAME_SAMPLES * 2
        # The exact consumers aiortc runs on every frame must accept it.
        compute_audio_level_dbov(frame)
        encoder.encode(frame)
    payloads, _ = encoder.encode(await track.recv())
    assert payloads and all(payloads)


# ---------------------------------------------------------------- pacing


class SteppedClock:
    """The track's clock: the machine's, plus whatever time a test makes pass at once (a stall the track must
    see, without blocking the loop: a loaded machine adds its own lateness, never takes any away)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.reads: list[float] = []

    def __call__(self) -> float:
        now = time.monotonic() + self.offset
        self.reads.append(now)
        return now

    def now(self) -> float:
        return time.monotonic() + self.offset


@pytest.mark.asyncio
async def test_real_pacing_20ms_without_bursts() -> None:
    """Each frame leaves at or after its slot on the track's clock (anchor + k * 20 ms): never ahead, so never a
    burst; and the track keeps its anchor (a slow machine only makes frames late, it moves no slot)."""
    clock = SteppedClock()
    track = PlayoutTrack(clock=clock)
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(200))  # audio and then silence: both paced
    stamps = []
    for _ in range(26):
        await track.recv()
        stamps.append(clock.now())
    anchor = clock.reads[0]
    early = [k for k, at in enumerate(stamps) if at < anchor + k * FRAME_SECONDS - 1e-4]
    assert not early, f"frames {early} left before their slot"
    assert track.stats().reanchors == 0 or max(np.diff([anchor, *stamps])) > REANCHOR_LATENESS_S


@pytest.mark.asyncio
async def test_catches_up_after_a_short_delay() -> None:
    """The track's clock jumps 3.5 frames (a loop busy for 70 ms): those frames go out without waiting, then the
    original slots are kept (no re-anchoring)."""
    clock = SteppedClock()
    track = PlayoutTrack(clock=clock)
    for _ in range(3):
        await track.recv()
    anchor = clock.reads[0]
    clock.offset += 0.07  # 3.5 frames late
    for _ in range(3):
        await track.recv()
    assert track.stats().reanchors == 0
    for k in range(6, 11):
        await track.recv()
        assert clock.now() >= anchor + k * FRAME_SECONDS - 1e-4, "then each frame waits for its original slot"
    assert track.stats().reanchors == 0


@pytest.mark.asyncio
async def test_reanchors_after_a_stall_instead_of_bursting() -> None:
    """The track's clock jumps 15 frames (a stall): the late frame goes at once and the clock is re-anchored there,
    so the next frames wait a full period each instead of going out as a backlog."""
    clock = SteppedClock()
    track = PlayoutTrack(clock=clock)
    for _ in range(3):
        await track.recv()
    clock.offset += 0.3  # 15 frames late
    first_read = len(clock.reads)
    await track.recv()  # late already: returned at once, clock re-anchored
    assert track.stats().reanchors == 1
    reanchored = clock.reads[first_read]  # the slot wait's reading: the new anchor
    await track.recv()
    await track.recv()
    assert clock.now() >= reanchored + 2 * FRAME_SECONDS - 1e-4, "two more full periods, not a backlog burst"


@pytest.mark.asyncio
async def test_audio_frames_handed_over_after_their_slot_are_counted_per_utterance() -> None:
    """On the track's own clock: a frame handed to the sender 30 ms after its slot counts as late, one 5 ms after
    does not (below half a frame), silence does not count; the utterance's `finished` event carries both."""
    clock = ManualClock(100.0)
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, clock=clock)
    await track.recv()  # anchors the clock on a silent frame
    clock.advance(FRAME_SECONDS + 0.05)  # a late silent frame: not counted
    await track.recv()
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(100))
    track.end_utterance("u")
    lateness = {2: 0.03, 3: 0.005}  # by the frame's index in the track
    frame = 2
    while not any(isinstance(e, UtteranceFinished) for e in events):
        clock.now = 100.0 + frame * FRAME_SECONDS + lateness.get(frame, 0.0)
        await track.recv()
        frame += 1
    finished = events[-1]
    assert isinstance(finished, UtteranceFinished) and finished.audio_ms == 100
    assert finished.late_frames == 1 and finished.max_late_ms == pytest.approx(30.0)


@pytest.mark.asyncio
async def test_an_utterance_ready_while_the_track_idles_goes_out_without_waiting_for_its_slot() -> None:
    """The track idles (silence out) and recv sleeps until its next slot: an utterance that becomes ready then
    (jitter 0: a whole frame) is returned at once, and the frames after it keep 20 ms from there. One still
    filling its jitter buffer does not cut the sleep short, nor does audio for an utterance already playing."""
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append)
    await track.recv()
    await track.recv()  # anchored, idle
    buffered = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)  # recv sleeps until its slot
    track.begin_utterance("b", 100)
    track.push_pcm("b", ms_of_pcm(40))  # 40 of its 100 ms: not ready
    assert is_silent(await buffered) and track.stats().early_starts == 0
    track.clear("b")
    await track.recv()  # the barge-in's silent frame

    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)
    track.begin_utterance("u", 0)
    pushed_at = time.monotonic()
    track.push_pcm("u", ms_of_pcm(200))
    first = await pending
    woke_after = time.monotonic() - pushed_at
    assert not is_silent(first) and track.stats().early_starts == 1
    assert woke_after < 0.5 * FRAME_SECONDS, woke_after  # not the slot's 20 ms
    track.push_pcm("u", ms_of_pcm(40))  # more audio for the playing utterance: paced as before
    stamps = []
    for _ in range(4):
        assert not is_silent(await track.recv())
        stamps.append(time.monotonic())
    assert track.stats().early_starts == 1
    assert 0.05 <= stamps[-1] - pushed_at <= 0.1  # 4 more frames, 20 ms apart from the early one


@pytest.mark.asyncio
async def test_clear_while_recv_sleeps_silences_that_frame() -> None:
    track = PlayoutTrack()
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(500))
    assert not is_silent(await track.recv())
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.005)  # recv is now sleeping until its slot
    assert track.clear() == ["u"]
    assert is_silent(await pending)


# ---------------------------------------------------------------- silence / resampling


@pytest.mark.asyncio
async def test_silence_when_nothing_queued() -> None:
    track = PlayoutTrack(pace=False)
    for _ in range(5):
        assert is_silent(await track.recv())
    stats = track.stats()
    assert (stats.frames_sent, stats.silence_frames, stats.underruns) == (5, 5, 0)


@pytest.mark.asyncio
async def test_resampled_sine_keeps_frequency_and_sample_count() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    rng = np.random.default_rng(1)
    n_in = 12_345  # not a multiple of anything relevant
    pcm = sine(n_in)
    track.begin_utterance("u", 0)
    pos = 0
    while pos < n_in:  # many odd-sized chunks, some of 1 sample
        step = int(rng.integers(1, 700))
        track.push_pcm("u", pcm[pos : pos + step])
        pos += step
    track.end_utterance("u")
    out = np.concatenate(await drain(track, events, "u"))

    n_out = n_in * RATIO
    assert len(out) == math.ceil(n_out / FRAME_SAMPLES) * FRAME_SAMPLES
    assert not out[n_out:].any()  # only zero padding after the audio
    audio = out[:n_out]
    # Same waveform at twice the rate, time-aligned (no offset from the filter delay).
    expected = sine(n_out, rate=SAMPLE_RATE_OUT).astype(np.float64)
    edge = 64  # filter start-up/tail transients
    err = np.abs(audio[edge:-edge] - expected[edge:-edge])
    assert err.max() < 0.02 * AMPLITUDE
    spectrum = np.abs(np.fft.rfft(audio))
    peak_hz = np.argmax(spectrum) * SAMPLE_RATE_OUT / n_out
    assert abs(peak_hz - 1000.0) < 5.0
    assert events[-1].audio_ms == len(out) * 1000 // SAMPLE_RATE_OUT


@pytest.mark.asyncio
async def test_no_samples_lost_or_smeared_across_utterances() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    lengths = {"a": 7_777, "b": 331, "c": 5_000}
    for uid, n in lengths.items():
        track.begin_utterance(uid, 0)
        # "b" is silence: any tail of "a" leaking into it would show up.
        track.push_pcm(uid, sine(n) if uid != "b" else np.zeros(n, dtype=np.int16))
        track.end_utterance(uid)
    per_utt = {uid: np.concatenate(await drain(track, events, uid)) for uid in lengths}
    for uid, n in lengths.items():
        n_out = n * RATIO
        assert len(per_utt[uid]) == math.ceil(n_out / FRAME_SAMPLES) * FRAME_SAMPLES
        assert not per_utt[uid][n_out:].any()
    assert not per_utt["b"].any()
    assert np.abs(per_utt["c"][: 4 * FRAME_SAMPLES]).max() > AMPLITUDE // 2
    # Played back to back: no silence frames between the three utterances.
    assert track.stats().silence_frames == 0


# ---------------------------------------------------------------- jitter buffer


@pytest.mark.asyncio
async def test_jitter_buffer_waits_for_configured_audio() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    track.begin_utterance("u", 500)
    track.push_pcm("u", ms_of_pcm(400))
    for _ in range(5):
        assert is_silent(await track.recv())
    assert events == []
    assert track.stats().queued_ms >= 380
    track.push_pcm("u", ms_of_pcm(100))
    assert not is_silent(await track.recv())
    assert kinds(events) == ["started"]
    assert track.stats().underruns == 0  # pre-roll silence is not an underrun


@pytest.mark.asyncio
async def test_the_lead_is_what_the_listener_can_play_before_it_needs_more() -> None:
    """The synthesis deadline, in whole queued frames: before it starts, what the utterance will hold then (at
    least its jitter buffer) behind the audio ahead of it; once it plays, its queued audio; None once played out.
    (The resampler keeps ~0.7 ms back: 400 ms in make 19 whole frames.)"""
    track = PlayoutTrack(pace=False)
    track.begin_utterance("a", 500)
    assert track.lead_s("a") == 0.5 and track.lead_s("unknown") is None
    track.push_pcm("a", ms_of_pcm(400))
    assert track.lead_s("a") == pytest.approx(0.5)  # waiting for its buffer: it cannot run dry yet
    assert not track.lead_runs("a")  # ... nor does that lead run down while it waits
    track.begin_utterance("b", 500)
    track.push_pcm("b", ms_of_pcm(600))
    assert track.lead_s("b") == pytest.approx(0.38 + 0.58)  # a's queued audio plays first
    assert not track.lead_runs("b")  # a is not playing yet
    track.push_pcm("a", ms_of_pcm(200))
    await track.recv()  # starts a
    assert track.lead_s("a") == pytest.approx(0.56)
    assert track.lead_s("b") == pytest.approx(0.56 + 0.58)
    assert track.lead_runs("a") and track.lead_runs("b")  # a plays: both leads run down
    assert track.lead_runs("unknown")
    for _ in range(10):
        await track.recv()
    assert track.lead_s("a") == pytest.approx(0.36)
    track.end_utterance("a")
    while track.playing_utterance_id != "b":
        await track.recv()
    assert track.lead_s("a") is None
    assert track.lead_s("b") == pytest.approx(0.56)


@pytest.mark.asyncio
async def test_ended_short_utterance_plays_at_once() -> None:
    track = PlayoutTrack(pace=False)
    track.begin_utterance("u", 2000)
    track.push_pcm("u", ms_of_pcm(100))
    assert is_silent(await track.recv())
    track.end_utterance("u")
    assert not is_silent(await track.recv())


@pytest.mark.asyncio
async def test_zero_jitter_buffer_starts_with_first_frame() -> None:
    track = PlayoutTrack(pace=False)
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(40))
    assert not is_silent(await track.recv())


@pytest.mark.parametrize("bad", [-1, JITTER_BUFFER_MAX_MS + 1, float("nan"), True])
def test_jitter_buffer_out_of_range_raises(bad: float) -> None:
    track = PlayoutTrack(pace=False)
    with pytest.raises(ValueError, match="jitter_buffer_ms"):
        track.begin_utterance("u", bad)
    track.begin_utterance("lo", 0)
    track.begin_utterance("hi", JITTER_BUFFER_MAX_MS)


def test_input_validation() -> None:
    track = PlayoutTrack(pace=False)
    track.begin_utterance("u", 0)
    with pytest.raises(ValueError, match="already queued"):
        track.begin_utterance("u", 0)
    with pytest.raises(ValueError, match="int16"):
        track.push_pcm("u", np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="mono"):
        track.push_pcm("u", np.zeros((2, 10), dtype=np.int16))
    assert track.push_pcm("u", np.zeros((10, 1), dtype=np.int16))
    assert track.push_pcm("u", np.zeros(0, dtype=np.int16))
    assert not track.push_pcm("never-begun", ms_of_pcm(20))
    track.end_utterance("u")
    with pytest.raises(ValueError, match="ended"):
        track.push_pcm("u", ms_of_pcm(20))


# ---------------------------------------------------------------- underruns


@pytest.mark.asyncio
async def test_underrun_counted_only_mid_utterance() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    for _ in range(3):  # idle before anything: not an underrun
        await track.recv()
    track.begin_utterance("u", 0)
    for _ in range(2):  # begun but empty (pre-roll): not an underrun
        await track.recv()
    assert track.stats().underruns == 0

    track.push_pcm("u", ms_of_pcm(100))  # 4 whole frames ready (resampler holds ~0.7 ms)
    played = [not is_silent(await track.recv()) for _ in range(7)]
    assert played == [True] * 4 + [False] * 3
    stats = track.stats()
    assert (stats.underruns, stats.underrun_ms) == (1, 3 * FRAME_MS)

    track.push_pcm("u", ms_of_pcm(100))
    track.end_utterance("u")
    await drain(track, events, "u")
    finished = events[-1]
    assert isinstance(finished, UtteranceFinished)
    assert (finished.underruns, finished.underrun_ms) == (1, 3 * FRAME_MS)
    assert finished.audio_ms == 200
    assert finished.underrun_at_ms == (4 * FRAME_MS,)  # it ran dry after its first 4 frames

    for _ in range(3):  # after the end: not an underrun either
        await track.recv()
    assert track.stats().underruns == 1
    assert track.stats().underrun_ms == 3 * FRAME_MS


@pytest.mark.asyncio
async def test_waiting_for_the_end_after_the_last_audio_is_not_an_underrun() -> None:
    """The end arriving after the last whole frame has played (the synthesizer finishing) leaves no gap inside
    what was heard, only the flushed remainder after it: not counted. An underrun followed by more audio before
    the end still is."""
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    track.begin_utterance("tail", 0)
    track.push_pcm("tail", ms_of_pcm(80))  # 3 whole frames; the rest waits in the partial frame and resampler
    played = [not is_silent(await track.recv()) for _ in range(7)]
    assert played == [True] * 3 + [False] * 4 and track.stats().underruns == 1  # dry, the end not known yet
    track.end_utterance("tail")
    samples = await drain(track, events, "tail")
    finished = events[-1]
    assert isinstance(finished, UtteranceFinished) and finished.audio_ms == 80 and np.any(samples[0])
    assert (finished.underruns, finished.underrun_ms, finished.underrun_at_ms) == (0, 0, ())
    assert track.stats().underruns == 0 and track.stats().underrun_ms == 0

    track.begin_utterance("gap", 0)
    track.push_pcm("gap", ms_of_pcm(100))
    for _ in range(7):
        await track.recv()
    track.push_pcm("gap", ms_of_pcm(40))
    for _ in range(3):
        await track.recv()
    track.end_utterance("gap")
    await drain(track, events, "gap")
    finished = events[-1]
    assert (finished.underruns, finished.underrun_at_ms) == (1, (4 * FRAME_MS,))


# ---------------------------------------------------------------- events


@pytest.mark.asyncio
async def test_markers_fire_with_the_frame_after_them() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False, clock=lambda: 42.0)
    track.begin_utterance("u", 0)
    track.mark("u", Label("s0", 0))
    track.push_pcm("u", ms_of_pcm(100))  # frames 0-4
    track.mark("u", Label("s1", 1))  # -> frame 5
    track.push_pcm("u", ms_of_pcm(90))  # frames 5-9 (last one padded)
    track.mark("u", Label("end"))  # after all audio: with the last frame
    track.end_utterance("u")
    per_frame = []
    for _ in range(11):
        events.clear()
        await track.recv()
        per_frame.append(kinds(events))
    assert per_frame[0] == ["started", "marker:s0"]
    assert per_frame[5] == ["marker:s1"]
    assert per_frame[9] == ["marker:end", "finished"]
    assert all(not k for i, k in enumerate(per_frame) if i not in (0, 5, 9))


@pytest.mark.asyncio
async def test_event_fields() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False, clock=lambda: 42.0)
    track.begin_utterance("u", 0)
    track.mark("u", Label("s0", 0))
    track.push_pcm("u", ms_of_pcm(20))
    track.end_utterance("u")
    await drain(track, events, "u")
    started, marker, finished = events
    assert started == UtteranceStarted("u", 42.0, 0)
    assert marker == MarkerReached("u", 42.0, 0, Label("s0", 0))
    assert isinstance(finished, UtteranceFinished)
    assert finished.audio_ms == FRAME_MS  # 480 in -> exactly 960 out after the flush


@pytest.mark.asyncio
async def test_empty_ended_utterance_still_reports_start_and_finish() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    track.begin_utterance("empty", 500)
    track.end_utterance("empty")
    assert is_silent(await track.recv())
    assert kinds(events) == ["started", "finished"]
    assert events[-1].audio_ms == 0


@pytest.mark.asyncio
async def test_raising_callback_does_not_break_recv() -> None:
    calls: list[PlayoutEvent] = []

    def bad(event: PlayoutEvent) -> None:
        calls.append(event)
        raise RuntimeError("session bug")

    track = PlayoutTrack(bad, pace=False)
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(60))
    track.end_utterance("u")
    for _ in range(5):
        await track.recv()
    assert kinds(calls) == ["started", "finished"]
    assert track.stats().callback_errors == 2


@pytest.mark.asyncio
async def test_internal_error_degrades_to_silence() -> None:
    track = PlayoutTrack(pace=False)

    def broken() -> bytes:
        raise RuntimeError("bug")

    track._next_payload = broken  # type: ignore[method-assign]
    frame = await track.recv()
    assert is_silent(frame) and frame.samples == FRAME_SAMPLES
    assert track.stats().errors == 1
    assert track.readyState == "live"


@pytest.mark.asyncio
async def test_callback_may_reenter_the_track() -> None:
    track: PlayoutTrack

    def on_event(event: PlayoutEvent) -> None:
        if isinstance(event, MarkerReached) and event.marker == Label("stop-here"):
            track.clear()

    track = PlayoutTrack(on_event, pace=False)
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(40))
    track.mark("u", Label("stop-here"))
    track.push_pcm("u", ms_of_pcm(200))
    audible = [not is_silent(await track.recv()) for _ in range(4)]
    assert audible == [True, True, True, False]  # the frame after the marker still plays


# ---------------------------------------------------------------- clear / stop


@pytest.mark.asyncio
async def test_clear_all_stops_audio_on_next_frame() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    for uid in ("a", "b"):
        track.begin_utterance(uid, 0)
        track.push_pcm(uid, ms_of_pcm(1000))
        track.end_utterance(uid)
    for _ in range(3):
        assert not is_silent(await track.recv())
    assert track.clear() == ["a", "b"]
    for _ in range(3):
        assert is_silent(await track.recv())
    assert kinds(events) == ["started"]  # no finished for dropped utterances
    stats = track.stats()
    assert (stats.queued_ms, stats.queued_utterances, stats.underruns) == (0, 0, 0)
    assert not track.push_pcm("a", ms_of_pcm(20))  # late TTS chunks are ignored
    assert track.clear() == []


@pytest.mark.asyncio
async def test_clear_one_utterance() -> None:
    events: list[PlayoutEvent] = []
    track = PlayoutTrack(events.append, pace=False)
    for uid in ("a", "b", "c"):
        track.begin_utterance(uid, 0)
        track.push_pcm(uid, ms_of_pcm(100, value=ord(uid)))
        track.end_utterance(uid)
    assert samples_of(await track.recv())[0] == ord("a")
    assert track.clear("b") == ["b"]  # queued one: "a" keeps playing
    assert samples_of(await track.recv())[0] == ord("a")
    assert track.playing_utterance_id == "a"
    assert track.clear("a") == ["a"]  # the playing one: next frame is silence
    assert is_silent(await track.recv())
    assert samples_of(await track.recv())[0] == ord("c")
    assert track.clear("nope") == []
    assert "finished" not in kinds(events)


@pytest.mark.asyncio
async def test_stop_releases_and_recv_raises() -> None:
    track = PlayoutTrack(pace=False)
    track.begin_utterance("u", 0)
    track.push_pcm("u", ms_of_pcm(100))
    await track.recv()
    track.stop()
    assert track.readyState == "ended"
    assert track.stats().queued_ms == 0 and track.stats().queued_utterances == 0
    with pytest.raises(MediaStreamError):
        await track.recv()
    assert not track.push_pcm("u", ms_of_pcm(20))
    with pytest.raises(MediaStreamError):
        track.begin_utterance("v", 0)
    track.stop()  # idempotent


@pytest.mark.asyncio
async def test_stop_during_paced_recv_raises() -> None:
    track = PlayoutTrack()
    await track.recv()
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.005)
    track.stop()
    with pytest.raises(MediaStreamError):
        await pending
