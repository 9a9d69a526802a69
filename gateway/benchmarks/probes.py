"""Where the time goes during a measurement point: engine process, SNAC worker, event loop.

CPU time is read per thread of this process (the event loop thread runs asyncio, aiortc and vLLM's output
handling; the SNAC decoder's thread, `stream_decoder.THREAD_NAME`, runs SNAC; the rest are torch/OpenMP and library
threads), per child process (vLLM's engine core, the bench's client processes), and for the whole machine (busy
cores: with a gateway running elsewhere on the same host, everything the point cost). An event-loop lag monitor
shows how late the loop wakes up, which is what delays every stream's chunks at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import psutil

from gateway.benchmarks.gateway_procs import GatewaySnapshot, GatewayWatch, cpu_by_kind, loop_lag_summary
from gateway.benchmarks.records import MS, first_audio_starts
from gateway.benchmarks.timing import describe
from gateway.service.loop_lag import LoopLagMonitor
from gateway.speech.stream_decoder import THREAD_NAME, DecodeStats

LAG_INTERVAL_S = 0.01  # how often the lag monitor wakes up


@dataclass(frozen=True)
class CpuSnapshot:
    at: float
    loop_thread_s: float
    snac_thread_s: float
    other_threads_s: float
    children_s: dict[int, float]  # engine processes (and their children)
    clients_s: dict[int, float]  # benchmark client processes: not the gateway's CPU
    snac_batches: int
    snac_windows: int  # stream-steps
    snac_frames: int  # new audio frames
    snac_window_frames: int  # frames run through SNAC
    snac_busy_s: float
    snac_held_steps: int  # steps taken when the hold ran out, no stream due
    snac_tick_ms: list[int]  # the decoder's ticks by whole milliseconds so far (DecodeStats.tick_ms)
    snac_bridge_frames: int  # frames run through the bridge's approximate decodes (StreamingSnac.stats)
    snac_bridge_s: float  # the decoder's time in bridge decodes
    snac_wakeups: int  # times the decoder's worker took commands from the event loop
    snac_exact_starts: int  # sentences whose first audio came from the exact stream, no bridge
    snac_first_audios: int  # sentences whose first audio went out (DecodeStats.first_audios)
    snac_start_hold_s: float  # summed over them: from the head ready to the first audio
    snac_paced_starts: int  # those planned at a pace read
    snac_start_pace_s: float  # summed over those: the seconds per frame read
    host_busy_s: float  # every core of the machine, all processes (the gateway's, vLLM's, the clients')


def _thread_ids() -> tuple[int | None, int | None]:
    loop_id = threading.current_thread().native_id
    snac_id = next((t.native_id for t in threading.enumerate() if t.name == THREAD_NAME), None)
    return loop_id, snac_id


def cpu_snapshot(decoder: Any, client_pids: Collection[int] = (), gateway_pids: Collection[int] = ()) -> CpuSnapshot:
    """CPU seconds so far by thread group and child process, and the SNAC worker's counters. `gateway_pids`: a
    gateway this process started (tests), counted by `GatewayWatch` instead of as engine processes."""
    proc = psutil.Process()
    loop_id, snac_id = _thread_ids()
    by_thread = {t.id: t.user_time + t.system_time for t in proc.threads()}
    loop_s = by_thread.pop(loop_id, 0.0) if loop_id is not None else 0.0
    snac_s = by_thread.pop(snac_id, 0.0) if snac_id is not None else 0.0
    children: dict[int, float] = {}
    clients: dict[int, float] = {}
    for child in proc.children(recursive=True):
        if child.pid in gateway_pids:
            continue
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            (clients if child.pid in client_pids else children)[child.pid] = times.user + times.system
    stats = decoder.stats if decoder is not None else DecodeStats()  # None: the gateway runs elsewhere
    host = psutil.cpu_times()
    return CpuSnapshot(time.monotonic(), loop_s, snac_s, sum(by_thread.values()), children, clients,
                       stats.batches, stats.windows, stats.frames, stats.window_frames, stats.busy_s,
                       stats.held_steps, list(stats.tick_ms),
                       decoder.snac.stats.approx_frames if decoder is not None else 0, stats.bridge_s, stats.wakeups,
                       stats.exact_starts, stats.first_audios, stats.start_hold_s, stats.paced_starts,
                       stats.start_pace_s, host_busy_s=sum(host) - host.idle - getattr(host, "iowait", 0.0))


def cpu_delta(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, Any]:
    """CPU seconds spent between two snapshots, and the SNAC worker's batching over that time."""
    wall = after.at - before.at
    children = sum(after.children_s[pid] - before.children_s.get(pid, 0.0) for pid in after.children_s)
    clients = sum(after.clients_s[pid] - before.clients_s.get(pid, 0.0) for pid in after.clients_s)
    batches = after.snac_batches - before.snac_batches
    windows = after.snac_windows - before.snac_windows
    frames = after.snac_frames - before.snac_frames
    window_frames = after.snac_window_frames - before.snac_window_frames
    busy = after.snac_busy_s - before.snac_busy_s
    bridge_frames = after.snac_bridge_frames - before.snac_bridge_frames
    bridge_s = after.snac_bridge_s - before.snac_bridge_s
    return {
        "wall_s": round(wall, 3),
        "cpu_s": {
            "engine_processes": round(children, 3),
            "event_loop_thread": round(after.loop_thread_s - before.loop_thread_s, 3),
            "snac_thread": round(after.snac_thread_s - before.snac_thread_s, 3),
            "other_threads": round(after.other_threads_s - before.other_threads_s, 3),
            "client_processes": round(clients, 3),
        },
        # Cores busy on the whole machine: a WebRTC run with its clients and `serve --workers` on one host shares
        # them, and a host near its core count slows every process (docs/decisions/benchmark-clients.md).
        "host": {
            "cores": psutil.cpu_count(),
            "busy_cores": round((after.host_busy_s - before.host_busy_s) / wall, 2) if wall > 0 else None,
            "client_cores": round(clients / wall, 2) if wall > 0 else None,
        },
        "snac": {
            **snac_batching(batches, windows, busy, wall),
            # deadline scheduling (gateway.speech.stream_decoder): steps taken because the hold ran out rather
            # than a stream being due, and the longest the worker was busy in one tick (bridges and step)
            "held_steps": after.snac_held_steps - before.snac_held_steps,
            "longest_tick_ms": longest_tick_ms(before.snac_tick_ms, after.snac_tick_ms),
            "new_frames": frames,
            "window_frames": window_frames,
            # recomputation: 1.0 for the exact stream (one frame per stream-step); its bridge's decodes apart
            "frames_per_new_frame": round(window_frames / frames, 3) if frames else None,
            # the bridge's approximate decodes (first audio until the exact stream takes over), which run as
            # sliding windows: a listener without lead keeps bridging through a sentence's first 8 frames
            "bridge_frames": bridge_frames,
            "bridge_frames_per_new_frame": round(bridge_frames / frames, 3) if frames else None,
            "bridge_busy_s": round(bridge_s, 3),
            "bridge_busy_share": round(bridge_s / wall, 3) if wall > 0 else None,
            # each wake-up takes the GIL from the event loop (commands go in one batch per loop iteration)
            "worker_wakeups_per_s": round((after.snac_wakeups - before.snac_wakeups) / wall, 1) if wall > 0 else None,
            # first audio from the exact stream, no bridge (`StreamDecoder._first_audio_at`)
            "exact_starts": after.snac_exact_starts - before.snac_exact_starts,
            **first_audio_starts(after.snac_first_audios - before.snac_first_audios,
                                 after.snac_start_hold_s - before.snac_start_hold_s,
                                 after.snac_paced_starts - before.snac_paced_starts,
                                 after.snac_start_pace_s - before.snac_start_pace_s),
            "windows_per_new_frame": round(windows / frames, 3) if frames else None,
        },
    }


