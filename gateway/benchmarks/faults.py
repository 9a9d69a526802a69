"""Faults under load, on the layout users run: `serve --workers` (its shared SNAC process, its `vllm serve`),
hundreds of WebRTC peers speaking continuously with the lessons' 500 ms jitter buffer, and one process killed
with SIGKILL mid-load: a worker, the SNAC process, or `vllm serve`'s engine core.

Per fault (one phase each, fresh peers, the same gateway), from the clients' side: sessions kept, errored and
lost (and when the client noticed), utterances by how they ended, with **silent** and doubled ones (both must be
0), how soon a new session is accepted and heard, and the process tree's resources before and after
(`summarise`).

    python -m gateway.benchmarks.faults --gateway-url http://127.0.0.1:8800 --supervisor-pid PID --sockets DIR \\
        --peers 256 --client-processes 8 --faults worker,snac,engine --out DIR

Results: a table on stdout and in `faults.md`, everything in `faults.json`. The peers run in spawned client
processes (`--client-processes`), so the measured gateway does not share a loop with its clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from gateway.benchmarks.client_pool import spawn_children, stop_children
from gateway.benchmarks.corpus import select
from gateway.benchmarks.gateway_procs import TreeProcess, gateway_tree
from gateway.benchmarks.machine import machine_info
from gateway.cluster.addressing import WORKER_INDEX_ENV, WORKER_SOCKETS_ENV, session_prefix, socket_path
from gateway.devtools.client import HeadlessPeer
from gateway.rtc.protocol import TERMINAL_EVENTS

FAULTS = ("worker", "snac", "engine")
CONNECT_CONCURRENCY = 16
CONNECT_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0  # an utterance without a terminal event by then is silent
PROBE_INTERVAL_S = 1.0
PROBE_TEXT = "Good morning, everyone."
ERROR_BACKOFF_S = 1.0  # a client's pause after an `error` without retry_after_s
SETTLE_S = 5.0  # after the peers are gone, before the idle resources are read
LANGUAGE = "en"


# --- the gateway's processes --------------------------------------------------------------------------------

def worker_index(pid: int) -> int | None:
    with contextlib.suppress(psutil.Error, ValueError):
        return int(psutil.Process(pid).environ().get(WORKER_INDEX_ENV, ""))
    return None


def fault_target(supervisor_pid: int, fault: str) -> TreeProcess:
    """The process a fault kills: worker 0, the SNAC process, or vLLM's engine core."""
    tree = gateway_tree(supervisor_pid)
    if fault == "worker":
        candidates = [p for p in tree if p.kind == "worker" and worker_index(p.pid) == 0]
    elif fault == "snac":
        candidates = [p for p in tree if p.kind == "snac"]
    else:
        candidates = [p for p in tree if p.kind == "engine-core"]
    if not candidates:
        kinds = ", ".join(f"{p.kind}:{p.name}" for p in tree)
        raise RuntimeError(f"no process to kill for fault {fault!r} under pid {supervisor_pid} ({kinds})")
    return candidates[0]


def resources(supervisor_pid: int) -> dict[str, Any]:
    """RSS, open fds and threads of the gateway's tree, per kind and in total; GPU memory if nvidia-smi runs."""
    per_kind: dict[str, dict[str, float]] = {}
    for entry in gateway_tree(supervisor_pid):
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(entry.pid)
            row = per_kind.setdefault(entry.kind, {"processes": 0, "rss_mb": 0.0, "fds": 0, "threads": 0})
            row["processes"] += 1
            row["rss_mb"] += proc.memory_info().rss / 2**20
            row["fds"] += proc.num_fds()
            row["threads"] += proc.num_threads()
    total = {key: sum(row[key] for row in per_kind.values()) for key in ("processes", "rss_mb", "fds", "threads")}
    return {"total": _rounded(total), "per_kind": {k: _rounded(v) for k, v in sorted(per_kind.items())},
            "gpu_memory_mib": gpu_memory_mib()}


def _rounded(row: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in row.items()}


def gpu_memory_mib() -> float | None:
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(subprocess.SubprocessError, ValueError, OSError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return float(sum(float(x) for x in out.split()))
    return None


async def all_workers_ready(sockets: str | None, workers: int, base_url: str, timeout_s: float) -> float | None:
    """Seconds until every worker's own socket (or, without the folder, the public port) answers /readyz 200;
    None if not within `timeout_s`."""
    t0 = time.monotonic()
    targets = [str(socket_path(sockets, i)) for i in range(workers)] if sockets else [None]
    for path in targets:
        while True:
            if time.monotonic() - t0 > timeout_s:
                return None
            connector = aiohttp.UnixConnector(path=path) if path else None
            url = "http://worker/readyz" if path else f"{base_url}/readyz"
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(5)) as http, \
                        http.get(url) as resp:
                    if resp.status == 200:
                        break
            await asyncio.sleep(0.5)
    return time.monotonic() - t0


