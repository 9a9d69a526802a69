"""A headless WebRTC peer that speaks the gateway's protocol: used by tests, benchmarks and load checks.

It negotiates through `POST /v1/webrtc/offer`, opens the `control` data channel, records every event with
its arrival time, and receives and decodes the RTP audio, keeping each 20 ms frame's arrival time and level.
A frame's arrival time is when aiortc's receive jitter buffer releases it; that buffer is set to hold one packet
(`RECEIVE_PREFETCH_PACKETS`), as a browser's does on a clean network, so the stamps carry no extra delay.
The frame is decoded right there, in the event loop (`InLoopAudioDecoder`), not in the decoder thread aiortc gives
each receiver: benchmarks run hundreds of peers in a few client processes, and the thread's hand-offs, its track's
queue and stereo decoding cost more than the mono decode itself (`benchmarks.client_cpu`, 2-core dev VM, 32 peers of
paced speech in one process: 149 us of CPU per frame, 0.24 cores, against 301 us and 0.48 through aiortc's own
receiver; other runs 145-212 against 234-415, the sender sharing the 2 cores).
It builds its messages with `gateway.rtc.protocol` and checks every event it receives against it: an event the
protocol does not define lands in `protocol_violations`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import aiortc
import av
import msgspec
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.jitterbuffer import JitterBuffer, JitterFrame

from gateway.rtc import protocol
from gateway.rtc.protocol import CONTROL_LABEL
from gateway.rtc.rtpclock import RTP_MODULO

SILENCE_RMS = 1.0  # decoded Opus silence is exactly or nearly zero
# Complete frames the receive jitter buffer waits for after a frame before releasing it. aiortc's default for
# audio, 4, held every frame until 4 later packets were in: ~80 ms added to every arrival stamp (client TTFA,
# stalls) that a browser does not have: its NetEQ holds about one packet on a clean network. With 0 a frame is
# released as soon as the next packet shows it complete: one 20 ms packet, like the browser.
RECEIVE_PREFETCH_PACKETS = 0
RECEIVE_JITTER_CAPACITY = 16  # packets (a power of 2), aiortc's default for audio
_JITTER_BUFFER_ATTR = "_RTCRtpReceiver__jitter_buffer"  # aiortc's private, created in RTCRtpReceiver.__init__
_DECODER_QUEUE_ATTR = "_RTCRtpReceiver__decoder_queue"  # aiortc's private: what its decoder thread reads
OPUS_RATE = 48000  # RTP clock and decoded rate of Opus (RFC 7587)

log = logging.getLogger(__name__)


class OfferRejectedError(RuntimeError):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"offer rejected with HTTP {status}: {body}")
        self.status = status
        self.body = body


@dataclass
class ReceivedFrame:
    at: float  # monotonic arrival time
    samples: int  # per channel
    rms: float
    rtp_timestamp: int | None = None  # the RTP timestamp of the packet it was decoded from

    @property
    def audible(self) -> bool:
        return self.rms > SILENCE_RMS


@dataclass
class ReceivedEvent:
    at: float
    message: dict[str, Any]


@dataclass
class Endings:
    """What ended one utterance, as a client saw it: every accepted `speak` must end with exactly one terminal
    event (`done`, `cancelled` or an `error` naming it), after its `queued`/`started`, with nothing about it after
    that."""

    terminal: list[str]  # the terminal event types received for it, in order
    out_of_order: list[str]  # why its events came in a wrong order, if they did

    @property
    def exactly_once(self) -> bool:
        return len(self.terminal) == 1 and not self.out_of_order


@dataclass
class HeadlessPeer:
    base_url: str
    voice: str | None = None
    jitter_buffer_ms: int | None = None
    keep_pcm: bool = False
    events: list[ReceivedEvent] = field(default_factory=list)
    frames: list[ReceivedFrame] = field(default_factory=list)
    pcm: list[np.ndarray] = field(default_factory=list)
    session_id: str | None = None
    protocol_violations: list[str] = field(default_factory=list)
    # STUN/TURN of this peer, e.g. from the gateway's GET /v1/webrtc/ice-servers; default none (loopback tests).
    configuration: RTCConfiguration | None = None
    # When the connection failed or was closed by anything but `close()` (a server gone without a word is
    # noticed by ICE consent checks, ~30 s with aioice); None while it holds.
    lost_at: float | None = None

    def __post_init__(self) -> None:
        self.pc = RTCPeerConnection(self.configuration or RTCConfiguration(iceServers=[]))
        self.channel = self.pc.createDataChannel(CONTROL_LABEL)
        receiver = self.pc.addTransceiver("audio", direction="recvonly").receiver
        set_receive_prefetch(receiver)
        self._decoder = InLoopAudioDecoder.install(receiver, self._on_audio)
        self._event_arrived = asyncio.Event()
        self._closing = False
        self.channel.on("message", self._on_message)
        self.pc.on("connectionstatechange", self._on_connection_state)

    # --- connection -------------------------------------------------------------------------------
    async def connect(self, timeout: float = 30.0) -> dict[str, Any]:
        """Negotiate and wait for the server's `ready` event, all of it within `timeout` (TimeoutError): an
        overloaded server's offer endpoint must not hold a client for aiohttp's 5-minute default (a benchmark's
        hundreds of peers would wait out their run without a request reaching the engine)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._negotiate(timeout)
        except TimeoutError as exc:
            if str(exc):  # `wait_event`'s own, which says what did come
                raise
            stage = "the offer" if self.session_id is None else f"ICE/DTLS (connection {self.pc.connectionState})"
            seen = [e.message.get("type") for e in self.events]
            raise TimeoutError(f"no session with {self.base_url} within {timeout} s: waiting for {stage}; "
                               f"events so far {seen}") from None

    async def _negotiate(self, timeout: float) -> dict[str, Any]:
        """Offer, answer, then the `ready` event (`connect` bounds the whole)."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = protocol.Offer(sdp=self.pc.localDescription.sdp, type="offer", voice=self.voice,
                               jitter_buffer_ms=self.jitter_buffer_ms)
        body = {k: v for k, v in protocol.to_dict(offer).items() if v is not None}
        async with aiohttp.ClientSession() as http, \
                http.post(f"{self.base_url}/v1/webrtc/offer", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise OfferRejectedError(resp.status, answer)
        self.session_id = answer["session_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        return await self.wait_event("ready", timeout=timeout)

    async def close(self) -> None:
        self._closing = True
        await self.pc.close()
        self._decoder.stop()  # aiortc stops it too; not if the receiver never started

    def _on_connection_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed") and not self._closing and self.lost_at is None:
            self.lost_at = time.monotonic()
            self._event_arrived.set()  # wake whoever waits for an event that cannot come now

    # --- protocol ---------------------------------------------------------------------------------
    def send(self, message: protocol.ClientMessage | dict[str, Any] | str | bytes) -> None:
        """A typed message, or anything else as it is (tests of bad input)."""
        if isinstance(message, (protocol.Speak, protocol.Cancel, protocol.Ping, protocol.Repeat, protocol.Played)):
            self.channel.send(protocol.encode(message))
        else:
            self.channel.send(message if isinstance(message, (str, bytes)) else json.dumps(message))

    def speak(self, utterance_id: str, text: str, **fields: Any) -> float:
        """Send a speak message (`fields`: its optional fields); returns its send time for latency measurements."""
        sent = time.monotonic()
        self.send(protocol.Speak(id=utterance_id, text=text, **fields))
        return sent

    def cancel(self, utterance_id: str | None = None) -> None:
        self.send(protocol.Cancel(id=utterance_id))

    def repeat(self, utterance_id: str, **fields: Any) -> None:
        """Send a repeat message (`fields`: new_id, from_word, to_word, rate, interrupt)."""
        self.send(protocol.Repeat(id=utterance_id, **fields))

    def _on_message(self, raw: str | bytes) -> None:
        try:
            protocol.parse_server_event(raw)
        except msgspec.MsgspecError as exc:
            self.protocol_violations.append(f"{exc}: {raw!r}"[:500])
        self.events.append(ReceivedEvent(time.monotonic(), json.loads(raw)))
        self._event_arrived.set()

    def find(self, kind: str, utterance_id: str | None = None) -> list[ReceivedEvent]:
        return [e for e in self.events if e.message.get("type") == kind
                and (utterance_id is None or e.message.get("id") == utterance_id)]

    async def wait_event(self, kind: str, utterance_id: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
        """The first event of this kind (and id) received so far or from now on."""
        if not await self._wait(lambda: bool(self.find(kind, utterance_id)), timeout, until_lost=False):
            seen = [e.message for e in self.events]
            raise TimeoutError(f"no {kind!r} event for {utterance_id!r} within {timeout} s; saw {seen}")
        return self.find(kind, utterance_id)[0].message

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds, checked on every event; False on timeout or when the connection is
        lost first."""
        return await self._wait(predicate, timeout, until_lost=True)

    async def _wait(self, predicate: Callable[[], bool], timeout: float, until_lost: bool) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (until_lost and self.lost_at is not None):
                return False
            self._event_arrived.clear()  # no await since the check: no event can slip in between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event_arrived.wait(), remaining)
        return True

    async def wait_ending(self, utterance_id: str, timeout: float) -> list[str]:
        """The utterance's terminal events once it has one (empty: timeout, or the connection was lost)."""
        await self.wait_until(lambda: bool(self.endings(utterance_id).terminal), timeout)
        return self.endings(utterance_id).terminal

    def endings(self, utterance_id: str) -> Endings:
        """The exactly-once audit of one utterance id over the events received so far."""
        mine = [e.message for e in self.events if e.message.get("id") == utterance_id]
        kinds = [m.get("type") for m in mine]
        terminal = [k for k in kinds if k in protocol.TERMINAL_EVENTS]
        problems: list[str] = []
        if terminal:
            first_end = next(i for i, k in enumerate(kinds) if k in protocol.TERMINAL_EVENTS)
            if first_end < len(kinds) - 1:
                problems.append(f"{kinds[first_end + 1:]} after {kinds[first_end]}")
        for before, after in (("queued", "started"), ("started", "segment")):
            if after in kinds and before in kinds and kinds.index(after) < kinds.index(before):
                problems.append(f"{after} before {before}")
        return Endings(terminal, problems)

    def ending_problems(self) -> list[str]:
        """The exactly-once audit over every utterance this peer was told of, from its `queued` on (an id may be
        spoken again once it ended): none ends twice (`done`/`cancelled`), none hears of itself after that, and
        none is left without an ending while one accepted after it finished (utterances play in order). An
        `error` naming a live utterance may refuse a later message about it (a piece, a duplicate), so it is
        counted as an ending only where nothing about the utterance follows it."""
        problems: list[str] = []
        instances: list[tuple[str, list[str]]] = []  # (id, its event types from its `queued` on)
        last: dict[str, list[str]] = {}  # each id's latest instance
        for event in self.events:
            uid, kind = event.message.get("id"), str(event.message.get("type"))
            if not isinstance(uid, str):
                continue
            kinds = last.get(uid)
            ended = kinds is not None and any(k in ("done", "cancelled") for k in kinds)
            if kind == "queued" and (kinds is None or ended):
                last[uid] = kinds = []
                instances.append((uid, kinds))
            elif kinds is None or (ended and kind == "error"):
                continue  # a refusal of a message about no live utterance
            kinds.append(kind)
        finished_after = False
        for uid, kinds in reversed(instances):
            ends = [i for i, k in enumerate(kinds) if k in ("done", "cancelled")]
            if ends and ends[0] < len(kinds) - 1:
                problems.append(f"{uid}: {kinds[ends[0] + 1:]} after {kinds[ends[0]]}")
            if not (ends or kinds[-1] == "error") and finished_after:
                problems.append(f"{uid}: no ending, though an utterance accepted after it finished: {kinds}")
            finished_after = finished_after or "done" in kinds
        return problems

    def event_time(self, kind: str, utterance_id: str | None = None) -> float:
        return self.find(kind, utterance_id)[0].at

    # --- audio ------------------------------------------------------------------------------------
    def _on_audio(self, mono: np.ndarray, rtp_timestamp: int | None) -> None:
        """A decoded 20 ms frame (`InLoopAudioDecoder`), as the jitter buffer released it."""
        self.frames.append(ReceivedFrame(time.monotonic(), mono.size, frame_rms(mono), rtp_timestamp))
        if self.keep_pcm:
            self.pcm.append(mono.copy())

    def audible_frames(self, since: float = 0.0, until: float = float("inf")) -> list[ReceivedFrame]:
        return [f for f in self.frames if f.audible and since <= f.at <= until]


