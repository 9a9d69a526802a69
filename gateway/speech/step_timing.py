"""When the streaming SNAC decoder steps: a ready stream is due once its audio runs less than `DUE_LEAD_S` ahead of
its listener, or once the last step is `MAX_HOLD_S` old, and never before the last step's rest (`step_duty`). The
decoder's worker thread (`stream_decoder.StreamDecoder`) asks `StepTiming` and tells it of each step; this module
holds the rule and its numbers, nothing of streams or SNAC. Why: docs/decisions/snac-step-timing.md.
"""

from __future__ import annotations

from gateway.config import STEP_DUTY_BOUNDS, step_duty_in_bounds

# A stream whose audio runs less than this ahead of its listener is stepped now: its audio must then reach the
# playout before the lead runs out, through the worker's longest tick under load and, with the shared SNAC process,
# a socket and a busy worker's event loop (docs/decisions/snac-step-timing.md). Listeners at 0 ms are below it from
# their first audio on.
DUE_LEAD_S = 0.2
# The longest a ready stream with lead to spare waits for a step: bounds the steps to ~20 a second for such
# streams while their buffers stay as full as at every-frame stepping, less 50 ms at most.
MAX_HOLD_S = 0.05
# Where SNAC shares the GPU with generation, after a step that left streams out the next waits until 4x its length
# from its start (docs/decisions/snac-step-timing.md, "Behind real time").
GPU_STEP_DUTY = 0.25


def step_duty_on(device_type: str, step_duty: float | None) -> float:
    """The one reading of `--snac-step-duty`'s default (None): GPU_STEP_DUTY where SNAC runs on CUDA; 1 (no rest) on
    a CPU, where the decoder itself is the bottleneck and resting could only delay it."""
    if step_duty is not None:
        return step_duty
    return GPU_STEP_DUTY if device_type == "cuda" else 1.0


class StepTiming:
    """The step rule's state on the decoder's clock (seconds): when the last step started and before when the next
    may not. One owner thread."""

    def __init__(self, hold_s: float = MAX_HOLD_S, due_lead_s: float = DUE_LEAD_S, step_duty: float = 1.0) -> None:
        if not step_duty_in_bounds(step_duty):
            raise ValueError(f"step_duty must be within {STEP_DUTY_BOUNDS}, not {step_duty}")
        self.hold_s = hold_s  # the longest a ready stream with lead to spare waits for a step (MAX_HOLD_S)
        self.due_lead_s = due_lead_s  # a ready stream with less lead is stepped now (DUE_LEAD_S)
        # The most of the wall time steps take: after a step of t seconds that left open streams out, none starts
        # before t / step_duty from its start, due streams or not (1: a due stream is stepped as its frame comes).
        # Where every stream is due (generation at or behind real time), stepping at every frame runs many small
        # batches whose GPU time slows generation further.
        self.step_duty = step_duty
        self.last_step = 0.0  # clock time of the last step's start: the hold counts from it
        self.rested_at = 0.0  # clock time before which no step starts

    def due_in(self, lead_s: float, now: float) -> float:
        """Seconds until a ready stream with this lead must be stepped: until its lead falls to `due_lead_s` or the
        last step is `hold_s` old, whichever comes first, and not before the last step's rest is over (0: now)."""
        return max(0.0, self.rested_at - now, min(lead_s - self.due_lead_s, self.last_step + self.hold_s - now))

    def held(self, least_lead_s: float) -> bool:
        """A step whose least-led stream still had lead to spare: it came from the hold, not a due stream."""
        return least_lead_s >= self.due_lead_s

    def step_started(self, at: float) -> None:
        self.last_step = at

    def step_ended(self, started: float, elapsed: float, left_out: bool) -> None:
        """A step from `started` took `elapsed` seconds. One that left open streams out rests until elapsed / duty
        from its start; one that took them all (or its most) rests only itself: waiting could not grow the next
        batch (the decoder, not generation, is behind)."""
        self.rested_at = started + (elapsed / self.step_duty if left_out else elapsed)

    @property
    def rests(self) -> bool:
        """Whether a step can rest beyond its own length (duty below 1): only then does `left_out` matter."""
        return self.step_duty < 1
