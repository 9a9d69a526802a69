"""The phrase cache of one gateway process: its policy, its store, single flight and prefetch.

Single flight: the first request for a key that is neither stored nor being made starts a `Flight`, a generation
owned by the cache (not by the request); that request and every later one for the key follow it, reading its
chunks from the first (`Flight.follow`). The flight ends when the last follower leaves before the audio is complete
(nobody hears it: the engine request is aborted), or with its entry stored. Across processes (the workers of a
host, the gateways of a Redis) the flight first claims the key on the store's board (`gateway.phrases.board`): the
claimant leads (generates and relays its chunks), any other process's flight follows the leader's relayed chunks.

Prefetch: sentences are made one at a time, each only while the engine has room (`PREFETCH_ROOM` of its utterance
limit, every worker's counted, is free), holding an admission slot as live speech does while it generates here; a
prefetch that follows a leader elsewhere asks no engine and holds none. Live speech goes first: a live utterance
that starts while a prefetch generates aborts the prefetch's engine request (the line is tried again later), so the
live request never shares the engine with it for longer than one `PREEMPT_CHECK_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from gateway.config import GatewayConfig
from gateway.orpheus import split_sentences
from gateway.phrases.board import FlightBoard, LeaderRelay, release_quietly, tail
from gateway.phrases.disk import DiskStore, default_folder
from gateway.phrases.entry import CorruptEntryError, PhraseEntry
from gateway.phrases.key import PhraseKey
from gateway.service.admission import Admission
from gateway.service.metrics import PhraseCacheMetrics
from gateway.speech.synthesizer import Synthesizer, UtteranceStats
from gateway.timing import VisemeTiming, WordTiming

log = logging.getLogger(__name__)

OFF, MARKED, ALL = "off", "marked", "all"
PREFETCH_ROOM = 0.5  # a prefetch starts only while at most this share of the utterance limit is in use
PREFETCH_IDLE_S = 0.05  # how often a waiting prefetch looks for room again
MAX_PREFETCH_QUEUE = 256  # sentences waiting to be prefetched per process; more are skipped
PREEMPT_CHECK_S = 0.02  # how often a running prefetch looks for live speech that started beside it
MAX_PREEMPTIONS = 3  # a prefetch aborted for live speech this often is skipped (the line is made when spoken)
MAX_CLAIMS = 8  # leaders elsewhere followed and lost for one flight before it generates without the board


class PhraseStore(Protocol):
    name: str

    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, data: bytes) -> int: ...
    async def drop(self, key: str) -> None: ...
    async def usage(self) -> tuple[int, int]: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class Timings:
    """A sentence's words and visemes as the cache stores them."""

    words: list[WordTiming]
    visemes: list[VisemeTiming]
    source: str


# (text, pcm, language) -> its timings: the sessions' timing service, so a hit carries the words a fresh line gets.
MakeTimings = Callable[[str, np.ndarray, str], Awaitable[Timings]]
LeadOf = Callable[[], float | None]
Admit = Callable[[], AbstractContextManager[object]]  # an admission slot, held while the flight generates here


class FlightAbandoned(Exception):  # noqa: N818 -- not an error to report: the flight's last listener left
    """Raised to a follower of a flight that ended without its audio."""


