"""A stream's host-side state (`StreamHandle`: pool slot, noise seed, progress, the frames kept for the bridge) and
the counters over all streams of a decoder (`StreamStats`). No torch: the stream decoder's thread reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gateway.orpheus import SAMPLES_PER_FRAME, Frame

MAX_HEAD_FRAMES = 8  # frames of a stream's start kept for `bridge`: it covers at most the first 8 (0.68 s)


@dataclass(eq=False)
class StreamHandle:
    """One utterance being decoded: its pool slot, noise seed and host-side progress (read-only for callers)."""

    slot: int
    seed: int
    received: int = 0  # frames pushed
    stepped: int = 0  # frames consumed by steps (the next step starts at this frame)
    emitted: int = 0  # samples handed out (approximate first chunk included)
    finished: bool = False
    closed: bool = False
    handover: int = 0  # samples [0, handover) came from `bridge`
    bridged: int = 0  # frames the last `bridge` decode reached
    _pending: list[Frame] = field(default_factory=list)  # frames pushed, not yet stepped
    _head: list[Frame] = field(default_factory=list)  # the first MAX_HEAD_FRAMES frames (for `bridge`)
    _fade: np.ndarray | None = None  # approximate audio of [handover, handover + crossfade)

    @property
    def total_samples(self) -> int | None:
        """The utterance's length in samples, once `finish` was called."""
        return self.received * SAMPLES_PER_FRAME if self.finished else None

    @property
    def done(self) -> bool:
        """Finished and all its audio handed out."""
        return self.finished and self.emitted >= self.received * SAMPLES_PER_FRAME

    @property
    def decoded_per_new_frame(self) -> float:
        """Frames this stream has run through the decoder per frame it was fed (flush steps included)."""
        return self.stepped / max(1, self.received)


@dataclass
class StreamStats:
    """Counters over all streams of a `StreamingSnac`."""

    launches: int = 0  # batched steps run (graph replays or eager passes)
    stream_steps: int = 0  # stream-steps in them (one chunk of one stream each)
    padded_rows: int = 0  # batch rows added to reach a graph bucket (wasted work)
    pushed_frames: int = 0
    stepped_frames: int = 0  # frames run through the exact decoder, flush steps included
    approx_frames: int = 0  # frames run through `bridge` decodes
    bridge_launches: int = 0  # bridge decodes (one per decode length per call)
    bridge_graphed: int = 0  # of them, graph replays

    @property
    def decoded_per_new_frame(self) -> float:
        """Frames decoded (exact steps + bridge decodes) per frame pushed; sliding 3-frame windows: ~2.9."""
        return (self.stepped_frames + self.approx_frames) / max(1, self.pushed_frames)
