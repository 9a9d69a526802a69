"""Reliability and security: admission control, auth and origins, limits, faults (engine death, SNAC failure,
vanished peers). Unit tests first; then the real gateway on loopback with the shared tiny engine.

Every test that needs other limits builds its own app around the shared synthesizer with
`dataclasses.replace(test_config, ...)` (gateway-only settings); the engine-restart test comes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from aiortc import RTCSessionDescription

from gateway.cli import build_parser
from gateway.cluster.workers import worker_config
from gateway.config import ConfigError, GatewayConfig, from_sources, normalize_origin
from gateway.devtools.client import HeadlessPeer
from gateway.edge.app import create_app
from gateway.edge.auth import AccessPolicy, make_session_token, verify_session_token
from gateway.edge.errors import AuthError
from gateway.edge.http import OFFER_PATH
from gateway.edge.signalling import NETWORK_RETRY_AFTER_S
from gateway.edge.state import GatewayState
from gateway.orpheus import AUDIO_TOKENS_PER_SECOND
from gateway.rtc.errors import ProtocolError
from gateway.rtc.session import RATE_ERROR_INTERVAL_S
from gateway.service.admission import (
    SESSION_RETRY_AFTER_S,
    STREAM_RETRY_AFTER_S,
    Admission,
    StreamCounts,
    TokenBucket,
    clear_stream_count,
    create_stream_counts,
)
from gateway.service.errors import AT_CAPACITY, CapacityError
from gateway.speech.engine import EngineState
from gateway.speech.errors import ENGINE_RETRY_AFTER_S
from gateway.speech.snac import StreamHandle
from gateway.speech.stream_decoder import DecodeStream, StreamDecoder
from gateway.speech.synthesizer import Synthesizer
from tests.support import (
    EVENT_TIMEOUT_S,
    EVIL,
    SCHOOL,
    SECRET,
    TOKEN,
    ManualClock,
    connected_peers,
    detached_session,
    offer_sdp,
    running,
    vanish,
    wait_until,
)

OTHER_SECRET = "another-secret-for-tests-987654"
LONG_TEXT = " ".join(f"This is sentence number {i} of a long lesson." for i in range(12))
CLEANUP_TIMEOUT_S = 30.0
FLOOD_MESSAGES = 30
ICE_CONSENT_MIN_S = 20.0  # the soonest aiortc's ICE consent check closes a silent peer on its own
HEARTBEAT_CLOSE_MARGIN_S = 8.0  # the watchdog's checks and the close itself, on a loaded 2-core machine
ENGINE_RESTART_TIMEOUT_S = 300.0


# --- helpers (also used by test_fuzz and test_soak) ----------------------------------------------------





async def connect_with(peer: HeadlessPeer, *, query: str = "", headers: dict[str, str] | None = None) -> None:
    """`HeadlessPeer.connect` with credentials (the peer itself sends none)."""
    await peer.pc.setLocalDescription(await peer.pc.createOffer())
    body = {"sdp": peer.pc.localDescription.sdp, "type": "offer"}
    async with aiohttp.ClientSession() as http, \
            http.post(f"{peer.base_url}{OFFER_PATH}{query}", json=body, headers=headers) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    peer.session_id = answer["session_id"]
    await peer.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
    await peer.wait_event("ready", timeout=EVENT_TIMEOUT_S)










def outcomes(gateway: GatewayState, outcome: str) -> float:
    """`orpheus_utterances_total{outcome=...}` of this gateway's own registry."""
    return gateway.metrics.registry.get_sample_value("orpheus_utterances_total", {"outcome": outcome}) or 0.0


async def error_of(resp: aiohttp.ClientResponse, status: int, code: str) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    error = (await resp.json())["error"]
    assert error["code"] == code and error["message"]
    return error


# --- admission and rate (no engine) ------------------------------------------------------------------

def test_admission_counts_and_releases_slots() -> None:
    admission = Admission(max_sessions=2, max_streams=1)
    first, second = admission.admit_session(), admission.admit_session()
    with pytest.raises(CapacityError) as refused:
        admission.admit_session()
    assert refused.value.code == AT_CAPACITY and refused.value.retry_after_s > 0
    first.release()
    first.release()  # idempotent: a double release must not free a slot twice
    assert admission.sessions == 1
    with admission.admit_stream():
        with pytest.raises(CapacityError):
            admission.admit_stream()
    assert admission.streams == 0
    second.release()
    assert admission.sessions == 0


@pytest.mark.parametrize(("streams_affordable", "budget_extra"), [(1, 0.0), (3, 0.5), (3, 81.0)])
def test_token_budget_admits_only_real_time_streams(streams_affordable: int, budget_extra: float) -> None:
    """(streams + 1) * 82.03 <= budget: exactly floor(budget / 82.03) streams at once."""
    admission = Admission(max_sessions=10, max_streams=100,
                          tokens_per_second=streams_affordable * AUDIO_TOKENS_PER_SECOND + budget_extra)
    slots = [admission.admit_stream() for _ in range(streams_affordable)]
    with pytest.raises(CapacityError):
        admission.admit_stream()
    slots.pop().release()
    admission.admit_stream()


