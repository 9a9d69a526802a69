"""Capacity accounting: how many sessions and synthesising utterances the gateway takes on, and how fast a
session may send messages.

One `Admission` per gateway, shared by the HTTP routes and the WebRTC sessions: a session or an utterance
holds a `Slot` while it runs and releases it when it ends. Refusing new work at the limit is what lets the
streams already running keep real time. Under `serve --workers` the utterances of every worker count against
one limit (`StreamCounts`: the engine they share is one).
"""

from __future__ import annotations

import math
import mmap
import struct
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from gateway.config import GatewayConfig
from gateway.orpheus import AUDIO_TOKENS_PER_SECOND
from gateway.service.errors import CapacityError

SESSION_RETRY_AFTER_S = 10  # a session slot frees when a lesson ends: minutes; ask again in a while
STREAM_RETRY_AFTER_S = 2  # an utterance slot frees when a sentence has been generated: seconds


class Slot:
    """A unit of admitted work; `release()` (idempotent) gives it back. Usable as a context manager."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


COUNT = struct.Struct("q")  # one worker's cell in the stream counts file


def create_stream_counts(path: Path, workers: int) -> None:
    """The file of `StreamCounts` for `workers` workers, every count 0 (the supervisor makes it before they start)."""
    path.write_bytes(bytes(COUNT.size * workers))


def clear_stream_count(path: Path, index: int) -> None:
    """Worker `index`'s count back to 0: it exited, and its utterances with it (the supervisor, before the next
    one starts, which can take minutes: meanwhile its last count would refuse utterances the engine has room for)."""
    with open(path, "r+b") as f:
        f.seek(COUNT.size * index)
        f.write(COUNT.pack(0))


class StreamCounts:
    """Utterances synthesising in each worker of one `serve --workers` gateway, in a file every worker maps (one
    8-byte cell per worker, `create_stream_counts`): a worker writes only its own cell and reads the others', so
    the gateway-wide limit holds wherever the kernel sent the sessions and requests. Before, each worker had
    limit / workers, and a worker whose share was taken refused while others had room.

    No lock: two workers admitting at the same instant may both take the last slot (at most workers - 1 over the
    limit); the engine queues those as any request beyond its batch."""

    def __init__(self, path: Path, index: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._cells = memoryview(self._map).cast(COUNT.format)
        if not 0 <= index < (workers := len(self._cells)):
            self.close()
            raise ValueError(f"worker {index} has no cell in {path} ({workers} workers)")
        self.index = index
        self.publish(0)  # a restarted worker starts with none

    def publish(self, count: int) -> None:
        self._cells[self.index] = count

    def others(self) -> int:
        """The other workers' utterances now."""
        return sum(self._cells) - self._cells[self.index]

    def close(self) -> None:
        self._cells.release()
        self._map.close()


class Admission:
    """Counts sessions and synthesising utterances ("streams") against the configured limits; with `shared`, the
    other workers' utterances count against `max_streams` too."""

    def __init__(self, max_sessions: int, max_streams: int, tokens_per_second: float = 0.0,
                 shared: StreamCounts | None = None) -> None:
        self.max_sessions = max_sessions
        # The token budget caps streams too: each real-time stream needs AUDIO_TOKENS_PER_SECOND.
        by_budget = math.floor(tokens_per_second / AUDIO_TOKENS_PER_SECOND) if tokens_per_second > 0 else max_streams
        self.max_streams = min(max_streams, by_budget)
        self.sessions = 0
        self.streams = 0  # this process's
        self.shared = shared

    @classmethod
    def from_config(cls, config: GatewayConfig, shared: StreamCounts | None = None) -> Admission:
        # Every served model has an engine of its own (LoRA adapters share their base's).
        engine_slots = config.max_num_seqs * config.data_parallel_size * len(config.model_table.bases)
        return cls(config.max_sessions, config.max_in_flight_utterances or engine_slots,
                   config.engine_tokens_per_second, shared)

    @property
    def sessions_full(self) -> bool:
        """No session slot is left (`admit_session` would refuse)."""
        return self.sessions >= self.max_sessions

    def admit_session(self) -> Slot:
        if self.sessions_full:
            raise CapacityError(f"the gateway is at capacity ({self.max_sessions} sessions); try again shortly",
                                SESSION_RETRY_AFTER_S)
        self.sessions += 1
        return Slot(self._end_session)

    @property
    def streams_in_use(self) -> int:
        """Utterances synthesising now, every worker's."""
        return self.streams + (self.shared.others() if self.shared is not None else 0)

    def admit_stream(self) -> Slot:
        """One more utterance synthesising, if every running stream keeps real time with it."""
        others = self.shared.others() if self.shared is not None else 0
        if self.streams + others >= self.max_streams:
            raise CapacityError(f"the speech engine is at capacity ({self.max_streams} utterances at once); "
                                "try again shortly", STREAM_RETRY_AFTER_S)
        self.streams += 1
        if self.shared is not None:
            self.shared.publish(self.streams)
        return Slot(self._end_stream)

    def _end_session(self) -> None:
        self.sessions -= 1

    def _end_stream(self) -> None:
        self.streams -= 1
        if self.shared is not None:
            self.shared.publish(self.streams)


class TokenBucket:
    """`rate` events per second on average, up to `burst` at once; rate 0 = unlimited."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._updated = clock()

    def take(self) -> bool:
        """Spend one token; False (nothing spent) when the bucket is empty."""
        if self.rate <= 0:
            return True
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
