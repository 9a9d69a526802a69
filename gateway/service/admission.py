"""Capacity accounting: how many sessions and synthesising utterances the gateway takes on, and how fast a
session may send messages.

One `Admission` per gateway, shared by the HTTP routes and the WebRTC sessions: a session or an utterance
holds a `Slot` while it runs and releases it when it ends. Refusing new work at the limit is what lets the
streams already running keep real time. Under `serve --workers` the utterances of every worker count against
one limit (`StreamCounts`: the engine they share is one).

With several models (`gateway.model_table`), an utterance counts against its voice's model's limit too (a LoRA
voice: its base's), so one model's traffic cannot take the budget the others' engines need: a model's
`max_streams` in the models file, else an even share of the total (rounded up).
"""

from __future__ import annotations

import math
import mmap
import struct
import time
from collections.abc import Callable, Mapping
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


def create_stream_counts(path: Path, workers: int, columns: int = 1) -> None:
    """The file of `StreamCounts` for `workers` workers of `columns` counts each (the total, then one per model),
    every count 0 (the supervisor makes it before they start)."""
    path.write_bytes(bytes(COUNT.size * workers * columns))


def stream_count_columns(config: GatewayConfig) -> int:
    """Counts per worker in the stream counts file: the total, and each model's where several are served."""
    bases = len(config.model_table.bases)
    return 1 + bases if bases > 1 else 1


def clear_stream_count(path: Path, index: int, columns: int = 1) -> None:
    """Worker `index`'s counts back to 0: it exited, and its utterances with it (the supervisor, before the next
    one starts, which can take minutes: meanwhile its last count would refuse utterances the engine has room for)."""
    with open(path, "r+b") as f:
        f.seek(COUNT.size * index * columns)
        f.write(bytes(COUNT.size * columns))


class StreamCounts:
    """Utterances synthesising in each worker of one `serve --workers` gateway, in a file every worker maps (a row
    of `columns` 8-byte cells per worker, `create_stream_counts`: column 0 the worker's utterances, column 1 + i
    those of the table's base model i): a worker writes only its own row and reads the others', so the
    gateway-wide limits hold wherever the kernel sent the sessions and requests. Before, each worker had
    limit / workers, and a worker whose share was taken refused while others had room.

    No lock: two workers admitting at the same instant may both take the last slot (at most workers - 1 over the
    limit); the engine queues those as any request beyond its batch."""

    def __init__(self, path: Path, index: int, columns: int = 1) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._cells = memoryview(self._map).cast(COUNT.format)
        self.columns = columns
        workers, odd = divmod(len(self._cells), columns)
        if odd or not 0 <= index < workers:
            self.close()
            raise ValueError(f"worker {index} has no cell in {path} ({workers} workers of {columns} counts)")
        self.index = index
        for column in range(columns):
            self.publish(0, column)  # a restarted worker starts with none

    def publish(self, count: int, column: int = 0) -> None:
        self._cells[self.index * self.columns + column] = count

    def others(self, column: int = 0) -> int:
        """The other workers' utterances now (column 0), or those of one model (column 1 + its place)."""
        cells = self._cells[column::self.columns]
        return sum(cells) - cells[self.index]

    def close(self) -> None:
        self._cells.release()
        self._map.close()


class Admission:
    """Counts sessions and synthesising utterances ("streams") against the configured limits; with `shared`, the
    other workers' utterances count against `max_streams` too. With several `models` (base model -> its own
    `max_streams` or None), an utterance of a voice in `model_of_voice` counts against its model's limit too:
    the given one, else an even share of `max_streams`."""

    def __init__(self, max_sessions: int, max_streams: int, tokens_per_second: float = 0.0,
                 shared: StreamCounts | None = None, models: Mapping[str, int | None] | None = None,
                 model_of_voice: Mapping[str, str] | None = None) -> None:
        self.max_sessions = max_sessions
        # The token budget caps streams too: each real-time stream needs AUDIO_TOKENS_PER_SECOND.
        by_budget = math.floor(tokens_per_second / AUDIO_TOKENS_PER_SECOND) if tokens_per_second > 0 else max_streams
        self.max_streams = min(max_streams, by_budget)
        self.sessions = 0
        self.streams = 0  # this process's
        self.shared = shared
        models = models or {}
        share = max(1, math.ceil(self.max_streams / len(models))) if models else self.max_streams
        self.model_limits = {name: min(limit or share, self.max_streams) for name, limit in models.items()}
        self.model_streams = dict.fromkeys(self.model_limits, 0)  # this process's, by model
        self._column = {name: 1 + i for i, name in enumerate(self.model_limits)}  # its count in `shared`
        self.model_of_voice = dict(model_of_voice or {})

    @classmethod
    def from_config(cls, config: GatewayConfig, shared: StreamCounts | None = None) -> Admission:
        table = config.model_table
        # Every served model has an engine of its own (LoRA adapters share their base's).
        engine_slots = config.max_num_seqs * config.data_parallel_size * len(table.bases)
        models = {name: spec.max_streams for name, spec in table.bases.items()} if len(table.bases) > 1 else None
        return cls(config.max_sessions, config.max_in_flight_utterances or engine_slots,
                   config.engine_tokens_per_second, shared, models,
                   {voice: table.engine_of(voice)[0] for voice in table.voices})

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

    def model_streams_in_use(self, model: str) -> int:
        """Utterances of one model synthesising now, every worker's."""
        others = self.shared.others(self._column[model]) if self.shared is not None else 0
        return self.model_streams[model] + others

    def admit_stream(self, voice: str | None = None) -> Slot:
        """One more utterance synthesising (spoken by `voice`: its model's limit holds too), if every running
        stream keeps real time with it."""
        others = self.shared.others() if self.shared is not None else 0
        if self.streams + others >= self.max_streams:
            raise CapacityError(f"the speech engine is at capacity ({self.max_streams} utterances at once); "
                                "try again shortly", STREAM_RETRY_AFTER_S)
        model = self.model_of_voice.get(voice) if voice is not None else None
        if model is not None and model in self.model_limits:
            if self.model_streams_in_use(model) >= self.model_limits[model]:
                raise CapacityError(f"model {model!r} is at capacity ({self.model_limits[model]} utterances at "
                                    "once); try again shortly", STREAM_RETRY_AFTER_S, model)
            self._count_model(model, 1)
        else:
            model = None
        self.streams += 1
        if self.shared is not None:
            self.shared.publish(self.streams)
        return Slot(lambda: self._end_stream(model))

    def _count_model(self, model: str, change: int) -> None:
        self.model_streams[model] += change
        if self.shared is not None:
            self.shared.publish(self.model_streams[model], self._column[model])

    def _end_session(self) -> None:
        self.sessions -= 1

    def _end_stream(self, model: str | None) -> None:
        self.streams -= 1
        if self.shared is not None:
            self.shared.publish(self.streams)
        if model is not None:
            self._count_model(model, -1)


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
