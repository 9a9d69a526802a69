"""Where a playout frame lands in a session's RTP stream: the 48 kHz RTP timestamp of a playout pts.

aiortc's `RTCRtpSender` starts each stream at a random timestamp origin (`timestamp_origin = random32()`, a local
of its `_run_rtp` loop) and stamps every packet `origin + timestamp`, where the timestamp of a pre-encoded packet
is its pts in 1/48000 (`OpusEncoder.pack`). Our Opus stage hands it packets whose pts is the playout frame's
(`PlayoutTrack`: frame k has pts k * 960), and every playout frame becomes exactly one packet. The origin itself is
not exposed, but the sender keeps the timestamp of the last packet it sent and the number of packets sent (its
private `__rtp_timestamp` and `__packet_count`, updated together right after each send), so

    origin = last timestamp - (packets sent - 1) * 960   (mod 2**32)

It is read once, after the first packet has gone out, and is fixed for the life of the sender. None before that,
or should a later aiortc rename those attributes (tests/test_lesson.py compares our timestamps with the ones a
receiver sees, and would fail).
"""

from __future__ import annotations

from aiortc import RTCPeerConnection, RTCRtpSender

from gateway.media.output_frames import FRAME_SAMPLES

RTP_MODULO = 1 << 32
_LAST_TIMESTAMP = "_RTCRtpSender__rtp_timestamp"
_PACKETS_SENT = "_RTCRtpSender__packet_count"


class RtpClock:
    """The RTP timestamp of a pts of the session's audio sender (found on the peer connection when first needed)."""

    def __init__(self, pc: RTCPeerConnection) -> None:
        self._pc = pc
        self._sender: RTCRtpSender | None = None
        self.origin: int | None = None

    def timestamp(self, pts: int) -> int | None:
        """The RTP timestamp of 48 kHz sample `pts` of the playout track (None while the origin is unknown)."""
        if self.origin is None:
            self.origin = self._read_origin()
        return None if self.origin is None else (self.origin + pts) % RTP_MODULO

    def _read_origin(self) -> int | None:
        if self._sender is None:
            self._sender = next((s for s in self._pc.getSenders() if s.kind == "audio"), None)
        sender = self._sender
        count = getattr(sender, _PACKETS_SENT, 0)
        last = getattr(sender, _LAST_TIMESTAMP, None)
        if not isinstance(count, int) or count <= 0 or not isinstance(last, int):
            return None
        return (last - (count - 1) * FRAME_SAMPLES) % RTP_MODULO
