"""WHEP, the standard door for WebRTC players we did not write (draft-ietf-wish-whep, which follows the WHIP pattern
of RFC 9725).

Owns the WHEP endpoint, `POST {whep_path}` (an `application/sdp` offer in; `201 Created`, the SDP answer, `Location`
of the session, an `ETag` and one `Link: <url>; rel="ice-server"` per STUN/TURN url out), the session resources
`{whep_path}/{session_id}` (`DELETE` ends one; `PATCH` is refused as the drafts say for a server without trickle ICE
or ICE restarts), and `OPTIONS`/`GET`/`HEAD` as the draft asks. The endpoint path is `GatewayConfig.whep_path`.

The sessions are the JSON offer route's (`signalling.open_session`, `SessionManager.open`): the same admission (503
+ `Retry-After` at capacity), the same checks of `?voice=`, `?language=` and `?jitter_buffer_ms=` (query parameters
here), the same `control` data channel when the offer opens one. A player that offers audio only (most do) gets a
session that waits for no data channel. Access is the app's middleware: with auth on, every WHEP request but a CORS
preflight needs `Authorization: Bearer <token>` (the draft's bearer tokens); errors are the gateway's JSON errors.
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.config import ConfigError
from gateway.edge.http import GATEWAY_KEY, SUBJECT_KEY, WHEP_OFFER_ROUTE, json_error
from gateway.edge.signalling import end_session, open_session  # DELETE: the same as the JSON route's
from gateway.rtc.ice import IceServer, client_id, ice_servers

log = logging.getLogger(__name__)

SDP_TYPE = "application/sdp"
TRICKLE_TYPE = "application/trickle-ice-sdpfrag"
QUERY_FIELDS = ("voice", "language", "jitter_buffer_ms")  # the offer's settings, as query parameters
WHEP_PATH_KEY: web.AppKey[str] = web.AppKey("whep_path", str)


def ice_server_links(servers: list[IceServer]) -> list[str]:
    """One `Link` value per url (RFC 9725 section 4.6): `<url>; rel="ice-server"`, with the TURN credentials as
    `username`, `credential` and `credential-type` attributes (named as in the browser's RTCIceServer)."""
    links = []
    for server in servers:
        attributes = ""
        if server.username is not None and server.credential is not None:
            attributes = (f'; username="{_quoted(server.username)}"; credential="{_quoted(server.credential)}"'
                          '; credential-type="password"')
        links += [f'<{url}>; rel="ice-server"{attributes}' for url in server.urls]
    return links


def _quoted(text: str) -> str:
    """The inside of an HTTP quoted-string (RFC 9110 section 5.6.4)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def entity_tag(session_id: str, answer_sdp: str) -> str:
    """A strong entity-tag naming the ICE session (the draft's `ETag`): session id and the answer's ICE ufrag."""
    ufrag = next((line.split(":", 1)[1].strip() for line in answer_sdp.splitlines()
                  if line.startswith("a=ice-ufrag:")), "")
    return f'"{session_id}.{ufrag}"'


async def create_session(request: web.Request) -> web.Response:
    """`POST {whep_path}?voice=&language=&jitter_buffer_ms=`: an SDP offer in, `201 Created` with the SDP answer out."""
    gateway = request.app[GATEWAY_KEY]
    if request.content_type != SDP_TYPE:
        return json_error(415, "unsupported_media_type", f"a WHEP offer is Content-Type: {SDP_TYPE}",
                          {"Accept-Post": SDP_TYPE})
    max_bytes = gateway.config.max_body_bytes
    if request.content_length is not None and request.content_length > max_bytes:
        return json_error(413, "body_too_large", f"body over {max_bytes} bytes")
    try:
        sdp = (await request.read()).decode("utf-8")
    except UnicodeDecodeError:
        return json_error(400, "invalid_sdp", "the offer is not UTF-8 text")
    fields = {"sdp": sdp, "type": "offer", **{k: request.query[k] for k in QUERY_FIELDS if k in request.query}}
    # strict=False: query values are text, so "500" counts as the integer the JSON route would take.
    opened = await open_session(gateway, fields, strict=False, audio_only=True)
    if isinstance(opened, web.Response):
        return opened
    answer = opened.pc.localDescription.sdp
    response = web.Response(status=201, body=answer.encode("utf-8"), headers={
        "Content-Type": SDP_TYPE, "Location": f"{request.app[WHEP_PATH_KEY]}/{opened.id}",
        "ETag": entity_tag(opened.id, answer),
        "Cache-Control": "no-store"})  # the Link headers may carry TURN credentials: no shared cache keeps them
    # The same servers, minted the same way, as the JSON route's GET /v1/webrtc/ice-servers.
    for link in ice_server_links(ice_servers(gateway.config, client_id(request.get(SUBJECT_KEY)))):
        response.headers.add("Link", link)
    return response


async def patch_session(request: web.Request) -> web.Response:
    """`PATCH {whep_path}/{session_id}`: refused. aiortc gathers every candidate before the answer leaves (the
    answer has them all) and takes none trickled later, and it has no ICE restart: neither use of PATCH exists here.

    501, not 405: the last WHEP text for a resource that supports PATCH for no purpose (draft-ietf-wish-whep-00,
    section 4.1) reads "it MUST return a '501 Not Implemented' response, as described in RFC9110 section 6.6.2";
    WHIP said the same ("If neither feature is supported, ... MUST return a '501 Not Implemented'", wish-wg WHIP
    commit e518357) until the sentence was dropped (RFC 9725 and whep-01 onwards keep only 422 for a session that
    supports one of the two, which is not this case). A body that is not an ICE fragment is 415 first ("an
    appropriate 4xx error response", draft-ietf-wish-whep section 4.3.1); an unknown session is 404 before all.
    """
    if request.match_info["session_id"] not in request.app[GATEWAY_KEY].sessions.sessions:
        return json_error(404, "unknown_session", "no such session")
    if request.content_type != TRICKLE_TYPE:
        return json_error(415, "unsupported_media_type", f"a WHEP PATCH is Content-Type: {TRICKLE_TYPE}",
                          {"Accept-Patch": TRICKLE_TYPE})
    return json_error(501, "not_implemented", "this server takes no trickled ICE candidates and no ICE restarts: "
                      "the offer must carry every candidate (gather first), as the answer does")


async def endpoint_options(request: web.Request) -> web.Response:
    """`OPTIONS {whep_path}` (not a CORS preflight, which the access middleware answers): `Accept-Post`."""
    return web.Response(status=200, headers={"Accept-Post": SDP_TYPE, "Allow": "OPTIONS, POST, GET, HEAD"})


async def endpoint_probe(request: web.Request) -> web.Response:
    """`GET`/`HEAD {whep_path}`: 200 with `Content-Type: application/sdp` and no body, how the draft lets a
    player recognise a WHEP endpoint."""
    return web.Response(status=200, headers={"Content-Type": SDP_TYPE})


async def session_probe(request: web.Request) -> web.Response:
    """`GET {whep_path}/{session_id}`: 2xx without content (the draft defines no representation), 404 unknown."""
    if request.match_info["session_id"] not in request.app[GATEWAY_KEY].sessions.sessions:
        return json_error(404, "unknown_session", "no such session")
    return web.Response(status=204)


def add_whep_routes(app: web.Application, path: str) -> None:
    """Mount the WHEP endpoint at `path` and its sessions under it."""
    if not path.startswith("/") or path.endswith("/") or any(c in path for c in "{}?#"):
        raise ConfigError(f"whep_path must be an absolute path without a trailing '/', got {path!r}")
    app[WHEP_PATH_KEY] = path
    resource = path + "/{session_id}"
    app.router.add_post(path, create_session, name=WHEP_OFFER_ROUTE)
    app.router.add_route("OPTIONS", path, endpoint_options)
    app.router.add_get(path, endpoint_probe)  # and HEAD
    app.router.add_delete(resource, end_session)
    app.router.add_patch(resource, patch_session)
    app.router.add_get(resource, session_probe, allow_head=False)
