"""STUN/TURN for both ends: `GET /v1/webrtc/ice-servers`, time-limited TURN credentials, and a real coturn.

Unit tests first (credentials checked against an HMAC computed here from its definition, settings refused by name),
then the route on the real gateway (shared tiny engine), then a real `turnserver` started with the repo's
docker/turnserver.conf: allocations with the gateway's credentials, and a whole session relayed through it.
The coturn tests need `turnserver` on PATH (install.sh installs Debian's coturn); in CI their skip fails the run.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import shutil
import subprocess
import time
from typing import Any

import aiohttp
import pytest
from aioice import stun
from aiortc import RTCConfiguration, RTCIceServer, RTCIceTransportPolicy

from gateway.config import ConfigError, GatewayConfig, check_ice_url, from_sources
from gateway.devtools.client import HeadlessPeer
from gateway.edge.auth import make_session_token
from gateway.edge.http import ICE_SERVERS_PATH
from gateway.rtc.ice import IceServer, client_id, ice_servers, turn_rest_credentials
from gateway.speech.synthesizer import Synthesizer
from tests.support import (
    EVIL,
    SCHOOL,
    SECRET,
    TOKEN,
    TURN_SECRET,
    Coturn,
    allocate,
    needs_coturn,
    running,
    wait_for_coturn,
)


def hmac_sha1_b64(key: bytes, message: bytes) -> str:
    """HMAC-SHA1 written out from RFC 2104 (not the `hmac` module the gateway uses), base64."""
    block = 64
    if len(key) > block:
        key = hashlib.sha1(key).digest()
    key = key.ljust(block, b"\0")
    inner = hashlib.sha1(bytes(k ^ 0x36 for k in key) + message).digest()
    return base64.b64encode(hashlib.sha1(bytes(k ^ 0x5C for k in key) + inner).digest()).decode("ascii")


def config_with(**overrides: Any) -> GatewayConfig:
    return from_sources(env={}, **overrides)


# --- credentials --------------------------------------------------------------------------------------------

def test_rest_credentials_match_the_hmac_definition_and_expire_as_asked() -> None:
    now = 1_800_000_000.4
    username, credential = turn_rest_credentials(TURN_SECRET, 600, "student-42", now=now)
    assert username == "1800000600:student-42"
    assert credential == hmac_sha1_b64(TURN_SECRET.encode(), username.encode())
    long_key = "k" * 100  # keys over one SHA-1 block are hashed first
    assert turn_rest_credentials(long_key, 60, "x", now=now)[1] == hmac_sha1_b64(long_key.encode(), b"1800000060:x")
    if shutil.which("openssl"):  # a third implementation, where there is one
        out = subprocess.run(["openssl", "dgst", "-sha1", "-hmac", TURN_SECRET, "-binary"], input=username.encode(),
                             capture_output=True, check=True, timeout=30).stdout
        assert credential == base64.b64encode(out).decode()
    with pytest.raises(ValueError, match="ttl_s"):
        turn_rest_credentials(TURN_SECRET, 0, "x")


def test_client_ids_are_safe_and_distinct() -> None:
    assert client_id("student-42") == "student-42"
    assert client_id("a:b c/d") == "a_b_c_d", "no ':' (coturn's separator) or spaces in the username"
    assert len(client_id("x" * 500)) == 64
    anonymous = {client_id(None) for _ in range(3)} | {client_id(""), client_id("::")}
    assert len(anonymous) == 5, "each anonymous client gets its own username (coturn counts quotas per username)"


def test_servers_for_the_browser_static_and_time_limited() -> None:
    assert ice_servers(config_with(), "c") == []
    stun_only = config_with(ice_servers=["stun:203.0.113.10:3478"])
    assert ice_servers(stun_only, "c") == [IceServer(("stun:203.0.113.10:3478",))]
    urls = ["stun:t.example:3478", "turn:t.example:3478?transport=udp", "turns:t.example:443?transport=tcp"]
    static = config_with(ice_servers=urls, ice_username="orpheus", ice_credential="static-password")
    assert [s.to_json() for s in ice_servers(static, "c")] == [
        {"urls": ["stun:t.example:3478"]},
        {"urls": urls[1:], "username": "orpheus", "credential": "static-password"},
    ]
    minted = config_with(ice_servers=urls, turn_secret=TURN_SECRET, turn_credential_ttl_s=900)
    now = time.time()
    stun_entry, turn_entry = ice_servers(minted, "student-7", now=now)
    assert stun_entry.username is None and stun_entry.credential is None
    assert turn_entry.urls == tuple(urls[1:])
    assert turn_entry.username == f"{int(now + 900)}:student-7"
    assert turn_entry.credential == hmac_sha1_b64(TURN_SECRET.encode(), turn_entry.username.encode())


@pytest.mark.parametrize("url", ["stun:h", "stun:203.0.113.10:3478", "stuns:h.example:5349", "turn:h:3478",
                                 "turn:h?transport=tcp", "turns:h.example:443?transport=tcp",
                                 "stun:[2001:db8::1]:3478"])
def test_ice_urls_browsers_accept(url: str) -> None:
    check_ice_url(url)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"ice_servers": ["http://t.example:3478"]}, "ice_servers: 'http://t.example:3478' is not a STUN/TURN url"),
    ({"ice_servers": ["stun:t.example:3478?transport=udp"]}, "ice_servers: .* is not a STUN/TURN url"),
    ({"ice_servers": ["turn:t.example:99999"]}, "ice_servers: .* is not a STUN/TURN url"),
    ({"ice_servers": ["turn:t.example:3478?transport=sctp"]}, "ice_servers: .* is not a STUN/TURN url"),
    ({"ice_servers": ["turn:t.example:3478"]}, "ice_servers: 'turn:t.example:3478' needs credentials: set turn_secret"),
    ({"ice_username": "orpheus"}, "ice_username and ice_credential: set both"),
    ({"ice_credential": "pw"}, "ice_username and ice_credential: set both"),
    ({"ice_servers": ["turn:t:3478"], "turn_secret": "short"}, "turn_secret must have at least 16 characters"),
    ({"ice_servers": ["turn:t:3478"], "turn_secret": TURN_SECRET, "ice_username": "u", "ice_credential": "p"},
     "turn_secret and ice_username/ice_credential: set one source"),
    ({"turn_credential_ttl_s": 10}, "turn_credential_ttl_s must be at least 60"),
])
def test_unworkable_ice_settings_are_refused_by_name(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_with(**overrides)


def test_turn_settings_from_the_environment() -> None:
    config = from_sources(env={"ORPHEUS_GATEWAY_ICE_SERVERS": "stun:t:3478,turn:t:3478?transport=tcp",
                               "ORPHEUS_GATEWAY_TURN_SECRET": TURN_SECRET,
                               "ORPHEUS_GATEWAY_TURN_CREDENTIAL_TTL_S": "7200"})
    assert (config.turn_secret, config.turn_credential_ttl_s) == (TURN_SECRET, 7200)
    assert config_with().turn_secret is None and config_with().turn_credential_ttl_s == 3600


# --- the route, on the real gateway -------------------------------------------------------------------------

needs_engine = pytest.mark.engine
TURN_URLS = ["stun:turn.example:3478", "turn:turn.example:3478?transport=udp", "turn:turn.example:3478?transport=tcp"]


@needs_engine
async def test_route_answers_the_configured_servers(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    async with running(test_config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        async with http.get(ICE_SERVERS_PATH) as resp:
            assert resp.status == 200
            assert await resp.json() == {"ice_servers": [], "ttl_s": None}
    static = dataclasses.replace(test_config, ice_servers=TURN_URLS, ice_username="orpheus", ice_credential="pw-1")
    async with running(static, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        async with http.get(ICE_SERVERS_PATH) as resp:
            assert await resp.json() == {"ice_servers": [
                {"urls": TURN_URLS[:1]}, {"urls": TURN_URLS[1:], "username": "orpheus", "credential": "pw-1"}],
                "ttl_s": None}


@needs_engine
async def test_route_mints_time_limited_credentials_and_never_the_secret(
        test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, ice_servers=TURN_URLS, turn_secret=TURN_SECRET, turn_credential_ttl_s=900)
    async with running(config, synthesizer) as (base, gateway), aiohttp.ClientSession(base_url=base) as http:
        answers = []
        for _ in range(2):
            before = time.time()
            async with http.get(ICE_SERVERS_PATH) as resp:
                assert resp.status == 200
                assert resp.headers["Cache-Control"] == "no-store", "credentials must not sit in a shared cache"
                text = await resp.text()
            after = time.time()
            assert TURN_SECRET not in text
            body = await resp.json()
            assert body["ttl_s"] == 900
            stun_entry, turn_entry = body["ice_servers"]
            assert stun_entry == {"urls": TURN_URLS[:1]}
            assert turn_entry["urls"] == TURN_URLS[1:]
            expiry, _, who = turn_entry["username"].partition(":")
            assert int(before + 900) <= int(expiry) <= int(after + 900)
            assert turn_entry["credential"] == hmac_sha1_b64(TURN_SECRET.encode(), turn_entry["username"].encode())
            answers.append(who)
        assert answers[0] != answers[1], "each anonymous browser gets its own username"

        # The gateway's own peer: credentials minted for the session, its id in the username.
        rtc = gateway.sessions.ice_configuration("w0-abc")
        turn_server = next(s for s in rtc.iceServers if s.username is not None)
        assert turn_server.username.endswith(":w0-abc") and turn_server.urls == TURN_URLS[1:]
        assert turn_server.credential == hmac_sha1_b64(TURN_SECRET.encode(), turn_server.username.encode())


@needs_engine
async def test_route_follows_the_offers_access_rules(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    config = dataclasses.replace(test_config, ice_servers=TURN_URLS, turn_secret=TURN_SECRET, auth_token=[TOKEN],
                                 auth_secret=[SECRET], allowed_origin=[SCHOOL])
    student = make_session_token(SECRET, 60, "student-42")
    async with running(config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        async with http.get(ICE_SERVERS_PATH) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "missing_token"
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        async with http.get(ICE_SERVERS_PATH, headers={"Authorization": "Bearer wrong-token"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_token"
        async with http.get(ICE_SERVERS_PATH, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
        # A session token: its subject names the TURN username; ?token= works as on the offer.
        for kwargs in ({"headers": {"Authorization": f"Bearer {student}"}}, {"params": {"token": student}}):
            async with http.get(ICE_SERVERS_PATH, **kwargs) as resp:
                assert resp.status == 200, kwargs
                assert (await resp.json())["ice_servers"][1]["username"].endswith(":student-42")
        async with http.get(ICE_SERVERS_PATH, headers={"Authorization": f"Bearer {TOKEN}", "Origin": EVIL}) as resp:
            assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"
        async with http.get(ICE_SERVERS_PATH, headers={"Authorization": f"Bearer {TOKEN}", "Origin": SCHOOL}) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == SCHOOL
        preflight = {"Origin": SCHOOL, "Access-Control-Request-Method": "GET",
                     "Access-Control-Request-Headers": "authorization"}
        async with http.options(ICE_SERVERS_PATH, headers=preflight) as resp:
            assert resp.status == 204 and "GET" in resp.headers["Access-Control-Allow-Methods"]


# --- a real coturn ------------------------------------------------------------------------------------------













@needs_coturn
async def test_coturn_accepts_minted_credentials_and_refuses_expired_or_foreign_ones(coturn: Coturn) -> None:
    await wait_for_coturn(coturn)
    relay = await allocate(coturn.port, *turn_rest_credentials(TURN_SECRET, 60, "student-1"))
    try:
        assert relay.get_extra_info("sockname")[0] == "127.0.0.1", "a relayed address"
    finally:
        relay.close()
    for name, (username, credential) in {
        "expired": turn_rest_credentials(TURN_SECRET, 60, "late", now=time.time() - 120),
        "another secret": turn_rest_credentials("not-the-turn-secret-000000", 60, "stranger"),
        "tampered expiry": (f"{int(time.time()) + 10**6}:late", turn_rest_credentials(TURN_SECRET, 60, "late")[1]),
    }.items():
        with pytest.raises(stun.TransactionFailed) as refused:
            await allocate(coturn.port, username, credential)
        assert refused.value.response.error_code == 401, name


@needs_coturn
async def test_a_relay_outlives_its_credential(coturn: Coturn) -> None:
    """coturn checks the expiry when it allocates; refreshes go on after it (what docs/deployment.md says)."""
    await wait_for_coturn(coturn)
    relay = await allocate(coturn.port, *turn_rest_credentials(TURN_SECRET, 2, "short-lived"))
    try:
        await asyncio.sleep(3.5)
        request = stun.Message(message_method=stun.Method.REFRESH, message_class=stun.Class.REQUEST)
        request.attributes["LIFETIME"] = 600
        inner = relay._TurnTransport__inner_protocol  # aioice refreshes by itself only after minutes
        response, _ = await inner.request_with_retry(request)
        assert response.attributes["LIFETIME"] > 0
    finally:
        relay.close()


def selected_pair(pc: Any) -> Any:
    """aioice's nominated candidate pair of a connected aiortc peer (aiortc exposes no getStats pair)."""
    connection = pc.sctp.transport.transport._connection
    return next(iter(connection._nominated.values()))


