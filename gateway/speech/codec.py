"""SNAC 24 kHz decoding: sliding windows per stream, one batched forward pass per tick for all streams.

SNAC's decoder is non-causal, so a frame's samples depend on neighbouring frames. Each stream decodes a
window of `context` frames before and `lookahead` frames after the `hop` frames it emits, and keeps only the
samples of those `hop` frames. The first window has no left context and the last no right context, so the
first and the last frame of an utterance are emitted too (the reference decoder loses both).

`StreamWindower` cuts the windows. A stream keeps one decode round in flight; frames that arrive meanwhile
go into its next window, so windows emit one frame at light load and up to `max_hop` under load (adaptive
hop: less recomputation per new frame, fewer and larger batches exactly when the decoder is busy).

`DecodeBatcher` runs the model in one worker thread: whatever windows are waiting when it becomes free are
stacked, grouped by length, and decoded in one pass per length, shortest first. The event loop only awaits
futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from gateway.orpheus import LAYER_CODES_PER_FRAME, SAMPLES_PER_FRAME, Frame, windows_to_layer_codes

log = logging.getLogger(__name__)

INT16_MAX = 32767


@dataclass(frozen=True)
class DecodeWindow:
    """Frames to decode together, and which of their samples are new audio."""

    frames: tuple[Frame, ...]
    keep_from: int  # first frame (index into `frames`) whose samples are emitted
    keep_count: int  # number of frames emitted

    @property
    def length(self) -> int:
        return len(self.frames)


class StreamWindower:
    """Per-stream window boundaries: `push` stores frames, `take` cuts the next decode window.

    The caller takes a window when the stream's previous decode has come back, so the window covers every
    frame that arrived meanwhile (adaptive hop): at light load the decoder returns within a frame time and
    windows emit `hop` frames; under load they grow up to `max_hop`, which decodes fewer, longer windows
    (less recomputed context per new frame, fewer and larger batches). The first window emits as soon as
    `first_lookahead` frames (default: `lookahead`) follow its first frame; the final ones (`final=True`)
    emit the rest, the last frame included. Every frame is emitted exactly once, in order.
    """

    def __init__(self, context: int = 1, lookahead: int = 1, hop: int = 1, max_hop: int | None = None,
                 first_lookahead: int | None = None) -> None:
        self.context = context
        self.lookahead = lookahead
        self.first_lookahead = lookahead if first_lookahead is None else first_lookahead
        self.hop = hop
        self.max_hop = max(hop, hop if max_hop is None else max_hop)
        self._frames: list[Frame] = []
        self._offset = 0  # absolute index of self._frames[0]
        self.emitted = 0  # frames whose audio has been handed out

    @property
    def received(self) -> int:
        return self._offset + len(self._frames)

    def push(self, frames: Sequence[Frame]) -> None:
        self._frames.extend(frames)

    def start_early(self) -> None:
        """Let the first window go without its right context (the caller knows the next frames come soon)."""
        if self.emitted == 0:
            self.first_lookahead = 0

    def _lookahead(self) -> int:
        return self.first_lookahead if self.emitted == 0 else self.lookahead

    def ready(self, final: bool = False) -> int:
        """Frames a window could emit now (before `final`, the last `lookahead` frames wait for their right
        context)."""
        return max(0, self.received - self.emitted - (0 if final else self._lookahead()))

    def take(self, final: bool = False, patient: bool = False) -> DecodeWindow | None:
        """The next window: up to `max_hop` ready frames, or None while fewer than `hop` are ready (`max_hop`
        when `patient`: a stream far enough ahead of real time waits for a whole window, which recomputes
        less context per new frame). The first window and the final ones go with fewer: first audio as soon
        as possible, then the tail."""
        ready = self.ready(final)
        if ready <= 0:
            return None
        if final:
            count = min(ready, self.max_hop)
        elif self.emitted == 0:
            count = min(ready, self.hop)
        elif ready >= (self.max_hop if patient else self.hop):
            count = min(ready, self.max_hop)
        else:
            return None
        window = self._window(count)
        self.emitted += count
        # Keep only the left context the next window needs.
        drop = max(0, self.emitted - self.context - self._offset)
        if drop:
            del self._frames[:drop]
            self._offset += drop
        return window

    def take_round(self, final: bool = False, patient: bool = False) -> list[DecodeWindow]:
        """The windows of one decode round: normally one (or none). A stream more than `max_hop` frames
        behind catches up in whole `max_hop` windows (all of one length, so they share a batch); `final`
        takes everything left."""
        windows: list[DecodeWindow] = []
        while (window := self.take(final, patient)) is not None:
            windows.append(window)
            if not final and self.ready() < self.max_hop:
                break
        return windows

    def window_lengths(self, early_start: bool = False) -> list[int]:
        """The window lengths a stream uses (for CUDA graph capture): first windows (also without right
        context with `early_start`), steady windows of `hop`..`max_hop` new frames, and the last window of a
        sentence (no right context)."""
        first = {count + lookahead for count in range(1, self.hop + 1)
                 for lookahead in {self.first_lookahead, *((0,) if early_start else ())}}
        steady = {self.context + count + self.lookahead for count in range(self.hop, self.max_hop + 1)}
        last = {self.context + count for count in range(1, self.max_hop + 1)}
        return sorted(first | steady | last)

    def _window(self, count: int) -> DecodeWindow:
        start = max(self._offset, self.emitted - self.context)
        end = min(self.received, self.emitted + count + self._lookahead())
        frames = tuple(self._frames[start - self._offset:end - self._offset])
        return DecodeWindow(frames=frames, keep_from=self.emitted - start, keep_count=count)


GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _decode_to_pcm(model: Any, codes: Any, frames: int) -> Any:
    """SNAC-decode rows of `windows_to_layer_codes` into int16 PCM [batch, samples], all on the device."""
    import torch

    bounds = [b * frames for b in itertools.accumulate((0, *LAYER_CODES_PER_FRAME))]
    layers = [codes[:, a:b].contiguous() for a, b in itertools.pairwise(bounds)]
    audio = model.decode(layers)[:, 0, :].float()
    return (audio.clamp(-1.0, 1.0) * INT16_MAX).to(torch.int16)


class _GraphedDecoder:
    """The SNAC decoder captured as CUDA graphs for one window length and a ladder of batch sizes.

    A batch is padded up to the next captured size and replayed. A decode is three GPU submissions: one
    host-to-device copy of the codes (from pinned memory), one graph replay (decoder + conversion to int16)
    and one device-to-host copy of the PCM. Few submissions matter beyond launch cost: the engine runs in
    another process, so each submission can wait for the GPU to switch to this process's context.
    """

    def __init__(self, model: Any, device: str, frames: int, max_batch: int, pool: Any = None) -> None:
        import torch

        self.frames = frames
        self.sizes = sorted({b for b in GRAPH_BATCH_BUCKETS if b < max_batch} | {max_batch})
        width = frames * sum(LAYER_CODES_PER_FRAME)
        self._staging = torch.zeros((self.sizes[-1], width), dtype=torch.long).pin_memory()
        self._graphs: dict[int, tuple[Any, Any, Any]] = {}
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
                codes = torch.zeros((size, width), dtype=torch.long, device=device)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        _decode_to_pcm(model, codes, frames)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    pcm = _decode_to_pcm(model, codes, frames)
                self._graphs[size] = (graph, codes, pcm)

    def fits(self, frames: int, batch: int) -> bool:
        return frames == self.frames and batch <= self.sizes[-1]

    def __call__(self, codes: np.ndarray) -> np.ndarray:
        """int16 PCM [batch, samples] of `codes` ([batch, 7 * frames], `windows_to_layer_codes`)."""
        batch = codes.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        graph, static_codes, static_pcm = self._graphs[size]
        staging = self._staging[:batch]
        staging.numpy()[:] = codes  # the previous call's copy from here finished: it ended with a sync
        static_codes[:batch].copy_(staging, non_blocking=True)
        graph.replay()
        return static_pcm[:batch].cpu().numpy()  # copies out before the buffer is replayed into again


# SNAC's precision where `--snac-dtype auto` runs it on a GPU. Measured on one H200 in one lease
# (docs/benchmarks.md, 2026-12-04): the exact streaming decoder in bfloat16 kept 180 of 256 streams real time at
# 0 ms (float32: 74) and 110 of 384 at 500 ms (73), at 0.67 GPU ms per audio second at B=256 (0.80); 39 dB SNR
# against float32 (tests/test_snac_stream.py holds it above 33 dB). float16 is as fast and closer (56 dB), but
# not its range: snake's 1 / (alpha + 1e-9) overflows float16 for a trained alpha near 0, which random weights
# cannot show.
GPU_SNAC_DTYPE = "bfloat16"


def snac_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """The one reading of `--snac-device auto` (CUDA when there is one) and `--snac-dtype auto` (GPU_SNAC_DTYPE on
    CUDA; float32 elsewhere: CPUs without bfloat16 units run it slower, and CPU tests compare against float32)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = GPU_SNAC_DTYPE if device.startswith("cuda") else "float32"
    return device, dtype


