"""Data-channel packets that fit every path: aiortc's SCTP fragments clamped below the smallest MTU we meet.

aiortc sizes SCTP packets (1189 B) for the IPv6 minimum MTU of 1280 B assuming DTLS with AES-GCM (37 B per record).
Its cipher list also admits AES-CBC with SHA-1 (up to 65 B per record: header 13, IV 16, MAC 20, padding up to 16),
and a TURN relay adds 4 B (ChannelData). Over such a path a full fragment is a 1302 B IPv6 packet: dropped on a
1280 B link (VPNs, IPv6 tunnels, Tailscale), retransmitted at the same size, and the channel stalls with every
event behind it. pipecat hit this and clamps the fragment; so do we, leaving room for the worst case.
"""

from __future__ import annotations

from aiortc import rtcsctptransport

IPV6_MIN_MTU = 1280
IPV6_UDP_HEADERS = 40 + 8
TURN_CHANNEL_DATA = 4
DTLS_WORST_RECORD_OVERHEAD = 13 + 16 + 20 + 16  # AES-CBC + HMAC-SHA1, full padding
SCTP_DATA_OVERHEAD = rtcsctptransport.SCTP_COMMON_HEADER_LENGTH + rtcsctptransport.SCTP_DATA_CHUNK_HEADER_LENGTH
# The largest UDP payload that crosses a 1280 B IPv6 path, through a TURN relay.
MAX_DATAGRAM = IPV6_MIN_MTU - IPV6_UDP_HEADERS - TURN_CHANNEL_DATA
# User data per DATA chunk: the worst-case datagram stays within MAX_DATAGRAM (a multiple of 4: chunks pad to it).
SAFE_USERDATA_LENGTH = (MAX_DATAGRAM - DTLS_WORST_RECORD_OVERHEAD - SCTP_DATA_OVERHEAD) // 4 * 4


def clamp_sctp_fragments() -> int:
    """Make aiortc cut data-channel messages into fragments of at most SAFE_USERDATA_LENGTH (idempotent; aiortc
    reads the module constant each time it fragments). Returns the fragment size in use."""
    if rtcsctptransport.USERDATA_MAX_LENGTH > SAFE_USERDATA_LENGTH:
        rtcsctptransport.USERDATA_MAX_LENGTH = SAFE_USERDATA_LENGTH
    return int(rtcsctptransport.USERDATA_MAX_LENGTH)
