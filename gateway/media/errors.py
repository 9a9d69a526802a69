"""The media layer's exceptions: values its callers pass on from a client and must refuse with their own error
shape (the session's `invalid_rate`, the speech route's `invalid_speed`)."""

from __future__ import annotations


class InvalidRateError(ValueError):
    """A playback rate that is not a finite number within the caller's bounds; the message names them."""
