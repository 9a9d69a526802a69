"""When a sentence's first audio goes out, and from where: the arithmetic of the fast start (the bridge's held start,
the exact start, the fast-start margin), the generation pace it reads (`GenerationPace`), and the gateway's start
policy (`EXACT_OR_BRIDGE`), which `stream_decoder.StreamDecoder` applies to each stream. Numbers only: no threads,
no torch. The measurements behind each bound: docs/decisions/first-audio-start.md.

May import: `gateway.orpheus` (model facts).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE
# Frames in when the exact stream hands out its first audio: 3 x 2048 samples pass its 4757 samples of delay.
FIRST_EXACT_FRAMES = 3
# The longest a first audio waits for its listener's sake (`start_hold_s`): at a pace below real time no wait
# would be enough, and a pace measured over the first frames of a burst is slower than what follows.
MAX_START_HOLD_S = 0.22  # about the hand-over's own cost (`handover_lead_s`: 4757 samples and the margin)
# How much later than a held bridge the exact stream may start a stream's audio and still be chosen
# (`starts_exact`; a bridge that needs no hold is always kept: it starts at once, and its GPU time is to spare): a
# bridged start decodes up to 8 frames 3 times each, which in a burst the whole batch's generation pays for. With
# `BRIDGE_PACE_FACTOR`, the exact start is chosen at measured paces slower than ~1.8x real time (a frame every
# 47 ms), the bridge above (docs/decisions/first-audio-start.md).
EXACT_START_PREFERENCE_S = 0.08
# Lead an exact start's hold keeps beyond the tick margin: the pace after the head is often a little slower than
# the head's, and without it most streams ran dry by a few ms at the 8th piece (docs/decisions/first-audio-start.md).
EXACT_START_MARGIN_S = 0.04
# The pace a bridged start is planned at, in multiples of the one measured at its head: a burst's bridges (eager
# decodes, 3 frames per frame) slow the whole batch's generation right after the head, so a bridge is kept only
# while the measured pace is faster than ~1.8x real time; slower, the exact start is chosen (`starts_exact`;
# docs/decisions/first-audio-start.md).
BRIDGE_PACE_FACTOR = 1.4
# The generation pace every stream shows (`GenerationPace`): frame intervals of the pushes in this last window. Long
# enough for a few frames of each stream at a loaded pace, short enough that a burst's slow pace is forgotten
# within a second of its end.
PACE_WINDOW_S = 0.5
PACE_SAMPLES = 1024  # at most this many intervals in the window (256 streams at 1.2x push ~3600 frames a second)
# The fast start (a first audio from the first frame alone, without its lookahead frame) is taken when the tokens
# of the next two frames are due within a margin: `decode_fast_start_ms`, which guards against a burst of new
# streams slowing the token rate right after the first frame. A sentence that starts alone (no other sentence's
# first token within `FAST_START_BURST_WINDOW_S`) has no burst beside it, so its margin is the first frame's own
# 85 ms less the next frame's decode and delivery (~15 ms): enough for a card making a token every ~4 ms
# (docs/decisions/first-audio-start.md).
LONE_FAST_START_S = 0.07
FAST_START_BURST_WINDOW_S = 0.2  # a burst's sentences get their first tokens within a few engine steps


def start_hold_s(received: int, interval_s: float, lead_s: float, handover_lead_s: float, head_frames: int) -> float:
    """How long after its latest frame a stream's first audio from the bridge waits, so that at the generation pace
    it has shown (a frame every `interval_s`) its listener does not run dry when the exact stream takes over (<= 0:
    no wait). `received` frames are in; `lead_s` is what the listener already holds (its jitter buffer, audio of an
    utterance ahead).

    The bridge hands out each frame once the next is in, and goes on at most until the frame after the head's
    last (`head_frames` + 1 received): its audio then reaches frame `head_frames` - 1, so the listener holds
    (`head_frames` - 1) frames less the time from its start to that frame's arrival. The hand-over needs
    `handover_lead_s` less 3 frames' growth (`StreamDecoder._keeps_bridging`). Starting later by the shortfall gives the
    listener that much more at every point, the hand-over included: one wait at the start instead of a pause
    after the first words."""
    growth = FRAME_S - interval_s
    need = handover_lead_s - 3 * max(growth, 0.0)
    last = head_frames + 1  # frames in when the bridge is over
    return (last - received) * interval_s - (last - 2) * FRAME_S + need - lead_s


def exact_start_hold_s(received: int, interval_s: float, lead_s: float, delay_s: float, head_frames: int,
                       margin_s: float = EXACT_START_MARGIN_S) -> float:
    """How long after its latest frame a stream's first audio waits when it comes from the exact stream, with no
    bridge, so that at the generation pace it has shown (a frame every `interval_s`) its listener does not run dry
    (<= 0: no wait; the audio itself needs 3 frames). `delay_s`: the exact stream's delay with a tick's margin
    (`handover_lead_s`); `received` and `lead_s` as for `start_hold_s`.

    With k frames in, the exact stream has handed out k frames less its delay; the listener must not have played
    that before frame k + 1 comes. The worst k is the first (3, the first audio's) when generation outruns real
    time, and the last one looked at otherwise (the head's end, as `start_hold_s` looks); `margin_s` more. At
    real-time pace the wait is 173 ms after the head's second frame against the held bridge's 218; at 1.2x 144
    against 76."""
    first = max(FIRST_EXACT_FRAMES, received)
    worst = max((k + 1 - received) * interval_s - k * FRAME_S for k in (first, max(first, head_frames)))
    return worst + delay_s + margin_s - lead_s


def bridged_start_hold_s(received: int, interval_s: float, lead_s: float, delay_s: float, head_frames: int) -> float:
    """`start_hold_s` at the pace the bridge's own work leaves (`BRIDGE_PACE_FACTOR` times the measured
    `interval_s`): the hold of a bridged start where the exact start is the alternative. Arguments as for
    `start_hold_s`."""
    return start_hold_s(received, interval_s * BRIDGE_PACE_FACTOR, lead_s, delay_s, head_frames)


def starts_exact(received: int, interval_s: float, lead_s: float, delay_s: float, head_frames: int) -> bool:
    """Whether a stream's first audio should come from the exact stream rather than the bridge: only where the
    bridge would wait too at the pace its work leaves (`bridged_start_hold_s`; at a fast pace it starts at once,
    and its GPU time is to spare), and the exact stream, its margin aside, starts at most
    `EXACT_START_PREFERENCE_S` after it. Compared where each can start at the earliest: the exact stream at its
    third frame. Arguments as for `start_hold_s`."""
    bridged = bridged_start_hold_s(received, interval_s, lead_s, delay_s, head_frames)
    exact = exact_start_hold_s(received, interval_s, lead_s, delay_s, head_frames, margin_s=0.0)
    first_exact = max(0, FIRST_EXACT_FRAMES - received) * interval_s
    return bridged > 0 and max(exact, first_exact) <= bridged + EXACT_START_PREFERENCE_S


class GenerationPace:
    """Seconds per frame the engine's generation takes now, from every stream's frame intervals in the last
    `PACE_WINDOW_S`: one stream's first interval is noisy (256 feeders on one event loop), and the engine steps all
    streams together. One owner thread: the stream decoder's worker."""

    def __init__(self, window_s: float = PACE_WINDOW_S, samples: int = PACE_SAMPLES) -> None:
        self.window_s = window_s
        self._intervals: deque[tuple[float, float]] = deque(maxlen=samples)  # (at, seconds per frame), oldest first
        self._median: float | None = None  # of the intervals, while none came or went since

    def add(self, at: float, seconds: float, frames: int) -> None:
        """`frames` frames came at `at` (the decoder's clock), `seconds` after the same stream's previous ones."""
        self._intervals.append((at, seconds / max(frames, 1)))
        self._median = None

    def seconds_per_frame(self, now: float) -> float:
        """The median interval of the window ending `now` (0: none in it)."""
        while self._intervals and self._intervals[0][0] < now - self.window_s:
            self._intervals.popleft()
            self._median = None
        if self._median is None:
            self._median = statistics.median(i for _, i in self._intervals) if self._intervals else 0.0
        return self._median


def fast_start_margin_s(configured_s: float, others_starting: int, others_waiting: int = 0) -> float:
    """The fast start's margin: the configured one (`decode_fast_start_ms`; 0 = off) where `others_starting`
    sentences got their first tokens beside this one, at least `LONE_FAST_START_S` where none did; 0 (no fast
    start) while `others_waiting` sentences of this process wait for their first token.

    A fast start bets that the token rate so far holds for two more frames. Sentences still waiting for their first
    token have their prefills ahead of the engine, which slow its next steps; and over `vllm serve` a burst's first
    tokens can come in one clump (7 tokens in 3 ms), a rate no engine makes: such starts were the server underruns
    of a burst without buffers (docs/decisions/first-audio-start.md)."""
    if configured_s <= 0 or others_waiting > 0:
        return 0.0
    if others_starting > 0:
        return configured_s
    return max(configured_s, LONE_FAST_START_S)


def fast_start_in_time(tokens: int, since_first_token_s: float, needed_tokens: int, margin_s: float) -> bool:
    """Whether, at the token rate so far (`tokens` in, the first `since_first_token_s` ago), the `needed_tokens`
    the second frame's audio needs are in within `margin_s`."""
    if margin_s <= 0 or tokens < 2:
        return False
    per_token_s = since_first_token_s / (tokens - 1)
    return (needed_tokens - tokens) * per_token_s <= margin_s


@dataclass(frozen=True)
class StartPolicy:
    """How a stream's first audio starts once its head is in and a pace is read (`StreamDecoder._first_audio_at`):
    whether it waits for what the hand-over will cost (`held`; else at once, from the bridge), whether and when it
    comes from the exact stream instead (`starts_exact`; None: never), and the bridged start's hold
    (`bridged_hold_s`). Both callables take (received, interval_s, lead_s, delay_s, head_frames)."""

    name: str
    bridged_hold_s: Callable[[int, float, float, float, int], float]
    starts_exact: Callable[[int, float, float, float, int], bool] | None = None
    held: bool = True


# The gateway's start: from the exact stream or a held bridge, whichever `starts_exact` says suits the pace, the
# bridge planned at the pace its own work leaves.
EXACT_OR_BRIDGE = StartPolicy("exact-or-bridge", bridged_hold_s=bridged_start_hold_s, starts_exact=starts_exact)