@dataclass(eq=False)
class Flight:
    """One key's generation and everything it has made so far; followed by every request for the key."""

    key: PhraseKey
    chunks: list[tuple[np.ndarray, bool]] = field(default_factory=list)  # (pcm, last of the sentence)
    samples: int = 0  # published so far
    stats: UtteranceStats = field(default_factory=UtteranceStats)
    entry: PhraseEntry | None = None
    error: BaseException | None = None
    done: bool = False
    followers: int = 0
    leads: list[LeadOf] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    relay: LeaderRelay | None = None  # leading on the board: followers elsewhere may hear it
    admit: Admit | None = None  # a prefetch's: its slot is taken only once the flight generates here
    generating: bool = False  # asking the engine here (holding admit's slot), not looking or following elsewhere
    tokens_taken: bool = False  # its tokens went to one request's count
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, pcm: np.ndarray, last: bool) -> None:
        self.chunks.append((pcm, last))
        self.samples += len(pcm)
        self._wake()

    def publish_from(self, pcm: np.ndarray, last: bool, at: int) -> None:
        """A chunk starting at sample `at` of its generation: only the samples past those already published (a
        leader elsewhere died mid-sentence and this flight goes on from another generation of it)."""
        skip = self.samples - at
        if skip <= 0:
            self.publish(pcm, last)
        elif skip < len(pcm) or last:
            self.publish(pcm[skip:], last)

    def heard(self) -> bool:
        """Somebody listens: a follower here, or (leading on the board) one elsewhere."""
        return self.followers > 0 or (self.relay is not None and self.relay.heard_elsewhere())

    def take_tokens(self) -> int:
        """The flight's tokens for the one request that counts them (the last follower out), 0 for any other: a
        request that joins a finished flight before it leaves the table does not count them again."""
        if self.followers or self.tokens_taken:
            return 0
        self.tokens_taken = True
        return self.stats.tokens

    def end(self, error: BaseException | None = None) -> None:
        self.done, self.error = True, error
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def lead_s(self) -> float | None:
        """The shortest playout lead among its listeners (the decoder serves the neediest); None: nobody hears it."""
        leads = [lead for read in self.leads if (lead := read()) is not None]
        return min(leads) if leads else None

    async def follow(self, lead: LeadOf | None, on_leave: Callable[[Flight], None]) -> AsyncIterator[
            tuple[np.ndarray, bool]]:
        """Every chunk from the first, as it comes; the flight's error if it failed."""
        self.followers += 1
        if lead is not None:
            self.leads.append(lead)
        try:
            sent = 0
            while True:
                while sent < len(self.chunks):
                    yield self.chunks[sent]
                    sent += 1
                if self.done:
                    if self.error is not None:
                        raise self.error
                    return
                await self._changed.wait()
        finally:
            self.followers -= 1
            if lead is not None:
                self.leads.remove(lead)
            on_leave(self)


