"""What crosses the network: data-channel datagrams fit a 1280 B IPv6 path through a TURN relay whatever DTLS
cipher is negotiated (aiortc's own sizing assumes AES-GCM), every JSON parser refuses hostile input with a
named error (the same inputs to every HTTP route and every data-channel message type), and the headless peer
gives up on a server that never answers."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from aiortc import rtcsctptransport

from gateway.config import GatewayConfig
from gateway.devtools.client import HeadlessPeer
from gateway.edge.http import OFFER_PATH
from gateway.rtc import protocol
from gateway.rtc.errors import ProtocolError
from gateway.rtc.sctp import DTLS_WORST_RECORD_OVERHEAD, MAX_DATAGRAM, SAFE_USERDATA_LENGTH, SCTP_DATA_OVERHEAD
from gateway.speech.synthesizer import Synthesizer
from tests.support import EVENT_TIMEOUT_S, running

GCM_RECORD_OVERHEAD = 13 + 8 + 16  # what this test's two aiortc peers negotiate (AES-128-GCM)


def test_clamped_fragment_fits_the_worst_path() -> None:
    assert SAFE_USERDATA_LENGTH % 4 == 0
    assert SAFE_USERDATA_LENGTH + SCTP_DATA_OVERHEAD + DTLS_WORST_RECORD_OVERHEAD <= MAX_DATAGRAM
    # aiortc's own default would not: with AES-CBC its full fragment is over the budget.
    assert 1160 + SCTP_DATA_OVERHEAD + DTLS_WORST_RECORD_OVERHEAD > MAX_DATAGRAM


class _Recorder:
    """The real UDP transport, recording the size of every datagram it sends."""

    def __init__(self, inner: Any, sizes: list[int]) -> None:
        self._inner, self._sizes = inner, sizes

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._sizes.append(len(data))
        self._inner.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.engine
async def test_large_events_cross_in_datagrams_that_fit_a_1280_path(test_config: GatewayConfig,
                                                                     synthesizer: Synthesizer) -> None:
    async with running(test_config, synthesizer) as (base, gateway):
        peer = HeadlessPeer(base)
        try:
            await peer.connect(timeout=EVENT_TIMEOUT_S)
            assert rtcsctptransport.USERDATA_MAX_LENGTH == SAFE_USERDATA_LENGTH, "the gateway clamped it"
            session = gateway.sessions.sessions[peer.session_id]
            sizes: list[int] = []
            for ice in session.pc._RTCPeerConnection__iceTransports:  # type: ignore[attr-defined]
                for candidate_pair in ice._connection._protocols:
                    candidate_pair.transport = _Recorder(candidate_pair.transport, sizes)
            text = "Word-timing events of a long sentence are large. " * 300  # ~15 KB, under the 16 KiB limit
            session.send(protocol.Segment(id="big", index=0, text=text))
            event = await peer.wait_event("segment", "big", timeout=EVENT_TIMEOUT_S)
            assert event["text"] == text, "the message arrived whole"
            data = [n for n in sizes if n > 200]  # fragments, not acks and keepalives
            assert len(data) >= 10
            # What this pair negotiated plus the room a CBC cipher would take more: still within the path.
            worst = max(data) + DTLS_WORST_RECORD_OVERHEAD - GCM_RECORD_OVERHEAD
            assert worst <= MAX_DATAGRAM, f"largest datagram {max(data)} B (worst cipher {worst} B)"
        finally:
            await peer.close()


# --- hostile JSON ----------------------------------------------------------------------------------------

DEEP = 20_000
HOSTILE_BODIES: dict[str, bytes] = {
    "deep arrays": b"[" * DEEP + b"]" * DEEP,
    "deep objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep inside a field": b'{"input": ' + b"[" * DEEP + b"]" * DEEP + b', "sdp": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "not UTF-8": b'{"input": "\xff\xfe"}',
    "NaN and a huge number": b'{"input": NaN, "speed": 1e999, "sdp": Infinity, "jitter_buffer_ms": 1e999}',
    "NUL bytes": b'{"input": "\x00", "sdp": "\x00"}',
    "duplicate keys": b'{"input": "a", "input": 5, "sdp": "x", "sdp": 7}',
    "huge integer": b'{"input": "hi", "jitter_buffer_ms": ' + b"9" * 5000 + b"}",
    "a bare string": b'"just a string"',
    "empty": b"",
}


@pytest.mark.engine
async def test_every_http_route_refuses_hostile_json(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    routes = ["/v1/audio/speech", OFFER_PATH]
    async with running(test_config, synthesizer) as (base, _), aiohttp.ClientSession(base_url=base) as http:
        for route in routes:
            for name, body in HOSTILE_BODIES.items():
                async with http.post(route, data=body, headers={"Content-Type": "application/json"}) as resp:
                    assert 400 <= resp.status < 500, (route, name, resp.status, await resp.text())
                    error = (await resp.json())["error"]
                    assert error["code"] and error["message"], (route, name)


@pytest.mark.parametrize("kind", ["speak", "cancel", "ping", None])
@pytest.mark.parametrize("name", ["deep", "deep id", "NaN", "huge integer", "NUL", "duplicate keys", "not an object"])
def test_every_message_type_refuses_hostile_json(kind: str | None, name: str) -> None:
    head = f'{{"type": {json.dumps(kind)}'
    raw = {
        "deep": head + ', "text": ' + "[" * DEEP + "]" * DEEP + "}",
        "deep id": head + ', "id": ' + '{"a":' * DEEP + "1" + "}" * DEEP + "}",
        "NaN": head + ', "id": NaN, "t": NaN, "text": Infinity}',
        "huge integer": head + ', "id": "u", "t": ' + "9" * 5000 + ', "text": 1}',
        "NUL": head + ', "id": "\\u0000", "text": 5}',
        "duplicate keys": head + ', "id": "u", "id": 5, "text": "a", "text": []}',
        "not an object": "[" + head + "}]",
    }[name]
    try:
        message = protocol.parse_client_message(raw)
    except ProtocolError as refused:
        assert refused.code in ("invalid_json", "invalid_message", "unknown_type", "message_too_large")
        assert str(refused)
        return
    # Accepted: then it is a well-formed message of its type (a cancel may well carry a NUL id).
    assert name not in ("deep", "deep id", "NaN", "not an object"), f"{name} must be refused"
    assert isinstance(message, (protocol.Speak, protocol.Cancel, protocol.Ping)) and message.__struct_config__


async def test_a_headless_peer_gives_up_on_an_offer_that_is_never_answered() -> None:
    """`HeadlessPeer.connect`'s timeout bounds the whole negotiation: an offer endpoint that never answers (an
    overloaded server) fails the connect in about the timeout, not aiohttp's 5 minutes."""
    async def never(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        return web.Response()

    app = web.Application()
    app.router.add_post(OFFER_PATH, never)
    async with TestServer(app) as server:
        peer = HeadlessPeer(str(server.make_url("")).rstrip("/"))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"no session with .* waiting for the offer; events so far \[\]"):
            await peer.connect(timeout=1.0)
        assert time.monotonic() - started < 5
        await peer.close()
