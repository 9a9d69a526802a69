"""HTTP helpers shared by the routes: the app key of the gateway state and JSON errors.

Every error the gateway answers is `{"error": {"code": ..., "message": ...}}` with a 4xx/5xx status.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.edge.state import GatewayState
from gateway.service.errors import CapacityError

GATEWAY_KEY: web.AppKey[GatewayState] = web.AppKey("gateway", GatewayState)
OFFER_PATH = "/v1/webrtc/offer"
ICE_SERVERS_PATH = "/v1/webrtc/ice-servers"
SESSIONS_PATH = "/v1/webrtc/sessions"
# The routes that open a session (the JSON offer, WHEP's POST), by route name: under `serve --workers` a worker
# with no session slot left passes such an offer to one that has (`gateway.cluster.forwarding.forward_to_owner`).
OFFER_ROUTE = "webrtc-offer"
WHEP_OFFER_ROUTE = "whep-offer"
SESSION_OFFER_ROUTES = frozenset({OFFER_ROUTE, WHEP_OFFER_ROUTE})
# Who the access check let in (a session token's `sub`), for routes that personalise their answer.
SUBJECT_KEY: web.RequestKey[str | None] = web.RequestKey("subject", str | None)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def json_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(code, message), status=status, headers=headers)


def capacity_error(exc: CapacityError) -> web.Response:
    """503 `at_capacity` with the `Retry-After` a client should honour."""
    return json_error(503, exc.code, str(exc), {"Retry-After": str(exc.retry_after_s)})


def _json_http_error(cls: type[web.HTTPException], code: str, message: str, **kw: Any) -> web.HTTPException:
    return cls(text=json.dumps(error_body(code, message)), content_type="application/json", **kw)


async def read_json_object(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object, or an HTTP 4xx with a JSON error body."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _json_http_error(web.HTTPRequestEntityTooLarge, "body_too_large", f"body over {max_bytes} bytes",
                               max_size=max_bytes, actual_size=request.content_length)
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _json_http_error(web.HTTPBadRequest, "invalid_json", "body is not valid JSON") from None
    except RecursionError:  # deeply nested arrays or objects: refused, not a 500
        raise _json_http_error(web.HTTPBadRequest, "invalid_json", "body nests too deeply") from None
    if not isinstance(body, dict):
        raise _json_http_error(web.HTTPBadRequest, "invalid_json", "body must be a JSON object")
    return body