def test_workers_count_each_others_utterances_against_one_limit(tmp_path: Path) -> None:
    """`serve --workers`: the in-flight utterance limit is the shared engine's, so each worker admits against every
    worker's count (`StreamCounts`, a file each maps). Worker 1 is another process here; once it is killed, its
    count holds until the supervisor clears it (`clear_stream_count`)."""
    counts = tmp_path / "streams.counts"
    create_stream_counts(counts, 2)
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys\n"
         "from pathlib import Path\n"
         "from gateway.service.admission import Admission, StreamCounts\n"
         "admission = Admission(10, 3, shared=StreamCounts(Path(sys.argv[1]), 1))\n"
         "slots = [admission.admit_stream(), admission.admit_stream()]\n"
         "print('admitted', flush=True)\n"
         "sys.stdin.readline()\n", str(counts)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    shared = StreamCounts(counts, 0)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "admitted"
        admission = Admission(max_sessions=10, max_streams=3, shared=shared)
        slot = admission.admit_stream()  # 2 there + 1 here: the limit
        with pytest.raises(CapacityError):
            admission.admit_stream()
        slot.release()
        admission.admit_stream().release()
        other.kill()
        other.wait(timeout=10)
        assert shared.others() == 2, "a dead worker's count stays until the supervisor clears it"
        clear_stream_count(counts, 1)
        slots = [admission.admit_stream() for _ in range(3)]
        assert shared.others() == 0 and admission.streams == 3
        with pytest.raises(CapacityError):
            admission.admit_stream()
        for slot in slots:
            slot.release()
    finally:
        if other.poll() is None:
            other.kill()
        shared.close()
    shared = StreamCounts(counts, 0)
    shared.publish(5)
    shared.close()
    StreamCounts(counts, 0).close()  # a restarted worker starts from none, whatever its cell held
    assert counts.read_bytes() == bytes(16)
    with pytest.raises(ValueError, match="no cell"):
        StreamCounts(counts, 2)


def test_a_worker_keeps_the_gateway_wide_utterance_limit(test_config: GatewayConfig) -> None:
    """Sessions are divided among the workers (offers move to one with room); utterances cannot move, so their
    limit and the token budget stay whole in each worker's config (counted across workers instead)."""
    config = dataclasses.replace(test_config, max_sessions=10, max_in_flight_utterances=6,
                                 engine_tokens_per_second=1000.0)
    one = worker_config(config, 4, ["http://127.0.0.1:1"])
    assert (one.max_sessions, one.max_in_flight_utterances, one.engine_tokens_per_second) == (3, 6, 1000.0)


def test_admission_defaults_follow_the_engine(test_config: GatewayConfig) -> None:
    admission = Admission.from_config(test_config)
    assert admission.max_streams == test_config.max_num_seqs
    assert admission.max_sessions == test_config.max_sessions
    limited = Admission.from_config(dataclasses.replace(test_config, max_in_flight_utterances=3))
    assert limited.max_streams == 3


def test_token_bucket_allows_burst_then_rate() -> None:
    clock = ManualClock(0.0)
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.advance(0.5)  # one token back at 2/s
    assert [bucket.take() for _ in range(2)] == [True, False]
    clock.advance(100)  # refills to the burst, not beyond
    assert sum(bucket.take() for _ in range(10)) == 3
    assert all(TokenBucket(rate=0, burst=1).take() for _ in range(100)), "rate 0 = unlimited"


# --- auth and origins (no engine) --------------------------------------------------------------------

def test_session_tokens_round_trip_expire_and_resist_tampering() -> None:
    token = make_session_token(SECRET, ttl_s=60, subject="student-42")
    assert verify_session_token([SECRET], token)["sub"] == "student-42"
    assert verify_session_token([OTHER_SECRET, SECRET], token)["sub"] == "student-42", "rotation: any secret"
    with pytest.raises(AuthError, match="expired") as expired:
        verify_session_token([SECRET], make_session_token(SECRET, ttl_s=60, subject="s", now=time.time() - 3600))
    assert (expired.value.status, expired.value.code) == (401, "expired_token")
    payload, signature = token.split(".")
    forged_payload = make_session_token(OTHER_SECRET, ttl_s=10**6, subject="admin").split(".")[0]
    for bad in (f"{forged_payload}.{signature}", f"{payload}.{signature[:-2]}", "a.b", "", "...", token + "x"):
        with pytest.raises(AuthError) as invalid:
            verify_session_token([SECRET], bad)
        assert invalid.value.status == 401
    with pytest.raises(AuthError):
        verify_session_token([OTHER_SECRET], token)
    with pytest.raises(ValueError):
        make_session_token(SECRET, ttl_s=0, subject="s")


def test_access_policy_tokens_and_origins() -> None:
    open_policy = AccessPolicy.from_lists([], [], [])
    assert open_policy.authenticate(None) is None, "no token configured: open"
    policy = AccessPolicy.from_lists([TOKEN], [SECRET], [SCHOOL + "/"])
    assert policy.authenticate(TOKEN) is None
    assert policy.authenticate(make_session_token(SECRET, 60, "t-1")) == "t-1"
    for token, code in ((None, "missing_token"), ("", "missing_token"), ("nope", "invalid_token")):
        with pytest.raises(AuthError) as refused:
            policy.authenticate(token)
        assert (refused.value.status, refused.value.code) == (401, code)
    policy.check_origin(None, ["gw:8000"])  # curl, servers: no Origin
    policy.check_origin(SCHOOL, ["gw:8000"])
    policy.check_origin("HTTPS://School.Example", ["gw:8000"])
    policy.check_origin("http://gw:8000", ["gw:8000"])  # the page's own origin
    policy.check_origin("https://tutor.example", ["127.0.0.1:8000", "tutor.example"])  # via X-Forwarded-Host
    for origin in (EVIL, "null", "http://school.example", "garbage"):
        with pytest.raises(AuthError) as refused:
            policy.check_origin(origin, ["gw:8000"])
        assert (refused.value.status, refused.value.code) == (403, "origin_not_allowed")
    AccessPolicy.from_lists([], [], ["*"]).check_origin(EVIL, ["gw:8000"])
    assert normalize_origin("http://LOCALHOST:8000/") == "http://localhost:8000"
    for bad in ("school.example", "ftp://x", "https://x/path", ""):
        with pytest.raises(ValueError):
            normalize_origin(bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"auth_token": ["short"]}, "auth_token"),
        ({"auth_secret": ["short"]}, "auth_secret"),
        ({"allowed_origin": ["school.example"]}, "allowed_origin"),
        ({"engine_tokens_per_second": 50.0}, "engine_tokens_per_second"),
        ({"max_in_flight_utterances": -1}, "max_in_flight_utterances"),
        ({"max_messages_per_second": -1.0}, "max_messages_per_second"),
        ({"message_burst": 0}, "message_burst"),
        ({"heartbeat_timeout_s": -1.0}, "heartbeat_timeout_s"),
        ({"max_session_s": -5.0}, "max_session_s"),
        ({"max_sessions": 0}, "max_sessions"),
    ],
)
def test_unworkable_limits_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_sources(env={}, **overrides)


