"""A bounded soak: waves of WebRTC sessions opened and closed over loopback, with utterances, cancels, bad
messages, pings and vanished peers, then a check that everything returns to its baseline: asyncio tasks,
file descriptors, engine requests, admission counts and memory.

Its size comes from the environment, so a long soak is the same test:
    ORPHEUS_SOAK_SESSIONS=400 ORPHEUS_SOAK_WAVE=20 python -m pytest tests/test_soak.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import os
import random
import time
from dataclasses import dataclass

import aiohttp
import psutil
import pytest

from gateway.config import GatewayConfig
from gateway.devtools.client import Endings, HeadlessPeer
from gateway.edge.state import GatewayState
from gateway.speech.synthesizer import Synthesizer
from tests.support import EVENT_TIMEOUT_S, fd_count, running, vanish, wait_until

pytestmark = pytest.mark.engine

SOAK_SESSIONS = int(os.environ.get("ORPHEUS_SOAK_SESSIONS", "60"))
SOAK_WAVE = int(os.environ.get("ORPHEUS_SOAK_WAVE", "10"))  # sessions open at once
SOAK_SEED = int(os.environ.get("ORPHEUS_SOAK_SEED", "6"))
HEARTBEAT_S = 2.0  # vanished peers are reaped by the heartbeat
SETTLE_TIMEOUT_S = 60.0
ENDING_GRACE_S = 0.5
# Slack over the baseline once everything is closed: aiortc and aiohttp keep a few pooled objects.
TASK_SLACK = 5
FD_SLACK = 10
RSS_SLACK_MB = 100.0
RSS_PER_SESSION_MB = 0.5  # a leak of more than this per session fails even a long soak
MB = 1024 * 1024

# What one soak session does (chosen per session by a seeded random draw, weights in parentheses):
# listen to a whole short utterance (1), cancel one right after `queued` (3), barge in with `interrupt` then
# cancel (2), send bad messages and ping (2), vanish without closing after a ping (1).
BEHAVIOURS = {"listen": 1, "cancel": 3, "interrupt": 2, "garbage": 2, "vanish": 1}


@dataclass
class Snapshot:
    tasks: int
    fds: int
    rss_mb: float

    @classmethod
    def take(cls) -> Snapshot:
        _release_free_memory()
        return cls(len(asyncio.all_tasks()), fd_count(), psutil.Process().memory_info().rss / MB)


def _release_free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS, so RSS measures live memory.

    Without the trim, RSS keeps the allocator's high-water mark: SNAC decoding on CPU alone took ~1 GB more
    for a batch of 25 three-frame windows than for 1, and glibc keeps it after the batch is gone (measured).
    """
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):  # glibc only
            libc.malloc_trim(0)


async def _one_session(base: str, index: int, behaviour: str, audits: dict[str, Endings]) -> None:
    peer = HeadlessPeer(base, jitter_buffer_ms=0)
    uid = f"u{index}"
    spoken = {"listen": [uid], "cancel": [uid], "interrupt": [f"{uid}a", f"{uid}b"]}.get(behaviour, [])
    try:
        await peer.connect(timeout=EVENT_TIMEOUT_S)
        if behaviour == "listen":
            peer.speak(uid, "Hi.")
            await peer.wait_event("done", uid, timeout=EVENT_TIMEOUT_S)
        elif behaviour == "cancel":
            peer.speak(uid, "This will be cancelled at once. It has two sentences.")
            await peer.wait_event("queued", uid, timeout=EVENT_TIMEOUT_S)
            peer.cancel(uid)
            await peer.wait_event("cancelled", uid, timeout=EVENT_TIMEOUT_S)
        elif behaviour == "interrupt":
            peer.speak(f"{uid}a", "First thought.", more=True)
            peer.speak(f"{uid}b", "Second thought replaces it.", interrupt=True)
            await peer.wait_event("cancelled", f"{uid}a", timeout=EVENT_TIMEOUT_S)
            peer.cancel()
            await wait_until(lambda: peer.find("cancelled", f"{uid}b") or peer.find("done", f"{uid}b"),
                             timeout=EVENT_TIMEOUT_S)
        elif behaviour == "garbage":
            for raw in ("not json", "[]", '{"type": "dance"}', b"\x00binary"):
                peer.send(raw)
            peer.send({"type": "ping", "t": index})
            await peer.wait_event("pong", timeout=EVENT_TIMEOUT_S)
        elif behaviour == "vanish":
            peer.send({"type": "ping"})  # arms the heartbeat
            await peer.wait_event("pong", timeout=EVENT_TIMEOUT_S)
            vanish(peer)
            return  # closed below, locally only: the server must notice by itself
        await asyncio.sleep(ENDING_GRACE_S)  # a second ending, were one sent, arrives meanwhile
        audits.update({spoken_id: peer.endings(spoken_id) for spoken_id in spoken})
        assert not peer.protocol_violations, peer.protocol_violations
        if index % 2:  # half end with DELETE, half just close the peer
            async with aiohttp.ClientSession() as http:
                await http.delete(f"{base}/v1/webrtc/sessions/{peer.session_id}")
    finally:
        await peer.close()


