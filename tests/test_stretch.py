"""Time-stretch: exact output length, pitch kept, 1.0 untouched, chunking irrelevant, bad rates refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gateway.media.stretch import (
    ATEMPO_RANGE,
    LESSON_RATE_RANGE,
    SPEECH_SPEED_RANGE,
    TimeStretcher,
    atempo_chain,
    check_rate,
)

RATE = 24000
CHUNK = 2048  # one SNAC frame, as the gateway streams
RATES = [0.5, 0.7, 1.0, 1.5, 0.25, 4.0]


def _tone(seconds: float, freq: float = 440.0, level: int = 8000) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (level * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def _stream(stretcher: TimeStretcher, pcm: np.ndarray, chunk: int) -> np.ndarray:
    parts = [stretcher.process(pcm[i:i + chunk]) for i in range(0, len(pcm), chunk)]
    parts.append(stretcher.flush())
    return np.concatenate(parts)


def _peak_hz(x: np.ndarray) -> float:
    n = 16384  # 1.46 Hz bins at 24 kHz
    seg = x[len(x) // 2 - n // 2:len(x) // 2 + n // 2].astype(np.float64)
    spectrum = np.abs(np.fft.rfft(seg * np.hanning(n)))
    k = int(np.argmax(spectrum))
    # Parabolic interpolation of the peak: sub-bin accuracy.
    a, b, c = np.log(spectrum[k - 1:k + 2])
    return (k + 0.5 * (a - c) / (a - 2 * b + c)) * RATE / n


@pytest.mark.parametrize("rate", RATES)
def test_length_is_input_over_rate(rate: float) -> None:
    pcm = _tone(1.5)
    chunked = _stream(TimeStretcher(rate), pcm, CHUNK)
    one_shot = _stream(TimeStretcher(rate), pcm, len(pcm))
    assert chunked.dtype == np.int16 and chunked.ndim == 1
    assert len(chunked) == len(one_shot) == round(len(pcm) / rate)


@pytest.mark.parametrize("rate", [0.7, 0.25, 4.0])
def test_pitch_is_kept(rate: float) -> None:
    out = _stream(TimeStretcher(rate), _tone(3.0 if rate > 1 else 1.5), CHUNK)
    assert abs(_peak_hz(out) - 440.0) < 3.0


def test_level_is_kept() -> None:
    pcm = _tone(1.5)
    out = _stream(TimeStretcher(0.7), pcm, CHUNK)
    middle = out[len(out) // 4:-len(out) // 4].astype(np.float64)
    assert abs(np.sqrt(np.mean(middle**2)) / np.sqrt(np.mean(pcm.astype(np.float64) ** 2)) - 1) < 0.1


def test_tail_comes_out() -> None:
    """The last input samples are in the output, not lost in atempo's window (flush pads, then trims)."""
    pcm = np.concatenate([np.zeros(RATE // 2, dtype=np.int16), _tone(0.3)])
    for rate in (0.5, 0.25, 1.5, 4.0):
        out = _stream(TimeStretcher(rate), pcm, CHUNK)
        last = out[-round(0.05 * RATE / rate):].astype(np.float64)  # the last 50 ms of input, stretched
        assert np.sqrt(np.mean(last**2)) > 0.5 * 8000 / math.sqrt(2), rate


def test_rate_one_is_passthrough() -> None:
    pcm = _tone(0.5)
    stretcher = TimeStretcher(1.0)
    assert stretcher.passthrough and stretcher.tempos == []
    chunk = pcm[:CHUNK]
    assert stretcher.process(chunk) is chunk
    np.testing.assert_array_equal(_stream(stretcher, pcm, 1000), pcm)
    assert stretcher.flush().size == 0


@pytest.mark.parametrize("rate", [0.25, 0.7, 1.5, 4.0])
@pytest.mark.parametrize("chunk", [1, 333, CHUNK])
def test_chunking_does_not_change_the_output(rate: float, chunk: int) -> None:
    pcm = _tone(0.4)
    expected = _stream(TimeStretcher(rate), pcm, len(pcm))
    out = _stream(TimeStretcher(rate), pcm, chunk)
    assert len(out) == len(expected)
    # atempo starts its first window on what the first chunk gives it: only the first ~50 ms may differ (0.1 s kept).
    start = 0 if chunk == CHUNK else round(0.1 * RATE)
    np.testing.assert_array_equal(out[start:], expected[start:])


def test_reusable_after_flush() -> None:
    stretcher = TimeStretcher(1.5)
    pcm = _tone(0.5)
    first = _stream(stretcher, pcm, CHUNK)
    second = _stream(stretcher, pcm, CHUNK)
    np.testing.assert_array_equal(first, second)
    assert stretcher.flush().size == 0  # nothing pending


@pytest.mark.parametrize("rate", [0.25, 0.3, 0.5, 0.7, 1.0, 1.3, 2.0, 3.0, 4.0])
def test_atempo_chain(rate: float) -> None:
    factors = atempo_chain(rate)
    assert all(ATEMPO_RANGE[0] <= f <= ATEMPO_RANGE[1] for f in factors)
    assert math.isclose(math.prod(factors), rate)
    assert atempo_chain(0.25) == [0.5, 0.5] and atempo_chain(4.0) == [2.0, 2.0] and atempo_chain(1.0) == []


def test_ranges() -> None:
    assert LESSON_RATE_RANGE == (0.5, 1.5)
    assert SPEECH_SPEED_RANGE == (0.25, 4.0)
    assert check_rate(1, *LESSON_RATE_RANGE, "rate") == 1.0
    assert check_rate(0.25, *SPEECH_SPEED_RANGE, "speed") == 0.25
    assert check_rate(4.0, *SPEECH_SPEED_RANGE, "speed") == 4.0


@pytest.mark.parametrize(("value", "bounds", "name"), [
    (0.4, LESSON_RATE_RANGE, "rate"),
    (1.6, LESSON_RATE_RANGE, "rate"),
    (0.2, SPEECH_SPEED_RANGE, "speed"),
    (4.5, SPEECH_SPEED_RANGE, "speed"),
    (float("nan"), SPEECH_SPEED_RANGE, "speed"),
    (float("inf"), SPEECH_SPEED_RANGE, "speed"),
    ("1.0", SPEECH_SPEED_RANGE, "speed"),
    (True, SPEECH_SPEED_RANGE, "speed"),
    (None, LESSON_RATE_RANGE, "rate"),
])
def test_bad_rates_raise(value: object, bounds: tuple[float, float], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be .*between {bounds[0]} and {bounds[1]}"):
        check_rate(value, *bounds, name)


@pytest.mark.parametrize("rate", [0.0, -1.0, 0.2, 5.0, float("nan")])
def test_stretcher_refuses_rates_out_of_range(rate: float) -> None:
    with pytest.raises(ValueError, match="rate must be"):
        TimeStretcher(rate)


def test_bad_pcm_raises() -> None:
    with pytest.raises(ValueError, match="int16"):
        TimeStretcher(0.7).process(np.zeros(10, dtype=np.float32))
