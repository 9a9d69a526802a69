"""WebRTC signalling over HTTP: the offer (`protocol.Offer` in, `protocol.Answer` out), the ICE servers a browser
should use, and ending a session. `open_session` is the one way from an offer to a session, for this route and for
WHEP (`gateway.edge.whep`)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web
from aiortc import RTCSessionDescription

from gateway.config import JITTER_BUFFER_MAX_MS
from gateway.edge.http import (
    GATEWAY_KEY,
    ICE_SERVERS_PATH,
    OFFER_PATH,
    OFFER_ROUTE,
    SESSIONS_PATH,
    SUBJECT_KEY,
    capacity_error,
    json_error,
    read_json_object,
)
from gateway.edge.state import GatewayState
from gateway.rtc import protocol
from gateway.rtc.ice import client_id, ice_servers, uses_turn_secret
from gateway.rtc.session import Session
from gateway.service.errors import CapacityError
from gateway.speech.errors import InvalidRequestError
from gateway.speech.utterance_text import choose_voice

log = logging.getLogger(__name__)

NETWORK_RETRY_AFTER_S = 5
MAX_ERROR_DETAIL_CHARS = 300  # an exception's text echoed to the client: enough to debug, not a whole SDP


def _offer_error(exc: msgspec.ValidationError) -> web.Response:
    text = str(exc)
    if "$.jitter_buffer_ms" in text:
        return json_error(400, "invalid_jitter_buffer", f"jitter_buffer_ms must be an integer in "
                          f"0..{JITTER_BUFFER_MAX_MS}")
    if "$.voice" in text:
        return json_error(400, "unknown_voice", f"voice must be a string naming a voice ({text})")
    if "$.type" in text:
        return json_error(400, "invalid_offer", "'type' must be \"offer\"")
    return json_error(400, "invalid_offer", f"'sdp' (a string) is required ({text})")


async def offer(request: web.Request) -> web.Response:
    """`protocol.Offer` -> `protocol.Answer`."""
    gateway = request.app[GATEWAY_KEY]
    body = await read_json_object(request, gateway.config.max_body_bytes)
    opened = await open_session(gateway, body)
    if isinstance(opened, web.Response):
        return opened
    answer = protocol.Answer(sdp=opened.pc.localDescription.sdp, type="answer", session_id=opened.id)
    return web.json_response(text=protocol.encode(answer))


async def open_session(gateway: GatewayState, fields: dict[str, Any], *, strict: bool = True,
                       audio_only: bool = False) -> Session | web.Response:
    """The one way from an offer to a session, whichever door it came through (this JSON route, WHEP): the
    offer's fields checked as a `protocol.Offer` (sdp, voice, jitter_buffer_ms), a session slot admitted, the
    session opened and answered. Returns the session, or the JSON error to send (400, or 503 + Retry-After).

    `strict=False` lets text convert to numbers (query parameters: `jitter_buffer_ms=500`). `audio_only` also
    takes an offer without a data channel (a WHEP player); such a session then waits for none.
    """
    config = gateway.config
    try:
        message = msgspec.convert(fields, protocol.Offer, strict=strict)
    except msgspec.ValidationError as exc:
        return _offer_error(exc)
    sdp = message.sdp
    if not sdp.strip():
        return json_error(400, "invalid_offer", "'sdp' (a string) is required")
    has_channel = "m=application" in sdp
    if audio_only and "m=audio" not in sdp:
        return json_error(400, "invalid_offer", "the offer must receive audio (m=audio)")
    if "m=audio" not in sdp or not (has_channel or audio_only):
        return json_error(400, "invalid_offer",
                          "the offer must receive audio and open a data channel (m=audio and m=application)")
    jitter = config.jitter_buffer_ms if message.jitter_buffer_ms is None else message.jitter_buffer_ms
    try:
        voice = choose_voice(config, message.voice, message.language)
    except InvalidRequestError as exc:
        return json_error(400, exc.code, str(exc))
    try:
        slot = gateway.admission.admit_session()
    except CapacityError as exc:
        gateway.metrics.rejections_total.labels(exc.code).inc()
        return capacity_error(exc)
    try:
        return await gateway.sessions.open(RTCSessionDescription(sdp=sdp, type="offer"), voice, jitter, slot,
                                           expect_channel=has_channel)
    except OSError:
        log.exception("could not set up a peer connection")
        return json_error(503, "network_unavailable", "the gateway could not open a peer connection",
                          {"Retry-After": str(NETWORK_RETRY_AFTER_S)})
    except Exception as exc:  # aiortc rejects malformed SDP with many exception types
        log.info("offer refused: %r", exc)
        return json_error(400, "invalid_sdp", f"the offer could not be used: {exc}"[:MAX_ERROR_DETAIL_CHARS])


async def get_ice_servers(request: web.Request) -> web.Response:
    """`{ice_servers: [RTCIceServer...], ttl_s}`: what the browser passes to `new RTCPeerConnection`.

    Behind the same access check as the offer. TURN credentials are minted per call when a TURN secret is set
    (`ttl_s` is then how long they can start a relay; null for static ones); the secret itself never leaves.
    """
    config = request.app[GATEWAY_KEY].config
    servers = ice_servers(config, client_id(request.get(SUBJECT_KEY)))
    ttl_s = config.turn_credential_ttl_s if uses_turn_secret(config) else None
    # no-store: the answer holds credentials, which no shared cache may keep or hand to someone else.
    return web.json_response({"ice_servers": [s.to_json() for s in servers], "ttl_s": ttl_s},
                             headers={"Cache-Control": "no-store"})


async def end_session(request: web.Request) -> web.Response:
    session = request.app[GATEWAY_KEY].sessions.sessions.get(request.match_info["session_id"])
    if session is None:
        return json_error(404, "unknown_session", "no such session")
    await session.close()
    return web.Response(status=204)


def add_signalling_routes(app: web.Application) -> None:
    app.router.add_get(ICE_SERVERS_PATH, get_ice_servers)
    app.router.add_post(OFFER_PATH, offer, name=OFFER_ROUTE)
    app.router.add_delete(SESSIONS_PATH + "/{session_id}", end_session)
