"""The service layer's exceptions: work the gateway refuses because it is full."""

from __future__ import annotations

AT_CAPACITY = "at_capacity"


class CapacityError(Exception):
    """The gateway is full: HTTP 503 with `Retry-After`, or an `error` event with code `at_capacity`."""

    code = AT_CAPACITY

    def __init__(self, message: str, retry_after_s: int, model: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.model = model  # refused at this model's own limit (several models served); None: the gateway's
