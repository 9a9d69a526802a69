"""Who may use the gateway: bearer tokens, HMAC-signed session tokens, and browser origins.

Standard library only, so a lesson backend can import (or copy) `make_session_token` without the gateway's
dependencies. A session token is `base64url(payload).base64url(hmac_sha256(secret, base64url(payload)))`,
unpadded, where the payload is JSON `{"sub": subject, "exp": unix_seconds}`:

    from gateway.edge.auth import make_session_token
    token = make_session_token(secret, ttl_s=300, subject="student-42")   # hand it to the page

The gateway accepts it as `Authorization: Bearer <token>` (or `?token=` on the WebRTC offer) until it expires.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.config import ANY_ORIGIN, normalize_origin
from gateway.edge.errors import AuthError

CLOCK_SKEW_S = 5.0  # the minting backend's clock may run a little behind ours
MAX_TOKEN_CHARS = 4096  # a longer "token" is not one of ours; refuse before decoding it


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(secret: str | bytes, payload_b64: str) -> bytes:
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hmac.new(key, payload_b64.encode("ascii"), hashlib.sha256).digest()


def make_session_token(secret: str | bytes, ttl_s: float, subject: str, *, now: float | None = None) -> str:
    """A signed token for `subject`, valid for `ttl_s` seconds (keep it short: minutes)."""
    if ttl_s <= 0:
        raise ValueError("ttl_s must be > 0")
    issued = time.time() if now is None else now
    payload = json.dumps({"sub": subject, "exp": int(issued + ttl_s)}, separators=(",", ":")).encode("utf-8")
    payload_b64 = _b64encode(payload)
    return f"{payload_b64}.{_b64encode(_signature(secret, payload_b64))}"


def verify_session_token(secrets: Iterable[str | bytes], token: str, *, now: float | None = None) -> dict[str, Any]:
    """The token's claims if one of `secrets` signed it and it has not expired; else `AuthError` (401)."""
    parts = token.split(".")
    if len(parts) != 2 or len(token) > MAX_TOKEN_CHARS:
        raise AuthError(401, "invalid_token", "the token is not valid")
    payload_b64, signature_b64 = parts
    if not (payload_b64.isascii() and signature_b64.isascii()):
        raise AuthError(401, "invalid_token", "the token is not valid")
    try:
        signature = _b64decode(signature_b64)
    except (binascii.Error, ValueError):
        raise AuthError(401, "invalid_token", "the token is not valid") from None
    if not any(hmac.compare_digest(_signature(s, payload_b64), signature) for s in secrets):
        raise AuthError(401, "invalid_token", "the token is not valid")
    try:
        claims = json.loads(_b64decode(payload_b64))
    except (binascii.Error, ValueError):
        raise AuthError(401, "invalid_token", "the token is not valid") from None
    expires = claims.get("exp") if isinstance(claims, dict) else None
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        raise AuthError(401, "invalid_token", "the token has no expiry")
    if (time.time() if now is None else now) > expires + CLOCK_SKEW_S:
        raise AuthError(401, "expired_token", "the token has expired; get a new one")
    return claims


@dataclass(frozen=True)
class AccessPolicy:
    """Decides whether a request may go on: its origin (browsers), then its token.

    Auth is on when any static token or HMAC secret is configured. Origins: a request without `Origin`
    (curl, servers) passes; a browser's `Origin` must be listed, or be the page's own (same host).
    """

    tokens: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    origins: frozenset[str] = frozenset()

    @classmethod
    def from_lists(cls, tokens: Iterable[str], secrets: Iterable[str], origins: Iterable[str]) -> AccessPolicy:
        return cls(tuple(tokens), tuple(secrets), frozenset(normalize_origin(o) for o in origins))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens or self.secrets)

    def listed_origin(self, origin: str) -> bool:
        """Explicitly allowed (these get CORS headers); the page's own origin needs none."""
        if ANY_ORIGIN in self.origins:
            return True
        try:
            return normalize_origin(origin) in self.origins
        except ValueError:
            return False

    def check_origin(self, origin: str | None, hosts: Iterable[str | None]) -> None:
        """Raise 403 unless the request has no Origin, a listed one, or its own host's (same origin)."""
        if origin is None or self.listed_origin(origin):
            return
        netloc = urlsplit(origin.strip().lower()).netloc
        if netloc and any(host is not None and netloc == host.strip().lower() for host in hosts):
            return
        raise AuthError(403, "origin_not_allowed", f"origin {origin[:200]!r} may not use this gateway")

    def authenticate(self, token: str | None) -> str | None:
        """The caller's subject (None for a static token or open access); 401 if a needed token is bad."""
        if not self.auth_enabled:
            return None
        if not token:
            raise AuthError(401, "missing_token", "a token is required: send 'Authorization: Bearer <token>'")
        candidate = token.encode("utf-8", "surrogatepass")
        if any(hmac.compare_digest(candidate, t.encode("utf-8")) for t in self.tokens):
            return None
        if not self.secrets:
            raise AuthError(401, "invalid_token", "the token is not valid")
        subject = verify_session_token(self.secrets, token).get("sub")
        return subject if isinstance(subject, str) else None