class PhraseCache:
    """Lookups, single flights, stores and prefetches of one process; `policy` decides what may be kept."""

    def __init__(self, config: GatewayConfig, metrics: PhraseCacheMetrics, admission: Admission,
                 store: PhraseStore, make_timings: MakeTimings, board: FlightBoard | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self.store = store
        self.board = board
        self.owner = f"{socket.gethostname()}:{os.getpid()}"  # with a fresh suffix per claim
        self.make_timings = make_timings
        self.flights: dict[str, Flight] = {}
        self._prefetch: asyncio.Queue[tuple[Synthesizer, PhraseKey]] = asyncio.Queue(MAX_PREFETCH_QUEUE)
        self._prefetcher: asyncio.Task[None] | None = None
        self._prefetching = False  # the prefetcher holds a sentence (waiting for room, or making it)
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: GatewayConfig, metrics: PhraseCacheMetrics, admission: Admission,
                    make_timings: MakeTimings) -> PhraseCache | None:
        """The process's cache, or None with `--phrase-cache off`."""
        if config.phrase_cache == OFF:
            return None
        store: PhraseStore
        board: FlightBoard
        if config.phrase_cache_url:
            from gateway.phrases.redis_board import RedisBoard
            from gateway.phrases.redis_store import RedisStore

            redis = RedisStore(config.phrase_cache_url, config.phrase_cache_bytes)
            store, board = redis, RedisBoard(redis.client, redis.prefix)
        else:
            from gateway.phrases.disk_board import DiskBoard

            folder = Path(config.phrase_cache_dir) if config.phrase_cache_dir else default_folder()
            store, board = DiskStore(folder, config.phrase_cache_bytes), DiskBoard(folder)
        return cls(config, metrics, admission, store, make_timings, board)

    def applies(self, marked: bool | None) -> bool:
        """Whether a line sent with `cache: marked` (None: not said) may be kept: `cache: false` never is (a
        private line); `marked` keeps `cache: true` lines only, `all` every other line too."""
        if marked is False:
            return False
        return marked is True or self.config.phrase_cache == ALL

    def key(self, voice: str, text: str, seed: int | None = None) -> PhraseKey:
        """The key of a sentence; its timings' language is the sessions' for this voice."""
        return PhraseKey.of(self.config, voice, self.config.language_of(voice), text, seed)

    # --- lookups ------------------------------------------------------------------------------------------
    async def lookup(self, key: PhraseKey) -> PhraseEntry | None:
        """The stored entry (a hit), or None: not stored, corrupt (dropped), or the store failed (a metric)."""
        digest = key.digest
        try:
            data = await self.store.get(digest)
        except Exception as exc:  # Redis down or slow, a locked or broken database: a miss, never a failure
            self._store_failed("get", exc)
            return None
        if data is None:
            return None
        try:
            return PhraseEntry.decode(data)
        except CorruptEntryError as exc:
            log.warning("phrase cache: entry %s dropped (%s); it is made again", digest[:12], exc)
            self.metrics.corrupt_total.inc()
            with contextlib.suppress(Exception):
                await self.store.drop(digest)
            return None

    def _store_failed(self, call: str, exc: BaseException) -> None:
        self.metrics.errors_total.labels(self.store.name).inc()
        log.warning("phrase cache: %s %s failed: %s", self.store.name, call, exc)

    def _board_failed(self, call: str, exc: BaseException) -> None:  # the line is made here: misses, no failure
        self._store_failed(f"flight {call}", exc)

    async def _put(self, key: PhraseKey, entry: PhraseEntry) -> None:
        try:
            evicted = await self.store.put(key.digest, entry.encode())
            _entries, size = await self.store.usage()
        except Exception as exc:
            self._store_failed("put", exc)
            return
        self.metrics.stored_total.inc()
        self.metrics.evictions_total.inc(evicted)
        self.metrics.bytes.set(size)

    # --- single flight ------------------------------------------------------------------------------------
    def flight(self, key: PhraseKey, synthesizer: Synthesizer, admit: Admit | None = None) -> Flight:
        """The running flight of `key` (joined: a metric), or a new one started (taking `admit`'s slot while it
        generates here, not while it follows a leader elsewhere)."""
        digest = key.digest
        flight = self.flights.get(digest)
        if flight is not None:
            self.metrics.joins_total.inc()
            return flight
        flight = self.flights[digest] = Flight(key, admit=admit)
        flight.stats.playout_lead_s = flight.lead_s
        flight.task = asyncio.create_task(self._generate(flight, synthesizer), name=f"phrase-{digest[:8]}")
        return flight

    async def _generate(self, flight: Flight, synthesizer: Synthesizer) -> None:
        """The flight's task: its audio from a leader elsewhere, or made here (and relayed while leading)."""
        key = flight.key
        abandoned = True
        try:
            if not await self._from_board(flight):
                with flight.admit() if flight.admit is not None else contextlib.nullcontext():
                    flight.generating = True
                    await self._make(flight, synthesizer)
            abandoned = False
        except asyncio.CancelledError:
            flight.end(FlightAbandoned("every listener of this sentence left"))
            raise
        except Exception as exc:
            flight.end(exc)
        finally:
            if self.flights.get(key.digest) is flight:
                del self.flights[key.digest]
            if abandoned:  # followers elsewhere see the lease freed and make the line themselves
                await release_quietly(flight.relay, complete=False)

    async def _from_board(self, flight: Flight) -> bool:
        """Claim the key on the board, or follow the leader that holds it. True: the flight ended with the audio
        of a leader elsewhere (or the entry it stored meanwhile); False: make it here (leading on the board, or
        alone where the board failed)."""
        board, digest = self.board, flight.key.digest
        if board is None:
            return False
        for _attempt in range(MAX_CLAIMS):
            owner = f"{self.owner}:{uuid.uuid4().hex[:12]}"
            try:
                if await board.claim(digest, owner):
                    flight.relay = LeaderRelay(board, digest, owner, self._board_failed,
                                               lambda: self._end_unheard(flight))
                    entry = await self.lookup(flight.key)  # a leader that finished just before the claim
                    if entry is None:
                        return False
                    flight.publish_from(entry.pcm, True, 0)
                    flight.relay.send(entry.pcm, True)  # for any follower that came meanwhile
                    flight.entry = entry
                    flight.end()
                    await flight.relay.close(complete=True)
                    return True
                self.metrics.joins_total.inc()
                if await tail(board, digest, flight.publish_from):
                    flight.end()
                    return True
                log.info("phrase cache: the leader of %s is gone; this process takes it over", digest[:12])
            except Exception as exc:
                self._board_failed("claim", exc)
                return False
        return False

    async def _make(self, flight: Flight, synthesizer: Synthesizer) -> None:
        key, relay = flight.key, flight.relay
        seed = None if key.seed_policy == "random" else int(key.seed_policy.split(":", 1)[1])
        pcm: list[np.ndarray] = []
        at = 0
        async with contextlib.aclosing(synthesizer.utterance([key.text], key.voice, seed=seed,
                                                             stats=flight.stats)) as chunks:
            async for chunk in chunks:
                pcm.append(chunk.pcm)
                flight.publish_from(chunk.pcm, chunk.last_of_sentence, at)
                at += len(chunk.pcm)
                if relay is not None:
                    relay.send(chunk.pcm, chunk.last_of_sentence)
        audio = np.concatenate(pcm) if pcm else np.zeros(0, np.int16)
        timings = await self.make_timings(key.text, audio, key.language)
        flight.entry = PhraseEntry(audio, timings.words, timings.visemes, timings.source)
        flight.end()
        if len(audio):
            await self._put(key, flight.entry)
        if relay is not None:
            await relay.close(complete=True)  # after the put: a follower that finds the stream final finds the entry

    def _left(self, flight: Flight) -> None:
        """A follower left: an unfinished flight nobody hears, here or elsewhere, ends (the engine request is
        aborted). A leader on the board asks it first whether a follower elsewhere listens."""
        if flight.heard() or flight.done or flight.task is None:
            return
        if flight.relay is not None and not flight.relay.failed:
            task = asyncio.create_task(self._leave_unless_heard(flight))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        flight.task.cancel()

    async def _leave_unless_heard(self, flight: Flight) -> None:
        assert flight.relay is not None
        await flight.relay.refresh()
        self._end_unheard(flight)

    def _end_unheard(self, flight: Flight) -> None:
        if not flight.heard() and not flight.done and flight.task is not None:
            flight.task.cancel()

    async def follow(self, flight: Flight, lead: LeadOf | None) -> AsyncIterator[tuple[np.ndarray, bool]]:
        async for item in flight.follow(lead, self._left):
            yield item

    # --- prefetch -----------------------------------------------------------------------------------------
    async def prefetch(self, synthesizer: Synthesizer, texts: Iterable[str], voice: str) -> list[bool]:
        """Whether each text's sentences are all stored now; the missing ones are queued to be made while the
        engine has room."""
        ready: list[bool] = []
        for text in texts:
            all_there = True
            for sentence in split_sentences(text, self.config.max_sentence_chars):
                key = self.key(voice, sentence)
                if key.digest in self.flights or await self.lookup(key) is not None:
                    all_there = all_there and key.digest not in self.flights
                    continue
                all_there = False
                try:
                    self._prefetch.put_nowait((synthesizer, key))
                except asyncio.QueueFull:
                    self.metrics.prefetches_total.labels("skipped").inc()
            ready.append(all_there)
            if all_there:
                self.metrics.prefetches_total.labels("ready").inc()
        if self._prefetcher is None or self._prefetcher.done():
            self._prefetcher = asyncio.create_task(self._prefetch_loop(), name="phrase-prefetch")
        return ready

    def has_room(self) -> bool:
        return self.admission.streams_in_use < max(1, int(self.admission.max_streams * PREFETCH_ROOM))

    async def _prefetch_loop(self) -> None:
        while True:
            synthesizer, key = await self._prefetch.get()
            self._prefetching = True
            try:
                await self._prefetch_one(synthesizer, key)
            finally:
                self._prefetching = False

    async def _prefetch_one(self, synthesizer: Synthesizer, key: PhraseKey) -> None:
        """Make one sentence while the engine has room; a live utterance that starts meanwhile goes first: the
        prefetch's engine request is aborted (unless a live request follows it too) and tried again later. Its
        admission slot is taken when its flight generates here (engine full: skipped), never while it follows a
        leader elsewhere."""
        floor = self.admission.max_streams  # after a preemption: wait until the live speech that caused it ended
        for _attempt in range(MAX_PREEMPTIONS + 1):
            # Polled: the other workers' utterances are counts in a shared file, which signals nothing.
            while not self.has_room() or self.admission.streams_in_use > floor:  # noqa: ASYNC110
                await asyncio.sleep(PREFETCH_IDLE_S)
            if key.digest in self.flights or await self.lookup(key) is not None:
                return
            flight = self.flight(key, synthesizer, admit=functools.partial(self.admission.admit_stream, key.voice))
            drain = asyncio.create_task(self._drain(flight))
            beside = await self._yield_to_live(flight, drain)
            if beside is not None:
                self.metrics.prefetches_total.labels("preempted").inc()
                floor = beside
                continue
            self.metrics.prefetches_total.labels("generated" if flight.entry is not None else "skipped").inc()
            return
        self.metrics.prefetches_total.labels("skipped").inc()

    async def _drain(self, flight: Flight) -> None:
        """A prefetch follows its flight to the end; leaving last, it counts the flight's tokens."""
        try:
            with contextlib.suppress(Exception):
                async for _chunk in self.follow(flight, None):
                    pass
        finally:
            self.metrics.prefetch_tokens_total.inc(flight.take_tokens())

    async def _yield_to_live(self, flight: Flight, drain: asyncio.Task[None]) -> int | None:
        """Follow a prefetch's flight to its end (None), or end it when live speech starts while it generates here
        (the utterances that ran beside it when it started, which its next try waits for). A flight that follows a
        leader elsewhere asks no engine: nothing to yield."""
        assert flight.task is not None
        beside = self.admission.streams_in_use + 1  # this prefetch (its slot once it generates) and what ran beside
        while not flight.task.done():
            in_use = self.admission.streams_in_use
            if not flight.generating:  # no slot yet: a live utterance that starts meanwhile goes first all the same
                beside = min(beside, in_use + 1)
            elif in_use > beside and flight.followers <= 1:  # a live utterance started; none follows this line
                drain.cancel()  # its last follower leaving aborts the engine request
                await asyncio.wait([drain, flight.task])
                return beside - 1
            else:
                beside = min(beside, in_use)
            await asyncio.wait([flight.task], timeout=PREEMPT_CHECK_S)
        await asyncio.wait([drain])
        return None

    async def prefetch_idle(self) -> None:
        """Wait until every queued prefetch is made (tests, benchmarks)."""
        while not self._prefetch.empty() or self._prefetching or self.flights:  # noqa: ASYNC110
            await asyncio.sleep(PREFETCH_IDLE_S)

    async def close(self) -> None:
        tasks = [t for t in (self._prefetcher, *(f.task for f in self.flights.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.board is not None:
            await self.board.close()
        await self.store.close()

