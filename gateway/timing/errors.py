"""The timing layer's exceptions."""

from __future__ import annotations


class AlignmentError(ValueError):
    """No CTC path exists: fewer frames than the token sequence needs."""