class SnacModel:
    """The SNAC decoder on one device; turns batches of equal-length windows into int16 PCM."""

    def __init__(self, model: Any, device: str) -> None:
        self.model = model
        self.device = device
        self._graphed: list[_GraphedDecoder] = []

    @classmethod
    def load(cls, name_or_path: str, device: str = "auto", dtype: str = "auto") -> SnacModel:
        """`dtype`: the decoder's weights and activations (bfloat16 halves its GPU time; the PCM is the
        float32 result within a tolerance bench/device/snac_check.py measures)."""
        import torch
        from snac import SNAC

        device, dtype = snac_device_and_dtype(device, dtype)
        model = SNAC.from_pretrained(name_or_path).eval().to(device=device, dtype=getattr(torch, dtype))
        # Only the decoder is used; dropping the encoder saves memory on every worker.
        model.encoder = None
        return cls(model, device)

    def capture_graphs(self, window_lengths: Sequence[int], max_batch: int) -> None:
        """CUDA-graph the window lengths streams use (`StreamWindower.window_lengths`); GPU only. Each length
        costs one capture per batch bucket, so start-up grows with the number of lengths."""
        if not self.device.startswith("cuda"):
            return
        import torch

        t0 = time.perf_counter()
        # One memory pool for every length, longest first (as for batch sizes within a length): the pool is
        # about the size of the longest window's largest batch, not the sum over lengths. Safe because the
        # worker replays one graph at a time and copies its output out before the next replay.
        pool = torch.cuda.graph_pool_handle()
        try:
            for frames in sorted(set(window_lengths), reverse=True):
                self._graphed.append(_GraphedDecoder(self.model, self.device, frames, max_batch, pool))
        except Exception:  # an eager decoder is slower, never wrong
            log.exception("SNAC CUDA graph capture failed; decoding eagerly")
            self._graphed.clear()
            return
        log.info("SNAC CUDA graphs for windows of %s frames, batches up to %d, in %.1f s",
                 sorted(set(window_lengths)), max_batch, time.perf_counter() - t0)

    def graphed(self, frames: int, batch: int) -> _GraphedDecoder | None:
        """The captured decoder for this window length and batch, if any."""
        return next((g for g in self._graphed if g.fits(frames, batch)), None)

    def decode_codes(self, codes: np.ndarray, frames: int, *, use_graphs: bool = True) -> np.ndarray:
        """int16 PCM [batch, samples] of `codes` ([batch, 7 * frames], `windows_to_layer_codes`)."""
        import torch

        with torch.inference_mode():
            graphed = self.graphed(frames, codes.shape[0]) if use_graphs else None
            if graphed is not None:
                return graphed(codes)
            return _decode_to_pcm(self.model, torch.from_numpy(codes).to(self.device), frames).cpu().numpy()



