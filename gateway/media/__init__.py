"""Media: what happens to PCM after synthesis. Each session's paced 20 ms playout track with its jitter buffer
(`playout.PlayoutTrack`, which owns time, with an injectable clock) and its Opus stage (`encoder.OpusTrack`).

Owns: playout, Opus encoding, the output format (48 kHz, mono, s16), and its exceptions (`errors`).
May import: `gateway.config`, `gateway.orpheus`, av, numpy, aiortc's track types. Not `gateway.speech`: media
takes PCM, whoever made it.

FFmpeg runs in its callers' threads in every process that imports this package (`avthreads`: a thread pool per
codec and graph measured 29 threads per session).
"""

from gateway.media.avthreads import use_one_ffmpeg_thread

use_one_ffmpeg_thread()