def snac_batching(batches: int, windows: int, busy_s: float, wall_s: float) -> dict[str, Any]:
    """SNAC's steps over a point: how many, streams per step, and the decoder's busy time (in this process or,
    from its /metrics, in a gateway elsewhere)."""
    return {
        "batches": batches,
        "windows": windows,
        "mean_batch": round(windows / batches, 2) if batches else None,
        "busy_s": round(busy_s, 3),
        "busy_share": round(busy_s / wall_s, 3) if wall_s > 0 else None,
        "ms_per_batch": round(busy_s / batches * MS, 2) if batches else None,
    }


def longest_tick_ms(before: list[int], after: list[int]) -> int | None:
    """The longest decoder tick between two readings of its counts, in whole ms (None: no tick)."""
    longest = [ms for ms, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    return longest[-1] if longest else None


class PointLoopLag:
    """This process's event-loop lag while a point runs (the gateway's own `LoopLagMonitor`, sampled more often)."""

    def __init__(self) -> None:
        self.lags_s: list[float] = []
        self._monitor = LoopLagMonitor(self.lags_s.append, LAG_INTERVAL_S)

    def start(self) -> None:
        self._monitor.start()

    async def stop(self) -> dict[str, Any]:
        await self._monitor.stop()
        return describe(self.lags_s, MS)


def gateway_delta(before: GatewaySnapshot, after: GatewaySnapshot, wall_s: float) -> dict[str, Any]:
    """A gateway in other processes (`benchmarks.run --gateway-url`): CPU by kind of process, where its supervisor's
    pid was given, and its SNAC decoders' batching, from its /metrics."""
    spent = cpu_by_kind(before.cpu, after.cpu)
    delta: dict[str, Any] = {"server": {"cpu_s": spent,
                                        "cores": {k: round(v / wall_s, 2) for k, v in spent.items()} if wall_s > 0
                                        else {}}}
    if before.loop_lag is not None and after.loop_lag is not None:
        for process in ("workers", "snac"):  # the SNAC process's: the loop that carries every peer's audio
            if process in after.loop_lag:
                delta[f"{process}_loop_lag"] = loop_lag_summary(before.loop_lag.get(process, {}),
                                                                after.loop_lag[process])
    if before.snac is not None and after.snac is not None:
        d = {key: after.snac[key] - before.snac[key] for key in after.snac}
        delta["snac"] = {**snac_batching(int(d["batches"]), int(d["windows"]), d["busy_s"], wall_s),
                         "new_frames": int(d["frames"]), "exact_starts": int(d["exact_starts"]),
                         **first_audio_starts(d["first_audios"], d["start_hold_s"], d["paced_starts"],
                                              d["start_pace_s"])}
    return delta


class PointProbe:
    """CPU split and event-loop lag over one measurement point: `await start()`, run, `await stop()`. With a
    `GatewayWatch` (the gateway runs in other processes), also its processes' CPU and its SNAC batching."""

    def __init__(self, decoder: Any, client_pids: Collection[int] = (), gateway: GatewayWatch | None = None) -> None:
        self.decoder = decoder
        self.client_pids = frozenset(client_pids)
        self.gateway = gateway
        self.monitor = PointLoopLag()
        self.before: CpuSnapshot | None = None
        self.gateway_before: GatewaySnapshot | None = None

    async def start(self) -> None:
        if self.gateway is not None:
            self.gateway_before = await self.gateway.snapshot()
        self.before = cpu_snapshot(self.decoder, self.client_pids, _pids(self.gateway_before))
        self.monitor.start()

    async def stop(self) -> dict[str, Any]:
        lag = await self.monitor.stop()
        gateway_after = await self.gateway.snapshot() if self.gateway is not None else None
        after = cpu_snapshot(self.decoder, self.client_pids, _pids(gateway_after))
        assert self.before is not None, "start() first"
        result = {**cpu_delta(self.before, after), "loop_lag_ms": lag}
        if self.decoder is None:
            del result["snac"]  # no decoder here: its zeros would read as "SNAC did nothing"
        if self.gateway_before is not None and gateway_after is not None:
            result.update(gateway_delta(self.gateway_before, gateway_after, result["wall_s"]))
        return result


def _pids(gateway: GatewaySnapshot | None) -> set[int]:
    """The processes of a gateway this process started (tests), read with it: counted under their kinds only."""
    return set(gateway.cpu) if gateway is not None else set()
