"""The exact streaming SNAC decoder (`snac_stream.StreamingSnac`) serving every sentence of a process: one worker
thread owns it, and each tick advances all streams that have a frame to decode in one batched launch.

Deadline order: each tick takes the ready streams by how far their audio runs ahead of real time, least first
(a stream about to run dry before one far ahead), up to `max_batch`; a stream that is far ahead simply waits a
tick when the batch is full. A stream's first audio comes from `first_chunk` (an approximate decode of its first
frames, crossfaded into the exact stream): after `first_frames + 1` frames, or as soon as its sentence ends.

The event loop only enqueues commands and awaits chunks; nothing here blocks it.
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

from gateway.orpheus import Frame
from gateway.speech.codec import DecodeStats

if TYPE_CHECKING:  # torch loads with the decoder, not with this module (codec_server imports it, torch-free)
    from gateway.speech.snac_stream import StreamHandle, StreamingSnac

log = logging.getLogger(__name__)

STEPS_BEFORE_AUDIO = 2  # a stream's first two steps emit nothing (4096 < 4757 samples of delay): step that far
FIRST_CHUNK_CROSSFADE = 512  # samples: halves the hand-over error of a 256-sample fade (snac_stream docstring)


@dataclass(eq=False)
class DecodeStream:
    """One sentence being decoded. The synthesizer pushes frames and reads `chunks`: (int16 PCM, is the last)
    pairs, then None; an exception if its decode failed."""

    loop: asyncio.AbstractEventLoop
    lead_s: Callable[[], float]  # how far this utterance's audio out runs ahead of real time (the deadline)
    first_frames: int = 2  # frames the first chunk emits (1: fastest start, 2: more slack before exact audio)
    chunks: asyncio.Queue[tuple[np.ndarray, bool] | BaseException | None] = field(default_factory=asyncio.Queue)
    handle: StreamHandle | None = None  # worker thread only
    started: bool = False  # worker thread only: its first chunk went out


class StreamDecoder:
    """Owns a `StreamingSnac` in one worker thread; `open` a stream per sentence."""

    def __init__(self, snac: StreamingSnac, max_batch: int = 256,
                 on_batch: Callable[[int, float, int, int], None] | None = None) -> None:
        self.snac = snac
        self.max_batch = max_batch
        self.on_batch = on_batch  # (streams, seconds, frames per stream, new frames): the metrics hook
        self.stats = DecodeStats()
        self._commands: queue.SimpleQueue[tuple[str, DecodeStream, Any] | None] = queue.SimpleQueue()
        self._streams: list[DecodeStream] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="snac-stream-decoder", daemon=True)
        self._thread.start()

    # --- event-loop side --------------------------------------------------------------------------
    def open(self, lead_s: Callable[[], float], first_frames: int = 2) -> DecodeStream:
        if self._closed:
            raise RuntimeError("decoder is closed")
        stream = DecodeStream(asyncio.get_running_loop(), lead_s, first_frames)
        self._commands.put(("open", stream, None))
        return stream

    def push(self, stream: DecodeStream, frames: Sequence[Frame]) -> None:
        self._commands.put(("push", stream, list(frames)))

    def finish(self, stream: DecodeStream) -> None:
        self._commands.put(("finish", stream, None))

    def release(self, stream: DecodeStream) -> None:
        """The sentence is over (done, failed or cancelled): free its slot; undelivered audio is dropped."""
        self._commands.put(("close", stream, None))

    def close(self) -> None:
        self._closed = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    # --- worker thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                busy = any(self._workable(s) for s in self._streams)
                try:
                    command = self._commands.get_nowait() if busy else self._commands.get()
                except queue.Empty:
                    command = ...
                if command is None:
                    return
                if command is not ...:
                    self._apply(command)
                    with contextlib.suppress(queue.Empty):  # everything else that waits, before deciding
                        while (more := self._commands.get_nowait()) is not None:
                            self._apply(more)
                        return
                self._tick()

    def _apply(self, command: tuple[str, DecodeStream, Any]) -> None:
        kind, stream, frames = command
        try:
            if kind == "open":
                stream.handle = self.snac.open_stream()
                self._streams.append(stream)
            elif stream.handle is None or stream.handle.closed:
                return  # opened after a failure, or already released
            elif kind == "push":
                self.snac.push(stream.handle, frames)
            elif kind == "finish":
                self.snac.finish(stream.handle)
            elif kind == "close":
                self._drop(stream)
        except Exception as exc:  # a full pool or bad codes fail this sentence, not the worker
            log.warning("SNAC stream %s failed: %s", kind, exc)
            self._fail([stream], exc)

    def _workable(self, stream: DecodeStream) -> bool:
        handle = stream.handle
        if handle is None or handle.closed:
            return False
        if not stream.started:
            return self._head_ready(stream) or (self.snac.ready(handle) and handle.stepped < STEPS_BEFORE_AUDIO)
        return self.snac.ready(handle)

    def _head_ready(self, stream: DecodeStream) -> bool:
        handle = stream.handle
        assert handle is not None
        return handle.received >= stream.first_frames + 1 or (handle.finished and handle.received > 0)

    def _tick(self) -> None:
        t0 = time.perf_counter()
        heads = [s for s in self._streams if not s.started and s.handle is not None and self._head_ready(s)]
        if heads:
            self._first_chunks(heads)
        ready = [s for s in self._streams if self._workable(s)]  # the heads just started are workable now
        if not ready:
            self._finish_done()
            return
        ready.sort(key=lambda s: s.lead_s())  # deadline order: the stream closest to running dry first
        batch = ready[:self.max_batch]
        try:
            pcm = self.snac.step_batch([s.handle for s in batch])  # type: ignore[misc]
        except Exception as exc:
            log.exception("SNAC stream step failed for %d streams", len(batch))
            self._fail(batch, exc)
            return
        elapsed = time.perf_counter() - t0
        self.stats.batches += 1
        self.stats.windows += len(batch)
        self.stats.frames += len(batch)
        self.stats.window_frames += len(batch)
        self.stats.busy_s += elapsed
        if self.on_batch is not None:
            self.on_batch(len(batch), elapsed, 1, len(batch))
        self._deliver([(s, p) for s, p in zip(batch, pcm, strict=True) if len(p)])
        self._finish_done()

    def _first_chunks(self, heads: list[DecodeStream]) -> None:
        by_frames: dict[int, list[DecodeStream]] = {}
        for stream in heads:
            by_frames.setdefault(stream.first_frames, []).append(stream)
        for frames, group in by_frames.items():
            try:
                pcm = self.snac.first_chunk([s.handle for s in group], emit_frames=frames,  # type: ignore[misc]
                                            crossfade=FIRST_CHUNK_CROSSFADE)
            except Exception as exc:
                log.exception("SNAC first chunk failed for %d streams", len(group))
                self._fail(group, exc)
                continue
            for stream in group:
                stream.started = True
            self._deliver(list(zip(group, pcm, strict=True)))

    def _finish_done(self) -> None:
        for stream in [s for s in self._streams if s.handle is not None and self.snac.done(s.handle)]:
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
