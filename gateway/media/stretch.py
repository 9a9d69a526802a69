"""Pitch-preserving time-stretch of a streaming 24 kHz mono int16 signal, and the one home of the rate bounds.

Owns: `TimeStretcher` (chunks in, chunks out, through libavfilter's `atempo` in a PyAV `av.filter.Graph`), the
two ranges its callers accept (`LESSON_RATE_RANGE` for a lesson's `rate`, `SPEECH_SPEED_RANGE` for the OpenAI
speech API's `speed`) and `check_rate`, which both callers use to refuse a value with a clear message. Imports av,
numpy and its siblings `formats` (the one PCM input check) and `errors`; nothing from other gateway packages.

"""

from __future__ import annotations

import math
from fractions import Fraction

import av
import numpy as np
import numpy.typing as npt

from gateway.media.errors import InvalidRateError
from gateway.media.formats import check_pcm
from gateway.orpheus import SAMPLE_RATE  # what SNAC makes

# The bounds callers accept, kept here only: a lesson's playback rate, and the OpenAI speech API's `speed`.
LESSON_RATE_RANGE: tuple[float, float] = (0.5, 1.5)
SPEECH_SPEED_RANGE: tuple[float, float] = (0.25, 4.0)
# What TimeStretcher itself takes: the union of the two.
STRETCH_RANGE: tuple[float, float] = (min(LESSON_RATE_RANGE[0], SPEECH_SPEED_RANGE[0]),
                                      max(LESSON_RATE_RANGE[1], SPEECH_SPEED_RANGE[1]))
ATEMPO_RANGE: tuple[float, float] = (0.5, 2.0)  # one atempo filter, see the module docstring

_PAD_BLOCK = 1024  # silence pushed per step at flush() to drive the held-back tail out
_PAD_LIMIT_S = 2.0  # at most this much silence per flush(): atempo holds far less (~0.15 s at 0.25)


def check_rate(value: object, lo: float, hi: float, name: str) -> float:
    """`value` as a float if it is a finite number in [lo, hi]; `InvalidRateError` naming `name` and the bounds if
    not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRateError(f"{name} must be a number between {lo} and {hi}, got {value!r}")
    rate = float(value)
    if not (math.isfinite(rate) and lo <= rate <= hi):
        raise InvalidRateError(f"{name} must be between {lo} and {hi}, got {value!r}")
    return rate


def atempo_chain(rate: float) -> list[float]:
    """Tempo factors, each within ATEMPO_RANGE, whose product is `rate` ([] for 1.0)."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number, got {rate!r}")
    lo, hi = ATEMPO_RANGE
    factors: list[float] = []
    rest = rate
    while rest > hi:
        factors.append(hi)
        rest /= hi
    while rest < lo:
        factors.append(lo)
        rest /= lo
    if not math.isclose(rest, 1.0, rel_tol=1e-9, abs_tol=0.0):
        factors.append(rest)
    return factors


_EMPTY: npt.NDArray[np.int16] = np.zeros(0, dtype=np.int16)


