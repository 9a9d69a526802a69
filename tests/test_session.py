"""WebRTC sessions end to end: real aiortc peers over loopback, the real engine on the tiny model."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import av
import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from gateway.config import GatewayConfig
from gateway.devtools.client import RECEIVE_PREFETCH_PACKETS, HeadlessPeer
from gateway.edge.app import create_app
from gateway.edge.http import GATEWAY_KEY
from gateway.edge.state import GatewayState
from gateway.media.output_frames import FRAME_SAMPLES, FRAME_SECONDS
from gateway.media.playout import REANCHOR_LATENESS_S
from gateway.media.playout_events import UtteranceStarted
from gateway.rtc.protocol import MAX_MESSAGE_BYTES
from gateway.rtc.session import Session
from gateway.speech.synthesizer import Synthesizer
from tests.support import connected_peers, wait_until

pytestmark = pytest.mark.engine

LONG_TEXT = " ".join(f"This is sentence number {i} of a long lesson." for i in range(12))
ARRIVAL_TIMEOUT_S = 10.0  # bounded waits for frames in flight, on a loaded 2-core machine
PACE_FRAMES = 50  # one second of frames per pacing window
PACE_WINDOWS = 5  # windows tried before concluding the track re-anchors even when the machine does not stall it
RECEIVE_SLACK_S = 0.1  # the client stamps a frame when its own loop gets to it: up to a few frames late
STAMPED_FRAMES = 30
CANCEL_STOP_S = 0.25  # a cancel's last audible frame arrives within this (a frame, and the receive path's buffer)
CANCEL_BUFFER_MS = 1000  # the cancelled listener's jitter buffer: audio queued ahead that a cancel must drop


@pytest.fixture(scope="module")
async def server(test_config: GatewayConfig, synthesizer: Synthesizer) -> AsyncIterator[TestServer]:
    app = create_app(test_config, synthesizer)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    yield test_server
    await test_server.close()


@pytest.fixture()
def base_url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture()
def gateway(server: TestServer) -> GatewayState:
    return server.app[GATEWAY_KEY]


@pytest.fixture()
async def peer(base_url: str) -> AsyncIterator[HeadlessPeer]:
    p = HeadlessPeer(base_url, jitter_buffer_ms=0)
    await p.connect()
    yield p
    await p.close()


def session_of(gateway: GatewayState, peer: HeadlessPeer) -> Session:
    return gateway.sessions.sessions[peer.session_id]


async def test_ready_event(peer: HeadlessPeer) -> None:
    ready = peer.find("ready")[0].message
    assert ready["sample_rate"] == 48000
    assert "tara" in ready["voices"]
    assert ready["session_id"] == peer.session_id


async def test_speak_plays_audio_and_events_in_order(peer: HeadlessPeer) -> None:
    peer.speak("u1", "Hello student. Let us begin.")
    queued = await peer.wait_event("queued", "u1")
    started = await peer.wait_event("started", "u1")
    done = await peer.wait_event("done", "u1")
    assert queued["position"] == 0
    assert peer.event_time("started", "u1") <= peer.event_time("done", "u1")
    assert 0 < started["ttft_ms"] <= started["ttfw_ms"] <= started["ttfa_ms"], started  # stages, in order
    assert done["audio_ms"] > 0 and done["audio_ms"] % 20 == 0
    segments = [e.message for e in peer.find("segment", "u1")]
    assert [s["index"] for s in segments] == list(range(len(segments))) and segments[0]["text"] == "Hello student."
    t0 = peer.event_time("started", "u1")
    # The last frames are still in flight when `done` is sent: wait for them, however slow the machine.
    await wait_until(lambda: len(peer.audible_frames(since=t0 - 0.05)) * 20 >= 0.5 * done["audio_ms"],
                     timeout=ARRIVAL_TIMEOUT_S)  # most of the utterance arrived as audible audio


async def test_rtp_frames_are_evenly_paced(peer: HeadlessPeer, gateway: GatewayState) -> None:
    """The track sends one 20 ms frame per 20 ms, silence included: every slot carries a full frame (RTP timestamps
    one frame apart), none leaves ahead of its slot beyond the catch-up the track allows, and while the track did not
    re-anchor (the machine did not stall it past that catch-up) none falls behind by more. Measured in slots of the
    track's own rule, not in how fast this machine runs: a window the machine stalled is measured again."""
    track = session_of(gateway, peer).track
    for _ in range(PACE_WINDOWS):
        first, reanchors = len(peer.frames), track.stats().reanchors
        await wait_until(lambda end=first + PACE_FRAMES: len(peer.frames) >= end, timeout=ARRIVAL_TIMEOUT_S)
        if track.stats().reanchors == reanchors:
            break
    else:
        pytest.fail(f"the track re-anchored in each of {PACE_WINDOWS} windows: the loop stalled every time")
    window = peer.frames[first:first + PACE_FRAMES]
    assert all(f.samples == FRAME_SAMPLES for f in window)
    stamps = [f.rtp_timestamp for f in window]
    assert None not in stamps
    steps = {(b - a) % 2**32 for a, b in itertools.pairwise(stamps)}  # type: ignore[operator]
    assert steps == {FRAME_SAMPLES}, f"a slot without its frame: RTP steps {sorted(steps)}"
    slots_s = (PACE_FRAMES - 1) * FRAME_SECONDS
    span_s = window[-1].at - window[0].at
    assert span_s >= slots_s - REANCHOR_LATENESS_S - RECEIVE_SLACK_S, f"burst: {span_s:.3f} s for {slots_s:.3f} s"
    assert span_s <= slots_s + REANCHOR_LATENESS_S + RECEIVE_SLACK_S, f"stalled: {span_s:.3f} s for {slots_s:.3f} s"


