"""What a `PlayoutTrack` reports as its frames leave: one frozen class per event (`PlayoutEvent` is their union),
the base of the markers a caller places in an utterance's audio, and the track's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Marker:
    """Base of what a caller places in an utterance's audio with `PlayoutTrack.mark`: subclass it with the fields
    it wants back in the `MarkerReached` event when that point plays."""


# The events, each reported at the moment a frame is handed to the sender. `timestamp` is the track clock
# (`time.monotonic` unless injected) at the recv that returned the frame; `pts` is that frame's pts (48 kHz
# samples since the track's first frame: where the event sits in the RTP stream).


@dataclass(frozen=True, slots=True)
class UtteranceStarted:
    """The utterance's first frame left."""

    utterance_id: str
    timestamp: float
    pts: int


@dataclass(frozen=True, slots=True)
class MarkerReached:
    """The frame holding the sample after `marker` left (with the last frame if no audio followed it)."""

    utterance_id: str
    timestamp: float
    pts: int
    marker: Marker


@dataclass(frozen=True, slots=True)
class UtteranceFinished:
    """The utterance's last frame left: how it played."""

    utterance_id: str
    timestamp: float
    pts: int
    audio_ms: int
    underruns: int
    underrun_ms: int
    underrun_at_ms: tuple[int, ...]  # audio played when each underrun began (the first few; `underruns` counts all)
    late_frames: int  # audio frames handed to the sender more than half a frame after their slot
    max_late_ms: float  # the latest of its audio frames, after its slot


PlayoutEvent = UtteranceStarted | MarkerReached | UtteranceFinished


@dataclass(frozen=True, slots=True)
class PlayoutStats:
    frames_sent: int
    silence_frames: int
    underruns: int
    underrun_ms: int
    reanchors: int
    early_starts: int  # utterances whose first frame went out before its slot (the track idled)
    queued_ms: int
    queued_utterances: int
    errors: int
    callback_errors: int
