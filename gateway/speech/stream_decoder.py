"""The exact streaming SNAC decoder (`snac.StreamingSnac`) serving every sentence of a process: one worker thread owns
it, and each step advances all streams that have a frame to decode in one batched launch. It steps when a ready
stream is due (its audio runs less than `DUE_LEAD_S` ahead of its listener) or the last step is `MAX_HOLD_S` old, so
streams with lead to spare join one step, and never sooner than the last step's rest (`step_duty`); a stream's first
audio comes from the bridge or the exact stream as the start policy (`first_audio`) says, and the bridge goes on
until the stream's lead covers the hand-over. The event loop only enqueues commands (one queue item per loop
iteration, a stream's open with its first push: each wake-up takes the GIL from the loop) and awaits chunks; nothing
here blocks it. Why: docs/decisions/snac-step-timing.md and docs/decisions/first-audio-start.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.orpheus import SAMPLE_RATE, Frame
from gateway.speech.first_audio import (
    EXACT_OR_BRIDGE,
    FIRST_EXACT_FRAMES,
    FRAME_S,
    MAX_START_HOLD_S,
    GenerationPace,
    StartPolicy,
    exact_start_hold_s,
)
from gateway.speech.step_timing import DUE_LEAD_S, MAX_HOLD_S, StepTiming

if TYPE_CHECKING:  # torch loads with the decoder, not with this module (the codec server imports it, torch-free)
    from gateway.speech.snac import StreamHandle, StreamingSnac

log = logging.getLogger(__name__)

STEPS_BEFORE_AUDIO = FIRST_EXACT_FRAMES - 1  # a stream's first 2 steps emit nothing (4096 < 4757 samples of delay)
# Samples of the bridge's crossfades: halves the hand-over error of a 256-sample fade
# (docs/decisions/snac-exactness-and-bridge.md).
BRIDGE_CROSSFADE = 512
# Lead beyond the hand-over's own need: a tick's decode and delivery (~15 ms at 256 streams).
HANDOVER_MARGIN_S = 0.02
# Frames a stream's first audio waits for beyond its own unless the tokens come fast (then 0): one frame of right
# context is where the bridge's error falls to the crossfade's scale (docs/decisions/snac-exactness-and-bridge.md).
FIRST_AUDIO_LOOKAHEAD = 1
TICK_MS_BUCKETS = 1001  # DecodeStats.tick_ms: 0..999 ms, then 1 s or more
THREAD_NAME = "snac-stream-decoder"  # the worker thread (gateway.benchmarks.probes reads its CPU time by this name)


def lead_always_runs() -> bool:
    """A stream's `lead_runs` where nobody says otherwise: its listener plays (the lead runs down in real time)."""
    return True


Command = tuple[str, "DecodeStream", Any]  # (open | push | finish | close, the stream, its payload)


@dataclass
class DecodeStats:
    """A decoder's batched steps so far (benchmarks.probes reads them; the metrics hook gets each step as it runs)."""

    batches: int = 0  # batched steps
    windows: int = 0  # stream-steps in them: one frame of one stream each
    frames: int = 0  # new audio frames emitted
    window_frames: int = 0  # frames run through SNAC's exact step (one per stream-step)
    busy_s: float = 0.0  # in exact steps (with the wait for the GPU)
    wakeups: int = 0  # times the worker took commands (each wake-up takes the GIL from an event loop)
    bridge_s: float = 0.0  # in bridge decodes (first audio and pieces until the hand-over; same)
    exact_starts: int = 0  # streams whose first audio came from the exact stream (`_first_audio_at`), no bridge
    # First audios out (`StreamDecoder._note_first_audio`): how many, and summed over them the time from the head
    # ready to the first audio (the start's hold and the wait for its decode), and the generation pace
    # (seconds per frame) the start was planned at, where it read one (`paced_starts` of them): whether the pace
    # read is what makes a start's hold differ between two setups (docs/decisions/first-audio-start.md).
    first_audios: int = 0
    start_hold_s: float = 0.0
    paced_starts: int = 0
    start_pace_s: float = 0.0
    held_steps: int = 0  # steps taken when the hold ran out, no stream due (the others: a stream was due)
    longest_tick_s: float = 0.0  # the longest tick (bridges and step): how long the worker answered nothing
    # Ticks by whole milliseconds (the last: TICK_MS_BUCKETS - 1 or more), so a reader can find the longest tick
    # between two of its reads from the counts alone; a list, whose copy another thread can take at any time.
    tick_ms: list[int] = field(default_factory=lambda: [0] * TICK_MS_BUCKETS)

    def count_tick(self, seconds: float) -> None:
        self.longest_tick_s = max(self.longest_tick_s, seconds)
        self.tick_ms[min(int(seconds * 1000), TICK_MS_BUCKETS - 1)] += 1