def own_stream(device: str) -> contextlib.AbstractContextManager[Any]:
    """Run the calling thread's GPU work on a CUDA stream of its own. Where the model shares the process (the
    engine core), its kernels are on the default stream: decodes queued there would wait behind every step."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.Stream(device))


class CodeDecoder(Protocol):
    """What `DecodeBatcher` decodes with: a `SnacModel`, or a `codec_server.CodecClient` of a shared one."""

    def decode_codes(self, codes: np.ndarray, frames: int) -> np.ndarray: ...


def decode_windows(decoder: CodeDecoder, windows: Sequence[DecodeWindow]) -> list[np.ndarray]:
    """Decode windows of one length in one pass (one copy in, one out) and keep each one's new samples."""
    frames = windows[0].length
    pcm = decoder.decode_codes(windows_to_layer_codes([w.frames for w in windows]), frames)
    return [pcm[i, w.keep_from * SAMPLES_PER_FRAME:(w.keep_from + w.keep_count) * SAMPLES_PER_FRAME]
            for i, w in enumerate(windows)]


T = TypeVar("T")


def drain(waiting: queue.SimpleQueue[T | None], first: T) -> tuple[list[T], bool]:
    """`first` and whatever else is waiting, without blocking; and whether the close marker (None) came."""
    items = [first]
    with contextlib.suppress(queue.Empty):
        while (more := waiting.get_nowait()) is not None:
            items.append(more)
        return items, True
    return items, False


