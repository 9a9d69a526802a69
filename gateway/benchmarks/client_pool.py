"""Headless client peers in their own processes, so the WebRTC level measures the server, not its clients.

One Python event loop cannot both serve hundreds of peers (Opus encoding, SRTP, pacing) and play hundreds of
clients (SRTP, Opus decoding, jitter buffers): the clients would starve the server and the numbers would
describe the benchmark, not the gateway. With `--client-processes K`, K spawned processes each hold a slice of
the users for the whole run. Per point: every process connects its peers, the parent picks one start time
(CLOCK_MONOTONIC is system-wide on Linux, so arrival times stay comparable), every user speaks, and the
records come back through a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from gateway.benchmarks import webrtc_level
from gateway.benchmarks.records import PlannedRequest, RequestRecord
from gateway.benchmarks.settings import BenchOptions
from gateway.media.avthreads import use_one_ffmpeg_thread

START_MARGIN_S = 0.05  # the start time lies this far ahead, so every process gets the message first
CHILD_EXIT_TIMEOUT_S = 10.0


def spawn_children(target: Callable[[Connection], None], count: int, name: str
                   ) -> tuple[list[Connection], list[Any]]:
    """`count` spawned processes running `target(pipe end)`: the parent's pipe ends and the processes."""
    context = multiprocessing.get_context("spawn")
    conns: list[Connection] = []
    procs: list[Any] = []
    for index in range(count):
        parent, child = context.Pipe()
        proc = context.Process(target=_child_start, args=(target, child), name=f"{name}-{index}", daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    return conns, procs


def _child_start(target: Callable[[Connection], None], conn: Connection) -> None:
    """A spawned client process: FFmpeg in its callers' threads, as in the gateway's processes, then `target`."""
    use_one_ffmpeg_thread()
    target(conn)


def stop_children(conns: Sequence[Connection], procs: Sequence[Any]) -> None:
    """Ask each child to exit ("exit" message), then kill what is still running after CHILD_EXIT_TIMEOUT_S."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("exit",))
    for proc in procs:
        proc.join(CHILD_EXIT_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


class ClientPool:
    """K long-lived client processes (spawned: the parent holds CUDA and vLLM threads, which must not fork)."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError("a client pool needs at least one process")
        self.size = processes
        self._conns: list[Connection] = []
        self._procs: list[Any] = []

    async def __aenter__(self) -> ClientPool:
        self._conns, self._procs = spawn_children(_child_main, self.size, "bench-clients")
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(stop_children, self._conns, self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    async def run_point(self, base_url: str, workload: Sequence[Sequence[PlannedRequest]], options: BenchOptions
                        ) -> list[RequestRecord]:
        """Users are dealt round-robin to the processes; all of them start speaking at the same moment."""
        slices = [list(workload[i::self.size]) for i in range(self.size)]
        busy = [(conn, part) for conn, part in zip(self._conns, slices, strict=True) if part]  # the first ones
        started = time.monotonic()
        for conn, part in busy:
            conn.send(("connect", base_url, part, options))
        connected = await asyncio.gather(*(_expect(conn, "connected") for conn, _ in busy))
        failed = sum(reply[1] for reply in connected)
        # Before the users speak: a point whose peers cannot connect says so here, not at the device call's end.
        print(f"[bench] {len(workload) - failed} of {len(workload)} peers connected in "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        await asyncio.sleep(webrtc_level.SETTLE_S)
        origin = time.monotonic() + START_MARGIN_S
        for conn, _ in busy:
            conn.send(("go", origin))
        replies = await asyncio.gather(*(_expect(conn, "records") for conn, _ in busy))
        records = []
        for process, reply in enumerate(replies):  # only trailing slices are empty: process k has users k::size
            for record in reply[1]:
                record.client_process = process
                records.append(record)
        return records


async def _expect(conn: Connection, kind: str) -> tuple[Any, ...]:
    reply = await asyncio.to_thread(conn.recv)
    if reply[0] == "failed":
        raise RuntimeError(f"client process failed: {reply[1]}")
    if reply[0] != kind:
        raise RuntimeError(f"client process answered {reply[0]!r}, expected {kind!r}")
    return reply


def _child_main(conn: Connection) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(_child_loop(conn))


async def _child_loop(conn: Connection) -> None:
    while True:
        message = await asyncio.to_thread(conn.recv)
        if message[0] == "exit":
            return
        _, base_url, workload, options = message
        try:
            peers = await webrtc_level.connect_all(base_url, len(workload), options.connect_concurrency,
                                                   options.listener_buffer_ms)
        except Exception as exc:  # report, don't leave the parent waiting
            conn.send(("failed", f"connect: {type(exc).__name__}: {exc}"))
            continue
        try:
            conn.send(("connected", sum(1 for p in peers if isinstance(p, BaseException))))
            go = await asyncio.to_thread(conn.recv)
            await asyncio.sleep(max(0.0, go[1] - time.monotonic()))
            records = await webrtc_level.speak_all(peers, workload, options, go[1])
        except Exception as exc:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            continue
        finally:
            await webrtc_level.close_all(base_url, peers)
        conn.send(("records", records))