@needs_coturn
@needs_engine
async def test_a_session_relayed_through_coturn_with_the_routes_credentials(
        coturn: Coturn, test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    """A relay-only client (what a browser on a UDP-blocking network amounts to) gets its servers from the route,
    connects through coturn, and hears the tutor; the gateway's side uses minted credentials of its own."""
    await wait_for_coturn(coturn)
    config = dataclasses.replace(test_config, ice_servers=[coturn.url], turn_secret=TURN_SECRET)
    async with running(config, synthesizer) as (base, gateway):
        async with aiohttp.ClientSession() as http, http.get(f"{base}{ICE_SERVERS_PATH}") as resp:
            body = await resp.json()
        servers = [RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential"))
                   for s in body["ice_servers"]]
        peer = HeadlessPeer(base, jitter_buffer_ms=0, configuration=RTCConfiguration(
            iceServers=servers, iceTransportPolicy=RTCIceTransportPolicy.RELAY))
        try:
            await peer.connect(timeout=60)
            client_pair = selected_pair(peer.pc)
            assert client_pair.local_candidate.type == "relay", client_pair
            session = gateway.sessions.sessions[peer.session_id]
            server_pair = selected_pair(session.pc)
            assert server_pair.remote_candidate.type == "relay", "the gateway sees the client's relayed address"
            gathered = session.pc.sctp.transport.transport._connection.local_candidates
            assert any(c.type == "relay" for c in gathered), "coturn took the session's own minted credentials"
            peer.speak("u1", "Hello through the relay.")
            done = await peer.wait_event("done", "u1", timeout=120)
            assert done["audio_ms"] > 0
            await asyncio.sleep(0.3)  # the last frames are still in flight when `done` is sent
            assert peer.audible_frames(), "audio came through the relay"
        finally:
            await peer.close()

