"""The single-flight board of gateways sharing one Redis (`board.FlightBoard`): each line is made once by all of them.

Keys (beside the store's, same prefix): `<prefix>f:<digest>` the lease (its owner, SET NX PX), `<prefix>l:<digest>`
a follower listens (PX), `<prefix>s:<digest>:<owner>` a leader's chunks as a Stream with ids `<seq+1>-0` (fields
`pcm`, `last`; the final marker `final`), expiring `CHUNK_KEEP_S` after its last write. Calls share the store's
client and its timeouts: a Redis down raises, and the caller makes the line alone.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.phrases.board import CHUNK_KEEP_S, LEASE_S, BoardView

LEASE_MS = int(LEASE_S * 1000)
KEEP_MS = int(CHUNK_KEEP_S * 1000)

# KEYS: lease, listener; ARGV: owner, lease ms. Extends the owner's lease; returns whether a follower listens.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('EXISTS', KEYS[2])
"""
# KEYS: lease; ARGV: owner. Frees the lease if the owner still holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBoard:
    """Leases and relayed chunks on the Redis of `client` (the store's) under `prefix`."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def _lease(self, key: str) -> str:
        return f"{self.prefix}f:{key}"

    def _listener(self, key: str) -> str:
        return f"{self.prefix}l:{key}"

    def _stream(self, key: str, owner: str) -> str:
        return f"{self.prefix}s:{key}:{owner}"

    async def claim(self, key: str, owner: str) -> bool:
        return bool(await self.client.set(self._lease(key), owner, nx=True, px=LEASE_MS))

    async def renew(self, key: str, owner: str) -> bool:
        return bool(await self._renew(keys=[self._lease(key), self._listener(key)], args=[owner, LEASE_MS]))

    async def _add(self, key: str, owner: str, seq: int, entries: list[dict[str, bytes]]) -> None:
        stream = self._stream(key, owner)
        async with self.client.pipeline(transaction=False) as pipe:
            for n, fields in enumerate(entries):
                pipe.xadd(stream, fields, id=f"{seq + n + 1}-0")  # type: ignore[arg-type]
            pipe.pexpire(stream, KEEP_MS)
            await pipe.execute()

    async def append(self, key: str, owner: str, seq: int, chunks: list[tuple[bytes, bool]]) -> None:
        await self._add(key, owner, seq, [{"pcm": pcm, "last": b"1" if last else b"0"} for pcm, last in chunks])

    async def finish(self, key: str, owner: str, seq: int, complete: bool) -> None:
        if complete:
            await self._add(key, owner, seq, [{"final": b"1"}])
        await self._release(keys=[self._lease(key)], args=[owner])

    async def read(self, key: str, owner: str | None, after: int) -> BoardView:
        current = await self.client.get(self._lease(key))
        current = None if current is None else current.decode()
        stream = owner or current
        if stream is None:
            return BoardView(None, None)
        entries = await self.client.xrange(self._stream(key, stream), min=f"{after + 1}-0")
        chunks: list[tuple[bytes, bool]] = []
        final = False
        for _id, fields in entries:
            if b"final" in fields:
                final = True
            else:
                chunks.append((fields[b"pcm"], fields[b"last"] == b"1"))
        return BoardView(current, stream, chunks, final)

    async def heard(self, key: str) -> None:
        await self.client.set(self._listener(key), b"1", px=LEASE_MS)

    async def close(self) -> None:
        """The client is the store's; it closes it."""