def test_access_settings_from_environment() -> None:
    config = from_sources(env={"ORPHEUS_GATEWAY_AUTH_TOKEN": f"{TOKEN},{TOKEN}-2",
                               "ORPHEUS_GATEWAY_ALLOWED_ORIGIN": SCHOOL,
                               "ORPHEUS_GATEWAY_ENGINE_TOKENS_PER_SECOND": "4000"})
    assert config.auth_token == [TOKEN, f"{TOKEN}-2"]
    assert config.allowed_origin == [SCHOOL]
    assert config.engine_tokens_per_second == 4000.0
    defaults = from_sources(env={})
    assert (defaults.auth_token, defaults.auth_secret, defaults.protect_metrics) == ([], [], False), "open locally"
    assert defaults.heartbeat_timeout_s > 0 and defaults.max_session_s > 0


# --- the data-channel protocol without an engine request --------------------------------------------

needs_engine = pytest.mark.engine  # the tests above need no engine; the ones below share the real one


@needs_engine
async def test_pieces_of_a_cancelled_utterance_are_not_spoken_as_a_new_one(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    gateway = GatewayState(test_config, synthesizer)
    async with detached_session(gateway) as session:
        session.handle('{"type": "speak", "id": "s", "text": "Today we learn ", "more": true}')
        session.handle('{"type": "cancel", "id": "s"}')
        assert "s" not in session.utterances
        with pytest.raises(ProtocolError) as ended:
            session.handle('{"type": "speak", "id": "s", "text": "colours. ", "more": true}')
        assert ended.value.code == "utterance_ended" and ended.value.utterance_id == "s"
        with pytest.raises(ProtocolError):
            session.handle('{"type": "speak", "id": "s", "text": "The end."}')  # its last piece frees the id
        session.handle('{"type": "speak", "id": "s", "text": "A new utterance."}')
        assert session.utterances["s"].closed


# --- HTTP: auth, origins, CORS -----------------------------------------------------------------------

@needs_engine
async def test_auth_guards_every_api_route_and_leaves_health_and_page_open(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, auth_token=[TOKEN], auth_secret=[SECRET])
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    signed = {"Authorization": f"bearer {make_session_token(SECRET, 60, 'student-1')}"}
    expired = {"Authorization": f"Bearer {make_session_token(SECRET, 1, 's', now=time.time() - 600)}"}
    async with running(config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        for path in ("/healthz", "/readyz", "/", "/static/app.js", "/metrics"):
            async with http.get(path) as resp:
                assert resp.status == 200, path
        for method, path in (("GET", "/v1/voices"), ("POST", "/v1/audio/speech"), ("POST", OFFER_PATH),
                             ("DELETE", "/v1/webrtc/sessions/abc"), ("GET", "/v1/unknown")):
            async with http.request(method, path) as resp:
                await error_of(resp, 401, "missing_token")
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        async with http.get("/v1/voices", headers={"Authorization": "Bearer wrong-token"}) as resp:
            await error_of(resp, 401, "invalid_token")
        async with http.get("/v1/voices", headers=expired) as resp:
            await error_of(resp, 401, "expired_token")
        async with http.get("/v1/voices", headers={"Authorization": TOKEN}) as resp:
            await error_of(resp, 401, "missing_token")  # not a Bearer credential
        for headers in (bearer, signed):
            async with http.get("/v1/voices", headers=headers) as resp:
                assert resp.status == 200
        # Past the guard, the routes answer their own errors.
        async with http.post("/v1/audio/speech", data=b"{", headers=bearer) as resp:
            await error_of(resp, 400, "invalid_json")
        async with http.delete("/v1/webrtc/sessions/abc", headers=signed) as resp:
            await error_of(resp, 404, "unknown_session")
        # ?token= is accepted on the offer only (a page that cannot set headers); not elsewhere.
        async with http.post(f"{OFFER_PATH}?token={TOKEN}", data=b"{") as resp:
            await error_of(resp, 400, "invalid_json")
        async with http.get(f"/v1/voices?token={TOKEN}") as resp:
            await error_of(resp, 401, "missing_token")


@needs_engine
async def test_offer_with_a_query_token_opens_a_working_session(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, auth_secret=[SECRET])
    token = make_session_token(SECRET, 60, "student-7")
    async with running(config, synthesizer) as (base, gateway):
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        try:
            await connect_with(peer, query=f"?token={token}")
            peer.send({"type": "ping", "t": 1})
            await peer.wait_event("pong", timeout=EVENT_TIMEOUT_S)
            url, auth = f"{base}/v1/webrtc/sessions/{peer.session_id}", {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession() as http, http.delete(url, headers=auth) as resp:
                assert resp.status == 204
            assert not gateway.sessions.sessions
        finally:
            await peer.close()


@needs_engine
async def test_metrics_protected_on_request(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, auth_token=[TOKEN], protect_metrics=True)
    async with running(config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        async with http.get("/metrics") as resp:
            await error_of(resp, 401, "missing_token")
        async with http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
            assert "orpheus_rejections_total" in await resp.text()
        async with http.get("/healthz") as resp:
            assert resp.status == 200


@needs_engine
async def test_origins_cors_and_preflight(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, allowed_origin=[SCHOOL])
    async with running(config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        async with http.get("/v1/voices", headers={"Origin": EVIL}) as resp:
            await error_of(resp, 403, "origin_not_allowed")
        async with http.get("/v1/voices", headers={"Origin": SCHOOL}) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == SCHOOL
            assert "Origin" in resp.headers.getall("Vary")
        async with http.get("/v1/voices", headers={"Origin": base}) as resp:  # the page's own origin
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
        preflight = {"Origin": SCHOOL, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        async with http.options(OFFER_PATH, headers=preflight) as resp:
            assert resp.status == 204
            assert resp.headers["Access-Control-Allow-Origin"] == SCHOOL
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]
        async with http.options(OFFER_PATH, headers={**preflight, "Origin": EVIL}) as resp:
            await error_of(resp, 403, "origin_not_allowed")
        # A streamed response gets its CORS headers too (added before the headers go out).
        async with http.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"},
                             headers={"Origin": SCHOOL}) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == SCHOOL
            assert "Retry-After" in resp.headers["Access-Control-Expose-Headers"]
    async with running(test_config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        async with http.post(OFFER_PATH, data=b"{}", headers={"Origin": EVIL}) as resp:
            await error_of(resp, 403, "origin_not_allowed")  # default: the page's own origin only
        async with http.get("/v1/voices", headers={"Origin": base}) as resp:
            assert resp.status == 200


# --- admission through the routes and the data channel ----------------------------------------------

@needs_engine
async def test_offer_over_max_sessions_gets_503_with_retry_after(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    async with running(dataclasses.replace(test_config, max_sessions=1), synthesizer) as (base, gateway):
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        try:
            body = {"sdp": await offer_sdp(), "type": "offer"}
            async with aiohttp.ClientSession() as http, http.post(f"{base}{OFFER_PATH}", json=body) as resp:
                await error_of(resp, 503, AT_CAPACITY)
                assert int(resp.headers["Retry-After"]) == SESSION_RETRY_AFTER_S
            peer.send({"type": "ping"})
            await peer.wait_event("pong", timeout=EVENT_TIMEOUT_S)  # the admitted session is unaffected
        finally:
            await peer.close()
        await wait_until(lambda: gateway.admission.sessions == 0, timeout=CLEANUP_TIMEOUT_S)
        second = HeadlessPeer(base, jitter_buffer_ms=0)
        await second.connect()  # the slot came back
        await second.close()


@contextlib.contextmanager
def no_free_file_descriptors() -> Iterator[None]:
    """Inside: this process can open no file or socket (EMFILE), as a gateway that ran out of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    held: list[int] = []
    try:
        while True:  # the free numbers below the limit
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@needs_engine
async def test_an_offer_without_sockets_to_answer_it_gets_503_network_unavailable(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """The gateway cannot open the peer connection's sockets: the offer is answered 503 `network_unavailable`
    with Retry-After, its session slot comes back, and once sockets open again the next offer connects."""
    async with running(test_config, synthesizer) as (base, gateway):
        body = {"sdp": await offer_sdp(), "type": "offer"}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as resp:  # the offer then goes on this pooled connection
                assert resp.status == 200
            with no_free_file_descriptors():
                resp = await http.post(f"{base}{OFFER_PATH}", json=body)
            async with resp:
                await error_of(resp, 503, "network_unavailable")
                assert int(resp.headers["Retry-After"]) == NETWORK_RETRY_AFTER_S
        assert gateway.admission.sessions == 0 and not gateway.sessions.sessions
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        await peer.close()


@needs_engine
async def test_speech_over_capacity_gets_503(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, max_in_flight_utterances=1)
    async with running(config, synthesizer) as (base, gateway), aiohttp.ClientSession(base_url=base) as http:
        held = gateway.admission.admit_stream()  # another stream is synthesising
        async with http.post("/v1/audio/speech", json={"input": "Hello."}) as resp:
            await error_of(resp, 503, AT_CAPACITY)
            assert int(resp.headers["Retry-After"]) == STREAM_RETRY_AFTER_S
        held.release()
        async with http.post("/v1/audio/speech", json={"input": "Hello.", "response_format": "pcm"}) as resp:
            assert resp.status == 200
            await resp.read()
        assert gateway.admission.streams == 0
        async with http.get("/metrics") as resp:
            assert 'orpheus_rejections_total{code="at_capacity"} 1.0' in await resp.text()


@needs_engine
async def test_utterance_over_token_budget_gets_at_capacity_while_the_running_one_plays_on(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """Budget for one real-time stream: a second utterance is refused by name, the first keeps going."""
    config = dataclasses.replace(test_config, engine_tokens_per_second=1.5 * AUDIO_TOKENS_PER_SECOND)
    async with running(config, synthesizer) as (base, gateway):
        rejected, cancelled = outcomes(gateway, "rejected"), outcomes(gateway, "cancelled")
        async with connected_peers(base, 2) as (first, second):
            first.speak("long", LONG_TEXT)
            await first.wait_event("started", "long", timeout=EVENT_TIMEOUT_S)
            second.speak("refused", "Me too, please.")
            error = await second.wait_event("error", "refused", timeout=EVENT_TIMEOUT_S)
            assert error["code"] == AT_CAPACITY and error["retry_after_s"] == STREAM_RETRY_AFTER_S
            assert outcomes(gateway, "rejected") == rejected + 1
            segments = len(first.find("segment", "long"))
            await wait_until(lambda: len(first.find("segment", "long")) > segments, timeout=EVENT_TIMEOUT_S)
            assert not first.find("error"), "the running utterance is not disturbed"
            first.cancel()
            await first.wait_event("cancelled", "long", timeout=EVENT_TIMEOUT_S)
            assert outcomes(gateway, "cancelled") == cancelled + 1
            await wait_until(lambda: gateway.admission.streams == 0, timeout=CLEANUP_TIMEOUT_S)
            second.speak("admitted", "Now it is my turn.")
            await second.wait_event("done", "admitted", timeout=EVENT_TIMEOUT_S)


@needs_engine
async def test_an_utterance_waiting_for_more_text_keeps_its_slot(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """`more: true`: the utterance holds its in-flight slot while its text is still being written, even with
    nothing left to generate; another utterance is refused until its last piece has played."""
    config = dataclasses.replace(test_config, max_in_flight_utterances=1)
    async with running(config, synthesizer) as (base, gateway):
        async with connected_peers(base, 2) as (writer, other):
            writer.speak("piecewise", "The first sentence is here. ", more=True)
            await writer.wait_event("started", "piecewise", timeout=EVENT_TIMEOUT_S)
            await wait_until(lambda: synthesizer.engine.in_flight == 0, timeout=EVENT_TIMEOUT_S)
            assert gateway.admission.streams == 1, "the slot is held while more text may come"
            other.speak("refused", "Me too.")
            refused = await other.wait_event("error", "refused", timeout=EVENT_TIMEOUT_S)
            assert refused["code"] == AT_CAPACITY
            writer.speak("piecewise", "And this ends it.")
            await writer.wait_event("done", "piecewise", timeout=EVENT_TIMEOUT_S)
            await wait_until(lambda: gateway.admission.streams == 0, timeout=CLEANUP_TIMEOUT_S)
            other.speak("admitted", "Now me.")
            await other.wait_event("done", "admitted", timeout=EVENT_TIMEOUT_S)


# --- limits ------------------------------------------------------------------------------------------

@needs_engine
async def test_messages_over_the_rate_are_refused_by_name(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, max_messages_per_second=1.0, message_burst=3)
    async with running(config, synthesizer) as (base, _):
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        try:
            flood_from = time.monotonic()
            for i in range(FLOOD_MESSAGES):
                peer.send({"type": "ping", "t": i})
            peer.speak("flooded", "This one is over the rate.")
            refused = await peer.wait_event("error", "flooded", timeout=EVENT_TIMEOUT_S)
            flood_s = time.monotonic() - flood_from  # every refusal of the flood came within this
            assert refused["code"] == "rate_limited"
            unnamed = [e.message for e in peer.find("error") if "id" not in e.message]
            assert unnamed and all(m["code"] == "rate_limited" for m in unnamed)
            assert len(unnamed) <= 1 + int(flood_s / RATE_ERROR_INTERVAL_S), \
                f"{len(unnamed)} rate_limited errors for a flood of {flood_s:.2f} s: at most one a second"
            assert 1 <= len(peer.find("pong")) < FLOOD_MESSAGES
            assert not peer.find("queued", "flooded")
            await asyncio.sleep(2.0)  # the bucket refills
            peer.send({"type": "ping", "t": "after"})
            await wait_until(lambda: any(e.message.get("t") == "after" for e in peer.find("pong")),
                             timeout=EVENT_TIMEOUT_S)
        finally:
            await peer.close()


@needs_engine
async def test_a_full_queue_refuses_the_next_speak_by_name(test_config: GatewayConfig,
                                                          synthesizer: Synthesizer) -> None:
    """--max-queued-utterances N: N utterances wait, the next speak gets `queue_full` naming it and is not queued;
    a barge-in (interrupt) is still taken."""
    limit = from_sources(build_parser().parse_args(["serve", "--max-queued-utterances", "2"]),
                         env={}).max_queued_utterances
    assert limit == 2
    gateway = GatewayState(dataclasses.replace(test_config, max_queued_utterances=limit), synthesizer)
    async with detached_session(gateway) as session:  # nothing dequeues: every accepted speak waits
        for i in range(limit):
            session.handle(json.dumps({"type": "speak", "id": f"q{i}", "text": "Hello."}))
        with pytest.raises(ProtocolError) as refused:
            session.handle(json.dumps({"type": "speak", "id": "over", "text": "One too many."}))
        assert (refused.value.code, refused.value.utterance_id) == ("queue_full", "over")
        assert list(session.utterances) == ["q0", "q1"]
        session.handle(json.dumps({"type": "speak", "id": "barge", "text": "Listen.", "interrupt": True}))
        assert list(session.utterances) == ["barge"]


@needs_engine
async def test_a_refused_repeat_names_the_id_it_would_have_had(test_config: GatewayConfig,
                                                                synthesizer: Synthesizer) -> None:
    """docs/protocol.md: a repeat's error names its new id (`new_id`, or the default `<id>#r<n>`)."""
    gateway = GatewayState(test_config, synthesizer)
    async with detached_session(gateway) as session:
        for message, uid, code in [
                ({"type": "repeat", "id": "never"}, "never#r1", "unknown_id"),
                ({"type": "repeat", "id": "never", "new_id": "mine"}, "mine", "unknown_id"),
                ({"type": "repeat", "id": "never", "new_id": "fast", "rate": 9.0}, "fast", "invalid_rate")]:
            with pytest.raises(ProtocolError) as refused:
                session.handle(json.dumps(message))
            assert (refused.value.code, refused.value.utterance_id) == (code, uid), message


@needs_engine
@pytest.mark.parametrize(("setting", "code"), [("max_session_s", "session_time_limit"),
                                               ("session_idle_timeout_s", "idle_timeout")])
async def test_session_limits_close_with_an_error_first(
        test_config: GatewayConfig, synthesizer: Synthesizer, setting: str, code: str) -> None:
    limit_s = 4.0  # long enough for the peer to connect on a busy CPU
    async with running(dataclasses.replace(test_config, **{setting: limit_s}), synthesizer) as (base, gateway):
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        try:
            error = await peer.wait_event("error", timeout=EVENT_TIMEOUT_S)
            assert error["code"] == code and error["message"]
            await wait_until(lambda: not gateway.sessions.sessions and gateway.admission.sessions == 0,
                             timeout=CLEANUP_TIMEOUT_S)
        finally:
            await peer.close()


@needs_engine
async def test_offer_never_connected_is_reaped(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """An answered offer whose peer never connects must not hold a session slot until the idle timeout."""
    async with running(dataclasses.replace(test_config, session_connect_timeout_s=1.0), synthesizer) as (base, gw):
        body = {"sdp": await offer_sdp(), "type": "offer"}
        async with aiohttp.ClientSession() as http, http.post(f"{base}{OFFER_PATH}", json=body) as resp:
            assert resp.status == 200
        assert gw.admission.sessions == 1
        await wait_until(lambda: not gw.sessions.sessions and gw.admission.sessions == 0, timeout=CLEANUP_TIMEOUT_S)


@needs_engine
async def test_shutdown_tells_sessions_why(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    peer = HeadlessPeer("", jitter_buffer_ms=0)
    async with running(test_config, synthesizer) as (base, _):
        peer.base_url = base
        await peer.connect()
    try:
        error = await peer.wait_event("error", timeout=EVENT_TIMEOUT_S)
        assert error["code"] == "shutting_down"
    finally:
        await peer.close()


# --- faults ------------------------------------------------------------------------------------------

@needs_engine
async def test_vanished_peer_is_closed_by_the_heartbeat(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """A peer that pinged and then went silent (no close, no packets) is cleaned up long before ICE notices."""
    heartbeat_s = 2.0
    ice_consent_timeout_s = 30.0  # what aiortc alone would take
    config = dataclasses.replace(test_config, heartbeat_timeout_s=heartbeat_s)
    async with running(config, synthesizer) as (base, gateway):
        engine = synthesizer.engine
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        try:
            peer.send({"type": "ping"})
            peer.speak("lost", LONG_TEXT)
            await peer.wait_event("started", "lost", timeout=EVENT_TIMEOUT_S)
            vanished_at = time.monotonic()
            vanish(peer)
            # aiortc's own ICE consent check closes a silent peer after 20-36 s: only the heartbeat closes it sooner.
            await wait_until(lambda: not gateway.sessions.sessions, timeout=ice_consent_timeout_s)
            closed_after_s = time.monotonic() - vanished_at
            assert closed_after_s < heartbeat_s + HEARTBEAT_CLOSE_MARGIN_S < ICE_CONSENT_MIN_S, \
                f"closed {closed_after_s:.1f} s after the peer vanished: not by the {heartbeat_s:g} s heartbeat"
            await wait_until(lambda: engine.in_flight == 0 and gateway.admission.streams == 0,
                             timeout=CLEANUP_TIMEOUT_S)
        finally:
            await peer.close()


FAULTY_UTTERANCE: contextvars.ContextVar[bool] = contextvars.ContextVar("faulty_utterance", default=False)


@needs_engine
async def test_snac_decode_failure_fails_that_utterance_only(
        test_config: GatewayConfig, synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """SNAC raises whenever it decodes one utterance's stream: that utterance gets an error event, a concurrent one
    finishes, and the decoder goes on (the same session speaks again)."""
    faulty_voice = "leah"
    decoder = synthesizer.decoder
    assert isinstance(decoder, StreamDecoder)
    snac = decoder.snac
    faulty: list[DecodeStream] = []  # the streams opened for the faulty utterance (appended on the event loop)
    failed: list[int] = []  # faulty streams in each call the injected fault failed
    real_utterance, real_open = synthesizer.utterance, decoder.open

    def utterance(text: Any, voice: str | None = None, **kw: Any) -> AsyncIterator[Any]:
        async def tagged() -> AsyncIterator[Any]:
            FAULTY_UTTERANCE.set(voice == faulty_voice)  # copied into the tasks that open its decode streams
            async with contextlib.aclosing(real_utterance(text, voice, **kw)) as chunks:
                async for chunk in chunks:
                    yield chunk
        return tagged()

    def open_stream(lead_s: Callable[[], float], lookahead: int = 1, **kwargs: Any) -> DecodeStream:
        stream = real_open(lead_s, lookahead, **kwargs)
        if FAULTY_UTTERANCE.get():
            faulty.append(stream)
        return stream

    def failing_for_the_faulty(decode: Callable[..., list[np.ndarray]]) -> Callable[..., list[np.ndarray]]:
        """SNAC's batched `decode` (worker thread) raising for the faulty streams only: they fail in calls of their
        own (a mixed call decodes the others and leaves the faulty ones for a later call), so the fault hits one
        utterance."""
        def run(handles: Sequence[StreamHandle], *args: Any, **kwargs: Any) -> list[np.ndarray]:
            bad = {id(stream.handle) for stream in faulty if stream.handle is not None}
            hit = [h for h in handles if id(h) in bad]
            if not hit:
                return decode(handles, *args, **kwargs)
            if len(hit) == len(handles):
                failed.append(len(hit))
                raise RuntimeError("injected SNAC fault")
            audio = iter(decode([h for h in handles if id(h) not in bad], *args, **kwargs))
            return [np.zeros(0, dtype=np.int16) if id(h) in bad else next(audio) for h in handles]
        return run

    monkeypatch.setattr(synthesizer, "utterance", utterance)
    monkeypatch.setattr(decoder, "open", open_stream)
    monkeypatch.setattr(snac, "step_batch", failing_for_the_faulty(snac.step_batch))
    monkeypatch.setattr(snac, "bridge", failing_for_the_faulty(snac.bridge))
    async with running(test_config, synthesizer) as (base, gateway):
        failed_before = outcomes(gateway, "failed")
        async with connected_peers(base, 2) as (healthy, faulty_peer):
            healthy.speak("ok", "This sentence plays. And so does this one.")
            faulty_peer.speak("broken", "This one loses its decoder.", voice=faulty_voice)
            error = await faulty_peer.wait_event("error", "broken", timeout=EVENT_TIMEOUT_S)
            assert error["code"] == "synthesis_failed" and "decod" in error["message"]
            assert outcomes(gateway, "failed") == failed_before + 1
            await healthy.wait_event("done", "ok", timeout=EVENT_TIMEOUT_S)
            assert not healthy.find("error") and not faulty_peer.find("done", "broken")
            assert failed, "the fault was injected"
            faulty_peer.speak("again", "The decoder works again.")
            await faulty_peer.wait_event("done", "again", timeout=EVENT_TIMEOUT_S)
            await wait_until(lambda: synthesizer.engine.in_flight == 0 and gateway.admission.streams == 0,
                             timeout=CLEANUP_TIMEOUT_S)
            await wait_until(lambda: not decoder._streams, timeout=CLEANUP_TIMEOUT_S)  # every slot given back


UTTERANCE_VOICE: contextvars.ContextVar[str] = contextvars.ContextVar("utterance_voice", default="")
BATCHING_WAIT_S = 20.0  # the longest the first steps wait for a second utterance's stream's frames
BATCHING_DELAY_S = 0.1  # each step until the fault: the first utterance's stream outlives the others' starts


@needs_engine
async def test_a_failing_snac_step_fails_every_utterance_in_its_batch(
        test_config: GatewayConfig, synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """SNAC's batched step raises once for a batch of several utterances' streams: each of those utterances ends
    with one `synthesis_failed` error (none is left hanging, none gets `done`), and the decoder goes on."""
    decoder = synthesizer.decoder
    assert isinstance(decoder, StreamDecoder)
    snac = decoder.snac
    hit: list[set[str]] = []  # the voices (one per utterance) of the one batch that failed
    opened: list[tuple[DecodeStream, str]] = []
    real_utterance, real_open, real_step = synthesizer.utterance, decoder.open, snac.step_batch

    def utterance(text: Any, voice: str | None = None, **kw: Any) -> AsyncIterator[Any]:
        async def tagged() -> AsyncIterator[Any]:
            UTTERANCE_VOICE.set(str(voice))  # copied into the tasks that open its decode streams
            async with contextlib.aclosing(real_utterance(text, voice, **kw)) as chunks:
                async for chunk in chunks:
                    yield chunk
        return tagged()

    def open_stream(lead_s: Callable[[], float], lookahead: int = 1, **kwargs: Any) -> DecodeStream:
        stream = real_open(lead_s, lookahead, **kwargs)
        opened.append((stream, UTTERANCE_VOICE.get()))
        return stream

    def step_batch(handles: Sequence[StreamHandle], *args: Any, **kwargs: Any) -> list[np.ndarray]:
        voices = {voice for stream, voice in list(opened) if stream.handle is not None
                  and any(stream.handle is h for h in handles)}
        if not hit and len(voices) >= 2:
            hit.append(voices)
            raise RuntimeError("injected SNAC fault for a whole batch")
        if not hit:
            # A slow step (the worker thread, not the loop), and none until a second utterance's stream has sent
            # its frames: the streams pile up into one batch however slowly the texts arrive on a loaded machine.
            deadline = time.monotonic() + BATCHING_WAIT_S
            while len({voice for s, voice in list(opened) if s.opened}) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(BATCHING_DELAY_S)
        return real_step(handles, *args, **kwargs)

    monkeypatch.setattr(synthesizer, "utterance", utterance)
    monkeypatch.setattr(decoder, "open", open_stream)
    monkeypatch.setattr(snac, "step_batch", step_batch)
    voices = ["tara", "leah", "jess"]
    async with running(test_config, synthesizer) as (base, gateway):
        async with connected_peers(base, len(voices)) as peers:
            for i, (peer, voice) in enumerate(zip(peers, voices, strict=True)):
                peer.speak(f"u{i}", f"Speaker {voice} says a sentence long enough to be stepped.", voice=voice)
            for i, peer in enumerate(peers):
                await wait_until(lambda p=peer, u=f"u{i}": bool(p.find("done", u) or p.find("error", u)),
                                 timeout=EVENT_TIMEOUT_S)
            assert hit, "no batch held several utterances' streams"
            failed = [voice for i, (peer, voice) in enumerate(zip(peers, voices, strict=True))
                      if voice in hit[0]]
            assert len(failed) >= 2
            for i, (peer, voice) in enumerate(zip(peers, voices, strict=True)):
                if voice in hit[0]:
                    codes = [e.message["code"] for e in peer.find("error", f"u{i}")]
                    assert codes == ["synthesis_failed"] and not peer.find("done", f"u{i}"), (voice, peer.events)
            peers[0].speak("again", "The decoder works again.")
            await peers[0].wait_event("done", "again", timeout=EVENT_TIMEOUT_S)
            await wait_until(lambda: synthesizer.engine.in_flight == 0 and gateway.admission.streams == 0,
                             timeout=CLEANUP_TIMEOUT_S)
            await wait_until(lambda: not decoder._streams, timeout=CLEANUP_TIMEOUT_S)


def failing_snac(synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch, good_calls: int) -> list[int]:
    """SNAC's batched decode (`step_batch` and `bridge`) raising after its first `good_calls` calls that gave audio:
    the fault a broken decode raises. Returns the count of calls made, for the test to read."""
    decoder = synthesizer.decoder
    assert isinstance(decoder, StreamDecoder)
    calls = [0]

    def failing(decode: Callable[..., list[np.ndarray]]) -> Callable[..., list[np.ndarray]]:
        def run(*args: Any, **kwargs: Any) -> list[np.ndarray]:
            if calls[0] >= good_calls:
                raise RuntimeError("injected SNAC fault")
            audio = decode(*args, **kwargs)
            calls[0] += any(len(a) for a in audio)
            return audio
        return run

    monkeypatch.setattr(decoder.snac, "step_batch", failing(decoder.snac.step_batch))
    monkeypatch.setattr(decoder.snac, "bridge", failing(decoder.snac.bridge))
    return calls


@needs_engine
async def test_speech_route_failing_before_audio_is_a_500_and_after_it_a_cut_connection(
        test_config: GatewayConfig, synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The speech route answers a synthesis that fails before its first audio with 500 `synthesis_failed` (JSON);
    once the 200 and audio have gone, a failure cuts the connection: the client sees a truncated transfer, never a
    complete shorter file."""
    async with running(test_config, synthesizer) as (base, gateway), aiohttp.ClientSession(base_url=base) as http:
        with monkeypatch.context() as faults:
            failing_snac(synthesizer, faults, good_calls=0)
            async with http.post("/v1/audio/speech", json={"input": "This fails at once."}) as resp:
                error = await error_of(resp, 500, "synthesis_failed")
                assert "decod" in error["message"]
        with monkeypatch.context() as faults:
            failing_snac(synthesizer, faults, good_calls=1)
            async with http.post("/v1/audio/speech", json={"input": LONG_TEXT, "response_format": "pcm"}) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
        await wait_until(lambda: synthesizer.engine.in_flight == 0 and gateway.admission.streams == 0,
                         timeout=CLEANUP_TIMEOUT_S)
        async with http.get("/metrics") as resp:
            assert 'orpheus_speech_requests_total{status="500"} 2.0' in await resp.text()
        async with http.post("/v1/audio/speech", json={"input": "Working again.", "response_format": "pcm"}) as resp:
            assert resp.status == 200 and len(await resp.read()) > 0


@needs_engine
async def test_readyz_says_what_it_waits_for_and_why_it_failed(
        test_config: GatewayConfig, synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """/readyz: 503 `waiting_for_snac` while the engine is up but the SNAC server not yet reachable; 503 `failed`
    with the reason when the engine cannot start."""
    async with running(test_config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        monkeypatch.setattr(synthesizer, "decoder_ready", False)  # as while `--snac-socket` has no server yet
        async with http.get("/readyz") as resp:
            assert (resp.status, await resp.json()) == (503, {"status": "waiting_for_snac"})
        monkeypatch.setattr(synthesizer, "decoder_ready", True)
        async with http.get("/readyz") as resp:
            assert (resp.status, await resp.json()) == (200, {"status": "ready"})
    broken = dataclasses.replace(test_config, model=str(tmp_path))  # no model there: the load fails
    app = create_app(broken, None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + CLEANUP_TIMEOUT_S
            while True:
                async with http.get(server.make_url("/readyz")) as resp:
                    body = await resp.json()
                if body["status"] != "loading" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert resp.status == 503 and body["status"] == "failed" and body["reason"], body
            assert str(tmp_path) in body["reason"] or "Error" in body["reason"], body
    finally:
        await server.close()


@needs_engine
async def test_speak_before_the_synthesizer_is_loaded_says_when_to_retry(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """While the gateway still loads its synthesizer (its state holds none yet), `speak` is refused as
    `engine_unavailable` with the same `retry_after_s` as HTTP's Retry-After; once it is there, the session speaks."""
    async with running(test_config, synthesizer) as (base, gateway):
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        try:
            gateway.synthesizer = None  # as between start-up and the end of `Synthesizer.load`
            peer.speak("early", "Hello?")
            refused = await peer.wait_event("error", "early", timeout=EVENT_TIMEOUT_S)
            assert refused["code"] == "engine_unavailable" and refused["retry_after_s"] == ENGINE_RETRY_AFTER_S
            gateway.synthesizer = synthesizer
            peer.speak("later", "Hello.")
            await peer.wait_event("done", "later", timeout=EVENT_TIMEOUT_S)
        finally:
            gateway.synthesizer = synthesizer
            await peer.close()


@needs_engine
async def test_engine_death_mid_utterance_reports_and_recovers(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """Kill the engine core mid-utterance: `engine_dead` by name, then the same session speaks again."""
    engine = synthesizer.engine
    restarts = engine.restarts
    async with running(test_config, synthesizer) as (base, gateway):
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        try:
            peer.speak("doomed", LONG_TEXT)
            await peer.wait_event("started", "doomed", timeout=EVENT_TIMEOUT_S)
            for pid in engine.engine_process_ids():
                os.kill(pid, signal.SIGKILL)
            error = await peer.wait_event("error", "doomed", timeout=EVENT_TIMEOUT_S)
            assert error["code"] == "engine_dead" and error["retry_after_s"] == ENGINE_RETRY_AFTER_S
            await wait_until(lambda: engine.state is not EngineState.READY, timeout=EVENT_TIMEOUT_S)
            peer.speak("while-restarting", "Are you there?")
            refused = await peer.wait_event("error", "while-restarting", timeout=EVENT_TIMEOUT_S)
            assert refused["code"] == "engine_unavailable" and refused["retry_after_s"] == ENGINE_RETRY_AFTER_S
            async with aiohttp.ClientSession(base_url=base) as http, \
                    http.post("/v1/audio/speech", json={"input": "Hi."}) as resp:
                await error_of(resp, 503, "engine_unavailable")
            await engine.wait_ready(timeout=ENGINE_RESTART_TIMEOUT_S)
            assert engine.restarts == restarts + 1
            peer.speak("back", "I am back.")
            await peer.wait_event("done", "back", timeout=EVENT_TIMEOUT_S)
            assert gateway.admission.streams == 0 and engine.in_flight == 0
        finally:
            await peer.close()
