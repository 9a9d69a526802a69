"""FFmpeg in the calling thread (`gateway.media.avthreads`): nothing of a session's media path (the WebRTC Opus
encoder, playout resampling, time stretch, the HTTP encoders) starts threads of its own in a process that called
`use_one_ffmpeg_thread` at its start, and importing `gateway.media` alone does not set it. Found at 256 peers on
an H200 host (16 cores): 29 threads per session in the workers (gateway.benchmarks.faults)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import av
import numpy as np
import pytest

from gateway.media.avthreads import use_one_ffmpeg_thread
from gateway.media.encoder import new_opus_encoder
from gateway.media.formats import StreamEncoder
from gateway.media.output_frames import CHANNEL_LAYOUT, FRAME_SAMPLES, SAMPLE_FORMAT, SAMPLE_RATE_OUT
from gateway.media.stretch import TimeStretcher

OBJECTS = 12  # alive at once; with FFmpeg's auto thread pools each would hold one thread per core

# Without gateway.media: PyAV's resampler graphs and the Opus encoder, counted in a fresh interpreter.
COUNT_WITHOUT = """
import os, numpy as np, av
def threads(): return len(os.listdir("/proc/self/task"))
before, alive = threads(), []
for _ in range(12):
    r = av.AudioResampler(format="s16", layout="stereo", rate=48000)
    f = av.AudioFrame.from_ndarray(np.ones((1, 480), np.int16), format="s16", layout="mono")
    f.sample_rate = 24000
    r.resample(f)
    alive.append(r)
print(threads() - before)
"""


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def speech(samples: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8000, 8000, samples, dtype=np.int16)


def threads_added(make_and_use: Callable[[], object]) -> int:
    """Threads alive after OBJECTS objects were made and used (and are still alive), minus before."""
    before = threads()
    alive = [make_and_use() for _ in range(OBJECTS)]
    added = threads() - before
    del alive
    return added


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="FFmpeg starts no pools on one core: nothing to see")
def test_ffmpeg_would_start_thread_pools_without_the_setting() -> None:
    """What the setting is for (and that the count below can see it): PyAV's graphs hold threads of their own."""
    out = subprocess.run([sys.executable, "-c", COUNT_WITHOUT], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= OBJECTS


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="FFmpeg starts no pools on one core: nothing to see")
def test_importing_media_sets_nothing() -> None:
    """The setting is a call at process start, not a side effect of importing `gateway.media`."""
    script = "import gateway.media.encoder, gateway.media.playout, gateway.media.stretch\n" + COUNT_WITHOUT
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= OBJECTS


def test_session_media_starts_no_threads() -> None:
    assert use_one_ffmpeg_thread()  # what every gateway process does at its start (idempotent)

    def webrtc_opus() -> object:
        codec = new_opus_encoder(32000, 5)
        frame = av.AudioFrame.from_ndarray(speech(FRAME_SAMPLES).reshape(1, -1), format=SAMPLE_FORMAT,
                                           layout=CHANNEL_LAYOUT)
        frame.sample_rate, frame.pts = SAMPLE_RATE_OUT, 0
        codec.encode(frame)
        return codec

    def playout_resampler() -> object:  # what PlayoutTrack does per utterance: 24 kHz in, 48 kHz out
        resampler = av.AudioResampler(format=SAMPLE_FORMAT, layout=CHANNEL_LAYOUT, rate=SAMPLE_RATE_OUT)
        frame = av.AudioFrame.from_ndarray(speech(4800).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 24000
        resampler.resample(frame)
        return resampler

    def stretcher() -> object:
        stretch = TimeStretcher(0.8)
        stretch.process(speech(4800))
        return stretch

    def http_encoder() -> object:
        encoder = StreamEncoder("opus")  # 24 kHz in, 48 kHz to the codec: resampled, then encoded
        encoder.encode(speech(4800))
        return encoder

    for make in (webrtc_opus, playout_resampler, stretcher, http_encoder):
        assert threads_added(make) <= 1, make.__name__  # 1: a thread of anything else in this process
