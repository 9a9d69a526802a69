"""WebRTC level: the real gateway app on 127.0.0.1, N `HeadlessPeer`s over loopback, end to end.

Peers ask for `jitter_buffer_ms` = `--listener-buffer-ms` (default 0: the server plays audio the moment it has
it and the received frame times show raw delivery); the stall check's views are total buffers, of which the
client side holds what the server did not.
The playout track sends silence when it has nothing, so only audible frames count as audio: an utterance's
audio is its audible frames from the first one after the `speak` to the `done` event (plus a grace period
for frames still in flight when `done` arrives on the data channel), corrected for what Opus does to the
edges of each run of audio (`audio_frames`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from gateway.benchmarks.records import (
    MS,
    PlannedRequest,
    RequestRecord,
    apply_arrivals,
    count_server_underruns,
    new_record,
)
from gateway.benchmarks.settings import BenchOptions
from gateway.config import GatewayConfig
from gateway.devtools.client import OPUS_RATE, SILENCE_RMS, HeadlessPeer, ReceivedEvent, ReceivedFrame
from gateway.edge.app import create_app
from gateway.media.output_frames import FRAME_MS
from gateway.rtc.rtpclock import RTP_MODULO
from gateway.speech.synthesizer import Synthesizer

LOOPBACK = "127.0.0.1"
DONE_GRACE_S = 0.3  # the last RTP frames are still in flight when `done` arrives
SETTLE_S = 0.5  # let every peer's RTP stream run before the clock starts
POLL_S = 0.02  # event polling; the peer stamps events itself, so this only delays the next phrase
CONNECT_TIMEOUT_S = 60.0  # offer, ICE, DTLS and the `ready` event, all of it (HeadlessPeer.connect)
CLOSE_TIMEOUT_S = 10.0
FRAME_S = FRAME_MS / MS
OUTCOMES = ("done", "error", "cancelled")
# Opus keeps ringing faintly for a frame after audio stops: measured rms 20-30 (rarely ~130) after frames of
# 2000-4000 (random SNAC audio). Frames below this share of the utterance's median level are not audio.
CODEC_TAIL_RATIO = 0.02


class LocalGateway:
    """The gateway app served in this process on a free loopback port, sharing a started synthesizer."""

    def __init__(self, config: GatewayConfig, synth: Synthesizer) -> None:
        self.app = create_app(config, synth)
        self.runner = web.AppRunner(self.app, access_log=None)
        self.base_url = ""

    async def __aenter__(self) -> LocalGateway:
        await self.runner.setup()
        site = web.TCPSite(self.runner, LOOPBACK, 0)  # port 0: the OS picks a free one
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.runner.cleanup()


@contextlib.asynccontextmanager
async def served(config: GatewayConfig) -> AsyncIterator[str]:
    """The gateway of `config` with its own started synthesizer, served on loopback: its base url; both closed after."""
    synthesizer = Synthesizer.load(config)
    await synthesizer.start()
    try:
        async with LocalGateway(config, synthesizer) as gateway:
            yield gateway.base_url
    finally:
        await synthesizer.close()


async def run_point(base_url: str, workload: Sequence[Sequence[PlannedRequest]], options: BenchOptions
                    ) -> list[RequestRecord]:
    """Connect one peer per user (in this process), then all users speak at once, each its phrases in turn."""
    peers = await connect_all(base_url, len(workload), options.connect_concurrency, options.listener_buffer_ms)
    try:
        await asyncio.sleep(SETTLE_S)
        return await speak_all(peers, workload, options, time.monotonic())
    finally:
        await close_all(base_url, peers)


async def speak_all(peers: Sequence[HeadlessPeer | BaseException], workload: Sequence[Sequence[PlannedRequest]],
                    options: BenchOptions, origin: float) -> list[RequestRecord]:
    """Every user speaks its phrases in turn, all users at once; `origin` is the point's start time."""
    per_user = await asyncio.gather(*(_run_peer(peer, requests, options, origin)
                                      for peer, requests in zip(peers, workload, strict=True)))
    return [record for records in per_user for record in records]


async def connect_all(base_url: str, count: int, concurrency: int, jitter_buffer_ms: int = 0
                      ) -> list[HeadlessPeer | BaseException]:
    gate = asyncio.Semaphore(concurrency)  # hundreds of simultaneous ICE/DTLS handshakes starve the loop

    async def connect() -> HeadlessPeer | BaseException:
        async with gate:
            peer = HeadlessPeer(base_url, jitter_buffer_ms=jitter_buffer_ms)
            try:
                await peer.connect(timeout=CONNECT_TIMEOUT_S)
            except Exception as exc:
                with contextlib.suppress(TimeoutError):  # a half-made peer's close can hang on its transports
                    await asyncio.wait_for(peer.close(), CLOSE_TIMEOUT_S)
                return exc
            return peer

    return list(await asyncio.gather(*(connect() for _ in range(count))))


async def close_all(base_url: str, peers: Sequence[HeadlessPeer | BaseException]) -> None:
    """End each server session explicitly (frees it at once), then close the client peers."""
    connected = [p for p in peers if isinstance(p, HeadlessPeer)]
    async with aiohttp.ClientSession() as http:
        for peer in connected:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.delete(f"{base_url}/v1/webrtc/sessions/{peer.session_id}"):
                    pass
    await asyncio.gather(*(asyncio.wait_for(p.close(), CLOSE_TIMEOUT_S) for p in connected), return_exceptions=True)


