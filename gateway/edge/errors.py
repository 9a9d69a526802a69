"""The edge layer's exceptions: requests refused before they reach a session or the engine, each answered with
its HTTP status and the route's JSON error shape.

Standard library only, so `auth` stays importable (and copyable) without the gateway's dependencies.
"""

from __future__ import annotations


class AuthError(Exception):
    """A request without valid credentials (HTTP 401) or from a refused origin (HTTP 403)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class SpeechRequestError(Exception):
    """A body field the speech route refuses (HTTP 400), naming the field as OpenAI's `param`."""

    def __init__(self, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