def frame_rms(mono: np.ndarray) -> float:
    """The level of a decoded frame's samples (int16 scale; `SILENCE_RMS` and below is silence)."""
    level = mono.astype(np.float32)
    return float(np.sqrt(np.dot(level, level) / level.size)) if level.size else 0.0


def set_receive_prefetch(receiver: RTCRtpReceiver, prefetch: int = RECEIVE_PREFETCH_PACKETS) -> None:
    """Give an audio receiver a jitter buffer that releases a frame after `prefetch` later frames (see
    `RECEIVE_PREFETCH_PACKETS`). aiortc offers no setting for it: its receiver makes the buffer in `__init__` (so
    replacing it before negotiation takes effect from the first packet) and keeps it in a private attribute. An
    aiortc that moves it fails here instead of silently bringing the ~80 ms bias back."""
    current = getattr(receiver, _JITTER_BUFFER_ATTR, None)
    if not isinstance(current, JitterBuffer):
        raise RuntimeError(f"aiortc {aiortc.__version__}: RTCRtpReceiver has no {_JITTER_BUFFER_ATTR} JitterBuffer "
                           f"(found {type(current).__name__}); update set_receive_prefetch for this aiortc")
    setattr(receiver, _JITTER_BUFFER_ATTR, JitterBuffer(capacity=RECEIVE_JITTER_CAPACITY, prefetch=prefetch))


