"""FFmpeg in the calling thread: `use_one_ffmpeg_thread` makes the FFmpeg that PyAV loaded count one CPU. Called
once at the start of each process that runs media (`gateway.cli`, a `serve --workers` worker, the benchmarks), not
on import.

Why: FFmpeg gives each codec context and libavfilter graph a pool of one thread per CPU core when it opens
(thread count 0 = auto), and PyAV adds graphs of its own: every `AudioResampler`, and one inside each audio
encoder whose codec has a fixed frame size (libopus: 960 samples). With an Opus encoder per session and a
resampler per utterance that is dozens of threads per session on a many-core host, most still alive after the
sessions close until the garbage collector frees them (docs/decisions/media-threads.md). Each call carries
20-200 ms of mono speech, which those threads cannot speed up (Opus and our audio filters do not thread), and
PyAV's internal graphs cannot be given a thread count;
FFmpeg's own switch for this, `av_cpu_force_count`, can.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import av  # noqa: F401 (loads the libavutil whose CPU count is set)

log = logging.getLogger(__name__)

MAPS = Path("/proc/self/maps")


def loaded_libavutil() -> str | None:
    """Path of the libavutil mapped into this process (PyAV's), or None where /proc does not say."""
    if not MAPS.exists():
        return None
    for line in MAPS.read_text().splitlines():
        path = line.split()[-1]
        if "/libavutil" in path:
            return path
    return None


def use_one_ffmpeg_thread() -> bool:
    """FFmpeg's CPU count forced to 1 for this process (codecs and graphs then run in their caller's thread);
    False where PyAV's libavutil cannot be found (then FFmpeg keeps its thread pools)."""
    path = loaded_libavutil()
    if path is None:
        log.debug("PyAV's libavutil not found: FFmpeg keeps a thread pool per codec and graph")
        return False
    libavutil = ctypes.CDLL(path)
    libavutil.av_cpu_force_count(1)
    return bool(libavutil.av_cpu_count() == 1)
