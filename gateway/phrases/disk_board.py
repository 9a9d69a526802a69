"""The single-flight board of one host (`board.FlightBoard`) in the disk store's SQLite file: the `serve --workers`
processes of the host (and any gateway sharing its `--phrase-cache-dir`) make each line once.

`flights` holds a key's lease (owner, expiry, when a follower last said it listens); `flight_chunks` a leader's
chunks by (key, owner, seq), its final marker a row with `final` set. A claim is one `BEGIN IMMEDIATE`
transaction (INSERT where the key has no live lease); followers read in WAL mode, never waiting for writers.
Every call runs in this board's one thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gateway.phrases.board import CHUNK_KEEP_S, LEASE_S, BoardView
from gateway.phrases.disk import BUSY_TIMEOUT_S, DATABASE_NAME

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS flights (key TEXT PRIMARY KEY, owner TEXT NOT NULL, expires REAL NOT NULL,
                                    heard REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS flight_chunks (key TEXT NOT NULL, owner TEXT NOT NULL, seq INTEGER NOT NULL,
                                          pcm BLOB NOT NULL, last INTEGER NOT NULL, final INTEGER NOT NULL,
                                          at REAL NOT NULL, PRIMARY KEY (key, owner, seq));
CREATE INDEX IF NOT EXISTS flight_chunks_at ON flight_chunks (at);
"""


class DiskBoard:
    """Leases and relayed chunks in `folder`/phrases.sqlite3 (beside the disk store's entries)."""

    name = "disk"

    def __init__(self, folder: Path) -> None:
        self.path = folder / DATABASE_NAME
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="phrase-board")
        self._db: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    async def _run(self, work: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    async def claim(self, key: str, owner: str) -> bool:
        return await self._run(self._claim, key, owner)

    async def renew(self, key: str, owner: str) -> bool:
        return await self._run(self._renew, key, owner)

    async def append(self, key: str, owner: str, seq: int, chunks: list[tuple[bytes, bool]]) -> None:
        rows = [(key, owner, seq + n, pcm, int(last), 0) for n, (pcm, last) in enumerate(chunks)]
        await self._run(self._insert, rows)

    async def finish(self, key: str, owner: str, seq: int, complete: bool) -> None:
        await self._run(self._finish, key, owner, seq, complete)

    async def read(self, key: str, owner: str | None, after: int) -> BoardView:
        return await self._run(self._read, key, owner, after)

    async def heard(self, key: str) -> None:
        await self._run(self._heard, key)

    async def close(self) -> None:
        await self._run(self._close)
        self._thread.shutdown(wait=True)

    # --- in the thread --------------------------------------------------------------------------------
    def _claim(self, key: str, owner: str) -> bool:
        db = self._connect()
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            taken = db.execute("SELECT 1 FROM flights WHERE key = ? AND expires > ?", (key, now)).fetchone()
            if taken is None:
                db.execute("INSERT OR REPLACE INTO flights VALUES (?, ?, ?, 0)", (key, owner, now + LEASE_S))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return taken is None

    def _renew(self, key: str, owner: str) -> bool:
        db = self._connect()
        now = time.time()
        db.execute("UPDATE flights SET expires = ? WHERE key = ? AND owner = ?", (now + LEASE_S, key, owner))
        row = db.execute("SELECT heard FROM flights WHERE key = ? AND owner = ?", (key, owner)).fetchone()
        return row is not None and row[0] > now - LEASE_S

    def _insert(self, rows: list[tuple[str, str, int, bytes, int, int]]) -> None:
        db = self._connect()
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("INSERT OR REPLACE INTO flight_chunks VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [(*row, now) for row in rows])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _finish(self, key: str, owner: str, seq: int, complete: bool) -> None:
        if complete:
            self._insert([(key, owner, seq, b"", 0, 1)])
        db = self._connect()
        db.execute("DELETE FROM flights WHERE key = ? AND owner = ?", (key, owner))
        # Streams with no live lease, older than the keep time: finished, abandoned, or their leader died.
        db.execute("DELETE FROM flight_chunks WHERE at < ? AND NOT EXISTS (SELECT 1 FROM flights f WHERE "
                   "f.key = flight_chunks.key AND f.owner = flight_chunks.owner AND f.expires > ?)",
                   (time.time() - CHUNK_KEEP_S, time.time()))

    def _read(self, key: str, owner: str | None, after: int) -> BoardView:
        db = self._connect()
        row = db.execute("SELECT owner FROM flights WHERE key = ? AND expires > ?", (key, time.time())).fetchone()
        current = None if row is None else str(row[0])
        stream = owner or current
        if stream is None:
            return BoardView(None, None)
        rows = db.execute("SELECT pcm, last, final FROM flight_chunks WHERE key = ? AND owner = ? AND seq >= ? "
                          "ORDER BY seq", (key, stream, after)).fetchall()
        chunks = [(bytes(pcm), bool(last)) for pcm, last, final in rows if not final]
        return BoardView(current, stream, chunks, final=any(final for _pcm, _last, final in rows))

    def _heard(self, key: str) -> None:
        self._connect().execute("UPDATE flights SET heard = ? WHERE key = ?", (time.time(), key))

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
