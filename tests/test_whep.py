"""WHEP (`gateway/edge/whep.py`) against the real engine: the protocol over aiohttp with an aiortc player, and a
third-party WHEP player (`@eyevinn/webrtc-player` from npm, bundled by esbuild) playing the gateway's voice in a
headless Chromium.

One gateway (auth on) serves the module; the tests that need other settings (ICE servers, a short connect
timeout) start their own app around the same engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack

from gateway.config import GatewayConfig
from gateway.edge.state import GatewayState
from gateway.rtc.protocol import Speak
from gateway.rtc.session import Session
from gateway.service.admission import Slot
from gateway.service.errors import CapacityError
from gateway.speech.synthesizer import Synthesizer
from tests.support import (
    CHROMIUM,
    CHROMIUM_ARGS,
    EVENT_TIMEOUT_S,
    SCHOOL,
    TOKEN,
    TURN_SECRET,
    running,
    wait_until,
)

pytestmark = pytest.mark.engine

WHEP = "/whep"
SDP = "application/sdp"
TRICKLE = "application/trickle-ice-sdpfrag"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONNECT_S = 30.0  # ICE + DTLS on loopback; generous for a loaded 2-core machine
PLAYER = "@eyevinn/webrtc-player@0.13.0"
ESBUILD = "esbuild@0.28.2"
# npm's cache of the player bundle, kept across runs (pytest's cache dir is off with -p no:cacheprovider).
PLAYER_CACHE = Path("/tmp/orpheus-gateway-test-cache") / "whep-player-0.13.0"
NPM_TIMEOUT_S = 300
SPEAK_ATTEMPTS = 3
MIN_HEARD_AUDIO_S = 0.3  # a line with less audio than this is spoken again in the player test


# --- helpers -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def served(test_config: GatewayConfig, synthesizer: Synthesizer) -> AsyncIterator[tuple[str, GatewayState]]:
    config = dataclasses.replace(test_config, auth_token=[TOKEN], allowed_origin=[SCHOOL])
    async with running(config, synthesizer) as (base, gateway):
        yield base, gateway


@contextlib.asynccontextmanager
async def player_peer() -> AsyncIterator[RTCPeerConnection]:
    """What a WHEP player offers: receive-only audio and no data channel (candidates gathered)."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    try:
        yield pc
    finally:
        await pc.close()


