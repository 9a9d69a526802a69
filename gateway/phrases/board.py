"""Single flight across processes and hosts: a board in the shared store where the one generation of a key is
announced and its audio relayed as it is made.

The process that first misses a key claims its lease on the board (`FlightBoard.claim`) and becomes its leader: it
asks the engine, plays the audio to its own listeners, appends each chunk to the board (`LeaderRelay`) and renews
the lease while it generates. A process that finds the lease held follows that leader (`tail`): it reads the
leader's chunks from the first, every `POLL_S`, and plays them; it asks no engine. The leader's finished sentence
is the store's normal entry; its stream ends with a final marker and is forgotten `CHUNK_KEEP_S` later.

A leader that dies stops renewing: its lease expires after `LEASE_S` and a follower claims it and generates the
sentence itself, its listeners going on from the samples they already heard. A leader whose own listeners all left
goes on while a follower elsewhere says it listens (`FlightBoard.heard`). A board that fails (Redis down) is no
single flight across processes: the process generates alone, never a failed utterance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

LEASE_S = 3.0  # a leader that renewed nothing for this long is gone; a follower takes the sentence over
RENEW_S = 1.0  # how often a leader renews its lease
POLL_S = 0.01  # how often a follower reads the leader's new chunks
HEARD_S = 1.0  # how often a follower says it listens (the leader goes on for LEASE_S after the last)
CHUNK_KEEP_S = 60.0  # a finished or abandoned stream's chunks are kept this long for followers still reading


@dataclass(frozen=True)
class BoardView:
    """A key's lease and one leader's chunks, as read once."""

    owner: str | None  # the leader holding the lease now (None: nobody, or its lease expired)
    stream: str | None  # whose chunks these are (the owner asked for, or the lease's owner)
    chunks: list[tuple[bytes, bool]] = field(default_factory=list)  # (little-endian int16 PCM, last of sentence)
    final: bool = False  # that leader's stream is complete: its entry is stored (or it made no audio)


class FlightBoard(Protocol):
    """Leases and relayed chunks by key (the store's key digest), in a store every process of the flight reaches."""

    name: str

    async def claim(self, key: str, owner: str) -> bool:
        """Take the key's lease (free or expired) for `owner` for `LEASE_S`; False: another leader holds it."""
        ...

    async def renew(self, key: str, owner: str) -> bool:
        """Extend `owner`'s lease; whether a follower elsewhere said it listens within `LEASE_S`."""
        ...

    async def append(self, key: str, owner: str, seq: int, chunks: list[tuple[bytes, bool]]) -> None:
        """Add `owner`'s chunks numbered from `seq` (little-endian int16 PCM, last of sentence)."""
        ...

    async def finish(self, key: str, owner: str, seq: int, complete: bool) -> None:
        """End `owner`'s flight: with the final marker at `seq` (complete), or abandoned; the lease is freed."""
        ...

    async def read(self, key: str, owner: str | None, after: int) -> BoardView:
        """The lease's owner now, and the chunks of `owner`'s stream (None: the owner's) from `after` on."""
        ...

    async def heard(self, key: str) -> None:
        """A follower of the key listens."""
        ...

    async def close(self) -> None: ...


def pcm_bytes(pcm: np.ndarray) -> bytes:
    return pcm.astype("<i2", copy=False).tobytes()


def pcm_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


# (pcm, last of sentence, the sample this chunk starts at in its own generation): the flight's listeners get the
# part they have not heard yet.
PublishFrom = Callable[[np.ndarray, bool, int], None]


class LeaderRelay:
    """A leader's side: its chunks appended in order by one writer task (what queued meanwhile in one call), its
    lease renewed, its end marked. A board call that fails ends the relay (followers elsewhere see the lease
    expire); the flight goes on."""

    def __init__(self, board: FlightBoard, key: str, owner: str, on_failure: Callable[[str, BaseException], None],
                 after_renew: Callable[[], None]) -> None:
        self.board, self.key, self.owner = board, key, owner
        self._on_failure = on_failure
        self._after_renew = after_renew  # the flight ends itself there if nobody listens, here or elsewhere
        self.heard_until = 0.0  # monotonic time until which a follower elsewhere listens
        self.seq = 0
        self.failed = False
        self._queue: asyncio.Queue[tuple[bytes, bool] | None] = asyncio.Queue()
        self._writer = asyncio.create_task(self._write(), name=f"phrase-relay-{key[:8]}")
        self._renewer = asyncio.create_task(self._renew(), name=f"phrase-lease-{key[:8]}")

    def send(self, pcm: np.ndarray, last: bool) -> None:
        if not self.failed:
            self._queue.put_nowait((pcm_bytes(pcm), last))

    def heard_elsewhere(self) -> bool:
        return time.monotonic() < self.heard_until

    def _fail(self, call: str, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self._on_failure(call, exc)

    async def _write(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            chunks = [item for item in batch if item is not None]
            if chunks:
                try:
                    await self.board.append(self.key, self.owner, self.seq, chunks)
                except Exception as exc:
                    self._fail("append", exc)
                    return
                self.seq += len(chunks)
            if None in batch:
                return

    async def refresh(self) -> None:
        """Renew the lease now and learn whether a follower elsewhere listens."""
        if self.failed:
            return
        try:
            if await self.board.renew(self.key, self.owner):
                self.heard_until = time.monotonic() + LEASE_S
        except Exception as exc:
            self._fail("renew", exc)

    async def _renew(self) -> None:
        while not self.failed:
            await asyncio.sleep(RENEW_S)
            await self.refresh()
            self._after_renew()

    async def close(self, complete: bool) -> None:
        """After the last chunk (complete: the entry is stored) or when the flight is abandoned."""
        self._renewer.cancel()
        if complete:
            self._queue.put_nowait(None)
            await self._writer
        else:
            self._writer.cancel()
        await asyncio.gather(self._renewer, self._writer, return_exceptions=True)
        if self.failed:
            return
        try:
            await self.board.finish(self.key, self.owner, self.seq, complete)
        except Exception as exc:
            self._fail("finish", exc)


async def tail(board: FlightBoard, key: str, publish: PublishFrom) -> bool:
    """Follow the leader elsewhere until its stream is complete (True) or it is gone (False: its lease expired or
    was given up before the end). Board failures raise."""
    owner: str | None = None
    seq = at = 0
    heard_at = 0.0
    while True:
        view = await board.read(key, owner, seq)
        if owner is None:
            if view.stream is None:
                return False
            owner = view.stream
        for data, last in view.chunks:
            pcm = pcm_of(data)
            publish(pcm, last, at)
            at += len(pcm)
            seq += 1
        if view.final:
            return True
        if view.owner != owner and not view.chunks:
            return False
        now = time.monotonic()
        if now - heard_at >= HEARD_S:
            heard_at = now
            await board.heard(key)
        await asyncio.sleep(POLL_S)


async def release_quietly(relay: LeaderRelay | None, complete: bool, timeout_s: float = 1.0) -> None:
    if relay is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(relay.close(complete), timeout_s)
