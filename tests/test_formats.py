"""Streaming encoders for the speech API's response formats: each streams, decodes back, and keeps its samples."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from gateway.media.formats import FORMATS, StreamEncoder, content_type, wav_header

RATE = 24000
CHUNK = 2048  # one SNAC frame, 85 ms: what the gateway hands the encoder
SECONDS = 1.5
LEVEL = 8000
LOSSLESS = ("flac", "wav", "pcm")
DECODED_RATE = {"opus": 48000}  # Ogg Opus always decodes at 48 kHz; the rest keep 24 kHz
# Streamed MP3 and ADTS AAC cannot say how much encoder delay and padding to trim: they decode a little longer.
LENGTH_SLACK_S = {"mp3": 0.1, "aac": 0.1}


def _sweep() -> np.ndarray:
    """1.5 s linear chirp, 100 Hz to 4 kHz: every codec band that speech uses, at a speech-like level."""
    t = np.arange(int(RATE * SECONDS)) / RATE
    f0, f1 = 100.0, 4000.0
    return (LEVEL * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * SECONDS)))).astype(np.int16)


SWEEP = _sweep()


def _encode(fmt: str, pcm: np.ndarray = SWEEP, sample_rate: int = RATE) -> tuple[bytes, list[bytes], bytes]:
    """(what an empty first call returns: the header, one result per chunk, what finish() returns)."""
    encoder = StreamEncoder(fmt, sample_rate)
    header = encoder.encode(np.zeros(0, dtype=np.int16))
    chunks = [encoder.encode(pcm[i:i + CHUNK]) for i in range(0, len(pcm), CHUNK)]
    return header, chunks, encoder.finish()


def _decode(data: bytes, fmt: str) -> tuple[int, np.ndarray]:
    """(sample rate, mono samples as float in int16 units), decoded by PyAV as a client would."""
    # Raw PCM has no header: the client has to be told what it is.
    kwargs = {"format": "s16le", "options": {"sample_rate": str(RATE), "ch_layout": "mono"}} if fmt == "pcm" else {}
    with av.open(io.BytesIO(data), **kwargs) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate = stream.codec_context.sample_rate
    samples = np.concatenate([frame.reshape(-1) for frame in frames]).astype(np.float64)
    if frames[0].dtype.kind == "f":  # fltp decoders (opus, mp3, aac) give -1..1
        samples *= 32768
    return rate, samples


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def test_content_types() -> None:
    assert FORMATS == {"mp3": "audio/mpeg", "opus": "audio/ogg; codecs=opus", "aac": "audio/aac",
                       "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm"}
    assert content_type("mp3") == "audio/mpeg"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip(fmt: str) -> None:
    header, chunks, tail = _encode(fmt)
    rate, decoded = _decode(header + b"".join(chunks) + tail, fmt)
    assert rate == DECODED_RATE.get(fmt, RATE)
    duration = len(decoded) / rate
    assert SECONDS <= duration <= SECONDS + LENGTH_SLACK_S.get(fmt, 0.0), duration
    if fmt in LOSSLESS:
        np.testing.assert_array_equal(decoded.astype(np.int16), SWEEP)
    else:
        # Level over every 100 ms stays within 2 dB of the input's (the sweep has constant level): catches a silent
        # or bursting decode, as FFmpeg's native Opus decoder gave on hybrid-mode frames.
        window = rate // 10
        levels = [_rms(decoded[i:i + window]) for i in range(window, len(decoded) - 2 * window, window)]
        expected = _rms(SWEEP.astype(np.float64))
        assert all(abs(20 * np.log10(level / expected)) < 2 for level in levels), levels


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_audio_comes_out_before_finish(fmt: str) -> None:
    """Every format streams: the first 85 ms chunk already returns audio, and most of it is out before finish()."""
    header, chunks, tail = _encode(fmt)
    assert chunks[0], "nothing after the first chunk"
    streamed = len(header) + sum(map(len, chunks))
    assert streamed > 0.8 * (streamed + len(tail)), (streamed, len(tail))
    assert all(chunks[:-1]), [len(c) for c in chunks]  # something out on every chunk, not in bursts


SYNC = {  # how every packet of the format starts: encode() results end on packet boundaries
    "mp3": lambda b: b[0] == 0xFF and b[1] & 0xE0 == 0xE0,  # MPEG audio frame sync
    "aac": lambda b: b[0] == 0xFF and b[1] & 0xF0 == 0xF0,  # ADTS sync
    "opus": lambda b: b[:4] == b"OggS",  # an Ogg page
    "flac": lambda b: b[0] == 0xFF and b[1] & 0xFE == 0xF8,  # FLAC frame sync
}


@pytest.mark.parametrize("fmt", list(SYNC))
def test_each_result_is_whole_packets(fmt: str) -> None:
    header, chunks, tail = _encode(fmt)
    for data in [*chunks, tail]:
        assert not data or SYNC[fmt](data), data[:4]
    if fmt == "opus":
        assert header.startswith(b"OggS") and b"OpusHead" in header
    if fmt == "flac":
        assert header.startswith(b"fLaC")


def test_wav_streams_the_gateway_header() -> None:
    header, chunks, tail = _encode("wav")
    assert header == wav_header(RATE) and len(header) == 44
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF  # RIFF size unknown while streaming
    assert struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF  # data size too
    assert chunks[0] == SWEEP[:CHUNK].tobytes()
    assert tail == b""


def test_pcm_is_the_samples() -> None:
    header, chunks, tail = _encode("pcm")
    assert header == b"" and tail == b""
    assert b"".join(chunks) == SWEEP.astype("<i2").tobytes()


def test_opus_resamples_a_rate_it_cannot_take() -> None:
    rate = 44100
    t = np.arange(rate) / rate
    tone = (LEVEL * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    header, chunks, tail = _encode("opus", tone, sample_rate=rate)
    out_rate, decoded = _decode(header + b"".join(chunks) + tail, "opus")
    assert out_rate == 48000
    assert abs(len(decoded) - 48000) <= 48  # 1 s, within 1 ms
    assert abs(_rms(decoded[4800:-4800]) - _rms(tone.astype(np.float64))) < 0.1 * _rms(tone.astype(np.float64))


def test_bad_format_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="mp3, opus, aac, flac, wav, pcm") as excinfo:
        StreamEncoder("ogg")
    assert "'ogg'" in str(excinfo.value)
    with pytest.raises(ValueError):
        content_type("MP3")


def test_misuse() -> None:
    encoder = StreamEncoder("mp3")
    with pytest.raises(ValueError, match="int16"):
        encoder.encode(np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        encoder.encode(np.zeros((2, 10), dtype=np.int16))
    encoder.encode(SWEEP[:CHUNK])
    assert encoder.finish()
    assert encoder.finish() == b""
    with pytest.raises(RuntimeError):
        encoder.encode(SWEEP[:CHUNK])
    with pytest.raises(ValueError):
        StreamEncoder("wav", 0)


def test_empty_stream() -> None:
    """A response whose utterance made no audio still ends as a valid (empty) file."""
    assert StreamEncoder("wav").finish() == wav_header(RATE)
    assert StreamEncoder("pcm").finish() == b""
    for fmt in ("mp3", "opus", "aac", "flac"):
        StreamEncoder(fmt).finish()  # no exception
