"""Exact, incremental, batched streaming SNAC 24 kHz decoding: each stream's code frames run through the decoder
once, batched across streams at different positions, and the audio equals a full-sequence `SNAC.decode` of the
same codes (tests compare them sample by sample), with an approximate bridge for a fast first audio.

Modules, one job each: `layers` (the decoder's layer math, full and streaming, and the position-tied noise),
`state` (a stream's host-side state, the counters), `graphs` (the device step: precision, compile, state pool,
CUDA graphs), `bridge` (the fast start and its hand-over), `pool` (`StreamingSnac`: the streams and their tick).
Why it is built this way, with the measurements: docs/decisions/exact-streaming-snac-decoder.md,
docs/decisions/snac-exactness-and-bridge.md and docs/decisions/snac-device-step.md.
"""

from gateway.speech.snac.graphs import DTYPES, GPU_SNAC_DTYPE, INT16_MAX, snac_compiles, snac_device_and_dtype
from gateway.speech.snac.layers import OPEN_END, position_noise
from gateway.speech.snac.pool import StreamingSnac
from gateway.speech.snac.state import MAX_HEAD_FRAMES, StreamHandle, StreamStats

__all__ = ["DTYPES", "GPU_SNAC_DTYPE", "INT16_MAX", "MAX_HEAD_FRAMES", "OPEN_END", "StreamHandle", "StreamStats",
           "StreamingSnac", "position_noise", "snac_compiles", "snac_device_and_dtype"]