# --- client side: peers speaking until told to stop -----------------------------------------------------------

@dataclass
class UtteranceRecord:
    uid: str
    sent: float
    started: float | None = None
    ended: float | None = None
    terminal: list[str] = field(default_factory=list)
    error_code: str | None = None
    retry_after_s: float | None = None
    underruns: int = 0
    underrun_ms: float = 0.0
    audio_ms: float = 0.0
    out_of_order: list[str] = field(default_factory=list)
    lost: bool = False  # the connection failed before a terminal event came


@dataclass
class SessionRecord:
    session_id: str
    lost_at: float | None
    utterances: list[UtteranceRecord]


async def _speak_until(peer: HeadlessPeer, texts: Sequence[str], stop: asyncio.Event, rng: random.Random
                       ) -> SessionRecord:
    records: list[UtteranceRecord] = []
    for k in itertools.count():
        if stop.is_set() or peer.lost_at is not None:
            break
        uid = f"{peer.session_id}-{k}"
        try:
            sent = peer.speak(uid, rng.choice(texts))
        except Exception:  # the data channel closed under us: the connection is gone
            peer.lost_at = peer.lost_at or time.monotonic()
            break
        record = UtteranceRecord(uid, sent)
        records.append(record)
        await peer.wait_ending(uid, REQUEST_TIMEOUT_S)
        _fill(record, peer)
        if not record.terminal and peer.lost_at is None:
            with contextlib.suppress(Exception):
                peer.cancel(uid)
        if record.error_code is not None:  # as a lesson page would: wait before asking again
            await asyncio.sleep(record.retry_after_s or ERROR_BACKOFF_S)
    return SessionRecord(peer.session_id or "", peer.lost_at, records)


def _fill(record: UtteranceRecord, peer: HeadlessPeer) -> None:
    endings = peer.endings(record.uid)
    record.terminal = endings.terminal
    record.out_of_order = endings.out_of_order
    if started := peer.find("started", record.uid):
        record.started = started[0].at
    for kind in TERMINAL_EVENTS:
        if found := peer.find(kind, record.uid):
            event = found[0]
            record.ended = event.at
            if kind == "done":
                record.underruns = int(event.message.get("underruns", 0))
                record.underrun_ms = float(event.message.get("underrun_ms", 0.0))
                record.audio_ms = float(event.message.get("audio_ms", 0.0))
            elif kind == "error":
                record.error_code = str(event.message.get("code"))
                record.retry_after_s = event.message.get("retry_after_s")
            break
    record.lost = not record.terminal and peer.lost_at is not None


async def _connect(base_url: str, count: int, jitter_buffer_ms: int) -> list[HeadlessPeer]:
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def one() -> HeadlessPeer | None:
        async with gate:
            peer = HeadlessPeer(base_url, jitter_buffer_ms=jitter_buffer_ms)
            try:
                await peer.connect(timeout=CONNECT_TIMEOUT_S)
                return peer
            except Exception:
                await peer.close()
                return None

    return [p for p in await asyncio.gather(*(one() for _ in range(count))) if p is not None]


async def _close(base_url: str, peers: Sequence[HeadlessPeer]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(10)) as http:
        for peer in peers:
            if peer.lost_at is None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.delete(f"{base_url}/v1/webrtc/sessions/{peer.session_id}"):
                        pass
    await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)


def _child_main(conn: Connection) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(_child_loop(conn))


async def _child_loop(conn: Connection) -> None:
    """connect -> ("connected", n); go -> speak until stop -> ("records", [...]); close; exit."""
    peers: list[HeadlessPeer] = []
    base_url = ""
    while True:
        message = await asyncio.to_thread(conn.recv)
        try:
            if message[0] == "exit":
                return
            if message[0] == "connect":
                _, base_url, count, jitter_buffer_ms = message
                peers = await _connect(base_url, count, jitter_buffer_ms)
                conn.send(("connected", len(peers)))
            elif message[0] == "go":
                texts, seed = message[1], message[2]
                stop = asyncio.Event()
                speaking = [asyncio.create_task(_speak_until(p, texts, stop, random.Random(seed + i)))
                            for i, p in enumerate(peers)]
                await asyncio.to_thread(conn.recv)  # ("stop",)
                stop.set()
                sessions = await asyncio.gather(*speaking)
                conn.send(("records", [asdict(s) for s in sessions]))
            elif message[0] == "close":
                await _close(base_url, peers)
                peers = []
                conn.send(("closed",))
        except Exception as exc:  # report, never leave the parent waiting
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))