async def test_frames_are_stamped_one_packet_after_they_leave(peer: HeadlessPeer, gateway: GatewayState) -> None:
    """The client releases a frame from its receive jitter buffer one packet after the server handed it to aiortc
    on loopback, like a browser, not after aiortc's default prefetch of 4. Counted in packets (how many later ones
    the server had sent when the client released each frame), so a slow machine delays both sides alike."""
    receiver = peer.pc.getReceivers()[0]
    assert receiver._RTCRtpReceiver__jitter_buffer._prefetch == RECEIVE_PREFETCH_PACKETS == 0
    session = session_of(gateway, peer)
    media = session.media
    sent: dict[int, float] = {}  # RTP timestamp -> when the Opus stage handed that packet to aiortc
    encode = media.recv

    async def recording_recv() -> av.Packet:
        packet = await encode()
        rtp = session.timelines.rtp.timestamp(packet.pts)
        if rtp is not None:
            sent[rtp] = time.monotonic()
        return packet

    media.recv = recording_recv  # type: ignore[method-assign]  # aiortc's sender looks recv up for every frame
    first = len(peer.frames)
    try:
        await wait_until(lambda: sum(f.rtp_timestamp in sent for f in peer.frames[first:]) >= STAMPED_FRAMES,
                         timeout=ARRIVAL_TIMEOUT_S)
    finally:
        del media.recv
    order = sorted(sent)  # RTP timestamps of one second do not wrap
    ahead = [sum(1 for rtp in order if rtp > f.rtp_timestamp and sent[rtp] <= f.at)
             for f in peer.frames[first:] if f.rtp_timestamp in sent]
    assert len(ahead) >= STAMPED_FRAMES, ahead
    assert float(np.median(ahead)) <= 1, f"frames released {np.median(ahead)} packets after the one they came in"