@dataclass(eq=False)
class DecodeStream:
    """One sentence being decoded. The synthesizer pushes frames and reads `chunks`: (int16 PCM, is the last)
    pairs, then None; an exception if its decode failed."""

    loop: asyncio.AbstractEventLoop
    lead_s: Callable[[], float]  # how far this utterance's audio out runs ahead of real time (the deadline)
    lookahead: int = FIRST_AUDIO_LOOKAHEAD  # frames the first audio waits for beyond its own (0: at one frame)
    # Whether lead_s runs down now (a shared SNAC process models the lead between reports; in-process it is read
    # live and this is not needed): not while the listener waits for this stream's first audio.
    lead_runs: Callable[[], bool] = lead_always_runs
    chunks: asyncio.Queue[tuple[np.ndarray, bool] | BaseException | None] = field(default_factory=asyncio.Queue)
    handle: StreamHandle | None = None  # worker thread only
    started: bool = False  # worker thread only: its first audio went out
    bridging: bool = True  # worker thread only: the bridge, not yet the exact stream, hands out its audio
    bridge_lead: tuple[int, float] | None = None  # worker thread only: (frames bridged, lead) at the last check
    # Worker thread only: the generation pace, from when frames were pushed (the decoder's clock), and when the head
    # was ready (`_first_audio_at`).
    first_push_at: float | None = None
    last_push_at: float = 0.0
    frames_after_first: int = 0  # frames pushed after the first push's
    head_ready_at: float | None = None
    opened: bool = False  # event-loop side only: its open went to the worker (with its first push or finish)
    start_at: float = 0.0  # worker thread only: the latest the first audio was held to so far (`_first_audio_at`)
    exact_start: bool | None = None  # worker thread only: its first audio comes from the exact stream (None: undecided)
    start_pace_s: float | None = None  # worker thread only: the pace its start was planned at (None: read none)


