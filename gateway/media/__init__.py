"""Media: what happens to PCM after synthesis. Each session's paced 20 ms playout track with its jitter buffer
(`playout.PlayoutTrack`, which owns time, with an injectable clock; `output_frames`: the output format and each
utterance's PCM cut into whole frames of it) and its Opus stage (`encoder.OpusTrack`); the HTTP formats
(`formats`) and raw PCM at a client's rate (`pcm_out`).

Owns: playout, Opus encoding, the output format (48 kHz, mono, s16: `output_frames`), and its exceptions
(`errors`).
May import: `gateway.config`, `gateway.orpheus`, av, numpy, aiortc's track types. Not `gateway.speech`: media
takes PCM, whoever made it.

Every process that runs media calls `avthreads.use_one_ffmpeg_thread()` at its start (the command line, a
`serve --workers` worker, the benchmarks): FFmpeg then runs in its callers' threads instead of a pool per codec
and graph. Importing this package changes nothing.
"""
