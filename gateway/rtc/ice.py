"""STUN/TURN servers for both ends of a session: the gateway's own peer and the browser's.

A TURN url needs credentials, either static (`--ice-username`, `--ice-credential`: every client gets the same
password) or time-limited ones minted per client from a secret shared with coturn (`--turn-secret`; coturn's
`use-auth-secret` + `static-auth-secret`, the "TURN REST API" of draft-uberti-behave-turn-rest):

    username   = "<expiry, unix seconds>:<client id>"
    credential = base64(HMAC-SHA1(secret, username))

coturn recomputes the credential from the username, so it needs no user database, and the secret never leaves the
gateway. coturn checks the expiry when a relay is allocated; an allocation it accepted keeps being refreshed
after that (tests/test_turn.py shows it on a real coturn), so the TTL bounds how long a leaked credential can
start relays, not how long a session lasts.

Standard library only (with gateway.config, itself standard library only), so a lesson backend can mint the
same credentials.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig, is_turn_url

MAX_CLIENT_ID_CHARS = 64  # STUN usernames may have 513 bytes; coturn's logs and quotas read better short
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._@-]")


def turn_rest_credentials(secret: str, ttl_s: float, client_id: str, *, now: float | None = None) -> tuple[str, str]:
    """(username, credential) valid for `ttl_s` seconds on a TURN server sharing `secret` (coturn REST API)."""
    if ttl_s <= 0:
        raise ValueError("ttl_s must be > 0")
    expires = int((time.time() if now is None else now) + ttl_s)
    username = f"{expires}:{client_id}"
    digest = hmac.new(secret.encode("utf-8"), username.encode("utf-8"), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode("ascii")


def client_id(subject: str | None) -> str:
    """The id after the expiry in a TURN username: the caller's subject (from its session token), else random.

    It shows in coturn's logs and its `user-quota` counts allocations per username, so each client gets its own.
    """
    if subject:
        cleaned = _UNSAFE_ID_CHARS.sub("_", subject)[:MAX_CLIENT_ID_CHARS]
        if cleaned.strip("_"):
            return cleaned
    return uuid.uuid4().hex


@dataclass(frozen=True)
class IceServer:
    """One RTCIceServer, the browser's dictionary: urls, and for TURN a username and credential."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"urls": list(self.urls)}
        if self.username is not None:
            entry["username"] = self.username
        if self.credential is not None:
            entry["credential"] = self.credential
        return entry


def uses_turn_secret(config: GatewayConfig) -> bool:
    return config.turn_secret is not None and any(is_turn_url(url) for url in config.ice_servers)


def ice_servers(config: GatewayConfig, client: str, *, now: float | None = None) -> list[IceServer]:
    """The configured servers for one client: STUN urls in one entry, TURN urls in another with credentials."""
    stun = tuple(url for url in config.ice_servers if not is_turn_url(url))
    turn = tuple(url for url in config.ice_servers if is_turn_url(url))
    servers = [IceServer(stun)] if stun else []
    if turn:
        if config.turn_secret is not None:
            username, credential = turn_rest_credentials(config.turn_secret, config.turn_credential_ttl_s, client,
                                                         now=now)
        else:
            username, credential = config.ice_username, config.ice_credential
        servers.append(IceServer(turn, username, credential))
    return servers
