"""The rtc layer's exceptions: what a session refuses, answered as the protocol's `error` event.

Standard library only: `protocol` imports nothing else of the gateway, and neither does this.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """A message the server refuses: becomes `{"type": "error", "code", "message", "id"?, "retry_after_s"?}`."""

    def __init__(self, code: str, message: str, utterance_id: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.utterance_id = utterance_id
        self.retry_after_s = retry_after_s  # when asking again makes sense (a starting engine), as HTTP Retry-After
