"""The streams of a `StreamingSnac`: slots in the state pool, frames pushed and finished, and the batched tick
(`step_batch`) that advances every ready stream by one frame, edge streams (start, flush) in a masked launch and the
rest in an unmasked one, handing out each stream's new audio crossfaded from the bridge's where they overlap.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gateway.orpheus import CODEBOOK_SIZE, SAMPLES_PER_FRAME, SLOTS_PER_FRAME, Frame
from gateway.speech.snac.bridge import StreamBridge, fade_in, to_int16
from gateway.speech.snac.graphs import INT16_MAX, snac_compiles, snac_device_and_dtype, snac_kernels
from gateway.speech.snac.layers import OPEN_END
from gateway.speech.snac.state import MAX_HEAD_FRAMES, StreamHandle

log = logging.getLogger(__name__)


class StreamingSnac(StreamBridge):
    """Exact incremental SNAC decoding of many streams, batched across streams at different positions.

    Typical use, from one thread (the decoder is not thread-safe)::

        snac = StreamingSnac.load("hubertsiuzdak/snac_24khz", "cuda", "bfloat16", max_streams=512)
        h = snac.open_stream(seed=utterance_id)
        snac.push(h, frames)                    # as the LLM produces them
        fast = snac.bridge([h], lookahead=0)[0] # optional fast start (approximate, crossfaded later)
        pcm = snac.step_batch(ready_handles)    # each tick: one frame per ready stream, one or two launches
        snac.finish(h)                          # end of speech: later steps flush the tail
        ...until snac.done(h); snac.close(h)
    """

    HEAD_FRAMES = MAX_HEAD_FRAMES  # for callers without torch (the stream decoder): the bridge's reach

    def __init__(self, model: Any, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 max_streams: int = 64, chunk_frames: int = 1, compile: bool = False, kernels: bool = False,
                 head_kernels: bool = False) -> None:
        """`model`: a `snac.SNAC` (24 kHz config); its decoder weights are copied, the model is not kept.
        `compile`: the streaming step through torch.compile; `kernels`: its residual units as fused kernels;
        `head_kernels`: its block heads too. `max_streams` slots, `chunk_frames` per step."""
        super().__init__(model, device, dtype, max_streams, chunk_frames, compile, kernels, head_kernels)
        self._free = list(range(max_streams - 1, -1, -1))
        self._seeds = itertools.count(1)

    @classmethod
    def load(cls, name_or_path: str, device: str = "auto", dtype: str = "auto", max_streams: int = 64,
             chunk_frames: int = 1, capture_graphs: bool = True, max_batch: int | None = None,
             compile: bool | None = None, kernels: bool | None = None,
             head_kernels: bool | None = None) -> StreamingSnac:
        """Load a SNAC checkpoint (hub name or folder) and build the streaming decoder on `device` in `dtype`
        ("auto": `snac_device_and_dtype`), its step compiled with `compile` (None: `snac_compiles`), its residual
        units fused with `kernels` (None: `snac_kernels`) before anything runs. On CUDA with `capture_graphs`,
        graphs for batch buckets up to `max_batch` (default: min(max_streams, 512)) are captured at once.

        Where compiling or the kernels were only the default (None) and fail (no Triton for this GPU, no C
        compiler), the step runs without them with a warning, kernels first: exact all the same, only slower.
        Asked for by name, their failure stops the start. `head_kernels`: the block heads as fused kernels too
        (None: with the residual units' kernels, in each attempt that fuses them; the benchmarks set it to time
        the units alone)."""
        from snac import SNAC

        device, dtype = snac_device_and_dtype(device, dtype)
        if head_kernels:
            snac_kernels(device, True)  # where they cannot run: the reason, before the model is loaded
        model = SNAC.from_pretrained(name_or_path).eval()
        compiles, fused = snac_compiles(device, compile), snac_kernels(device, kernels)
        attempts = [(compiles, fused)]
        if fused and kernels is None:
            attempts.append((compiles, False))
        if compiles and compile is None:
            attempts.append((False, attempts[-1][1]))
        for n, (compiled, fused) in enumerate(attempts):
            heads = fused if head_kernels is None else head_kernels
            snac = cls(model, device, dtype, max_streams, chunk_frames, compiled, fused, heads)
            try:
                snac.precompile()  # a compiler or kernel that cannot work fails here, before any graph capture
                break
            except Exception as exc:
                if n == len(attempts) - 1:
                    raise
                drops_kernels = fused and not attempts[n + 1][1]
                what, then, flag = (("the fused kernels", "without them", "--no-snac-kernels") if drops_kernels
                                    else ("compiling the decoder's step", "eagerly", "--no-snac-compile"))
                log.warning("SNAC: %s failed (%s: %s); it runs %s (%s skips the attempt)", what,
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", then, flag)
        if capture_graphs:
            snac.capture_graphs(max_batch)
        return snac

    def needs_mask(self, handle: StreamHandle) -> bool:
        """Whether the stream's next step touches an edge: some layer still has samples before the start (the
        first ceil(delay_samples / 2048) = 3 steps) or the chunk passes the end (flush steps)."""
        return (handle.stepped * SAMPLES_PER_FRAME < self.delay_samples
                or handle.stepped + self.chunk_frames > handle.received)

    # -- streams -------------------------------------------------------------------------------------------

    def open_stream(self, seed: int | None = None) -> StreamHandle:
        """A new stream in a free slot (its state zeroed). `seed` keys its noise (default: a counter); the same
        seed and frames always give the same audio. Raises RuntimeError when all `max_streams` are open."""
        if not self._free:
            raise RuntimeError(f"all {self.max_streams} stream slots are in use")
        slot = self._free.pop()
        with torch.inference_mode():
            self.pool[slot].zero_()
        return StreamHandle(slot=slot, seed=(next(self._seeds) if seed is None else seed) & ((1 << 63) - 1))

    def push(self, handle: StreamHandle, frames: Sequence[Frame]) -> None:
        """Append frames (7 codes each, 0..4095) to the stream; they are decoded by later steps."""
        if handle.closed or handle.finished:
            raise ValueError("push to a finished or closed stream")
        if frames:
            codes = np.asarray(frames)
            if codes.ndim != 2 or codes.shape[1] != SLOTS_PER_FRAME or codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
                raise ValueError(f"frames must be {SLOTS_PER_FRAME} codes in [0, {CODEBOOK_SIZE}) each")
        handle._pending.extend(frames)
        room = MAX_HEAD_FRAMES - len(handle._head)
        if room > 0:
            handle._head.extend(frames[:room])
        handle.received += len(frames)
        self.stats.pushed_frames += len(frames)

    def finish(self, handle: StreamHandle) -> None:
        """No more frames: the stream's next steps flush its tail with the full decode's right zero padding
        (ceil(delay_samples / 2048 k) steps), after which `done` is true."""
        handle.finished = True

    def ready(self, handle: StreamHandle) -> bool:
        """Whether `step_batch` would advance this stream: a whole chunk is pending, or it is finished and not
        all its audio is out yet."""
        if handle.closed:
            return False
        if handle.finished:
            return handle.emitted < handle.received * SAMPLES_PER_FRAME
        return len(handle._pending) >= self.chunk_frames

    def done(self, handle: StreamHandle) -> bool:
        """Finished and all its audio handed out."""
        return handle.done

    def close(self, handle: StreamHandle) -> None:
        """Release the stream's slot (at any time; unfinished audio is dropped)."""
        if not handle.closed:
            handle.closed = True
            handle._pending.clear()
            self._free.append(handle.slot)

    def step_batch(self, handles: Sequence[StreamHandle], *, as_float: bool = False) -> list[np.ndarray]:
        """Advance every ready handle by one chunk: the streams at an edge (first 3 steps, flush) in one masked
        launch, the others in one unmasked launch (more if a kind exceeds the largest graph bucket). Returns each
        handle's new audio: int16 PCM (float32 in [-1, 1] with `as_float`), empty
        for handles that were not ready or whose new samples all lie before the start (the first two steps)
        or before the audio `bridge` handed out. One host sync per tick, none per launch or stream."""
        out = [np.zeros(0, dtype=np.float32 if as_float else np.int16) for _ in handles]
        active = [(i, h) for i, h in enumerate(handles) if self.ready(h)]
        if len({h.slot for _, h in active}) != len(active):
            raise ValueError("a stream appears twice in one step")
        top = self._max_rows()
        # Streams at an edge (start or flush) run the masked step, the others the cheaper unmasked one.
        edge = [(i, h) for i, h in active if self.needs_mask(h)]
        steady = [(i, h) for i, h in active if not self.needs_mask(h)]
        launches = [(True, edge[at:at + top]) for at in range(0, len(edge), top)]
        launches += [(False, steady[at:at + top]) for at in range(0, len(steady), top)]
        k = self.chunk_frames
        silence = [(0,) * SLOTS_PER_FRAME] * k  # past the end: any codes (masked)
        results: list[tuple[list[tuple[int, StreamHandle]], np.ndarray]] = []
        for part, (masked, group) in enumerate(launches):
            rows = np.array([[*itertools.chain.from_iterable((h._pending[:k] + silence)[:k]), h.slot, h.stepped,
                              h.received if h.finished else OPEN_END, h.seed] for _, h in group], dtype=np.int64)
            audio, pcm = self._launch(self._to_device(rows, part), masked)
            # Copied out in stream order, before the next launch may reuse the graphs' shared output memory.
            results.append((group, self._to_host(audio if as_float else pcm, ("out", part), self._max_rows())))
        if launches:
            self._wait_for_device()  # one host sync for all of the tick's launches
        for group, reused in results:
            data = reused.copy()  # the pieces handed out are views of it; the next tick overwrites the buffer
            for r, (i, h) in enumerate(group):
                out[i] = self._emit(h, data[r], as_float)
                del h._pending[:k]
                h.stepped += k
            self.stats.stream_steps += len(group)
            self.stats.stepped_frames += len(group) * k
        return out

    def _emit(self, handle: StreamHandle, chunk: np.ndarray, as_float: bool) -> np.ndarray:
        """The part of a step's output that is new audio, crossfaded with the first chunk where it overlaps."""
        start = handle.stepped * SAMPLES_PER_FRAME - self.delay_samples
        stop = start + chunk.shape[0]
        if handle.finished:
            stop = min(stop, handle.received * SAMPLES_PER_FRAME)
        lo = max(handle.emitted, start)
        if stop <= lo:
            return chunk[:0]
        piece = chunk[lo - start:stop - start]
        handle.emitted = stop
        fade = handle._fade
        if fade is not None and lo < handle.handover + fade.shape[0]:
            a, b = lo - handle.handover, min(stop - handle.handover, fade.shape[0])
            exact = piece[:b - a].astype(np.float32) / (1.0 if as_float else INT16_MAX)
            weight = fade_in(fade.shape[0])[a:b]
            mixed = (1.0 - weight) * fade[a:b] + weight * exact
            piece = piece.copy()
            piece[:b - a] = mixed if as_float else to_int16(mixed)
            if b == fade.shape[0]:
                handle._fade = None
        return piece

    def drain(self, handles: Sequence[StreamHandle], *, as_float: bool = False) -> list[np.ndarray]:
        """Run `step_batch` until no handle is ready; each handle's audio of all those steps, concatenated."""
        pieces: list[list[np.ndarray]] = [[] for _ in handles]
        while any(self.ready(h) for h in handles):
            for i, piece in enumerate(self.step_batch(handles, as_float=as_float)):
                pieces[i].append(piece)
        dtype = np.float32 if as_float else np.int16
        return [np.concatenate(p) if p else np.zeros(0, dtype=dtype) for p in pieces]