async def test_cancel_stops_audio_and_aborts_engine(base_url: str, gateway: GatewayState) -> None:
    """A cancel while the track holds over half a second of the utterance ahead of the listener (a 1 s jitter
    buffer): none of it is heard past the allowance, and the engine request is aborted."""
    engine = gateway.synthesizer.engine
    peer = HeadlessPeer(base_url, jitter_buffer_ms=CANCEL_BUFFER_MS)
    await peer.connect()
    try:
        peer.speak("long", LONG_TEXT)
        await peer.wait_event("started", "long")
        track = session_of(gateway, peer).track
        await wait_until(lambda: bool(peer.audible_frames()) and (track.lead_s("long") or 0.0) > 2 * CANCEL_STOP_S,
                         timeout=ARRIVAL_TIMEOUT_S,
                         message=f"not heard while the track held {2 * CANCEL_STOP_S:g} s of the utterance ahead")
        assert engine.in_flight == 1
        peer.cancel()
        await peer.wait_event("cancelled", "long")
        cancelled_at = peer.event_time("cancelled", "long")
        await wait_until(lambda: engine.in_flight == 0, timeout=5, message="the engine request was not aborted")
        await wait_until(lambda: engine.unfinished_requests() == 0, timeout=5,
                         message="the engine kept the request")
        # The server stops within one frame; allow the receive path's own buffering on top. The track goes on with
        # silence: half a second of it received after that allowance is where audio that went on would be.
        quiet_from = cancelled_at + CANCEL_STOP_S
        await wait_until(lambda: bool(peer.frames) and peer.frames[-1].at > quiet_from + 0.5,
                         timeout=ARRIVAL_TIMEOUT_S, message="no frames received half a second after the cancel")
        assert not peer.audible_frames(since=quiet_from), "audio continued after cancel"
        assert not peer.find("done", "long")
    finally:
        await peer.close()


async def test_interrupt_replaces_current_utterance(peer: HeadlessPeer) -> None:
    peer.speak("first", LONG_TEXT)
    await peer.wait_event("started", "first")
    peer.speak("second", "Short answer.", interrupt=True)
    await peer.wait_event("cancelled", "first")
    await peer.wait_event("done", "second")
    assert not peer.find("done", "first")


async def test_queued_utterances_play_in_order(peer: HeadlessPeer) -> None:
    for i in range(3):
        peer.speak(f"q{i}", f"Queued phrase {i}.")
    for i in range(3):
        await peer.wait_event("done", f"q{i}")
    starts = [peer.event_time("started", f"q{i}") for i in range(3)]
    assert starts == sorted(starts)
    assert [peer.find("queued", f"q{i}")[0].message["position"] for i in range(3)] == [0, 1, 2]


async def test_cancel_named_queued_utterance(peer: HeadlessPeer) -> None:
    peer.speak("a", LONG_TEXT)
    peer.speak("b", "Second.")
    peer.speak("c", "Third.")
    await peer.wait_event("queued", "c")
    peer.cancel("b")
    await peer.wait_event("cancelled", "b")
    peer.cancel("a")
    await peer.wait_event("done", "c")
    assert not peer.find("started", "b")


async def test_streamed_text_in_pieces(peer: HeadlessPeer) -> None:
    """An LLM writing the lesson: sentences start as soon as they are complete; the last piece closes."""
    peer.speak("s", "Today we learn ", more=True)
    peer.speak("s", "colours. Red is vermelho. ", more=True)
    await peer.wait_event("started", "s")  # the first sentence plays before the text is complete
    peer.speak("s", "Blue is azul.")
    await peer.wait_event("done", "s")
    texts = [e.message["text"] for e in peer.find("segment", "s")]
    assert texts == ["Today we learn colours.", "Red is vermelho.", "Blue is azul."]


async def test_eight_peers_each_hear_their_own(base_url: str, gateway: GatewayState) -> None:
    async with connected_peers(base_url, 8) as peers:
        for i, p in enumerate(peers):
            p.speak(f"peer{i}", f"I am student number {i}.")
        await asyncio.gather(*(p.wait_event("done", f"peer{i}", timeout=120) for i, p in enumerate(peers)))
        for i, p in enumerate(peers):
            ids = {e.message.get("id") for e in p.events if "id" in e.message}
            assert ids == {f"peer{i}"}, "no peer receives another's events"
            assert p.audible_frames(), "every peer received audio"


