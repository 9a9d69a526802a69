"""The phrase cache on a host's disk: one SQLite database in WAL mode, shared by every gateway process of the host
(`serve --workers`), bounded in bytes with least-recently-used eviction.

Readers never wait for writers (WAL); writers take the database's one write lock for a put and its evictions
(`BEGIN IMMEDIATE`), so the bound holds across processes. The byte total is kept by triggers beside the rows, so a
put costs no scan. Every call runs in this store's one thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

DATABASE_NAME = "phrases.sqlite3"
BUSY_TIMEOUT_S = 5.0  # how long a writer waits for another process's write lock
EVICT_BATCH = 16  # least recently used rows looked at per eviction step
# A hit's recency is written at most this often per entry: a hot line read by every session costs no write each.
TOUCH_INTERVAL_S = 10.0

T = TypeVar("T")
MAX_TOUCHED_KEYS = 4096  # recency write times remembered (then forgotten together)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS phrases (key TEXT PRIMARY KEY, value BLOB NOT NULL, bytes INTEGER NOT NULL,
                                    used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS phrases_used ON phrases (used);
CREATE TABLE IF NOT EXISTS totals (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER NOT NULL,
                                   entries INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS phrases_added AFTER INSERT ON phrases BEGIN
    UPDATE totals SET bytes = bytes + NEW.bytes, entries = entries + 1 WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS phrases_removed AFTER DELETE ON phrases BEGIN
    UPDATE totals SET bytes = bytes - OLD.bytes, entries = entries - 1 WHERE id = 0; END;
"""


def default_folder() -> Path:
    """$XDG_CACHE_HOME/orpheus-gateway/phrases (~/.cache/... without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orpheus-gateway" / "phrases"


class DiskStore:
    """Entries by key in `folder`/phrases.sqlite3, at most `max_bytes` of them together."""

    name = "disk"

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.path = folder / DATABASE_NAME
        self.max_bytes = max_bytes
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="phrase-disk")
        self._db: sqlite3.Connection | None = None
        self._touched: dict[str, float] = {}

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a crash may lose the last puts, never corrupt the file
            db.executescript(_SCHEMA)  # idempotent: every process of the host runs it
            self._db = db
        return self._db

    async def _run(self, work: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    # --- the store's calls (each in its thread) --------------------------------------------------------
    async def get(self, key: str) -> bytes | None:
        return await self._run(self._get, key)

    async def put(self, key: str, data: bytes) -> int:
        """Store `data` under `key`; returns how many entries were evicted for it (one larger than the whole
        bound is not stored)."""
        return await self._run(self._put, key, data)

    async def drop(self, key: str) -> None:
        await self._run(self._drop, key)

    async def usage(self) -> tuple[int, int]:
        """(entries, bytes) stored."""
        return await self._run(self._usage)

    async def close(self) -> None:
        await self._run(self._close)
        self._thread.shutdown(wait=True)

    # --- in the thread --------------------------------------------------------------------------------
    def _get(self, key: str) -> bytes | None:
        db = self._connect()
        row = db.execute("SELECT value FROM phrases WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        now = time.time()
        if now - self._touched.get(key, 0.0) >= TOUCH_INTERVAL_S:
            self._touched[key] = now
            if len(self._touched) > MAX_TOUCHED_KEYS:
                self._touched.clear()
            db.execute("UPDATE phrases SET used = ? WHERE key = ?", (now, key))
        return bytes(row[0])

    def _put(self, key: str, data: bytes) -> int:
        if len(data) > self.max_bytes:
            return 0
        db = self._connect()
        evicted = 0
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM phrases WHERE key = ?", (key,))
            db.execute("INSERT INTO phrases VALUES (?, ?, ?, ?)", (key, data, len(data), time.time()))
            while (total := db.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()[0]) > self.max_bytes:
                oldest = db.execute("SELECT key, bytes FROM phrases WHERE key != ? ORDER BY used LIMIT ?",
                                    (key, EVICT_BATCH)).fetchall()
                if not oldest:
                    break
                for old_key, size in oldest:
                    db.execute("DELETE FROM phrases WHERE key = ?", (old_key,))
                    evicted += 1
                    total -= size
                    if total <= self.max_bytes:
                        break
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return evicted

    def _drop(self, key: str) -> None:
        self._connect().execute("DELETE FROM phrases WHERE key = ?", (key,))

    def _usage(self) -> tuple[int, int]:
        entries, total = self._connect().execute("SELECT entries, bytes FROM totals WHERE id = 0").fetchone()
        return int(entries), int(total)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
