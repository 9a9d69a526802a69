"""The Opus stage: aiortc packetises what it returns, silence is cached, speech survives the round trip."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest
from aiortc.codecs.opus import OpusDecoder, OpusEncoder
from aiortc.jitterbuffer import JitterFrame

from gateway.config import ConfigError, from_sources
from gateway.media.encoder import SILENCE_TAIL_FRAMES, OpusTrack
from gateway.media.output_frames import FRAME_SAMPLES
from gateway.media.playout import PlayoutTrack

SPEECH_LEVEL = 4000
FRAMES = 25


def _pcm_ms(ms: int) -> np.ndarray:
    t = np.arange(24 * ms) / 24000
    return (SPEECH_LEVEL * np.sin(2 * np.pi * 220 * t)).astype(np.int16)  # 24 kHz input, as SNAC makes


async def _packets(track: OpusTrack, count: int) -> list[av.Packet]:
    return [await track.recv() for _ in range(count)]


def _decode(packets: list[av.Packet]) -> np.ndarray:
    decoder = OpusDecoder()
    out = []
    for packet in packets:
        for frame in decoder.decode(JitterFrame(bytes(packet), int(packet.pts))):
            out.append(frame.to_ndarray().reshape(-1, 2)[:, 0])
    return np.concatenate(out)


async def test_speech_is_encoded_and_decodes_to_the_same_level() -> None:
    source = PlayoutTrack(pace=False)
    track = OpusTrack(source, bitrate=32000, complexity=5)
    source.begin_utterance("u", 0)
    source.push_pcm("u", _pcm_ms(FRAMES * 20))
    source.end_utterance("u")
    packets = await _packets(track, FRAMES + 10)

    assert [p.pts for p in packets] == [i * FRAME_SAMPLES for i in range(FRAMES + 10)]
    assert all(p.time_base == Fraction(1, 48000) for p in packets)
    pcm = _decode(packets).astype(np.float32)
    speech = pcm[5 * FRAME_SAMPLES:(FRAMES - 2) * FRAME_SAMPLES]  # away from the codec's edges
    rms = float(np.sqrt(np.mean(speech ** 2)))
    assert 0.6 * SPEECH_LEVEL / np.sqrt(2) < rms < 1.4 * SPEECH_LEVEL / np.sqrt(2)
    assert np.abs(pcm[-5 * FRAME_SAMPLES:]).max() < 50  # silence after the utterance is silence
    # Frames after the utterance: only a short tail goes through the encoder, then the cached packet.
    assert track.encoded_frames <= FRAMES + 1 + SILENCE_TAIL_FRAMES
    assert len({bytes(p) for p in packets[-3:]}) == 1 and len(bytes(packets[-1])) < 10


async def test_aiortc_packs_our_packets_without_encoding() -> None:
    """aiortc's sender calls `pack` for anything that is not a Frame: pts becomes the RTP timestamp."""
    track = OpusTrack(PlayoutTrack(pace=False), bitrate=32000, complexity=5)
    packet = (await _packets(track, 3))[-1]
    payloads, timestamp = OpusEncoder().pack(packet)
    assert payloads == [bytes(packet)] and timestamp == 2 * FRAME_SAMPLES


async def test_stop_stops_the_playout_track() -> None:
    source = PlayoutTrack(pace=False)
    track = OpusTrack(source, bitrate=32000, complexity=5)
    track.stop()
    assert source.readyState == "ended" and track.readyState == "ended"


@pytest.mark.parametrize(("key", "value"), [("opus_bitrate", 1000), ("opus_bitrate", 600000),
                                            ("opus_complexity", -1), ("opus_complexity", 11)])
def test_bad_opus_settings_are_rejected_by_name(key: str, value: int) -> None:
    with pytest.raises(ConfigError, match=key):
        from_sources(env={}, **{key: value})
