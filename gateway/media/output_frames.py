"""The playout's output frames: their format, and an utterance's PCM cut into whole frames of it.

The format is exactly what aiortc's OpusEncoder accepts (s16, mono or stereo, 48 kHz; it repacketises to
960-sample frames itself, but the playout already hands it 20 ms so nothing is buffered inside the encoder).
`FrameCutter` resamples one utterance's PCM (any rate, any chunk length) to that format and queues it as whole
20 ms frames, keeping the remainder until more comes or the end pads it. It knows nothing of time: when a frame
leaves is the playout track's (`gateway.media.playout`).
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction

import av
import numpy as np

__all__ = [
    "CHANNEL_LAYOUT",
    "FRAME_BYTES",
    "FRAME_MS",
    "FRAME_SAMPLES",
    "FRAME_SECONDS",
    "MS_PER_SECOND",
    "PCM_DTYPE",
    "SAMPLE_FORMAT",
    "SAMPLE_RATE_OUT",
    "TIME_BASE",
    "FrameCutter",
    "FramePayload",
]

SAMPLE_RATE_OUT = 48000
FRAME_MS = 20
MS_PER_SECOND = 1000
FRAME_SAMPLES = SAMPLE_RATE_OUT * FRAME_MS // MS_PER_SECOND  # 960
FRAME_SECONDS = FRAME_MS / MS_PER_SECOND
SAMPLE_FORMAT = "s16"
CHANNEL_LAYOUT = "mono"
PCM_DTYPE = np.dtype(np.int16)
FRAME_BYTES = FRAME_SAMPLES * PCM_DTYPE.itemsize  # 1920
TIME_BASE = Fraction(1, SAMPLE_RATE_OUT)

FramePayload = bytes | np.ndarray  # a queued frame: exactly FRAME_BYTES of s16 samples (bytes or an int16 view)


class FrameCutter:
    """One utterance's PCM at `input_sample_rate` as whole output frames (`frames`, oldest first).

    `push` and `end` return how many whole frames they queued; the caller pops `frames` as it plays them.
    """

    __slots__ = ("_in_rate", "_partial", "_partial_len", "_resampler", "frames", "in_samples")

    def __init__(self, input_sample_rate: int) -> None:
        self._in_rate = input_sample_rate
        self._resampler: av.AudioResampler | None = av.AudioResampler(
            format=SAMPLE_FORMAT, layout=CHANNEL_LAYOUT, rate=SAMPLE_RATE_OUT
        )
        self.frames: deque[FramePayload] = deque()
        # Resampled samples not yet making a whole frame (reused buffer).
        self._partial = np.zeros(FRAME_SAMPLES, dtype=PCM_DTYPE)
        self._partial_len = 0
        self.in_samples = 0  # input samples pushed

    def push(self, pcm: np.ndarray) -> int:
        """Append mono int16 PCM (any length); returns the whole frames it completed.

        Raises ``ValueError`` for PCM that is not a mono int16 numpy array.
        """
        if not isinstance(pcm, np.ndarray) or pcm.dtype != PCM_DTYPE:
            raise ValueError(f"pcm must be an int16 numpy array, got {getattr(pcm, 'dtype', type(pcm).__name__)}")
        if pcm.ndim != 1:
            if pcm.size != max(pcm.shape, default=0):
                raise ValueError(f"pcm must be mono, got shape {pcm.shape}")
            pcm = pcm.reshape(-1)
        if pcm.size == 0:
            return 0
        assert self._resampler is not None  # only None once ended
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm).reshape(1, -1),
            format=SAMPLE_FORMAT,
            layout=CHANNEL_LAYOUT,
        )
        frame.sample_rate = self._in_rate
        self.in_samples += pcm.size
        added = 0
        for out in self._resampler.resample(frame):
            added += self._cut(out.to_ndarray().reshape(-1))
        return added

    def next_frame_index(self) -> int:
        """Index (within the utterance) of the frame that will hold the next input sample."""
        out_pos = self.in_samples * SAMPLE_RATE_OUT // self._in_rate
        return out_pos // FRAME_SAMPLES

    def end(self) -> int:
        """No more input: flush the resampler and pad the last frame with silence; returns the frames queued."""
        added = 0
        if self._resampler is not None:
            # Flushing drains the resampler's filter delay (~32 samples), so
            # the utterance keeps exactly 2x its input samples.
            for out in self._resampler.resample(None):
                added += self._cut(out.to_ndarray().reshape(-1))
            self._resampler = None
        if self._partial_len:
            self._partial[self._partial_len :] = 0
            self.frames.append(self._partial.tobytes())
            self._partial_len = 0
            added += 1
        return added

    def drop(self) -> int:
        """Discard every queued frame and the resampler; returns how many frames were queued."""
        dropped = len(self.frames)
        self.frames.clear()
        self._resampler = None
        return dropped

    def _cut(self, out: np.ndarray) -> int:
        """Cut resampled samples into whole frames; keep the remainder. Returns the whole frames queued."""
        n = out.shape[0]
        pos = 0
        added = 0
        if self._partial_len:
            take = min(FRAME_SAMPLES - self._partial_len, n)
            self._partial[self._partial_len : self._partial_len + take] = out[:take]
            self._partial_len += take
            pos = take
            if self._partial_len == FRAME_SAMPLES:
                self.frames.append(self._partial.tobytes())
                self._partial_len = 0
                added += 1
        whole_end = pos + (n - pos) // FRAME_SAMPLES * FRAME_SAMPLES
        # Views into `out` (no copy); the track's frame update() copies them into the AVFrame.
        for start in range(pos, whole_end, FRAME_SAMPLES):
            self.frames.append(out[start : start + FRAME_SAMPLES])
        added += (whole_end - pos) // FRAME_SAMPLES
        tail = n - whole_end
        if tail:
            self._partial[:tail] = out[whole_end:]
            self._partial_len = tail
        return added
