"""Pure measurement arithmetic: distributions, gaps, the playback stall check, token budgets.

Everything here works on plain numbers (seconds), so the definitions in gateway/benchmarks/README.md can be checked in
isolation from the engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.orpheus import sentence_token_cap

FRAME_TOKENS = 7  # one SNAC frame = 7 audio tokens
PERCENTILES = (50, 95)

# Orpheus speaks ~82 audio tokens per second of audio (SNAC 24 kHz: 11.7 frames/s x 7 tokens) and reads text
# at roughly 14 characters per second, so one character is ~82 / 14 = 5.9 audio tokens.
ORPHEUS_TOKENS_PER_CHAR = 6.0


def describe(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """n, min, avg, p50, p95, max of `values` (times `scale`, e.g. 1000 for ms); None fields when empty."""
    keys = ("min", "avg", *(f"p{p}" for p in PERCENTILES), "max")
    if not values:
        return {"n": 0, **dict.fromkeys(keys)}
    arr = np.asarray(values, dtype=np.float64) * scale
    stats = [arr.min(), arr.mean(), *(np.percentile(arr, p) for p in PERCENTILES), arr.max()]
    return {"n": len(values), **{k: round(float(v), 3) for k, v in zip(keys, stats, strict=True)}}


def gaps(times: Sequence[float]) -> list[float]:
    """Time between consecutive arrivals."""
    return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True)
class Playback:
    """What a client that starts playing `buffer_s` after the first audio arrives would experience."""

    buffer_s: float
    stalls: int  # times playback had to wait for audio that had not arrived
    stall_s: float  # total waiting
    max_late_s: float  # worst lateness of a chunk against the schedule without stalls (0 if never late)
    first_stall_at_s: float | None = None  # arrival time of the chunk the first stall waited for (None: no stall)
    stalled_chunks: tuple[int, ...] = ()  # the index of each chunk a stall waited for

    @property
    def stalled(self) -> bool:
        return self.stalls > 0


def simulate_playback(arrivals: Sequence[tuple[float, float]], buffer_s: float, tolerance_s: float = 0.0
                      ) -> Playback:
    """Play chunks `(arrival time, audio seconds)` in order, starting at first arrival + `buffer_s`.

    A chunk that arrives after its playout time (by more than `tolerance_s`) is a stall: playback pauses
    until it arrives and resumes from there, so one late chunk is counted once, not for every chunk after it.
    """
    if not arrivals:
        return Playback(buffer_s, 0, 0.0, 0.0)
    start = arrivals[0][0] + buffer_s
    clock = start  # playout time of the next chunk, stalls included
    fixed = start  # playout time of the next chunk on the schedule without stalls
    stalls, stall_s, max_late = 0, 0.0, 0.0
    first_stall_at: float | None = None
    stalled: list[int] = []
    for index, (arrived, duration) in enumerate(arrivals):
        max_late = max(max_late, arrived - fixed)
        if arrived > clock + tolerance_s:
            if first_stall_at is None:
                first_stall_at = arrived
            stalled.append(index)
            stalls += 1
            stall_s += arrived - clock
            clock = arrived
        clock += duration
        fixed += duration
    return Playback(buffer_s, stalls, stall_s, max(0.0, max_late), first_stall_at, tuple(stalled))


def token_budget(chars: int, tokens_per_char: float, cap: int) -> int | None:
    """Audio tokens to generate for a sentence of `chars` characters: whole frames, at least one, at most `cap`
    (the gateway's own `--max-tokens-per-char` rule, so a gateway started with it runs the same budgets).

    None when `tokens_per_char` is 0: the model decides when to stop (a trained Orpheus).
    """
    if tokens_per_char <= 0:
        return None
    return sentence_token_cap(chars, tokens_per_char, cap)
