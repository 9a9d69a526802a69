"""The fast start: an approximate decode of a stream's latest frames (one frame of left context, zero padding after
the last, as a sliding window) that hands out its first audio after one or two frames, continued piece by piece
with raised-cosine crossfades until the exact stream, which needs ~2.3 frames of right context, takes over.
`StreamBridge` is a base of `pool.StreamingSnac`. Its error, the hand-over: docs/decisions/snac-exactness-and-bridge.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from gateway.orpheus import SAMPLES_PER_FRAME, Frame
from gateway.speech.snac.graphs import INT16_MAX, DeviceSteps
from gateway.speech.snac.state import MAX_HEAD_FRAMES, StreamHandle

# Frames of left context of a bridge decode (before the first sample it hands out). Its error comes from the one
# frame of right context; 1 frame on the left costs 3 decoded frames per bridged frame, as sliding windows did.
BRIDGE_CONTEXT_FRAMES = 1


class StreamBridge(DeviceSteps):
    """`bridge` and its plan, over the device steps (`DeviceSteps`) and the streams' handles."""

    def bridging_over(self, handle: StreamHandle) -> bool:
        """Whether `bridge` can give this stream no more audio: the exact stream has taken over (it handed out
        audio past the bridge's), the stream is done or closed, or its bridged frames reached MAX_HEAD_FRAMES."""
        return (handle.closed or handle.emitted > handle.handover or handle.done
                or handle.bridged >= MAX_HEAD_FRAMES)

    @staticmethod
    def check_bridge(lookahead: int, crossfade: int = 0) -> None:
        """The bounds of `bridge`'s arguments: ValueError outside them."""
        if not 0 <= crossfade <= SAMPLES_PER_FRAME or not 0 <= lookahead < MAX_HEAD_FRAMES:
            raise ValueError(f"crossfade must be in [0, {SAMPLES_PER_FRAME}] samples and the lookahead in "
                             f"[0, {MAX_HEAD_FRAMES - 1}] frames")

    def bridgeable(self, handle: StreamHandle, lookahead: int = 1, crossfade: int = 512) -> bool:
        """Whether `bridge` would hand out audio for this stream now."""
        return self._bridge_plan(handle, lookahead, crossfade) is not None

    def _bridge_plan(self, h: StreamHandle, lookahead: int, crossfade: int) -> tuple[int, int, int, bool] | None:
        """(first frame, frames, reach, whole) of the stream's next bridge decode, or None if it would add no
        audio. `whole`: the decode ends at the utterance's true end (finished, all frames within the head)."""
        if h.received == 0 or self.bridging_over(h):
            return None
        frames = min(h.received, MAX_HEAD_FRAMES)
        whole = h.finished and h.received == frames
        if frames <= h.bridged and not whole:
            return None
        total = frames * SAMPLES_PER_FRAME
        reach = total if whole else min((frames - lookahead) * SAMPLES_PER_FRAME, total - crossfade)
        fading = 0 if h._fade is None else h._fade.shape[0]
        if reach <= h.emitted or reach < h.emitted + fading:
            return None
        # Left context for the samples it hands out; the whole utterance's end decodes from frame 0, so it is exact.
        first = 0 if whole else max(0, h.emitted // SAMPLES_PER_FRAME - BRIDGE_CONTEXT_FRAMES)
        return first, frames - first, reach, whole

    def bridge(self, handles: Sequence[StreamHandle], lookahead: int = 1, crossfade: int = 512, *,
               as_float: bool = False) -> list[np.ndarray]:
        """Fast, approximate audio of streams the exact stream has not taken over yet, ahead of it: a decode of
        their latest frames (up to the first MAX_HEAD_FRAMES; BRIDGE_CONTEXT_FRAMES of left context, zero padding
        after the last frame, as a sliding window decodes), of which the audio up to `lookahead` frames before
        its end is handed out (at most `crossfade` samples before the end: those are kept to fade into what
        comes next). Each call continues the last one with a raised-cosine crossfade of `crossfade` samples, and
        the exact stream takes over the same way once it is past the bridge's audio: `step_batch` hands out
        nothing before then, and from the end of that crossfade on the audio is exact. Where the decode reaches
        the end of a finished utterance, it decodes from frame 0 and all of it is exact (the stream is done).

        Handles with nothing to add get empty audio. Batched per decode length; the common lengths replay a
        captured graph (`capture_graphs`), the others run eagerly. `lookahead` 0 hands out a frame as soon as it
        is in (the fastest first audio)."""
        self.check_bridge(lookahead, crossfade)
        out = [np.zeros(0, dtype=np.float32 if as_float else np.int16) for _ in handles]
        groups: dict[int, list[tuple[int, StreamHandle, int, int, bool]]] = {}
        for i, h in enumerate(handles):
            plan = self._bridge_plan(h, lookahead, crossfade)
            if plan is not None:
                first, frames, reach, whole = plan
                groups.setdefault(frames, []).append((i, h, first, reach, whole))
        for frames, group in sorted(groups.items()):
            audio = self._bridge_decode([h._head[first:first + frames] for _, h, first, _, _ in group],
                                        [first for _, _, first, _, _ in group], [h.seed for _, h, _, _, _ in group])
            self.stats.approx_frames += frames * len(group)
            for row, (i, h, first, reach, whole) in enumerate(group):
                base = first * SAMPLES_PER_FRAME
                piece = audio[row, h.emitted - base:reach - base]
                if h._fade is not None:  # continue the last bridge's audio without a step
                    n = h._fade.shape[0]
                    weight = fade_in(n)
                    piece = piece.copy()
                    piece[:n] = (1.0 - weight) * h._fade + weight * piece[:n]
                h._fade = audio[row, reach - base:reach - base + crossfade].copy() if crossfade and not whole \
                    else None
                h.handover = h.emitted = reach
                h.bridged = min(h.received, MAX_HEAD_FRAMES)
                out[i] = piece if as_float else to_int16(piece)
        return out

    def _bridge_decode(self, codes: list[list[Frame]], offsets: list[int], seeds: list[int]) -> np.ndarray:
        """Float32 audio [n, 2048 frames] of n equal-length bridge windows: captured graphs where they exist for
        the length (more rows than the largest bucket: several replays of it), else eagerly. One host sync.

        Replays, not one eager decode, for a burst's many first pieces: an eager decode is ~175 launches, and with
        vLLM's engine in another process each can wait for the GPU to switch contexts
        (docs/decisions/snac-exactness-and-bridge.md)."""
        frames = len(codes[0])
        rows = np.array([[*itertools.chain.from_iterable(c), o, s] for c, o, s in zip(codes, offsets, seeds,
                                                                                    strict=True)], dtype=np.int64)
        buckets = sorted(b for f, b in self._bridge_graphs if f == frames)
        part = buckets[-1] if buckets else len(rows)
        cuda = self.device.type == "cuda"
        host = self._host_buffer(("bridge", frames), (len(rows), frames * SAMPLES_PER_FRAME), torch.float32,
                                 pinned=cuda)[:len(rows)]
        with torch.inference_mode():
            packed = torch.from_numpy(rows).to(self.device)
            for start in range(0, len(rows), part):
                chunk = packed[start:start + part]
                bucket = next((b for b in buckets if b >= chunk.shape[0]), None)
                self.stats.bridge_launches += 1
                if bucket is None:
                    audio, _ = self._run_bridge(chunk, frames)
                else:
                    self.stats.bridge_graphed += 1
                    audio, _ = self._bridge_graphs[frames, bucket](chunk)
                # Stream-ordered: the copy reads this replay's output before the next replay reuses its memory.
                host[start:start + chunk.shape[0]].copy_(audio, non_blocking=cuda)
            self._wait_for_device()
            return host.numpy().copy()  # the host buffer serves the next bridge decode of this length


def fade_in(length: int) -> np.ndarray:
    """Raised-cosine weights of the incoming (exact) signal over a crossfade of `length` samples."""
    return (0.5 - 0.5 * np.cos(np.pi * (np.arange(length, dtype=np.float32) + 0.5) / length)).astype(np.float32)


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16 as the decoder's own conversion does (scale by 32767, truncate toward zero)."""
    return (np.clip(audio, -1.0, 1.0) * INT16_MAX).astype(np.int16)