class FaultClients:
    """K spawned processes holding the phase's peers."""

    def __init__(self, processes: int) -> None:
        self.size = processes
        self._conns: list[Connection] = []
        self._procs: list[Any] = []

    def __enter__(self) -> FaultClients:
        self._conns, self._procs = spawn_children(_child_main, self.size, "fault-clients")
        return self

    def __exit__(self, *_: object) -> None:
        stop_children(self._conns, self._procs)

    async def _all(self, message: tuple[Any, ...] | None, expect: str,
                   messages: Sequence[tuple[Any, ...]] | None = None) -> list[tuple[Any, ...]]:
        for index, conn in enumerate(self._conns):
            conn.send(messages[index] if messages is not None else message)
        replies = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in self._conns))
        for reply in replies:
            if reply[0] != expect:
                raise RuntimeError(f"client process answered {reply}, expected {expect!r}")
        return replies

    async def connect(self, base_url: str, peers: int, jitter_buffer_ms: int) -> int:
        shares = [peers // self.size + (1 if i < peers % self.size else 0) for i in range(self.size)]
        replies = await self._all(None, "connected",
                                  [("connect", base_url, n, jitter_buffer_ms) for n in shares])
        return sum(r[1] for r in replies)

    def go(self, texts: Sequence[str], seed: int) -> None:
        for index, conn in enumerate(self._conns):
            conn.send(("go", list(texts), seed + 100_000 * index))

    async def stop(self) -> list[SessionRecord]:
        replies = await self._all(("stop",), "records")
        return [SessionRecord(s["session_id"], s["lost_at"], [UtteranceRecord(**u) for u in s["utterances"]])
                for reply in replies for s in reply[1]]

    async def close(self) -> None:
        await self._all(("close",), "closed")


# --- new sessions after the fault -----------------------------------------------------------------------------

@dataclass
class ProbeResult:
    accepted_after_s: float | None = None  # a new session connected (offer answered, `ready`)
    speaking_after_s: float | None = None  # ... and one of its utterances ended `done`
    attempts: int = 0
    failures: Counter[str] = field(default_factory=Counter)


async def probe_new_sessions(base_url: str, since: float, give_up_at: float) -> ProbeResult:
    """From the fault on, every PROBE_INTERVAL_S: connect a new peer and speak once, until a `done` comes."""
    result = ProbeResult()
    while time.monotonic() < give_up_at:
        result.attempts += 1
        peer = HeadlessPeer(base_url, jitter_buffer_ms=0)
        try:
            await peer.connect(timeout=10)
            if result.accepted_after_s is None:
                result.accepted_after_s = time.monotonic() - since
            uid = f"probe{result.attempts}"
            peer.speak(uid, PROBE_TEXT)
            ended = await peer.wait_ending(uid, give_up_at - time.monotonic())
            if ended == ["done"]:
                result.speaking_after_s = time.monotonic() - since
                return result
            code = next((e.message.get("code") for e in peer.find("error", uid)), None)
            result.failures[f"{ended[0]}:{code}" if ended else "no terminal event"] += 1
        except Exception as exc:
            result.failures[type(exc).__name__] += 1
        finally:
            with contextlib.suppress(Exception):
                await _close(base_url, [peer])
        await asyncio.sleep(PROBE_INTERVAL_S)
    return result


# --- one phase ----------------------------------------------------------------------------------------------

@dataclass
class FaultSettings:
    gateway_url: str
    supervisor_pid: int
    sockets: str | None
    workers: int
    peers: int
    client_processes: int
    jitter_buffer_ms: int
    before_s: float
    after_s: float
    recovery_timeout_s: float
    seed: int


def lesson_texts() -> list[str]:
    """The bench corpus' English phrases: short turns and long explanations, as a lesson mixes them."""
    return [p.text for p in select(lang=LANGUAGE)]


async def run_phase(fault: str, settings: FaultSettings, clients: FaultClients) -> dict[str, Any]:
    url = settings.gateway_url
    ready_s = await all_workers_ready(settings.sockets, settings.workers, url, settings.recovery_timeout_s)
    if ready_s is None:
        raise RuntimeError(f"before the {fault} phase: the workers are not ready")
    idle_before = resources(settings.supervisor_pid)
    connected = await clients.connect(url, settings.peers, settings.jitter_buffer_ms)
    print(f"[{fault}] {connected}/{settings.peers} peers connected", flush=True)
    clients.go(lesson_texts(), settings.seed)
    await asyncio.sleep(settings.before_s)
    target = fault_target(settings.supervisor_pid, fault)
    loaded = resources(settings.supervisor_pid)
    killed_at = time.monotonic()
    os.kill(target.pid, signal.SIGKILL)
    print(f"[{fault}] killed {target.kind} pid {target.pid} ({target.name})", flush=True)
    probe = await probe_new_sessions(url, killed_at, killed_at + settings.recovery_timeout_s)
    # Let the load run on after recovery, so the survivors show whether they kept real time.
    remaining = killed_at + max(settings.after_s, (probe.speaking_after_s or 0.0) + settings.after_s / 2)
    await asyncio.sleep(max(0.0, remaining - time.monotonic()))
    sessions = await clients.stop()
    await clients.close()
    recovered_s = await all_workers_ready(settings.sockets, settings.workers, url, settings.recovery_timeout_s)
    await asyncio.sleep(SETTLE_S)
    idle_after = resources(settings.supervisor_pid)
    summary = summarise(fault, sessions, killed_at, target, probe, connected, settings.peers)
    summary["resources"] = {"idle_before": idle_before, "loaded": loaded, "idle_after": idle_after}
    summary["workers_ready_after_phase_s"] = None if recovered_s is None else round(recovered_s, 1)
    return summary


def summarise(fault: str, sessions: Sequence[SessionRecord], killed_at: float, target: TreeProcess,
              probe: ProbeResult, connected: int, asked: int) -> dict[str, Any]:
    """One fault's phase from the clients' side:
    - sessions that survived (connection held, last utterance `done`) and kept real time (no underrun in any of
      their utterances), sessions that got an `error` event, sessions lost (their connection failed: a killed
      worker cannot say goodbye; ICE consent checks notice it) and how long the client took to notice;
    - utterances: `done`, `error` (by code), `cancelled`, ended by the lost connection, and silent ones (no
      terminal event on a live connection) and doubled ones (more than one terminal event);
    - new sessions: the probe's time until a new session is accepted and until it hears a `done`."""
    utterances = [u for s in sessions for u in s.utterances]
    silent = [u.uid for u in utterances if not u.terminal and not u.lost]
    doubled = [u.uid for u in utterances if len(u.terminal) > 1]
    disordered = [u.uid for u in utterances if u.out_of_order]
    lost = [s for s in sessions if s.lost_at is not None]
    survived = [s for s in sessions if s.lost_at is None and s.utterances and s.utterances[-1].terminal == ["done"]]
    real_time = [s for s in survived if all(u.underruns == 0 for u in s.utterances if u.terminal == ["done"])]
    errored = [s for s in sessions if any(u.terminal[:1] == ["error"] for u in s.utterances)]
    owned = ([s for s in sessions if s.session_id.startswith(session_prefix(0))] if fault == "worker" else [])
    done = [u for u in utterances if u.terminal == ["done"]]
    after = [u for u in done if u.sent >= killed_at]
    before = [u for u in done if u.sent < killed_at]
    return {
        "fault": fault,
        "killed": asdict(target),
        "peers_asked": asked,
        "sessions": connected,
        "sessions_on_killed_worker": len(owned) if fault == "worker" else None,
        "survived": len(survived),
        "kept_real_time": len(real_time),
        "sessions_with_error_event": len(errored),
        "sessions_lost": len(lost),
        "lost_noticed_after_s": _spread([s.lost_at - killed_at for s in lost if s.lost_at is not None]),
        "utterances": len(utterances),
        "done": len(done),
        "done_before_fault": len(before),
        "done_before_fault_with_underruns": sum(1 for u in before if u.underruns),
        "done_after_fault": len(after),
        "done_after_fault_with_underruns": sum(1 for u in after if u.underruns),
        "errors_by_code": dict(Counter(u.error_code or "?" for u in utterances if u.terminal[:1] == ["error"])),
        "cancelled": sum(1 for u in utterances if u.terminal[:1] == ["cancelled"]),
        "ended_by_lost_connection": sum(1 for u in utterances if u.lost),
        "silent": len(silent),
        "doubled": len(doubled),
        "out_of_order": len(disordered),
        "silent_ids": silent[:20],
        "doubled_ids": doubled[:20],
        "new_session_accepted_after_s": _round(probe.accepted_after_s),
        "new_session_speaking_after_s": _round(probe.speaking_after_s),
        "probe_attempts": probe.attempts,
        "probe_failures": dict(probe.failures),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": round(statistics.median(values), 1), "max": round(max(values), 1)}


# --- report -------------------------------------------------------------------------------------------------

COLUMNS = ("fault", "sessions", "survived", "kept real time", "error event", "lost", "utterances", "done",
           "error", "by lost conn.", "silent", "doubled", "new session after", "speaking after", "RSS MB idle",
           "fds idle")


def table(phases: Sequence[dict[str, Any]]) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for p in phases:
        if "failed" in p:
            rows.append(f"| {p['fault']} | failed: {p['failed']} |")
            continue
        res = p["resources"]
        before, after = res["idle_before"]["total"], res["idle_after"]["total"]
        lost = str(p["sessions_lost"])
        if p["lost_noticed_after_s"]:
            lost += f" (noticed {p['lost_noticed_after_s']['p50']} s)"
        cells = [
            f"{p['fault']} ({p['killed']['kind']})", p["sessions"], p["survived"], p["kept_real_time"],
            p["sessions_with_error_event"], lost, p["utterances"], p["done"],
            sum(p["errors_by_code"].values()), p["ended_by_lost_connection"], p["silent"], p["doubled"],
            _seconds(p["new_session_accepted_after_s"]), _seconds(p["new_session_speaking_after_s"]),
            f"{before['rss_mb']:.0f} -> {after['rss_mb']:.0f}", f"{before['fds']:.0f} -> {after['fds']:.0f}",
        ]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value} s"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.benchmarks.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway-url", required=True)
    parser.add_argument("--supervisor-pid", type=int, required=True,
                        help="pid of `orpheus-gateway serve --workers` (its children are the targets)")
    parser.add_argument("--sockets", default=os.environ.get(WORKER_SOCKETS_ENV),
                        help=f"the workers' socket folder (default ${WORKER_SOCKETS_ENV}): each worker's /readyz")
    parser.add_argument("--workers", type=int, default=0, help="how many workers (default: counted)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order: {', '.join(FAULTS)}")
    parser.add_argument("--peers", type=int, default=256)
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--jitter-buffer-ms", type=int, default=500)
    parser.add_argument("--before-s", type=float, default=20.0, help="load before the kill")
    parser.add_argument("--after-s", type=float, default=45.0,
                        help="load after the kill (at least; longer while new sessions cannot speak yet); a killed "
                             "worker's peers notice after ~30 s (ICE consent)")
    parser.add_argument("--recovery-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not faults or any(f not in FAULTS for f in faults):
        parser.error(f"--faults: choose from {', '.join(FAULTS)}")
    args.fault_list = faults
    if args.peers < 1 or args.client_processes < 1:
        parser.error("--peers and --client-processes must be at least 1")
    if not psutil.pid_exists(args.supervisor_pid):
        parser.error(f"--supervisor-pid {args.supervisor_pid}: no such process")
    return args


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    workers = args.workers or sum(1 for p in gateway_tree(args.supervisor_pid) if p.kind == "worker")
    settings = FaultSettings(args.gateway_url.rstrip("/"), args.supervisor_pid, args.sockets, workers, args.peers,
                             min(args.client_processes, args.peers), args.jitter_buffer_ms, args.before_s,
                             args.after_s, args.recovery_timeout_s, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_info(), "settings": asdict(settings), "phases": []}
    with FaultClients(settings.client_processes) as clients:
        for fault in args.fault_list:
            try:
                phase = await run_phase(fault, settings, clients)
            except Exception as exc:  # the table says so; the next fault still runs if it can
                phase = {"fault": fault, "failed": f"{type(exc).__name__}: {exc}"}
            report["phases"].append(phase)
            (args.out / "faults.json").write_text(json.dumps(report, indent=1))  # a cut-short run keeps its phases
            print(table([phase]).splitlines()[-1], flush=True)
    text = table(report["phases"])
    (args.out / "faults.md").write_text(text + "\n")
    print(text)
    return report["phases"]


def main(argv: Sequence[str] | None = None) -> int:
    phases = asyncio.run(run(parse_args(argv)))
    bad = [p for p in phases if "failed" in p or p["silent"] or p["doubled"] or p["out_of_order"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