async def test_jitter_buffer_holds_first_frame_until_filled(base_url: str, gateway: GatewayState) -> None:
    """With 500 ms, playback starts only once 500 ms of the utterance is queued (or it is complete)."""
    peer = HeadlessPeer(base_url, jitter_buffer_ms=500)
    await peer.connect()
    seen: dict[str, tuple[int, bool]] = {}
    session = session_of(gateway, peer)
    original = session.reporter.on_playout_event

    def spy(event):  # type: ignore[no-untyped-def]
        if isinstance(event, UtteranceStarted):
            utterance = session.utterances[event.utterance_id]
            seen[event.utterance_id] = (utterance.stats.samples, utterance.stats.finished_at is not None)
        original(event)

    session.track._on_event = spy
    try:
        peer.speak("jb", "Wait for the buffer to fill before playing. Then keep going.")
        await peer.wait_event("done", "jb", timeout=120)
        samples, complete = seen["jb"]
        assert complete or samples >= 0.5 * 24000
    finally:
        await peer.close()


async def test_a_buffered_listeners_decoding_deadline_is_its_playout(
        base_url: str, gateway: GatewayState, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 ms listener's decoding deadline (the lead the SNAC decoder orders its streams by) is its track's: at
    least the buffer while it fills, then the audio the track holds. The clock model it replaces (audio out since
    the first, less the time since, plus 500 ms) read less than the buffer while the listener still waited, and
    more than the track held once it played: 384 lesson peers on an H200 ran dry after their start."""
    peer = HeadlessPeer(base_url, jitter_buffer_ms=500)
    await peer.connect()
    session = session_of(gateway, peer)
    waiting: list[float] = []  # leads read as audio reaches the track before it starts the utterance
    playing: list[tuple[float, float]] = []  # (lead, the track's queued audio of it) once it plays
    real_push = session.track.push_pcm

    def push(utterance_id: str, pcm: np.ndarray) -> bool:
        pushed = real_push(utterance_id, pcm)
        stats = session.utterances[utterance_id].stats
        assert stats is not None
        lead = Synthesizer._lead_s(stats)
        if session.track.playing_utterance_id is None:
            waiting.append(lead)
        else:
            playing.append((lead, session.track.stats().queued_ms / 1000))
        return pushed

    monkeypatch.setattr(session.track, "push_pcm", push)
    try:
        peer.speak("deadline", LONG_TEXT[:300])
        await peer.wait_event("done", "deadline", timeout=120)
        assert waiting and all(lead >= 0.5 for lead in waiting)
        assert playing and all(lead == pytest.approx(queued) for lead, queued in playing)
    finally:
        await peer.close()


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("not json", "invalid_json"),
        ("[1, 2]", "invalid_message"),
        (json.dumps({"type": "dance"}), "unknown_type"),
        (json.dumps({"text": "no type"}), "unknown_type"),
        (json.dumps({"type": "speak", "text": "no id"}), "invalid_message"),
        (json.dumps({"type": "speak", "id": 5, "text": "x"}), "invalid_message"),
        (json.dumps({"type": "speak", "id": "", "text": "x"}), "invalid_message"),
        (json.dumps({"type": "speak", "id": "x"}), "invalid_message"),
        (json.dumps({"type": "speak", "id": "x", "text": ""}), "empty_text"),
        (json.dumps({"type": "speak", "id": "x", "text": "hi", "voice": "nobody"}), "unknown_voice"),
        (json.dumps({"type": "speak", "id": "x", "text": "hi", "interrupt": "yes"}), "invalid_message"),
        (json.dumps({"type": "speak", "id": "x", "text": "y" * 5000}), "text_too_long"),
        (json.dumps({"type": "cancel", "id": "nothing-here"}), "unknown_id"),
        ("x" * (MAX_MESSAGE_BYTES + 1), "message_too_large"),
        (b"\x00\x01binary", "invalid_message"),
    ],
)
async def test_bad_messages_get_error_events(peer: HeadlessPeer, message: str | bytes, code: str) -> None:
    peer.send(message)
    error = await peer.wait_event("error", timeout=10)
    assert error["code"] == code
    assert error["message"]
    peer.send({"type": "ping"})
    await peer.wait_event("pong", timeout=10)  # the session survived


async def test_duplicate_id_rejected(peer: HeadlessPeer) -> None:
    peer.speak("dup", "Once.")
    await peer.wait_event("queued", "dup")
    peer.speak("dup", "Twice.")
    error = await peer.wait_event("error", "dup")
    assert error["code"] == "duplicate_id"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json", 400),
        (json.dumps({"type": "offer"}).encode(), 400),
        (json.dumps({"sdp": "garbage", "type": "offer"}).encode(), 400),
        (json.dumps({"sdp": "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\nm=application 9 x\r\n",
                     "type": "offer"}).encode(), 400),
        (json.dumps({"sdp": "v=0", "type": "answer"}).encode(), 400),
        (json.dumps({"sdp": 5, "type": "offer"}).encode(), 400),
        (b"x" * 200_000, 413),
    ],
)
async def test_bad_offers(base_url: str, body: bytes, status: int) -> None:
    async with aiohttp.ClientSession() as http, http.post(f"{base_url}/v1/webrtc/offer", data=body) as resp:
        assert resp.status == status
        payload = await resp.json()
        assert payload["error"]["code"] and payload["error"]["message"]


async def test_bad_offer_fields(base_url: str) -> None:
    peer = HeadlessPeer(base_url, jitter_buffer_ms=99999)
    with pytest.raises(Exception, match="invalid_jitter_buffer"):
        await peer.connect()
    await peer.close()
    peer = HeadlessPeer(base_url, voice="nobody")
    with pytest.raises(Exception, match="unknown_voice"):
        await peer.connect()
    await peer.close()


async def test_closed_peer_leaves_nothing_behind(base_url: str, gateway: GatewayState) -> None:
    engine = gateway.synthesizer.engine
    # The module's earlier peers closed from their side: their sessions gone here too, so the counts start settled.
    await wait_until(lambda: not gateway.sessions.sessions, timeout=30, message="earlier tests' sessions closed")
    sessions_before = len(gateway.sessions.sessions)
    tasks_before = len(asyncio.all_tasks())
    peer = HeadlessPeer(base_url, jitter_buffer_ms=0)
    await peer.connect()
    peer.speak("gone", LONG_TEXT)
    await peer.wait_event("started", "gone")
    assert engine.in_flight == 1
    await peer.close()
    await wait_until(lambda: len(gateway.sessions.sessions) == sessions_before, timeout=30)
    await wait_until(lambda: engine.in_flight == 0 and engine.unfinished_requests() == 0, timeout=10)
    await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before, timeout=10)


async def test_delete_session(base_url: str, gateway: GatewayState) -> None:
    peer = HeadlessPeer(base_url)
    await peer.connect()
    async with aiohttp.ClientSession() as http:
        async with http.delete(f"{base_url}/v1/webrtc/sessions/{peer.session_id}") as resp:
            assert resp.status == 204
        async with http.delete(f"{base_url}/v1/webrtc/sessions/{peer.session_id}") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "unknown_session"
    assert peer.session_id not in gateway.sessions.sessions
    await peer.close()


async def test_metrics_count_sessions_and_utterances(base_url: str) -> None:
    peer = HeadlessPeer(base_url, jitter_buffer_ms=0)  # its own session and utterance: passes run alone too
    try:
        await peer.connect()
        peer.speak("m1", "Count me.")
        await peer.wait_event("done", "m1", timeout=120)
    finally:
        await peer.close()
    async with aiohttp.ClientSession() as http, http.get(f"{base_url}/metrics") as resp:
        text = await resp.text()
    assert "orpheus_sessions_active" in text
    assert 'orpheus_utterances_total{outcome="done"}' in text
    assert 'orpheus_time_to_first_audio_seconds_count{path="webrtc"}' in text
    assert "orpheus_playout_late_frames_total" in text  # the server's share of delivery jitter
