"""When a sentence's first audio goes out, and from where: the arithmetic of the fast start, which
`stream_decoder.StreamDecoder` applies to each stream (`_first_audio_at`), and the generation pace it reads
(`GenerationPace`). Numbers only: no threads, no torch.

A first audio comes from the bridge (`snac_stream.StreamingSnac.bridge`) once a stream's head is in. The exact
stream runs 2709 samples (113 ms) further behind its input than the bridge, so handing over from the bridge costs
the listener that much lead once, and at a loaded pace (1.0-1.3x real time) the bridge's 8 head frames cannot build
it: a listener without a buffer paused right after its first words. So the bridged start waits for the shortfall
(`start_hold_s`, at most `MAX_START_HOLD_S` after the head). Or, where that wait is long, the first audio comes from
the exact stream itself, with no bridge and no hand-over (`exact_start_hold_s`; chosen by `starts_exact`): sooner at
real-time pace, and none of the bridge's work, which in a burst the whole batch's generation pays for. That work
slows the pace the hold was measured at, so the choice weighs the bridge at the slower pace (`BRIDGE_PACE_FACTOR`,
`bridged_start_hold_s`).

May import: `gateway.orpheus` (model facts).
"""

from __future__ import annotations

import statistics
from collections import deque

from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE
# Frames in when the exact stream hands out its first audio: 3 x 2048 samples pass its 4757 samples of delay.
FIRST_EXACT_FRAMES = 3
# The longest a first audio waits for its listener's sake (`start_hold_s`): at a pace below real time no wait
# would be enough, and a pace measured over the first frames of a burst is slower than what follows.
MAX_START_HOLD_S = 0.22  # about the hand-over's own cost (`handover_lead_s`: 4757 samples and the margin)
# How much later than a held bridge the exact stream may start a stream's audio and still be chosen
# (`starts_exact`; a bridge that needs no hold is always kept: it starts at once, and at such a pace its GPU time
# is to spare): a bridged start decodes up to 8 frames 3 times each, which in a burst the whole batch's generation
# pays for (H100, 256 users: frames 2-5 came 87-93 ms apart after a first interval of 65, then 65 again). 80 ms:
# with the bridge planned at the pace it leaves (`BRIDGE_PACE_FACTOR`), the exact start is chosen at measured
# paces up to ~1.8x real time (one frame every 47 ms; at the measured pace itself it was ~1.33x), the bridge
# above. Measured (engine level, 0 ms, one H100, same machine; docs/benchmarks.md 2026-12-05 night): with 80 ms and
# `EXACT_START_MARGIN_S`, 124/209/384 of 128/256/384 kept real time; with 40 ms and no margin 105/40/27; the held
# bridge alone 126/75/235.
EXACT_START_PREFERENCE_S = 0.08
# Lead an exact start's hold keeps beyond the tick margin: the pace after the head is often a little slower than
# the head's (H100, 384 users: 84 ms, then 85-96), and without it most streams ran dry by a few ms at the 8th piece
# (357 of 384 stalled, 1 ms median; with it none did).
EXACT_START_MARGIN_S = 0.04
# The pace a bridged start is planned at, in multiples of the one measured at its head: a burst's bridges (eager
# decodes, 3 frames per frame) slow the whole batch's generation right after the head. Frames 2-5 came 1.35-1.45x
# the first interval apart while bridges ran (H100 and H200, 128 and 256 users: 40 -> 54-59 ms, 60-69 -> 83-94),
# 1.0-1.1x where the streams started exact (H100, 256: 68 -> 65-74). Planned at the measured pace, 256 listeners
# without a buffer on an H200 (60 ms: no hold, bridge at once) all paused at their second or third piece (0 of 256
# kept real time, bare vLLM 256). So a bridge is kept only while the measured pace is faster than ~1.8x real time
# (a frame every 47 ms); slower, the exact start is chosen (`starts_exact`).
BRIDGE_PACE_FACTOR = 1.4
# The generation pace every stream shows (`GenerationPace`): frame intervals of the pushes in this last window. Long
# enough for a few frames of each stream at a loaded pace, short enough that a burst's slow pace is forgotten
# within a second of its end.
PACE_WINDOW_S = 0.5
PACE_SAMPLES = 1024  # at most this many intervals in the window (256 streams at 1.2x push ~3600 frames a second)
# How first audio starts (`StreamDecoder(start=...)`): from the exact stream or a held bridge, as `starts_exact`
# says; from a held bridge only; from the bridge at once, as before the holds.
START_POLICIES = ("exact-or-bridge", "bridge-held", "bridge-at-once")
# The fast start (a first audio from the first frame alone, without its lookahead frame) is taken when the tokens
# of the next two frames are due within a margin: `decode_fast_start_ms` (45), which guards against a burst of new
# streams slowing the token rate right after the first frame (with 65, 16 of 128 streams started together stalled
# 26 ms after it on an H200). A sentence that starts alone (no other sentence's first token within
# `FAST_START_BURST_WINDOW_S`) has no burst beside it, so its margin is the first frame's own 85 ms less the next
# frame's decode and delivery (~15 ms). Measured need: an H100 at one stream makes a token every ~4 ms, so its next
# two frames take 56 ms; with 45 its first audio waited for the lookahead frame (TTFA p50 at 1: 67 ms over WebRTC
# against the H200's 46, whose 3.2 ms a token passed by 0.2 ms).
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
    after the first words (H200, 256 listeners without a buffer: every stream paused once, 41 ms on average,
    right after its first piece)."""
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
        """`frames` frames came at `at` (perf_counter time), `seconds` after the same stream's previous ones."""
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
    tokens can come in one clump (7 tokens in 3 ms), a rate no engine makes. Every server underrun of 256 WebRTC
    peers without a buffer on an H100 (6 and 8 streams in two runs, 2026-12-06 midday) was such a start: the
    burst's first streams, first audio 3-7 ms after their first frame, dry 60 ms later and again 80-160 ms after."""
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
