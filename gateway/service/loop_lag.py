"""How late this process's event loop wakes up: the wait every real-time task of the process (a track's 20 ms
pacing, the sender's encode and send, the engine's token stream) adds beyond its due time.

A task sleeps `interval_s` and reports how much longer than that it slept. A loop blocked for 60 ms shows one
sample of ~60 ms, whatever blocked it (a burst's start, a long callback, the garbage collector, a starved core).
The gateway reports each sample to Prometheus (`orpheus_event_loop_lag_seconds`), so the server's late frames
(`orpheus_playout_late_frames_total`) can be told apart from lateness on the way to the listener; the benchmarks
sample their own loop with the same class.

May import: the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

# One sample per playout frame: a lag worth seeing (over 10 ms makes a frame late) is never between two samples.
LOOP_LAG_INTERVAL_S = 0.02


class LoopLagMonitor:
    """Samples this event loop's wake-up lag while started; `observe(seconds)` gets every sample."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        self.observe = observe
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.observe(max(0.0, time.monotonic() - t0 - self.interval_s))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._sample(), name="loop-lag-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