class TimeStretcher:
    """One stream's time-stretch: `process()` each chunk, then `flush()` once at the end of the utterance.

    After `flush()` the stretcher starts afresh, ready for the next utterance at the same rate.

    How:
    - abuffer -> atempo [-> atempo ...] -> aformat -> abuffersink. One atempo stays within 0.5..2.0: atempo takes up
      to 100, but above 2.0 it skips input instead of overlapping it (FFmpeg's documentation advises chaining), and
      below 0.5 it refuses. So 0.25 is atempo=0.5,atempo=0.5 and 4.0 is atempo=2,atempo=2 (`atempo_chain`).
    - rate 1.0 builds no filter at all: `process()` returns the very samples it was given.
    - atempo holds back part of a window: with 2048-sample chunks, ~50 ms of input at 0.5, ~135 ms at 0.25 (two
      filters); the rest comes out on the next chunk or at `flush()`. At end of stream atempo alone drops its last
      partial window (up to ~1 % short, measured), so `flush()` pushes silence until the tail is out, then trims: the
      total output is exactly round(input / rate) samples, whatever the chunking. The content too is the same, sample
      for sample, except in the first ~21 ms (~50 ms at 0.25) of output when the first chunk is shorter than a window:
      atempo starts its first window on what it has (measured: 1-sample and 333-sample chunks against one shot, up to
      7 % of the level there, nothing after; 2048-sample chunks are identical to one shot for all the rates tested).
    - Rate r means r times as fast: 0.5 plays twice as long, pitch unchanged (atempo's WSOLA-style overlap-add).
    """

    def __init__(self, rate: float, sample_rate: int = SAMPLE_RATE) -> None:
        self.rate = check_rate(rate, *STRETCH_RANGE, "rate")
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.sample_rate = sample_rate
        self.tempos = atempo_chain(self.rate)
        self._graph: av.filter.Graph | None = None
        self._samples_in = 0  # since the last flush(): what the output length must come to
        self._samples_out = 0

    @property
    def passthrough(self) -> bool:
        return not self.tempos

    def _build(self) -> av.filter.Graph:
        graph = av.filter.Graph()
        nodes = [graph.add_abuffer(sample_rate=self.sample_rate, format="s16", layout="mono",
                                   time_base=Fraction(1, self.sample_rate))]
        nodes += [graph.add("atempo", tempo=repr(tempo)) for tempo in self.tempos]
        # atempo keeps s16 mono today; aformat pins it so the output is always what callers get from SNAC.
        nodes.append(graph.add("aformat", sample_fmts="s16", channel_layouts="mono"))
        nodes.append(graph.add("abuffersink"))
        graph.link_nodes(*nodes)
        graph.configure()
        return graph

    def _push(self, graph: av.filter.Graph, samples: npt.NDArray[np.int16], pts: int) -> None:
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.time_base = Fraction(1, self.sample_rate)
        frame.pts = pts
        graph.push(frame)

    @staticmethod
    def _drain(graph: av.filter.Graph) -> list[npt.NDArray[np.int16]]:
        out: list[npt.NDArray[np.int16]] = []
        while True:
            try:
                frame = graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):  # needs more input / all out
                return out
            out.append(frame.to_ndarray().reshape(-1))

    def process(self, pcm: npt.ArrayLike) -> npt.NDArray[np.int16]:
        """Stretch one chunk; returns the samples ready now (often fewer than len/rate: atempo looks ahead)."""
        samples = check_pcm(pcm)
        if self.passthrough:
            return samples
        if not samples.size:
            return _EMPTY
        if self._graph is None:
            self._graph = self._build()
        # pts only has to grow: samples since the start of this utterance, in 1/sample_rate.
        self._push(self._graph, samples, self._samples_in)
        self._samples_in += samples.size
        parts = self._drain(self._graph)
        out = np.concatenate(parts) if parts else _EMPTY
        self._samples_out += out.size
        return out

    def flush(self) -> npt.NDArray[np.int16]:
        """The rest of the utterance: total output is round(input / rate) samples. Then start afresh."""
        graph, self._graph = self._graph, None
        samples_in, samples_out = self._samples_in, self._samples_out
        self._samples_in = self._samples_out = 0
        if graph is None:  # passthrough, or nothing since the last flush()
            return _EMPTY
        remaining = round(samples_in / self.rate) - samples_out
        parts: list[npt.NDArray[np.int16]] = []
        got = 0
        pts = samples_in
        silence = np.zeros(_PAD_BLOCK, dtype=np.int16)
        # Silence after the end drives out the window atempo holds; the trim below drops the silence again.
        while got < remaining and pts - samples_in < _PAD_LIMIT_S * self.sample_rate:
            self._push(graph, silence, pts)
            pts += _PAD_BLOCK
            new = self._drain(graph)
            got += sum(part.size for part in new)
            parts += new
        graph.push(None)
        parts += self._drain(graph)
        out = np.concatenate(parts) if parts else _EMPTY
        return out[:max(0, remaining)]