async def _run_peer(peer: HeadlessPeer | BaseException, requests: Sequence[PlannedRequest], options: BenchOptions,
                    origin: float) -> list[RequestRecord]:
    if isinstance(peer, BaseException):
        return [_failed(request, f"connect: {type(peer).__name__}: {peer}", options) for request in requests]
    return [await _speak_one(peer, request, options, origin) for request in requests]


def _failed(request: PlannedRequest, error: str, options: BenchOptions) -> RequestRecord:
    record = new_record(request, 0.0)
    record.error = error
    apply_arrivals(record, [], options.buffers_ms, options.stall_tolerance_ms, keep=False)
    return record


async def _speak_one(peer: HeadlessPeer, request: PlannedRequest, options: BenchOptions, origin: float
                     ) -> RequestRecord:
    uid = request.request_id
    sent = peer.speak(uid, request.phrase.text, **({"voice": request.voice} if request.voice else {}))
    record = new_record(request, sent - origin)
    outcome = await _wait_outcome(peer, uid, options.request_timeout_s)
    if outcome is None:
        with contextlib.suppress(Exception):
            peer.cancel(uid)  # free the engine for the others
        record.error = "timeout"
    elif outcome.message["type"] != "done":
        record.error = f"{outcome.message['type']}: {outcome.message.get('code', '')}".rstrip(": ")
    await asyncio.sleep(DONE_GRACE_S)
    until = (outcome.at if outcome is not None else time.monotonic()) + DONE_GRACE_S
    window = [f for f in peer.frames if sent <= f.at <= until]
    arrivals = [(f.at - sent, FRAME_S) for f in audio_frames(window)]
    record.delivery_jitter_ms = delivery_jitter_ms(window)
    record.ok = record.error is None and bool(arrivals)
    if record.error is None and not arrivals:
        record.error = "no_audio"
    if outcome is not None:
        record.done_ms = round((outcome.at - sent) * MS, 2)
    record.server = _server_figures(peer, uid)
    endings = peer.endings(uid)  # after the grace period: a second ending would have arrived by now
    record.endings = len(endings.terminal)
    if endings.out_of_order and record.error is None:
        record.error = "events_out_of_order"
    apply_arrivals(record, arrivals, options.buffers_ms, options.stall_tolerance_ms, options.keep_arrivals,
                   held_ms=options.listener_buffer_ms)
    count_server_underruns(record, options.listener_buffer_ms)
    return record


def audio_frames(frames: Sequence[ReceivedFrame]) -> list[ReceivedFrame]:
    """The received frames that stand for the 20 ms audio frames the server sent, in order.

    `frames` are all received frames of a time window, silent ones included. Two codec effects are undone
    (measured against the server's frames; the count then matches the `done` event's `audio_ms` within a
    frame or two, since a one-frame underrun is bridged by the spill and reads as audio):
    the faint ringing after a run of audio (below CODEC_TAIL_RATIO of the median level) is not audio, and
    Opus' 6.5 ms algorithmic delay spills the end of every run of k frames into a (k+1)-th frame, so the last
    frame of each run is dropped.
    """
    levels = [f.rms for f in frames if f.rms > SILENCE_RMS]
    if not levels:
        return []
    threshold = max(SILENCE_RMS, CODEC_TAIL_RATIO * float(np.median(levels)))
    kept: list[ReceivedFrame] = []
    run: list[ReceivedFrame] = []
    for frame in [*frames, None]:
        if frame is not None and frame.rms > threshold:
            run.append(frame)
            continue
        kept += run[:-1]
        run = []
    return kept


def delivery_jitter_ms(frames: Sequence[ReceivedFrame]) -> float | None:
    """How far the frames' arrivals strayed from the clock they were sent on: the spread of (arrival time less
    RTP time) over every frame, silent ones included (the playout sends a frame every 20 ms either way). It is the
    delay a client's jitter buffer must absorb, from the server's sending, the network and the client's own
    event loop together; a stall no larger than it, with no server underrun, was delivery, not synthesis
    (docs/decisions/benchmark-clients.md). None with fewer than two stamped frames."""
    stamped = [(f.at, f.rtp_timestamp) for f in frames if f.rtp_timestamp is not None]
    if len(stamped) < 2:
        return None
    first = stamped[0][1]
    offsets = [at - ((stamp - first) % RTP_MODULO) / OPUS_RATE for at, stamp in stamped]
    return round((max(offsets) - min(offsets)) * MS, 2)


async def _wait_outcome(peer: HeadlessPeer, uid: str, timeout_s: float) -> ReceivedEvent | None:
    """The first done/error/cancelled event of this utterance, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in peer.events:
            if event.message.get("id") == uid and event.message.get("type") in OUTCOMES:
                return event
        await asyncio.sleep(POLL_S)
    return None


def _server_figures(peer: HeadlessPeer, uid: str) -> dict[str, Any]:
    """What the server reported: first token, first decode window and first audio (`started`), audio, underruns
    and the audio frames it handed to its sender late (`done`)."""
    started = peer.find("started", uid)
    done = peer.find("done", uid)
    figures: dict[str, Any] = {key: started[0].message.get(key) if started else None
                               for key in ("ttft_ms", "ttfw_ms", "ttfa_ms")}
    if done:
        message = done[0].message
        figures.update({key: message.get(key) for key in ("audio_ms", "underruns", "underrun_ms", "underrun_at_ms",
                                                           "late_frames", "max_late_ms")})
    return figures