class InLoopAudioDecoder:
    """Stands in for the queue an aiortc audio receiver hands its encoded frames to: decodes each one (mono Opus)
    where it is put, in the event loop, as soon as the jitter buffer releases it, and hands the PCM with the
    frame's RTP timestamp to `on_audio`. aiortc's decoder thread, which still starts, waits on `get` until the
    receiver stops. (A thread per receiver made each frame a hand-off from the loop to it and back: see the
    module docstring.)"""

    def __init__(self, receiver: RTCRtpReceiver, on_audio: Callable[[np.ndarray, int | None], None]) -> None:
        self._receiver = receiver
        self._on_audio = on_audio
        self._codec: Any = None
        self._stopped = threading.Event()
        self.decode_errors = 0

    @classmethod
    def install(cls, receiver: RTCRtpReceiver,
                on_audio: Callable[[np.ndarray, int | None], None]) -> InLoopAudioDecoder:
        """Before negotiation (the receiver starts its decoder thread on the queue it holds then). An aiortc that
        moves the queue fails here, not silently with no audio."""
        if not hasattr(receiver, _DECODER_QUEUE_ATTR):
            raise RuntimeError(f"aiortc {aiortc.__version__}: RTCRtpReceiver has no {_DECODER_QUEUE_ATTR}; update "
                               "InLoopAudioDecoder for this aiortc")
        decoder = cls(receiver, on_audio)
        setattr(receiver, _DECODER_QUEUE_ATTR, decoder)
        return decoder

    def put(self, item: tuple[Any, JitterFrame] | None) -> None:
        """aiortc's receiver: (codec, encoded frame) in the loop; None when it stops."""
        if item is None:
            self.stop()
            return
        codec, encoded = item
        if codec.name.lower() != "opus":
            return  # the gateway offers Opus only
        if self._codec is None:
            self._codec = av.CodecContext.create("libopus", "r")
            self._codec.format = "s16"
            self._codec.layout = "mono"
            self._codec.sample_rate = OPUS_RATE
        packet = av.Packet(encoded.data)
        try:
            decoded = self._codec.decode(packet)
        except av.FFmpegError as exc:
            self.decode_errors += 1
            log.warning("audio frame failed to decode: %s", exc)
            return
        timestamp = _rtp_timestamp(self._receiver, encoded.timestamp)
        for frame in decoded:  # mono s16: one plane (padded past its samples); to_ndarray took 20 us of ~150
            self._on_audio(np.frombuffer(frame.planes[0], dtype=np.int16, count=frame.samples), timestamp)

    def get(self) -> None:
        """aiortc's decoder thread: nothing to decode there; None (its stop) once the receiver stops."""
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


def _rtp_timestamp(receiver: Any, pts: int) -> int | None:
    """A frame's RTP timestamp: aiortc's receiver counts an encoded frame's timestamp from the first RTP timestamp it
    saw (its private `TimestampMapper`), so the stream's own timestamp is that origin + this count."""
    mapper = getattr(receiver, "_RTCRtpReceiver__timestamp_mapper", None)
    origin = getattr(mapper, "_origin", None)
    if origin is None:
        return None
    return (origin + pts) % RTP_MODULO
