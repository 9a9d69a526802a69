"""The SNAC stream protocol between a gateway process (`client`) and the shared codec server (`server`), over a
Unix socket. Both ends first send the 8 bytes STREAM_HELLO; then messages, little-endian: u32 kind, u32 stream id
(the client's choice), u32 payload bytes (<= MAX_MESSAGE_BYTES), payload:
  client  OPEN 1     -
          PUSH 2     i32 lead_ms, u32 lookahead (0..7), u32 lead_runs (0|1), then n x 7 int16 codes
                     (1 <= n <= MAX_PUSH_FRAMES)
          FINISH 3   i32 lead_ms, u32 lead_runs
          RELEASE 4  -  (the sentence is over, whatever state it is in; the id is free again)
  server  CHUNK 5    u32 last (1: the stream's last audio), then int16 PCM
          END 6      -  (all of the stream's audio is out)
          ERROR 7    UTF-8 text: that stream failed; on ALL_STREAMS: the connection broke the protocol and is closed
`lead_ms`: how far the client's audio runs ahead of real time (the decoder's deadline order); `lead_runs` 0: the
listener waits for this stream's first audio, so the lead holds until audio is sent.
"""

from __future__ import annotations

import struct

from gateway.orpheus import SLOTS_PER_FRAME
from gateway.speech.errors import CodecWireError

STREAM_HELLO = b"SNACSTR2"  # 2: PUSH and FINISH carry lead_runs
MESSAGE = struct.Struct("<III")  # kind, stream id, payload bytes
OPEN, PUSH, FINISH, RELEASE, CHUNK, END, ERROR = range(1, 8)
PUSH_HEAD = struct.Struct("<iII")  # lead_ms, lookahead, lead_runs
LEAD = struct.Struct("<iI")  # lead_ms, lead_runs
LAST = struct.Struct("<I")  # a chunk ends its stream
ALL_STREAMS = 0xFFFFFFFF  # the stream id of a connection's own error
FRAME_BYTES = SLOTS_PER_FRAME * 2
MAX_PUSH_FRAMES = 256  # a client splits longer pushes
MAX_MESSAGE_BYTES = 1 << 20  # above a push's and a chunk's largest (a first chunk: 7 frames of PCM, 28 KiB)
MAX_STREAM_FRAMES = 1 << 16  # 93 min of audio: far beyond any sentence (max_tokens bounds them)
MAX_CONNECTION_STREAMS = 4096  # ids a connection holds open at once (its worker's sentences, not yet released)
MAX_UNSENT_BYTES = 64 << 20  # audio waiting for a client that stopped reading: the connection is dropped
LEAD_MS_LIMIT = (1 << 31) - 1


def check_framing(kind: int, size: int) -> None:
    """A client message's kind and payload size agree with the protocol (else the connection is closed)."""
    if kind in (OPEN, RELEASE):
        good = size == 0
    elif kind == FINISH:
        good = size == LEAD.size
    elif kind == PUSH:
        frames, rest = divmod(size - PUSH_HEAD.size, FRAME_BYTES)
        good = rest == 0 and 1 <= frames <= MAX_PUSH_FRAMES
    else:
        raise CodecWireError(f"unknown message kind {kind}")
    if not good:
        raise CodecWireError(f"message kind {kind} with {size} payload bytes (push: {PUSH_HEAD.size} + "
                            f"{FRAME_BYTES} per frame, 1..{MAX_PUSH_FRAMES} frames)")