async def _wave(base: str, first: int, count: int, rng: random.Random, audits: dict[str, Endings]
                ) -> list[BaseException]:
    names, weights = list(BEHAVIOURS), list(BEHAVIOURS.values())
    plan = [(first + i, rng.choices(names, weights)[0]) for i in range(count)]
    results = await asyncio.gather(*(_one_session(base, i, b, audits) for i, b in plan), return_exceptions=True)
    return [r for r in results if isinstance(r, BaseException)]


def _settled(gateway: GatewayState) -> bool:
    engine = gateway.synthesizer.engine
    return (not gateway.sessions.sessions and gateway.admission.sessions == 0 and gateway.admission.streams == 0
            and engine.in_flight == 0 and engine.unfinished_requests() == 0)


async def test_soak_returns_to_baseline(test_config: GatewayConfig, synthesizer: Synthesizer) -> None:
    rng = random.Random(SOAK_SEED)
    config = dataclasses.replace(test_config, heartbeat_timeout_s=HEARTBEAT_S, max_messages_per_second=0.0)
    async with running(config, synthesizer) as (base, gateway):
        # Warm-up wave: first use allocates codecs, pools and caches that are not leaks.
        warmup = min(SOAK_WAVE, SOAK_SESSIONS)
        audits: dict[str, Endings] = {}
        failures = await _wave(base, 0, warmup, rng, audits)
        await wait_until(lambda: _settled(gateway), timeout=SETTLE_TIMEOUT_S)
        await asyncio.sleep(1.0)
        baseline = Snapshot.take()
        started = time.monotonic()
        done = warmup
        while done < SOAK_SESSIONS:
            count = min(SOAK_WAVE, SOAK_SESSIONS - done)
            failures += await _wave(base, done, count, rng, audits)
            done += count
            print(f"soak: {done}/{SOAK_SESSIONS} sessions, {time.monotonic() - started:.0f} s, "
                  f"RSS {Snapshot.take().rss_mb:.0f} MB, fds {fd_count()}")  # shown with -s: the trend of a long soak
        await wait_until(lambda: _settled(gateway), timeout=SETTLE_TIMEOUT_S)
        with contextlib.suppress(AssertionError):  # a few aiortc timers end shortly after the close
            await wait_until(lambda: len(asyncio.all_tasks()) <= baseline.tasks, timeout=SETTLE_TIMEOUT_S / 4)
        final = Snapshot.take()
        elapsed = time.monotonic() - started
        rss_limit = RSS_SLACK_MB + RSS_PER_SESSION_MB * SOAK_SESSIONS
        print(f"\nsoak: {SOAK_SESSIONS} sessions in waves of {SOAK_WAVE}, {elapsed:.0f} s after warm-up; "
              f"tasks {baseline.tasks}->{final.tasks}, fds {baseline.fds}->{final.fds}, "
              f"RSS {baseline.rss_mb:.0f}->{final.rss_mb:.0f} MB (limit +{rss_limit:.0f}); "
              f"failed sessions {len(failures)}: {[repr(f) for f in failures[:3]]}")
        assert not failures, f"{len(failures)} sessions failed, e.g. {failures[0]!r}"
        # Exactly-once endings: every accepted speak ended with one terminal event, in order, nothing after it.
        broken = {uid: endings for uid, endings in audits.items() if not endings.exactly_once}
        print(f"soak: endings audited for {len(audits)} utterances, {len(broken)} not exactly once")
        assert audits and not broken, broken
        assert final.tasks <= baseline.tasks + TASK_SLACK
        assert final.fds <= baseline.fds + FD_SLACK
        assert final.rss_mb <= baseline.rss_mb + rss_limit
