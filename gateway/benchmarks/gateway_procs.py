"""The processes of a running `serve --workers` gateway, seen from a benchmark on the same host: what each one
is (supervisor, worker, the SNAC process, `vllm serve`'s API servers, its engine core), the CPU each kind
spends, and from its merged /metrics the SNAC decoders' counters and the workers' event-loop lag.
`benchmarks.faults` kills and weighs them; `benchmarks.run --gateway-pid` splits a point's host CPU by them, so a WebRTC
run shows where the cores went (workers' media, vLLM's HTTP front, SNAC, the clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from gateway.benchmarks.records import MS
from gateway.cluster.supervisor import VLLM_CLI_MODULE, WORKER_MODULE
from gateway.media.playout import LATE_FRAME_S

SNAC_MODULE = "gateway.cluster.snac_process"
# vLLM titles its processes ("VLLM::APIServer_0", "VLLM::EngineCore", "VLLM::Worker"): the API servers beyond
# the first (--api-server-count) and the engine's processes are multiprocessing children whose command line
# says nothing else.
API_SERVER_TITLE = "APIServer"
ENGINE_CORE_TITLE = "EngineCore"
ENGINE_WORKER_TITLE = "VLLM::Worker"  # the model runner, where the engine core runs it in another process
KINDS = ("supervisor", "worker", "snac", "vllm", "engine-core", "engine-worker", "other")


@dataclass(frozen=True)
class TreeProcess:
    pid: int
    kind: str  # one of KINDS
    name: str


def process_kind(proc: psutil.Process, cmdline: str) -> str:
    """What a descendant of the supervisor is, by its command line or vLLM's title for it."""
    name = proc.name()
    if WORKER_MODULE in cmdline:
        return "worker"
    if SNAC_MODULE in cmdline:
        return "snac"
    if VLLM_CLI_MODULE in cmdline or API_SERVER_TITLE in name or API_SERVER_TITLE in cmdline:
        return "vllm"
    if ENGINE_CORE_TITLE in name or ENGINE_CORE_TITLE in cmdline:
        return "engine-core"
    if ENGINE_WORKER_TITLE in name or ENGINE_WORKER_TITLE in cmdline:
        return "engine-worker"
    return "other"


def gateway_tree(supervisor_pid: int) -> list[TreeProcess]:
    """The supervisor and every live descendant, each with what it is."""
    root = psutil.Process(supervisor_pid)
    found = [TreeProcess(supervisor_pid, "supervisor", root.name())]
    for proc in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append(TreeProcess(proc.pid, process_kind(proc, " ".join(proc.cmdline())), proc.name()))
    return found


