"""The phrase cache on a Redis server shared by many hosts (`--phrase-cache-url redis://...`): the same entries
and byte bound as the disk store, least-recently-used eviction done by one Lua script per put (atomic on the
server, so gateways writing at once keep the bound).

Keys: `<prefix>e:<digest>` the entry's bytes, `<prefix>lru` a sorted set of entry keys by last use, `<prefix>bytes`
the byte total. A Redis that is down or slow raises `redis.RedisError` (or OSError/TimeoutError) quickly: the cache
turns that into a miss and a metric.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

KEY_PREFIX = "orpheus:phrases:"
TIMEOUT_S = 0.5  # a Redis slower than this for one call counts as down for it (a miss, never a held utterance)

# KEYS: entry, lru, bytes; ARGV: value, now, bound. Returns the number of entries evicted.
_PUT = """
local old = redis.call('STRLEN', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
local total = redis.call('INCRBY', KEYS[3], string.len(ARGV[1]) - old)
local bound = tonumber(ARGV[3])
local evicted = 0
while total > bound do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 or oldest[1] == KEYS[1] then break end
  redis.call('ZREM', KEYS[2], oldest[1])
  total = redis.call('DECRBY', KEYS[3], redis.call('STRLEN', oldest[1]))
  redis.call('DEL', oldest[1])
  evicted = evicted + 1
end
return evicted
"""
# KEYS: entry, lru, bytes. Removes one entry and its bytes.
_DROP = """
local size = redis.call('STRLEN', KEYS[1])
if redis.call('DEL', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[3], size) end
redis.call('ZREM', KEYS[2], KEYS[1])
return size
"""


class RedisStore:
    """Entries by key on the Redis at `url`, at most `max_bytes` of them together."""

    name = "redis"

    def __init__(self, url: str, max_bytes: int, prefix: str = KEY_PREFIX) -> None:
        self.url = url
        self.max_bytes = max_bytes
        self.prefix = prefix
        # No retries: a refused or slow call is a miss now, and the next call tries again.
        self.client = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                              retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._put = self.client.register_script(_PUT)
        self._drop = self.client.register_script(_DROP)

    def _keys(self, key: str) -> list[str]:
        return [f"{self.prefix}e:{key}", f"{self.prefix}lru", f"{self.prefix}bytes"]

    async def get(self, key: str) -> bytes | None:
        entry, lru, _ = self._keys(key)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.get(entry)
            pipe.zadd(lru, {entry: time.time()}, xx=True)  # its recency, if it is there
            value, _touched = await pipe.execute()
        return value

    async def put(self, key: str, data: bytes) -> int:
        if len(data) > self.max_bytes:
            return 0
        return int(await self._put(keys=self._keys(key), args=[data, time.time(), self.max_bytes]))

    async def drop(self, key: str) -> None:
        await self._drop(keys=self._keys(key))

    async def usage(self) -> tuple[int, int]:
        _, lru, total = self._keys("")
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zcard(lru)
            pipe.get(total)
            entries, size = await pipe.execute()
        return int(entries), int(size or 0)

    async def close(self) -> None:
        await self.client.aclose()
