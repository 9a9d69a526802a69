"""Streaming encoders for the OpenAI speech API's `response_format` values: mp3, opus, aac, flac, wav, pcm.

Owns turning a stream of 24 kHz mono int16 PCM chunks into the bytes of one of those formats, chunk by chunk, so an
HTTP response can send audio while the utterance is still being generated: the content types (`FORMATS`), the
streamed WAV header (`wav_header`), and `StreamEncoder`. Every format puts audio out from the first 85 ms chunk on:
the output is non-seekable (no header patched later), each packet is flushed at once, Opus is CELT-only in 40 ms Ogg
pages, FLAC uses one SNAC frame per block (docs/decisions/streaming-audio-formats.md). Runs in the calling thread;
imports only av, numpy and `gateway.orpheus` (SNAC's SAMPLE_RATE), so the HTTP edge, benchmarks and tests can use it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
import numpy.typing as npt

from gateway.orpheus import SAMPLE_RATE  # what SNAC makes; the default input rate

FALLBACK_RATE = 48000  # every codec here takes 48 kHz: the target when a codec cannot take the input rate
WAV_STREAMING_SIZE = 0xFFFFFFFF  # unknown length: players read a streamed WAV up to the end
OGG_PAGE_US = 40_000  # Ogg page duration (µs): see the module docstring
FLAC_BLOCK = 2048  # samples per FLAC frame: one SNAC frame, so each gateway chunk is one FLAC frame

# response_format -> Content-Type of the HTTP response.
FORMATS: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


@dataclass(frozen=True)
class _Codec:
    """How one compressed format is made: FFmpeg muxer and encoder, bit rate, and options."""

    muxer: str
    encoder: str
    bit_rate: int | None = None  # None: lossless, no bit rate to set
    container_options: dict[str, str] = field(default_factory=dict)
    codec_options: dict[str, str] = field(default_factory=dict)


# Bit rates are for one voice: mono speech, which these codecs carry transparently or nearly so at these rates.
_CODECS: dict[str, _Codec] = {
    "mp3": _Codec("mp3", "libmp3lame", 64_000, {"id3v2_version": "0", "write_xing": "0"}),
    # CELT only ("lowdelay"): see the module docstring; constrained VBR keeps the rate near the target.
    "opus": _Codec("ogg", "libopus", 48_000, {"page_duration": str(OGG_PAGE_US)},
                   {"application": "lowdelay", "vbr": "constrained", "frame_duration": "20"}),
    "aac": _Codec("adts", "aac", 64_000),
    "flac": _Codec("flac", "flac", None, {"metadata_header_padding": "0"}, {"frame_size": str(FLAC_BLOCK)}),
}


def wav_header(sample_rate: int = SAMPLE_RATE, data_bytes: int = WAV_STREAMING_SIZE) -> bytes:
    """RIFF/WAVE header for 16-bit mono PCM; `data_bytes` unknown (0xFFFFFFFF) while streaming."""
    riff_size = WAV_STREAMING_SIZE if data_bytes == WAV_STREAMING_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def content_type(fmt: str) -> str:
    """Content-Type for a response_format; ValueError naming the valid ones for any other."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported response_format {fmt!r}: use one of {', '.join(FORMATS)}") from None


class _ByteSink:
    """Write-only, non-seekable file object for PyAV: collects what the muxer writes until `take()`.

    No `seek`/`tell` on purpose: PyAV then tells FFmpeg the output cannot seek, so no muxer rewrites bytes that
    `take()` has already handed out.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def writable(self) -> bool:
        return True

    def take(self) -> bytes:
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


def check_pcm(pcm: npt.ArrayLike) -> npt.NDArray[np.int16]:
    array = np.asarray(pcm)
    if array.dtype != np.int16 or array.ndim != 1:
        raise ValueError(f"pcm must be a 1-D int16 array of mono samples, got {array.dtype} with shape {array.shape}")
    return array


class StreamEncoder:
    """One response's encoder: `encode()` each PCM chunk, send what it returns, then send `finish()`."""

    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE) -> None:
        self.content_type = content_type(fmt)
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self._finished = False
        self._pending = b""  # the WAV header, sent with the first encode() or finish()
        self._container: av.container.OutputContainer | None = None
        if fmt == "wav":
            self._pending = wav_header(sample_rate)
        if fmt in _CODECS:
            self._open(_CODECS[fmt])

    def _open(self, spec: _Codec) -> None:
        codec = av.Codec(spec.encoder, "w")
        rates = codec.audio_rates  # None: any rate (FLAC)
        self.codec_rate = self.sample_rate if not rates or self.sample_rate in rates else FALLBACK_RATE
        # The codec context would also resample on its own; an explicit resampler keeps the pts of what it
        # hands the encoder in the codec's time base.
        self._resampler = (av.AudioResampler(format="s16", layout="mono", rate=self.codec_rate)
                           if self.codec_rate != self.sample_rate else None)
        self._sink = _ByteSink()
        self._container = av.open(self._sink, mode="w", format=spec.muxer,
                                  container_options={"flush_packets": "1", **spec.container_options})
        self._stream = self._container.add_stream(spec.encoder, rate=self.codec_rate, layout="mono")
        if spec.bit_rate is not None:
            self._stream.codec_context.bit_rate = spec.bit_rate
        self._stream.codec_context.options = dict(spec.codec_options)
        # Write the header now, so the first encode() returns it even before the codec has a packet.
        self._container.start_encoding()
        self._samples = 0  # pts of the next input frame, in 1/sample_rate

    def encode(self, pcm: npt.ArrayLike) -> bytes:
        """Encode one chunk of mono int16 PCM; returns the bytes ready now (possibly empty)."""
        if self._finished:
            raise RuntimeError("encode() after finish()")
        samples = check_pcm(pcm)
        head, self._pending = self._pending, b""
        if self._container is None:  # wav, pcm: the samples are the stream
            return head + samples.astype("<i2", copy=False).tobytes()
        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.time_base = Fraction(1, self.sample_rate)
            frame.pts = self._samples
            self._samples += samples.size
            frames = self._resampler.resample(frame) if self._resampler is not None else [frame]
            for f in frames:
                self._container.mux(self._stream.encode(f))
        return head + self._sink.take()

    def finish(self) -> bytes:
        """Flush the encoder and write the trailer; returns the last bytes. Later calls return b""."""
        if self._finished:
            return b""
        self._finished = True
        head, self._pending = self._pending, b""
        if self._container is None:
            return head
        if self._resampler is not None:  # the resampler's own filter tail
            for f in self._resampler.resample(None):
                self._container.mux(self._stream.encode(f))
        self._container.mux(self._stream.encode(None))
        self._container.close()
        self._container = None
        return head + self._sink.take()

    def close(self) -> None:
        """Release the codec without sending anything more (the client went away)."""
        if not self._finished:
            self.finish()