def cpu_by_process(supervisor_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of every process of the gateway, with its kind; {} once it is gone."""
    found: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(psutil.Error):
        for entry in gateway_tree(supervisor_pid):
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(entry.pid).cpu_times()
                found[entry.pid] = (entry.kind, times.user + times.system)
    return found


def cpu_by_kind(before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each kind spent between two `cpu_by_process` readings (a process started in between counts
    from zero; one that exited in between is lost, its time with it)."""
    spent: dict[str, float] = {}
    for pid, (kind, seconds) in after.items():
        spent[kind] = spent.get(kind, 0.0) + seconds - before.get(pid, (kind, 0.0))[1]
    return {kind: round(spent[kind], 3) for kind in KINDS if kind in spent}


# --- the SNAC decoders' counters, from the gateway's merged /metrics -------------------------------------------
# Summed over every process that decodes (the shared SNAC process, `worker="snac"`, or each worker's own).
SNAC_SAMPLES = {
    "orpheus_snac_batch_size_count": "batches",
    "orpheus_snac_batch_size_sum": "windows",  # stream-steps
    "orpheus_snac_batch_seconds_sum": "busy_s",
    "orpheus_snac_new_frames_total": "frames",
    "orpheus_snac_first_audio_hold_seconds_count": "first_audios",
    "orpheus_snac_first_audio_hold_seconds_sum": "start_hold_s",
    "orpheus_snac_start_pace_seconds_count": "paced_starts",
    "orpheus_snac_start_pace_seconds_sum": "start_pace_s",
}
METRICS_TIMEOUT_S = 5.0
METRICS_ATTEMPTS = 4  # a merged read where a process did not answer (loaded host) is read again
METRICS_RETRY_S = 0.5


def snac_counters(exposition: str) -> dict[str, float]:
    """SNAC's steps, stream-steps, step seconds and new frames so far, and its first audios (how many, how many from
    the exact stream, their holds and the paces they were planned at, summed), from a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.service.metrics import FIRST_AUDIO_HOLD_METRIC, START_LABEL

    totals = dict.fromkeys((*SNAC_SAMPLES.values(), "exact_starts"), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            key = SNAC_SAMPLES.get(sample.name)
            if key is not None:
                totals[key] += sample.value
            if sample.name == f"{FIRST_AUDIO_HOLD_METRIC}_count" and sample.labels.get(START_LABEL) == "exact":
                totals["exact_starts"] += sample.value
    return totals


def loop_lag_buckets(exposition: str) -> dict[str, dict[float, float]]:
    """The event-loop lag samples so far, as cumulative counts by bucket bound (seconds; `inf` last): the workers'
    summed ("workers"), and the shared SNAC process's streams loop ("snac", its `worker` label). A process that
    reports none is absent; a single gateway's own samples count as "workers"."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.cluster.snac_process import SNAC_LABEL
    from gateway.service.metrics import LOOP_LAG_METRIC, WORKER_LABEL

    counts: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name != LOOP_LAG_METRIC:
            continue
        for sample in family.samples:
            if sample.name == f"{LOOP_LAG_METRIC}_bucket":
                which = counts.setdefault("snac" if sample.labels.get(WORKER_LABEL) == SNAC_LABEL else "workers", {})
                bound = float(sample.labels["le"])
                which[bound] = which.get(bound, 0.0) + sample.value
    return {process: dict(sorted(buckets.items())) for process, buckets in counts.items()}


def loop_lag_summary(before: dict[float, float], after: dict[float, float]) -> dict[str, Any] | None:
    """Samples between two readings of `loop_lag_buckets`: how many, how many over 10 ms, and the bucket bounds
    (ms) that hold the 95th percentile and the largest sample (a histogram gives bounds, not values)."""
    delta = {bound: after[bound] - before.get(bound, 0.0) for bound in after}
    total = delta.get(math.inf, 0.0)
    if total <= 0:
        return None

    def bound_of(rank: float) -> float | None:
        bound = next(b for b, count in delta.items() if count >= rank)
        return None if math.isinf(bound) else round(bound * MS, 1)

    # a lag over LATE_FRAME_S (10 ms) makes a playout frame late (`done.late_frames`)
    over_10ms = total - max((count for b, count in delta.items() if b <= LATE_FRAME_S), default=0.0)
    return {"samples": int(total), "over_10ms": int(over_10ms), "p95_le_ms": bound_of(0.95 * total),
            "max_le_ms": bound_of(total)}


@dataclass(frozen=True)
class GatewaySnapshot:
    cpu: dict[int, tuple[str, float]]  # cpu_by_process; {} without a supervisor pid
    snac: dict[str, float] | None  # snac_counters; None when /metrics (or a process behind it) did not answer
    loop_lag: dict[str, dict[float, float]] | None = None  # loop_lag_buckets; None likewise


class GatewayWatch:
    """Reads a running gateway's CPU by process (given its supervisor's pid, on this host) and its SNAC counters
    (from `{url}/metrics`) at the start and end of each benchmark point."""

    def __init__(self, base_url: str, supervisor_pid: int | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.supervisor_pid = supervisor_pid

    async def snapshot(self) -> GatewaySnapshot:
        """One reading; /metrics is read again (up to METRICS_ATTEMPTS times) while a worker or the shared SNAC
        process did not answer the merged read, since its counters would be missing from the difference; a read
        still missing one gives no counters (the point reports no SNAC figures rather than short ones)."""
        import aiohttp

        cpu = cpu_by_process(self.supervisor_pid) if self.supervisor_pid is not None else {}
        for attempt in range(METRICS_ATTEMPTS):
            if attempt:
                await asyncio.sleep(METRICS_RETRY_S)
            text: str | None = None
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
                async with aiohttp.ClientSession(timeout=timeout) as http, \
                        http.get(f"{self.base_url}/metrics") as r:
                    text = await r.text() if r.status == 200 else None
            if text is not None and all_processes_answered(text):
                return GatewaySnapshot(cpu, snac_counters(text), loop_lag_buckets(text))
        return GatewaySnapshot(cpu, None, None)  # short counters would make short figures: none


def all_processes_answered(exposition: str) -> bool:
    """Whether every worker and the shared SNAC process answered a merged /metrics read (a single gateway's own
    /metrics, which has no such counts, always has)."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.service.metrics import METRICS_WORKERS_METRIC, SNAC_PROCESS_METRIC

    for family in text_string_to_metric_families(exposition):
        if family.name in (METRICS_WORKERS_METRIC, SNAC_PROCESS_METRIC):
            states = {s.labels.get("state"): s.value for s in family.samples}
            if states.get("answered", 0.0) < states.get("expected", 0.0):
                return False
    return True