def batches_by_length(items: Sequence[T], length: Callable[[T], int], rows: Callable[[T], int],
                      max_batch: int) -> Iterator[tuple[int, list[T]]]:
    """(length, items) batches of one window length each, shortest length first, at most `max_batch` rows each
    (an item's rows stay in one batch). Shortest first: a stream's first window (no left context) is the
    shortest, and first audio waits for nothing but it; short passes first also make the mean wait shorter."""
    by_length: dict[int, list[T]] = {}
    for item in items:
        by_length.setdefault(length(item), []).append(item)
    for frames, same in sorted(by_length.items()):
        batch: list[T] = []
        count = 0
        for item in same:
            if batch and count + rows(item) > max_batch:
                yield frames, batch
                batch, count = [], 0
            batch.append(item)
            count += rows(item)
        yield frames, batch


@dataclass
class _Job:
    window: DecodeWindow
    future: asyncio.Future[np.ndarray]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class DecodeStats:
    batches: int = 0
    windows: int = 0
    frames: int = 0  # new audio frames emitted
    window_frames: int = 0  # frames run through SNAC, context and lookahead included (>= frames)
    skipped: int = 0  # windows cancelled while they waited (never decoded)
    busy_s: float = 0.0


class DecodeBatcher:
    """One worker thread decodes the waiting windows of all streams together.

    Batching is natural: while a pass runs, new windows queue up, and the next pass takes them all (up to
    `max_batch`). `on_batch(windows, seconds, window_length, new_frames)` is called from the worker after
    each pass (metrics).
    """

    def __init__(self, model: CodeDecoder, max_batch: int = 256,
                 on_batch: Callable[[int, float, int, int], None] | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        self.stats = DecodeStats()
        self.on_batch = on_batch
        self._queue: queue.SimpleQueue[list[_Job] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="snac-decoder", daemon=True)
        self._closed = False
        self._thread.start()

    async def decode(self, window: DecodeWindow) -> np.ndarray:
        return (await self.decode_many([window]))[0]

    async def decode_many(self, windows: Sequence[DecodeWindow]) -> list[np.ndarray]:
        """The PCM of each window, in order; the windows are queued together, so they share a pass."""
        if self._closed:
            raise RuntimeError("decoder is closed")
        if not windows:
            return []
        loop = asyncio.get_running_loop()
        jobs = [_Job(w, loop.create_future(), loop) for w in windows]
        self._queue.put(jobs)
        try:
            return [await job.future for job in jobs]
        finally:
            for job in jobs:  # cancelled or failed: the worker skips what is still queued
                if not job.future.done():
                    job.future.cancel()
                elif not job.future.cancelled():
                    job.future.exception()  # retrieved: a failed batch is reported once, not at garbage collection

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        release = getattr(self.model, "release", None)  # a CodecClient's connection and folder
        if release is not None:
            release()

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            waiting, closing = drain(self._queue, first)
            jobs = [job for jobs in waiting for job in jobs if not job.future.cancelled()]
            self.stats.skipped += sum(len(round_) for round_ in waiting) - len(jobs)
            for length, group in batches_by_length(jobs, lambda j: j.window.length, lambda _: 1, self.max_batch):
                self._decode_group(length, group)
            if closing:
                return

    def _decode_group(self, length: int, group: list[_Job]) -> None:
        t0 = time.perf_counter()
        try:
            results: list[Any] = decode_windows(self.model, [j.window for j in group])
            error: BaseException | None = None
        except Exception as exc:  # one bad batch fails its utterances, not the worker
            log.exception("SNAC decode failed for a batch of %d", len(group))
            results, error = [None] * len(group), exc
        elapsed = time.perf_counter() - t0
        new_frames = sum(j.window.keep_count for j in group)
        stats = self.stats
        stats.batches += 1
        stats.windows += len(group)
        stats.frames += new_frames
        stats.window_frames += length * len(group)
        stats.busy_s += elapsed
        if self.on_batch is not None:
            self.on_batch(len(group), elapsed, length, new_frames)
        # One wake-up per event loop for the whole group, not one per window.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[np.ndarray], Any]]] = {}
        for job, result in zip(group, results, strict=True):
            by_loop.setdefault(job.loop, []).append((job.future, result))
        for loop, resolved in by_loop.items():
            loop.call_soon_threadsafe(_resolve, resolved, error)


def _resolve(resolved: list[tuple[asyncio.Future[np.ndarray], Any]], error: BaseException | None) -> None:
    for future, result in resolved:
        if future.done():
            continue
        if error is not None:
            future.set_exception(RuntimeError(f"audio decoding failed: {error}"))
        else:
            future.set_result(result)
