"""Raw PCM out at the rate and sample format a streaming client asks for: 24 kHz mono int16 in, `pcm_s16le` or
`pcm_f32le` out at one of `PCM_RATES`, chunk by chunk, through PyAV's resampler (FFmpeg's swresample).

Owns `PCM_RATES`, `PCM_ENCODINGS` and `PcmOutput`. Imports only av and numpy, like `formats`.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import numpy.typing as npt

from gateway.media.formats import check_pcm
from gateway.orpheus import SAMPLE_RATE

# The rates a client may ask for (telephony, wideband, CD and studio families, and the gateway's own).
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
# Encoding name -> (PyAV sample format, little-endian numpy dtype of the bytes sent).
PCM_ENCODINGS: dict[str, tuple[str, str]] = {"pcm_s16le": ("s16", "<i2"), "pcm_f32le": ("flt", "<f4")}


class PcmOutput:
    """One stream's raw PCM: `feed()` each 24 kHz chunk and send what it returns, then send `finish()`.

    The resampler keeps its filter state across chunks (no seam at a chunk's edge) and hands its tail out at
    `finish()`, so the samples out are the whole input at the new rate. 24 kHz `pcm_s16le` is a copy."""

    def __init__(self, sample_rate: int, encoding: str) -> None:
        if sample_rate not in PCM_RATES:
            raise ValueError(f"sample_rate must be one of {list(PCM_RATES)}, got {sample_rate!r}")
        if encoding not in PCM_ENCODINGS:
            raise ValueError(f"encoding must be one of {list(PCM_ENCODINGS)}, got {encoding!r}")
        self.sample_rate = sample_rate
        self.encoding = encoding
        av_format, self._dtype = PCM_ENCODINGS[encoding]
        self._resampler = None if (sample_rate, encoding) == (SAMPLE_RATE, "pcm_s16le") else \
            av.AudioResampler(format=av_format, layout="mono", rate=sample_rate)
        self._pts = 0
        self.samples_out = 0

    def feed(self, pcm: npt.ArrayLike) -> bytes:
        samples = check_pcm(pcm)
        if self._resampler is None:
            self.samples_out += samples.size
            return samples.astype("<i2", copy=False).tobytes()
        if not samples.size:
            return b""
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.time_base = Fraction(1, SAMPLE_RATE)
        frame.pts = self._pts
        self._pts += samples.size
        return self._bytes(self._resampler.resample(frame))

    def finish(self) -> bytes:
        """The resampler's tail (nothing for a copy); call once, at the end of the stream."""
        if self._resampler is None:
            return b""
        out = self._bytes(self._resampler.resample(None))
        self._resampler = None
        return out

    def _bytes(self, frames: list[av.AudioFrame]) -> bytes:
        parts = [np.asarray(f.to_ndarray()).reshape(-1).astype(self._dtype, copy=False) for f in frames]
        self.samples_out += sum(p.size for p in parts)
        return b"".join(p.tobytes() for p in parts)