async def post_offer(http: aiohttp.ClientSession, url: str, sdp: str,
                     headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
    async with http.post(url, data=sdp.encode(), headers={"Content-Type": SDP, **AUTH, **(headers or {})}) as resp:
        await resp.read()
        return resp


async def error_code(resp: aiohttp.ClientResponse, status: int) -> str:
    assert resp.status == status, await resp.text()
    return str((await resp.json())["error"]["code"])


def session_of(gateway: GatewayState, location: str) -> Session:
    assert re.fullmatch(rf"{WHEP}/[0-9a-f]{{32}}", location), location
    return gateway.sessions.sessions[location.rsplit("/", 1)[1]]


async def first_audible_frame(track: MediaStreamTrack) -> np.ndarray:
    """Frames until one carries sound (the playout sends silence while nothing is spoken)."""
    while True:
        samples = (await track.recv()).to_ndarray()
        if np.abs(samples).max() > 0:
            return samples


# --- protocol ------------------------------------------------------------------------------------------

async def test_post_answers_201_and_the_session_plays_without_a_data_channel(
        served: tuple[str, GatewayState]) -> None:
    base, gateway = served
    async with player_peer() as pc, aiohttp.ClientSession() as http:
        tracks: list[MediaStreamTrack] = []
        pc.on("track", tracks.append)
        resp = await post_offer(http, f"{base}{WHEP}?voice=leo&jitter_buffer_ms=0", pc.localDescription.sdp)
        assert resp.status == 201, await resp.text()
        assert resp.headers["Content-Type"] == SDP
        assert re.fullmatch(r'"[^"\s]+"', resp.headers["ETag"]), "a strong entity-tag"
        assert "Link" not in resp.headers, "no ICE servers configured, none announced"
        answer = await resp.text()
        assert "a=sendonly" in answer and "a=msid:" in answer and "m=application" not in answer
        session = session_of(gateway, resp.headers["Location"])
        assert (session.voice, session.jitter_buffer_ms, session.expect_channel) == ("leo", 0, False)

        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        await wait_until(lambda: session.peer_connected and bool(tracks), timeout=CONNECT_S)
        # No data channel to speak on: the server side asks, as an application driving a listener would.
        session.speak(Speak(id="whep-1", text="Hello, listener."))
        frame = await asyncio.wait_for(first_audible_frame(tracks[0]), EVENT_TIMEOUT_S)
        assert frame.size > 0

        async with http.get(f"{base}{resp.headers['Location']}", headers=AUTH) as probe:
            assert probe.status == 204
        async with http.delete(f"{base}{resp.headers['Location']}", headers=AUTH) as deleted:
            assert deleted.status == 204
        assert session.closed and session.id not in gateway.sessions.sessions
        async with http.delete(f"{base}{resp.headers['Location']}", headers=AUTH) as again:
            assert await error_code(again, 404) == "unknown_session"


async def test_refusals_follow_the_draft(served: tuple[str, GatewayState]) -> None:
    base, gateway = served
    async with player_peer() as pc, aiohttp.ClientSession() as http:
        offer = pc.localDescription.sdp
        async with http.post(f"{base}{WHEP}", json={"sdp": offer, "type": "offer"}, headers=AUTH) as resp:
            assert await error_code(resp, 415) == "unsupported_media_type"
        for query, code in [("?jitter_buffer_ms=lots", "invalid_jitter_buffer"),
                            ("?jitter_buffer_ms=99999", "invalid_jitter_buffer"),
                            ("?voice=klingon", "unknown_voice")]:
            assert await error_code(await post_offer(http, f"{base}{WHEP}{query}", offer), 400) == code, query
        assert await error_code(await post_offer(http, f"{base}{WHEP}", "v=0\r\n"), 400) == "invalid_offer"
        broken = "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=recvonly\r\n"
        assert await error_code(await post_offer(http, f"{base}{WHEP}", broken), 400) == "invalid_sdp"

        # Discovery and CORS-less OPTIONS; a method the endpoint does not take.
        async with http.head(f"{base}{WHEP}", headers=AUTH) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == SDP
        async with http.options(f"{base}{WHEP}", headers=AUTH) as resp:
            assert resp.status == 200 and resp.headers["Accept-Post"] == SDP
        async with http.put(f"{base}{WHEP}", headers=AUTH) as resp:
            assert resp.status == 405

        resp = await post_offer(http, f"{base}{WHEP}", offer)
        assert resp.status == 201
        location = f"{base}{resp.headers['Location']}"
        fragment = ("a=ice-ufrag:abcd\r\na=ice-pwd:0123456789abcdefghijkl\r\n"
                    "a=candidate:1 1 udp 1 192.0.2.1 9 typ host\r\n")
        trickle = {"Content-Type": TRICKLE, "If-Match": "*", **AUTH}
        async with http.patch(location, data=fragment, headers=trickle) as patched:
            assert await error_code(patched, 501) == "not_implemented"  # no trickle, no ICE restart (whep.py)
        async with http.patch(location, data="x", headers={"Content-Type": "text/plain", **AUTH}) as patched:
            assert await error_code(patched, 415) == "unsupported_media_type"
        async with http.delete(location, headers=AUTH) as deleted:
            assert deleted.status == 204
        async with http.patch(location, data=fragment, headers={"Content-Type": TRICKLE, **AUTH}) as patched:
            assert await error_code(patched, 404) == "unknown_session"

        # At capacity: 503 with Retry-After (every free slot held here).
        held: list[Slot] = []
        with contextlib.suppress(CapacityError):
            while True:
                held.append(gateway.admission.admit_session())
        try:
            resp = await post_offer(http, f"{base}{WHEP}", offer)
            assert await error_code(resp, 503) == "at_capacity" and int(resp.headers["Retry-After"]) > 0
        finally:
            for slot in held:
                slot.release()


async def test_tokens_and_cors(served: tuple[str, GatewayState]) -> None:
    base, _ = served
    async with player_peer() as pc, aiohttp.ClientSession() as http:
        for method in ("POST", "DELETE", "PATCH", "OPTIONS"):
            async with http.request(method, f"{base}{WHEP}/{'0' * 32}" if method in ("DELETE", "PATCH") else
                                    f"{base}{WHEP}", data=pc.localDescription.sdp,
                                    headers={"Content-Type": SDP}) as resp:
                assert await error_code(resp, 401) == "missing_token", method
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        resp = await post_offer(http, f"{base}{WHEP}", pc.localDescription.sdp,
                                headers={"Authorization": "Bearer not-the-token"})
        assert await error_code(resp, 401) == "invalid_token"

        # A player on another (allowed) origin: the preflight needs no token; the 201 exposes what it must read.
        preflight = {"Origin": SCHOOL, "Access-Control-Request-Method": "PATCH",
                     "Access-Control-Request-Headers": "authorization, content-type, if-match"}
        async with http.options(f"{base}{WHEP}/{'0' * 32}", headers=preflight) as resp:
            assert resp.status == 204
            assert "PATCH" in resp.headers["Access-Control-Allow-Methods"]
            assert "If-Match" in resp.headers["Access-Control-Allow-Headers"]
        resp = await post_offer(http, f"{base}{WHEP}", pc.localDescription.sdp, headers={"Origin": SCHOOL})
        assert resp.status == 201
        assert resp.headers["Access-Control-Allow-Origin"] == SCHOOL
        assert {"Location", "ETag", "Link"} <= set(resp.headers["Access-Control-Expose-Headers"].split(", "))
        async with http.delete(f"{base}{resp.headers['Location']}", headers=AUTH) as deleted:
            assert deleted.status == 204


async def test_link_headers_carry_the_minted_ice_servers(
        test_config: GatewayConfig, synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    config = dataclasses.replace(test_config, ice_servers=["stun:192.0.2.10:3478", "turn:192.0.2.10:3478?transport=udp",
                                                           "turns:192.0.2.10:5349?transport=tcp"],
                                 turn_secret=TURN_SECRET)
    async with running(config, synthesizer) as (base, gateway), player_peer() as pc, aiohttp.ClientSession() as http:
        # The gateway's own peer would wait out its ICE gathering timeout on these unreachable servers: not what
        # this test is about, so that peer gets none (the Link headers come from the config, not from it).
        monkeypatch.setattr(gateway.sessions, "ice_configuration", lambda session_id: RTCConfiguration(iceServers=[]))
        resp = await post_offer(http, f"{base}{WHEP}", pc.localDescription.sdp)
        assert resp.status == 201, await resp.text()
        assert resp.headers["Cache-Control"] == "no-store", "credentials are not for shared caches"
        stun, *turns = resp.headers.getall("Link")
        assert stun == '<stun:192.0.2.10:3478>; rel="ice-server"'
        assert len(turns) == 2
        for link, url in zip(turns, config.ice_servers[1:], strict=True):
            match = re.fullmatch(rf'<{re.escape(url)}>; rel="ice-server"; username="(\d+:[0-9a-f]{{32}})"; '
                                 r'credential="([^"]+)"; credential-type="password"', link)
            assert match, link
            username, credential = match.groups()
            digest = hmac.new(TURN_SECRET.encode(), username.encode(), hashlib.sha1).digest()
            assert credential == base64.b64encode(digest).decode(), "coturn's REST credential for this username"
        assert len({re.search(r'username="([^"]+)"', link).group(1) for link in turns}) == 1  # type: ignore[union-attr]
        async with http.delete(f"{base}{resp.headers['Location']}") as deleted:
            assert deleted.status == 204


async def test_connect_timeout_waits_for_the_peer_not_for_a_channel(
        test_config: GatewayConfig, synthesizer: Synthesizer, caplog: pytest.LogCaptureFixture) -> None:
    """With no data channel expected, a connected listener outlives the connect timeout; a player that never
    connects (its offer carries no candidate and none ever trickles in) is closed by it."""
    caplog.set_level(logging.INFO, logger="gateway.rtc.session")
    config = dataclasses.replace(test_config, session_connect_timeout_s=2.0)
    async with running(config, synthesizer) as (base, gateway), aiohttp.ClientSession() as http, \
            player_peer() as listener, player_peer() as ghost:
        resp = await post_offer(http, f"{base}{WHEP}", listener.localDescription.sdp)
        connected = session_of(gateway, resp.headers["Location"])
        await listener.setRemoteDescription(RTCSessionDescription(sdp=await resp.text(), type="answer"))
        no_candidates = "".join(line + "\r\n" for line in ghost.localDescription.sdp.splitlines()
                                if not line.startswith("a=candidate"))
        resp = await post_offer(http, f"{base}{WHEP}", no_candidates)
        abandoned = session_of(gateway, resp.headers["Location"])
        await wait_until(lambda: abandoned.closed, timeout=10)
        assert any(abandoned.id in r.getMessage() and "(connect_timeout)" in r.getMessage() for r in caplog.records)
        assert connected.peer_connected and not connected.closed
        await asyncio.sleep(1.0)  # further past the timeout, and two more watchdog rounds
        assert not connected.closed and connected.id in gateway.sessions.sessions


# --- a third-party player in Chromium -------------------------------------------------------------------

PAGE = """<!doctype html>
<meta charset="utf-8">
<audio id="out" autoplay></audio>
<script type="module">
import { WebRTCPlayer } from './player.js';
window.startPlayer = async (token) => {
  const audio = document.getElementById('out');
  window.player = new WebRTCPlayer({
    video: audio, type: 'whep', iceServers: [], mediaConstraints: { audioOnly: true } });
  await window.player.load(new URL('/whep?voice=tara&jitter_buffer_ms=0', location.href), 'Bearer ' + token);
};
window.inboundAudio = async () => {
  for (const entry of (await window.player.peer.getStats()).values()) {
    if (entry.type === 'inbound-rtp' && entry.kind === 'audio') return { ...entry };
  }
  return null;
};
window.pageReady = true;
</script>
"""


@pytest.fixture(scope="module")
def player_bundle() -> str:
    """@eyevinn/webrtc-player as one browser ES module (the package ships CommonJS only), built once and cached."""
    npm, npx = shutil.which("npm"), shutil.which("npx")
    if npm is None or npx is None:
        pytest.skip("npm/npx are not installed: this test bundles the WHEP player @eyevinn/webrtc-player from npm")
    bundle = PLAYER_CACHE / "player.js"
    if not bundle.exists():
        PLAYER_CACHE.mkdir(parents=True, exist_ok=True)
        installed = subprocess.run([npm, "install", "--prefix", str(PLAYER_CACHE), "--no-audit", "--no-fund",
                                    PLAYER, ESBUILD], capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
        if installed.returncode != 0:
            pytest.skip(f"npm could not install {PLAYER} (registry unreachable?): {installed.stderr[-500:]}")
        entry = PLAYER_CACHE / "entry.js"
        entry.write_text("export { WebRTCPlayer } from '@eyevinn/webrtc-player';\n")
        partial = PLAYER_CACHE / "player.js.partial"
        subprocess.run([npx, "--prefix", str(PLAYER_CACHE), "esbuild", str(entry), "--bundle", "--format=esm",
                        "--platform=browser", f"--outfile={partial}"], cwd=PLAYER_CACHE, check=True,
                       capture_output=True, timeout=NPM_TIMEOUT_S)
        partial.rename(bundle)  # whole or not at all: a cut-short build is never taken for the cache
    return bundle.read_text()


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Chromium is not installed at {CHROMIUM} (install.sh installs it)")
async def test_third_party_player_plays_the_gateway(served: tuple[str, GatewayState], player_bundle: str) -> None:
    from playwright import async_api as playwright_api

    base, gateway = served
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                                                   ignore_default_args=["--mute-audio"])
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            requests: list[Any] = []
            page.on("request", lambda request: requests.append(request))
            # The page and the bundle come from the gateway's origin (so /whep is same-origin), served by the
            # browser's own interception: nothing is added to the gateway for the test.
            files = {"index.html": ("text/html", PAGE), "player.js": ("text/javascript", player_bundle)}

            async def serve(route: Any) -> None:
                content_type, body = files[route.request.url.rsplit("/", 1)[1]]
                await route.fulfill(status=200, content_type=content_type, body=body)

            await page.route(f"{base}/whep-test/*", serve)
            await page.goto(f"{base}/whep-test/index.html")
            await page.wait_for_function("window.pageReady === true")
            before = set(gateway.sessions.sessions)
            await page.evaluate("token => window.startPlayer(token)", TOKEN)
            await wait_until(lambda: set(gateway.sessions.sessions) - before, timeout=CONNECT_S)
            (session_id,) = set(gateway.sessions.sessions) - before
            session = gateway.sessions.sessions[session_id]
            await wait_until(lambda: session.peer_connected, timeout=CONNECT_S)

            offer = next(r for r in requests if r.method == "POST" and r.url.startswith(f"{base}{WHEP}"))
            headers = await offer.all_headers()
            assert headers["content-type"] == SDP and headers["authorization"] == f"Bearer {TOKEN}"
            assert "m=application" not in offer.post_data, "the player offers audio only"

            registry = gateway.metrics.registry
            # The tiny model stops at random (TEST_STOP_PROBABILITY a frame): a line that happened to stop at its
            # first frames is spoken again, so the browser has audio to hear.
            for attempt in range(SPEAK_ATTEMPTS):
                done = registry.get_sample_value("orpheus_utterances_total", {"outcome": "done"}) or 0
                audio_s = registry.get_sample_value("orpheus_audio_seconds_total") or 0.0
                utterance_id = f"whep-browser-{attempt}"
                session.speak(Speak(id=utterance_id, text="Hello from the gateway."))
                await wait_until(lambda u=utterance_id: u not in session.utterances, timeout=EVENT_TIMEOUT_S * 2)
                assert registry.get_sample_value("orpheus_utterances_total", {"outcome": "done"}) == done + 1, \
                    "the utterance played to its end"
                if (registry.get_sample_value("orpheus_audio_seconds_total") or 0.0) - audio_s >= MIN_HEARD_AUDIO_S:
                    break
            await asyncio.sleep(0.5)  # the last packets are still on their way
            stats = await page.evaluate("window.inboundAudio()")
            assert stats is not None, "the player receives an audio stream"
            assert stats["packetsReceived"] > 0
            assert stats["totalSamplesReceived"] > 0, "the browser played it out"
            assert stats["totalAudioEnergy"] > 0, "and it was not silence"

            await page.evaluate("window.player.unload()")  # the player's DELETE on the Location
            await wait_until(lambda: session_id not in gateway.sessions.sessions, timeout=10)
            assert any(r.method == "DELETE" and r.url == f"{base}{WHEP}/{session_id}" for r in requests)
            assert not errors, f"uncaught errors in the page: {errors}"
        finally:
            await browser.close()
