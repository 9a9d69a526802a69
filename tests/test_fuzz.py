"""Property-based fuzzing of everything a stranger can send: data-channel messages (straight into
`Session.handle`, and through a live peer), HTTP bodies of the speech and offer routes, tokens and origins.

Properties: a message is either handled or refused with a `ProtocolError` (an `error` event), never anything
else; an HTTP body gets 200 or a 4xx/503 JSON error, never a 500.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.devtools.client import HeadlessPeer
from gateway.edge.auth import AccessPolicy, verify_session_token
from gateway.edge.errors import AuthError
from gateway.edge.http import OFFER_PATH
from gateway.edge.state import GatewayState
from gateway.rtc.errors import ProtocolError
from gateway.rtc.session import MAX_ABANDONED_IDS
from gateway.speech.synthesizer import Synthesizer
from tests.support import EVENT_TIMEOUT_S, detached_session, offer_sdp, running, wait_until

FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
HANDLE_EXAMPLES = 300  # pure Python, no engine: cheap
HTTP_EXAMPLES = 60
LIVE_EXAMPLES = 6  # each goes through a real peer and may start (then cancel) real synthesis
ACCEPTED_STATUSES = {200, 400, 404, 405, 413, 503}
KNOWN_IDS = ("a", "b", "c")
MAX_SDP_MUTATIONS = 4
MAX_SDP_DRAW = 1000

# --- strategies --------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
ids = st.sampled_from(KNOWN_IDS) | st.text(max_size=140) | json_values
texts = st.text(max_size=300) | st.sampled_from(["Hello there. ", "Two. Sentences!", "   ", "x" * 4001]) | json_values
voices = st.sampled_from(["tara", "leah", "", "nobody"]) | json_values
flags = st.booleans() | json_values
protocol_dicts = st.fixed_dictionaries(
    {"type": st.sampled_from(["speak", "cancel", "ping"]) | json_values},
    optional={"id": ids, "text": texts, "voice": voices, "interrupt": flags, "more": flags, "t": json_values},
)
messages = (st.builds(json.dumps, protocol_dicts) | st.builds(json.dumps, json_values) | st.text(max_size=200)
            | st.binary(max_size=64) | st.just("x" * (16 * 1024 + 1)))

speech_bodies = st.fixed_dictionaries({}, optional={
    "input": st.text(max_size=60) | json_values, "voice": voices,
    "response_format": st.sampled_from(["wav", "pcm", "mp3"]) | json_values,
    "speed": st.floats() | json_values, "model": st.just("orpheus") | json_values})
plausible_speech = st.fixed_dictionaries(  # valid more often than not: exercises the 200 path too
    {"input": st.text(min_size=1, max_size=40)},
    optional={"voice": st.sampled_from(["tara", "leah"]), "response_format": st.sampled_from(["wav", "pcm"])})
http_bodies = (st.builds(lambda v: json.dumps(v).encode(), speech_bodies | plausible_speech | json_values)
               | st.binary(max_size=300) | st.text(max_size=100).map(str.encode))
offer_fields = st.fixed_dictionaries({}, optional={
    "sdp": st.text(max_size=200) | json_values, "type": st.just("offer") | json_values,
    "voice": voices, "jitter_buffer_ms": st.integers() | json_values})


# --- Session.handle directly -------------------------------------------------------------------------

@pytest.mark.engine
@settings(FUZZ, max_examples=HANDLE_EXAMPLES)
@given(batch=st.lists(messages, max_size=25))
async def test_handle_raises_only_protocol_errors(
        test_config: GatewayConfig, synthesizer: Synthesizer, batch: list[str | bytes]) -> None:
    gateway = GatewayState(test_config, synthesizer)
    async with detached_session(gateway) as session:
        for raw in batch:
            try:
                session.handle(raw)
                event("handled")
            except ProtocolError as exc:
                assert exc.code and str(exc)
                event(f"refused: {exc.code}")
            assert len(session.utterances) <= test_config.max_queued_utterances
            assert len(session._abandoned) <= MAX_ABANDONED_IDS


# --- through a live peer -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def fuzz_server(test_config: GatewayConfig, synthesizer: Synthesizer) -> AsyncIterator[tuple[str, GatewayState]]:
    # No message rate limit (examples run back to back); answered offers that never connect are reaped fast.
    config = dataclasses.replace(test_config, max_messages_per_second=0.0, session_connect_timeout_s=2.0)
    async with running(config, synthesizer) as served:
        yield served


@pytest.fixture(scope="module")
async def real_offer_lines() -> list[str]:
    """One real offer per module: hypothesis needs the same input to replay (and shrink) an example."""
    return (await offer_sdp()).split("\r\n")


@pytest.fixture(scope="module")
async def live_peer(fuzz_server: tuple[str, GatewayState]) -> AsyncIterator[HeadlessPeer]:
    peer = HeadlessPeer(fuzz_server[0], jitter_buffer_ms=0)
    await peer.connect()
    yield peer
    await peer.close()


@pytest.mark.engine
@settings(FUZZ, max_examples=LIVE_EXAMPLES)
@given(batch=st.lists(messages, min_size=1, max_size=5))
async def test_live_session_survives_any_messages(live_peer: HeadlessPeer, batch: list[str | bytes]) -> None:
    marker = f"alive-{id(batch)}-{len(live_peer.events)}"
    for raw in batch:
        live_peer.send(raw)
    live_peer.send({"type": "ping", "t": marker})
    await _wait_pong(live_peer, marker)
    live_peer.cancel()  # stop any synthesis a valid speak started
    assert not [e for e in live_peer.find("error") if e.message["code"] == "internal_error"]


async def _wait_pong(peer: HeadlessPeer, marker: str) -> None:

    await wait_until(lambda: any(e.message.get("t") == marker for e in peer.find("pong")), timeout=EVENT_TIMEOUT_S)


# --- HTTP bodies -------------------------------------------------------------------------------------

async def _check_response(resp: aiohttp.ClientResponse) -> dict[str, Any] | None:
    assert resp.status in ACCEPTED_STATUSES, (resp.status, await resp.text())
    if resp.status == 200:
        event("status 200")
        return None
    assert resp.content_type == "application/json"
    error = (await resp.json())["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str)
    event(f"status {resp.status}: {error['code']}")
    return error


@pytest.mark.engine
@settings(FUZZ, max_examples=HTTP_EXAMPLES)
@given(body=http_bodies)
async def test_speech_bodies_get_audio_or_a_json_error(fuzz_server: tuple[str, GatewayState], body: bytes) -> None:
    async with aiohttp.ClientSession() as http, http.post(f"{fuzz_server[0]}/v1/audio/speech", data=body) as resp:
        await _check_response(resp)  # a 200 is closed at once: the request is aborted in the engine


@pytest.mark.engine
@settings(FUZZ, max_examples=HTTP_EXAMPLES)
@given(data=st.data())
async def test_offer_bodies_get_an_answer_or_a_json_error(fuzz_server: tuple[str, GatewayState],
                                                          real_offer_lines: list[str], data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["bytes", "fields", "mutated_sdp"]))
    if kind == "bytes":
        body = data.draw(http_bodies)
    elif kind == "fields":
        body = json.dumps(data.draw(offer_fields)).encode()
    else:
        body = json.dumps({"sdp": _mutated_sdp(real_offer_lines, data), "type": "offer"}).encode()
    async with aiohttp.ClientSession() as http, http.post(f"{fuzz_server[0]}{OFFER_PATH}", data=body) as resp:
        if await _check_response(resp) is None:
            answer = await resp.json()
            assert answer["type"] == "answer" and answer["sdp"] and answer["session_id"]


def _mutated_sdp(real_lines: list[str], data: st.DataObject) -> str:
    """A real offer with a few lines deleted, duplicated, cut short or replaced."""
    lines = list(real_lines)
    for _ in range(data.draw(st.integers(1, MAX_SDP_MUTATIONS))):
        if not lines:
            break
        # Draws do not depend on the lines' lengths, so every example replays the same way.
        i = data.draw(st.integers(0, MAX_SDP_DRAW)) % len(lines)
        op = data.draw(st.sampled_from(["delete", "duplicate", "truncate", "replace"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "truncate":
            lines[i] = lines[i][:data.draw(st.integers(0, MAX_SDP_DRAW)) % max(1, len(lines[i]))]
        else:
            lines[i] = data.draw(st.text(max_size=40))
    return "\r\n".join(lines)


# --- tokens and origins ------------------------------------------------------------------------------

STATIC_TOKEN, SESSION_SECRET, LISTED_ORIGIN = "x" * 16, "s" * 16, "https://school.example"


@FUZZ
@given(token=st.text(max_size=300) | st.builds(lambda a, b: f"{a}.{b}", st.text(max_size=50), st.text(max_size=50)))
def test_any_token_but_the_configured_one_is_refused_with_401(token: str) -> None:
    """docs/operations.md: a bad token gets 401. Neither a static token nor an HMAC signature can be guessed, so
    every drawn token but the configured static one is refused, by the policy and by the session-token check."""
    policy = AccessPolicy.from_lists([STATIC_TOKEN], [SESSION_SECRET], [])
    if token != STATIC_TOKEN:
        with pytest.raises(AuthError) as refused:
            policy.authenticate(token)
        assert refused.value.status == 401
    with pytest.raises(AuthError) as refused:
        verify_session_token([SESSION_SECRET], token)
    assert refused.value.status == 401


@FUZZ
@given(origin=st.text(max_size=100), host=st.text(max_size=40) | st.none())
def test_any_origin_but_the_listed_or_same_one_is_refused_with_403(origin: str, host: str | None) -> None:
    """docs/operations.md: a bad origin gets 403. Drawn text is neither the listed origin nor the request's own
    host (a drawn pair that happens to be is skipped), so it is refused."""
    netloc = urlsplit(origin.strip().lower()).netloc if origin.isascii() else ""
    assume(origin.strip().lower().rstrip("/") != LISTED_ORIGIN)
    assume(not netloc or host is None or netloc != host.strip().lower())
    with pytest.raises(AuthError) as refused:
        AccessPolicy.from_lists([], [], [LISTED_ORIGIN]).check_origin(origin, [host])
    assert refused.value.status == 403


@pytest.mark.engine
@settings(FUZZ, max_examples=HTTP_EXAMPLES)
@given(data=st.data())
async def test_whep_offer_bodies_get_an_answer_or_a_json_error(fuzz_server: tuple[str, GatewayState],
                                                               real_offer_lines: list[str],
                                                               data: st.DataObject) -> None:
    """WHEP's body is the SDP itself: mutated offers and arbitrary bytes get 201 with an SDP answer, or a JSON
    error (4xx/503), never a 500."""
    if data.draw(st.booleans()):
        body = _mutated_sdp(real_offer_lines, data).encode("utf-8", "surrogatepass")
    else:
        body = data.draw(st.binary(max_size=300) | st.text(max_size=200).map(lambda t: t.encode("utf-8",
                                                                                           "surrogatepass")))
    async with aiohttp.ClientSession() as http, http.post(
            f"{fuzz_server[0]}{fuzz_server[1].config.whep_path}", data=body,
            headers={"Content-Type": "application/sdp"}) as resp:
        if resp.status == 201:
            event("status 201")
            assert resp.content_type == "application/sdp" and resp.headers["Location"]
            assert (await resp.text()).startswith("v=0")
        else:
            await _check_response(resp)