class StreamDecoder:
    """Owns a `StreamingSnac` in one worker thread; `open` a stream per sentence. Its time is `clock` (monotonic
    seconds); the worker waits for a tick that many seconds, or until the next command comes."""

    def __init__(self, snac: StreamingSnac, max_batch: int = 256,
                 on_batch: Callable[[int, float, int, int], None] | None = None, hold_s: float = MAX_HOLD_S,
                 due_lead_s: float = DUE_LEAD_S, start: StartPolicy = EXACT_OR_BRIDGE,
                 on_first_audio: Callable[[bool, float, float | None], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, step_duty: float = 1.0) -> None:
        self.snac = snac
        self._clock = clock  # seconds, monotonic: push stamps, holds, steps and their durations all read it
        self.max_batch = max_batch
        self.timing = StepTiming(hold_s, due_lead_s, step_duty)  # when it steps (`step_timing`)
        self.start = start  # how a first audio starts (`_first_audio_at`; benchmarks compare others)
        self.on_batch = on_batch  # (streams, seconds, frames per stream, new frames): the metrics hook
        # (from the exact stream, seconds from the head ready, the pace planned at or None): the metrics hook
        self.on_first_audio = on_first_audio
        # Lead at which the exact stream takes over from the bridge (`_bridge`).
        self.handover_lead_s = snac.delay_samples / SAMPLE_RATE + HANDOVER_MARGIN_S
        self.stats = DecodeStats()
        # The worker's input: each item a loop iteration's commands, in order (None: stop).
        self._commands: queue.SimpleQueue[list[Command] | None] = queue.SimpleQueue()
        self._outboxes: dict[asyncio.AbstractEventLoop, list[Command]] = {}  # event-loop side: not yet sent
        self.commands_sent = 0  # event-loop side: commands handed to the worker so far (tests wait on it)
        self._streams: list[DecodeStream] = []
        self.pace = GenerationPace()  # every stream's recent frame intervals (`_pace_s`)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # --- event-loop side --------------------------------------------------------------------------
    def open(self, lead_s: Callable[[], float], lookahead: int = FIRST_AUDIO_LOOKAHEAD, *,
             lead_runs: Callable[[], bool] = lead_always_runs) -> DecodeStream:
        if self._closed:
            raise RuntimeError("decoder is closed")
        # Nothing goes to the worker yet (see the module docstring): `_send` opens it with its first command.
        return DecodeStream(asyncio.get_running_loop(), lead_s, lookahead, lead_runs)

    def push(self, stream: DecodeStream, frames: Sequence[Frame]) -> None:
        self._send("push", stream, (list(frames), self._clock()))

    def finish(self, stream: DecodeStream) -> None:
        self._send("finish", stream, None)

    def release(self, stream: DecodeStream) -> None:
        """The sentence is over (done, failed or cancelled): free its slot; undelivered audio is dropped."""
        if stream.opened:  # else the worker never heard of it: no slot to free
            self._post(stream.loop, ("close", stream, None))

    def _send(self, kind: str, stream: DecodeStream, payload: Any) -> None:
        if not stream.opened:
            stream.opened = True
            self._post(stream.loop, ("open", stream, None))
        self._post(stream.loop, (kind, stream, payload))

    def _post(self, loop: asyncio.AbstractEventLoop, command: Command) -> None:
        """Queue a command for the worker with the rest of this loop iteration's: one wake-up for them all."""
        box = self._outboxes.get(loop)
        if box is None:
            if loop.is_closed():  # a release after its loop ended: nothing is left to send it
                return
            box = self._outboxes[loop] = []
            loop.call_soon(self._flush, loop)
        box.append(command)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        box = self._outboxes.pop(loop, None)
        if box:
            self.commands_sent += len(box)
            self._commands.put(box)

    def close(self) -> None:
        self._closed = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    # --- worker thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        wake_at: float | None = None  # clock time of the next tick; None: nothing to do until a command
        with torch.inference_mode():
            while True:
                try:
                    if wake_at is None:
                        command = self._commands.get()
                    elif (wait_s := wake_at - self._clock()) > 0:
                        command = self._commands.get(timeout=wait_s)
                    else:
                        command = self._commands.get_nowait()
                except queue.Empty:
                    command = ...
                if command is None:
                    return
                if command is not ...:
                    self.stats.wakeups += 1
                    touched = [self._apply(c) for c in command]
                    with contextlib.suppress(queue.Empty):  # everything else that waits, before deciding
                        while (more := self._commands.get_nowait()) is not None:
                            touched += [self._apply(c) for c in more]
                        return
                    self._finish_done(touched)  # a sentence finished with nothing left to step ends here
                    # Only the streams a command touched can need a tick sooner than planned (a lead only falls
                    # with time, which the plan counts in), so the rest are not looked at again (256 streams push
                    # ~3000 frames a second).
                    sooner = self._next_tick_at(touched)
                    if sooner is not None and (wake_at is None or sooner < wake_at):
                        wake_at = sooner
                    if wake_at is None or wake_at > self._clock():
                        continue
                    # due now: tick before reading the queue again, which a steady flow of pushes never empties
                self._tick()
                wake_at = self._next_tick_at(self._streams)  # every stream: the tick changed them

    def _next_tick_at(self, streams: Sequence[DecodeStream]) -> float | None:
        """When the worker must tick next for these streams (clock time): now for a first audio or a
        bridge decision, the step's time for ready streams (`timing.due_in`), None if none needs anything."""
        now = self._clock()
        waits = []
        for stream in streams:
            if stream.handle is None or stream.handle.closed:
                continue
            if not stream.started:
                if (start := self._first_audio_at(stream)) is not None:
                    if start <= now:
                        return now
                    waits.append(start - now)  # a held first audio
            elif self._bridge_due(stream):
                return now
            if self._steppable(stream):
                waits.append(self.timing.due_in(stream.lead_s(), now))
        return now + min(waits) if waits else None

    def _bridge_due(self, stream: DecodeStream) -> bool:
        """`_bridge` has something to do for this started stream: while it bridges, a decision on a new frame (a
        piece, or the hand-over). An unstarted one's first audio is `_first_audio_at`'s."""
        handle = stream.handle
        assert handle is not None
        return stream.bridging and (self.snac.bridging_over(handle) or self.snac.bridgeable(
            handle, self._piece_lookahead(stream), BRIDGE_CROSSFADE))

    def _apply(self, command: Command) -> DecodeStream:
        """Apply one command; returns the stream it touched."""
        kind, stream, frames = command
        try:
            if kind == "open":
                stream.handle = self.snac.open_stream()
                self._streams.append(stream)
            elif stream.handle is None or stream.handle.closed:
                return stream  # opened after a failure, or already released
            elif kind == "push":
                self.snac.check_bridge(stream.lookahead)  # a bad one fails the stream now, not once its head is in
                frames, at = frames
                self.snac.push(stream.handle, frames)
                self._note_push(stream, len(frames), at)
            elif kind == "finish":
                self.snac.finish(stream.handle)
            elif kind == "close":
                self._drop(stream)
        except Exception as exc:  # a full pool or bad codes fail this sentence, not the worker
            log.warning("SNAC stream %s failed: %s", kind, exc)
            self._fail([stream], exc)
        return stream

    def _note_push(self, stream: DecodeStream, frames: int, at: float) -> None:
        """The generation pace (`_first_audio_at`): when frames came, and when the head was ready."""
        if stream.first_push_at is None:
            stream.first_push_at = at
        else:
            stream.frames_after_first += frames
            self.pace.add(at, at - stream.last_push_at, frames)
        stream.last_push_at = at
        handle = stream.handle
        assert handle is not None
        if stream.head_ready_at is None and handle.received >= stream.lookahead + 1:
            stream.head_ready_at = at

    def _steppable(self, stream: DecodeStream) -> bool:
        """The exact stream can advance: before the first audio only through its silent first steps, unless the
        first audio is its own and its time has come (`_first_audio_at`)."""
        handle = stream.handle
        return handle is not None and self.snac.ready(handle) and (
            stream.started or handle.stepped < STEPS_BEFORE_AUDIO or (
                bool(stream.exact_start) and (handle.finished or stream.start_at <= self._clock())))

    def _first_audio_at(self, stream: DecodeStream) -> float | None:
        """When an unstarted stream's first audio may go out (clock time; 0: at once), None before its head
        is ready. At once for a finished sentence (the bridge decodes it whole: no hand-over; the exact stream
        flushes it) and while the pace is unknown (one push so far: a fast start, from the bridge); else, at the
        pace `_pace_s` reads, held by `start_hold_s` from its latest frame for a bridged start, by
        `exact_start_hold_s` for one from the exact stream, either at most `MAX_START_HOLD_S` after its head was
        ready. Which of the two it is is decided once, at the first pace read (the `start` policy).
        A later frame may move the start later, never sooner: the hold reaches 7 intervals ahead, so a frame that
        came a few ms early would otherwise cancel it (a 1.2x pace's third frame comes before its hold ends)."""
        handle = stream.handle
        assert handle is not None
        if handle.finished:
            return 0.0 if handle.received > 0 else None
        if handle.received < stream.lookahead + 1:
            return None
        if not self.start.held or stream.frames_after_first == 0 or stream.first_push_at is None \
                or stream.head_ready_at is None:
            return 0.0
        interval = self._pace_s(stream)
        lead = stream.lead_s()
        if stream.exact_start is None:
            stream.start_pace_s = interval
            exact = self.start.starts_exact
            stream.exact_start = exact is not None and exact(
                handle.received, interval, lead, self.handover_lead_s, self.snac.HEAD_FRAMES)
            if stream.exact_start:
                stream.bridging = False
                self.stats.exact_starts += 1
        hold_s = exact_start_hold_s if stream.exact_start else self.start.bridged_hold_s
        hold = hold_s(handle.received, interval, lead, self.handover_lead_s, self.snac.HEAD_FRAMES)
        at = min(stream.last_push_at + hold, stream.head_ready_at + MAX_START_HOLD_S)
        stream.start_at = max(stream.start_at, at)
        return stream.start_at

    def _pace_s(self, stream: DecodeStream) -> float:
        """Seconds per frame this stream's generation is expected to take: the slower of its own frames' so far
        and every stream's recent ones (`GenerationPace`)."""
        assert stream.first_push_at is not None and stream.frames_after_first > 0
        own = (stream.last_push_at - stream.first_push_at) / stream.frames_after_first
        return max(own, self.pace.seconds_per_frame(self._clock()))

    def _tick(self) -> None:
        t0 = self._clock()
        self._bridge()
        ready = [s for s in self._streams if self._steppable(s)]
        if ready:
            leads = {s: s.lead_s() for s in ready}  # once per tick: a lead is a call into the synthesizer
            if self.timing.due_in(min(leads.values()), self._clock()) <= 0:
                self._step(leads)
        self._finish_done()
        self.stats.count_tick(self._clock() - t0)

    def _step(self, leads: dict[DecodeStream, float]) -> None:
        """Step the ready streams (`leads`: each one's lead) by lead, least first, up to `max_batch`."""
        t0 = self._clock()
        batch = sorted(leads, key=leads.__getitem__)[:self.max_batch]  # the closest to running dry first
        held = self.timing.held(leads[batch[0]])
        self.timing.step_started(t0)
        try:
            pcm = self.snac.step_batch([s.handle for s in batch])  # type: ignore[misc]
        except Exception as exc:
            log.exception("SNAC stream step failed for %d streams", len(batch))
            self._fail(batch, exc)
            return
        elapsed = self._clock() - t0
        left_out = self.timing.rests and len(batch) < min(self.max_batch, sum(  # open streams: counted only then
            1 for s in self._streams if s.handle is not None and not s.handle.closed))
        self.timing.step_ended(t0, elapsed, left_out)
        self.stats.batches += 1
        self.stats.held_steps += held
        self.stats.windows += len(batch)
        self.stats.frames += len(batch)
        self.stats.window_frames += len(batch)
        self.stats.busy_s += elapsed
        if self.on_batch is not None:
            self.on_batch(len(batch), elapsed, 1, len(batch))
        pieces = [(s, p) for s, p in zip(batch, pcm, strict=True) if len(p)]
        now = self._clock()
        for stream, _ in pieces:
            if not stream.started:  # a first audio from the exact stream (a bridged one started at its bridge)
                self._note_first_audio(stream, now)
        self._deliver(pieces)

    def _note_first_audio(self, stream: DecodeStream, now: float) -> None:
        """A stream's first audio goes out now: count it, its hold (from its head ready, or its first push where a
        sentence ended before its head) and the pace it was planned at."""
        stream.started = True
        since = stream.head_ready_at if stream.head_ready_at is not None else stream.first_push_at
        hold_s = max(0.0, now - since) if since is not None else 0.0
        self.stats.first_audios += 1
        self.stats.start_hold_s += hold_s
        if stream.start_pace_s is not None:
            self.stats.paced_starts += 1
            self.stats.start_pace_s += stream.start_pace_s
        if self.on_first_audio is not None:
            self.on_first_audio(bool(stream.exact_start), hold_s, stream.start_pace_s)

    def _keeps_bridging(self, stream: DecodeStream, bridged: int, lead_s: float) -> bool:
        """Bridge on while the lead is short of what the hand-over needs, if at the pace it grew since the last
        check it gets there by the head's end; otherwise bridging on would only postpone the same stall at three
        decoded frames per frame (generation near real-time pace: a loaded engine).

        The need: after the bridge's last piece (one frame behind its input), the exact stream's next audio comes
        two frames later with 4757 - 2 * 2048 samples fewer, so the lead must cover three frame intervals T less
        3 * 2048 - 4757 samples: `handover_lead_s` - 3 g, where g = 2048 samples - T is the lead a frame adds
        (`handover_lead_s` itself at real-time pace, g = 0; before a second check g is not known)."""
        last = stream.bridge_lead
        stream.bridge_lead = (bridged, lead_s)
        if last is None or bridged <= last[0]:
            return lead_s < self.handover_lead_s
        growth = max(0.0, (lead_s - last[1]) / (bridged - last[0]))
        need = self.handover_lead_s - 3 * growth
        return need > lead_s and lead_s + growth * (self.snac.HEAD_FRAMES - bridged) >= need

    @staticmethod
    def _piece_lookahead(stream: DecodeStream) -> int:
        """Lookahead of a started stream's next bridge piece: 1 (the exact-er one), except for a stream that
        started without lookahead and has less than a frame of audio ahead of its listener. Its first piece
        handed out its whole frame, so a piece with lookahead 1 would add only the crossfade until a second
        frame beyond it arrives: if the pace falls after a fast start (a burst joining), that stalls the
        listener (gateway.benchmarks.fast_start at 1.5x: 86 ms)."""
        return 0 if stream.lookahead == 0 and stream.lead_s() < FRAME_S else 1

    def _bridge(self) -> None:
        """First audio of the streams whose head is ready (with their own lookahead), and a further piece
        (`_piece_lookahead`) for each started stream with a new frame while `_keeps_bridging` says so."""
        by_lookahead: dict[int, list[DecodeStream]] = {}
        now = self._clock()
        for stream in self._streams:
            handle = stream.handle
            if handle is None or not stream.bridging:
                continue
            if not stream.started:
                if (start := self._first_audio_at(stream)) is not None and start <= now:
                    by_lookahead.setdefault(stream.lookahead, []).append(stream)
            elif self.snac.bridging_over(handle):
                stream.bridging = False
            elif not self.snac.bridgeable(handle, lookahead := self._piece_lookahead(stream), BRIDGE_CROSSFADE):
                continue  # no new frame since its last piece
            elif self._keeps_bridging(stream, handle.bridged, stream.lead_s()):
                by_lookahead.setdefault(lookahead, []).append(stream)
            else:
                stream.bridging = False
        for lookahead, group in by_lookahead.items():
            t0 = self._clock()
            try:
                pcm = self.snac.bridge([s.handle for s in group], lookahead=lookahead,  # type: ignore[misc]
                                       crossfade=BRIDGE_CROSSFADE)
            except Exception as exc:
                log.exception("SNAC bridge failed for %d streams", len(group))
                self._fail(group, exc)
                continue
            finally:
                self.stats.bridge_s += self._clock() - t0
            now = self._clock()
            for stream in group:
                if not stream.started:  # its first piece (a started one's next piece is counted already)
                    self._note_first_audio(stream, now)
            self._deliver([(s, p) for s, p in zip(group, pcm, strict=True) if len(p)])

    def _finish_done(self, streams: Sequence[DecodeStream] | None = None) -> None:
        """End the streams (of these; default: all) whose audio is all out."""
        for stream in [s for s in (self._streams if streams is None else streams)
                       if s.handle is not None and not s.handle.closed and self.snac.done(s.handle)]:
            self._drop(stream)
            stream.loop.call_soon_threadsafe(stream.chunks.put_nowait, None)

    def _drop(self, stream: DecodeStream) -> None:
        if stream.handle is not None:
            self.snac.close(stream.handle)
        with contextlib.suppress(ValueError):
            self._streams.remove(stream)

    def _fail(self, streams: list[DecodeStream], exc: BaseException) -> None:
        error = RuntimeError(f"audio decoding failed: {exc}")
        for stream in streams:
            self._drop(stream)
            stream.loop.call_soon_threadsafe(stream.chunks.put_nowait, error)

    def _deliver(self, pieces: list[tuple[DecodeStream, np.ndarray]]) -> None:
        """One wake-up per event loop for all of a tick's audio; each piece says whether it ends its stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DecodeStream, np.ndarray, bool]]] = {}
        for stream, pcm in pieces:
            last = stream.handle is not None and self.snac.done(stream.handle)
            by_loop.setdefault(stream.loop, []).append((stream, pcm, last))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[DecodeStream, np.ndarray, bool]]) -> None:
    for stream, pcm, last in items:
        stream.chunks.put_nowait((pcm, last))
