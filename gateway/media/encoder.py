"""Opus encoding of a session's paced PCM, in the event loop, mono and tuned for speech.

aiortc would encode each 20 ms frame itself: resample to stereo, encode stereo Opus at complexity 10, in the
default thread pool (one executor round trip per frame and peer), which costs more CPU in GIL hand-offs than the
event loop itself (docs/decisions/media-threads.md). A track that returns `av.Packet`s makes aiortc skip its
encoder (it only packetises), so this stage encodes mono speech at a chosen complexity and sends a cached packet
for silence, which is what a mostly idle lesson page hears.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from aiortc.mediastreams import MediaStreamTrack

from gateway.media.output_frames import CHANNEL_LAYOUT, FRAME_SAMPLES, SAMPLE_FORMAT, SAMPLE_RATE_OUT

TIME_BASE = Fraction(1, SAMPLE_RATE_OUT)
# Silent frames still run through the encoder right after audio: Opus holds 6.5 ms of the last audio frame
# (its look-ahead) and ramps down over the next frames; after this many, its output is the steady silence packet.
SILENCE_TAIL_FRAMES = 3
SILENCE_PRIMING_FRAMES = 10  # frames of zeros encoded once to get the steady silence packet


def new_opus_encoder(bitrate: int, complexity: int) -> av.AudioCodecContext:
    codec = av.CodecContext.create("libopus", "w")
    codec.sample_rate = SAMPLE_RATE_OUT
    codec.layout = CHANNEL_LAYOUT
    codec.format = SAMPLE_FORMAT
    codec.bit_rate = bitrate
    codec.time_base = TIME_BASE
    # FFmpeg's libopus maps compression_level to Opus complexity (0-10); "audio" keeps the full band.
    codec.options = {"application": "audio", "compression_level": str(complexity), "frame_duration": "20"}
    return codec  # type: ignore[return-value]


def _silent_frame(index: int) -> av.AudioFrame:
    frame = av.AudioFrame(format=SAMPLE_FORMAT, layout=CHANNEL_LAYOUT, samples=FRAME_SAMPLES)
    frame.planes[0].update(bytes(FRAME_SAMPLES * 2))
    frame.pts = index * FRAME_SAMPLES
    frame.sample_rate = SAMPLE_RATE_OUT
    frame.time_base = TIME_BASE
    return frame


def steady_silence_packet(bitrate: int, complexity: int) -> bytes:
    """What the encoder settles on for digital silence (a few bytes)."""
    codec = new_opus_encoder(bitrate, complexity)
    packets = [bytes(p) for i in range(SILENCE_PRIMING_FRAMES) for p in codec.encode(_silent_frame(i))]
    return packets[-1]


class OpusTrack(MediaStreamTrack):
    """Wraps a paced PCM track (20 ms, 48 kHz mono s16 frames) and hands aiortc Opus packets instead."""

    kind = "audio"

    def __init__(self, source: MediaStreamTrack, *, bitrate: int, complexity: int) -> None:
        super().__init__()
        self.source = source
        self._codec = new_opus_encoder(bitrate, complexity)
        self._silence = steady_silence_packet(bitrate, complexity)
        self._silent_run = SILENCE_TAIL_FRAMES  # start as after a long silence
        self.encoded_frames = 0  # frames that went through the encoder (the rest: cached silence)

    async def recv(self) -> av.Packet:  # type: ignore[override]
        return self.encode(await self.source.recv())

    def encode(self, frame: av.AudioFrame) -> av.Packet:
        silent = not np.frombuffer(frame.planes[0], dtype=np.int16, count=FRAME_SAMPLES).any()
        self._silent_run = self._silent_run + 1 if silent else 0
        data = self._silence
        if self._silent_run <= SILENCE_TAIL_FRAMES:
            self.encoded_frames += 1
            # One 20 ms frame in, one packet out (the encoder's delay shows in pts, not in the packet count).
            packets = self._codec.encode(frame)
            if packets:
                data = bytes(packets[-1])
        packet = av.Packet(data)
        packet.pts = frame.pts
        packet.time_base = TIME_BASE
        return packet

    def stop(self) -> None:
        self.source.stop()
        super().stop()
