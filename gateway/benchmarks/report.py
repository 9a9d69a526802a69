"""Markdown tables like the seed's, and the run's JSON file."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.benchmarks.scenarios import SCENARIO_INFO
from gateway.benchmarks.settings import LORA, MAX_USERS, MIXED_SPANS, STREAMING, STRESS, TRAFFIC, TTFA

Getter = Callable[[dict[str, Any]], Any]
Column = tuple[str, Getter]
MISSING = "-"
JSON_NAME = "bench.json"


def _get(*path: str) -> Getter:
    def get(summary: dict[str, Any]) -> Any:
        value: Any = summary
        for key in path:
            if not isinstance(value, dict) or value.get(key) is None:
                return None
            value = value[key]
        return value
    return get


def _num(value: Any, digits: int) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def _ms(*path: str) -> Callable[[dict[str, Any]], str]:
    get = _get(*path)
    return lambda s: _num(get(s), 0)


def _fixed(digits: int, *path: str) -> Callable[[dict[str, Any]], str]:
    get = _get(*path)
    return lambda s: _num(get(s), digits)


def _success(summary: dict[str, Any]) -> str:
    rate = summary.get("success_rate")
    return MISSING if rate is None else f"{rate:.0%}"


def _stalled(buffer_ms: int) -> Callable[[dict[str, Any]], str]:
    def cell(summary: dict[str, Any]) -> str:
        played = summary["playback"].get(str(buffer_ms))
        return MISSING if played is None else f"{played['streams_stalled']}/{summary['requests']}"
    return cell


def _realtime_users(buffer_ms: int) -> Callable[[dict[str, Any]], str]:
    def cell(summary: dict[str, Any]) -> str:
        played = summary["playback"].get(str(buffer_ms))
        return MISSING if played is None else f"{played['realtime_users']}/{summary['users']}"
    return cell


def _stall_moments(buffer_ms: int) -> Callable[[dict[str, Any]], str]:
    """The client-seen stalls of a view: at how many moments (`records.STALL_MOMENT_S` windows) they began, and in
    how many client processes. Few moments across every process: the host; one process: that process."""
    def cell(summary: dict[str, Any]) -> str:
        played = summary["playback"].get(str(buffer_ms))
        if played is None or played.get("stall_moments") is None:
            return MISSING
        processes = played.get("stalled_client_processes")
        return f"{played['stall_moments']}" + ("" if processes is None else f" ({processes} procs)")
    return cell


def _endings(summary: dict[str, Any]) -> str:
    """Utterances whose ending was not exactly one terminal event (missing + doubled + out of order): must be 0."""
    endings = summary.get("endings")
    if endings is None:
        return MISSING
    return str(endings["missing"] + endings["doubled"] + endings["out_of_order"])


def _underruns(summary: dict[str, Any]) -> str:
    server = summary.get("server")
    return MISSING if server is None else f"{server['underruns']} ({server['underrun_ms']} ms)"


def _late_frames(summary: dict[str, Any]) -> str:
    """Audio frames the server handed to its sender over 10 ms late (all streams), and the latest, ms."""
    server = summary.get("server")
    if server is None or server.get("late_frames") is None:
        return MISSING
    return f"{server['late_frames']} ({_num(server.get('max_late_ms'), 0)} ms)"


def _audio_per_stream(summary: dict[str, Any]) -> str:
    """Mean audio seconds a stream got (~5.5 with the bench's phrases and budgets): a gateway that does not cap a
    random-weight model's sentences (`--max-tokens-per-char`) shows 40 here, and its other columns mean nothing."""
    return f"{summary['audio_s'] / summary['requests']:.1f}" if summary.get("requests") else MISSING


def _realtime_by_voice(buffer_ms: int) -> Callable[[dict[str, Any]], str]:
    """Streams that played without a stall in this view, per voice asked for (each names its model or adapter)."""
    def cell(summary: dict[str, Any]) -> str:
        voices = summary.get("by_voice") or {}
        return MISSING if not voices else " · ".join(
            f"{voice or 'default'} {v['realtime_streams'].get(str(buffer_ms), 0)}/{v['streams']}"
            for voice, v in voices.items())
    return cell


def _boundary_underruns(buffer_ms: int) -> Callable[[dict[str, Any]], str]:
    """Stalls that waited for the first audio of a span of another voice, of the span boundaries spoken."""
    def cell(summary: dict[str, Any]) -> str:
        spans = summary.get("span_boundaries")
        return MISSING if spans is None else f"{spans['underruns'].get(str(buffer_ms), 0)}/{spans['boundaries']}"
    return cell


def columns(scenario: str, axis: str, buffers_ms: Sequence[int]) -> list[Column]:
    """The table of each scenario: the seed's columns first, then the stall check."""
    n: Column = (axis, lambda s: str(s["users"]))
    stalls = [(f"stalled @{b} ms", _stalled(b)) for b in buffers_ms]
    underruns: Column = ("server underruns", _underruns)
    endings: Column = ("endings not once", _endings)
    if scenario == STRESS:
        return [n, ("success", _success), ("wall s", _fixed(2, "wall_s")), ("audio s", _fixed(2, "audio_s")),
                ("RTF", _fixed(3, "rtf")), ("real-time users", _fixed(1, "realtime_users")),
                ("TTFA p50 ms", _ms("ttfa_ms", "p50")), ("TTFA max ms", _ms("ttfa_ms", "max")), *stalls, underruns,
                endings]
    if scenario == TTFA:
        latency = [(f"{name.upper()} {stat} ms", _ms(f"{name}_ms", stat))
                   for name, stats in (("ttft", ("min", "avg", "max")), ("ttff", ("avg", "max")),
                                       ("ttfw", ("p50", "p95")), ("ttfa", ("min", "avg", "p50", "p95", "max")))
                   for stat in stats]
        server = [(f"server {name.upper()} {stat} ms", _ms("server", f"{name}_ms", stat))
                  for name in ("ttft", "ttfw", "ttfa") for stat in ("p50", "p95")]  # WebRTC: the `started` event
        return [n, ("success", _success), *latency, *server]
    if scenario == MAX_USERS:
        return [n, ("success", _success), ("TTFF max ms", _ms("ttff_ms", "max")),
                ("TTFA max ms", _ms("ttfa_ms", "max")), ("RTF", _fixed(3, "rtf")),
                ("real-time users", _fixed(1, "realtime_users")), *stalls, underruns]
    if scenario == STREAMING:
        realtime = [(f"real-time users @{b} ms", _realtime_users(b)) for b in buffers_ms]
        return [n, ("streams", lambda s: str(s["requests"])), ("success", _success),
                ("audio s/stream", _audio_per_stream), ("max gap ms", _ms("max_gap_ms")),
                ("RTF max", _fixed(2, "stream_rtf", "max")),
                ("TTFA p95 ms", _ms("ttfa_ms", "p95")), *stalls, *realtime,
                *[(f"stall moments @{b} ms", _stall_moments(b)) for b in buffers_ms[:1]], underruns,
                ("server late frames", _late_frames), ("delivery jitter p95 ms", _ms("delivery_jitter_ms", "p95")),
                endings]
    if scenario in (TRAFFIC, LORA):
        return [n, ("streams", lambda s: str(s["requests"])), ("success", _success),
                ("audio s/stream", _audio_per_stream), ("RTF max", _fixed(2, "stream_rtf", "max")),
                ("TTFA p50 ms", _ms("ttfa_ms", "p50")), ("TTFA p95 ms", _ms("ttfa_ms", "p95")),
                *[(f"real-time streams @{b} ms", _realtime_by_voice(b)) for b in buffers_ms],
                *[(f"real-time users @{b} ms", _realtime_users(b)) for b in buffers_ms]]
    if scenario == MIXED_SPANS:
        return [n, ("success", _success), ("audio s/stream", _audio_per_stream),
                ("TTFA p95 ms", _ms("ttfa_ms", "p95")), ("max gap ms", _ms("max_gap_ms")),
                *[(f"boundary underruns @{b} ms", _boundary_underruns(b)) for b in buffers_ms], *stalls]
    raise ValueError(f"unknown scenario {scenario!r}")


def _percent(*path: str) -> Callable[[dict[str, Any]], str]:
    get = _get(*path)
    return lambda s: MISSING if get(s) is None else f"{get(s):.0%}"


def pipeline_columns(axis: str) -> list[Column]:
    """Where the time went during each point (bench/probes.py): CPU seconds by part, SNAC batching, loop lag."""
    return [
        (axis, lambda p: str(p["users"])),
        ("wall s", _fixed(1, "pipeline", "wall_s")),
        ("engine procs CPU s", _fixed(1, "pipeline", "cpu_s", "engine_processes")),
        ("event loop CPU s", _fixed(1, "pipeline", "cpu_s", "event_loop_thread")),
        ("SNAC thread CPU s", _fixed(1, "pipeline", "cpu_s", "snac_thread")),
        ("other threads CPU s", _fixed(1, "pipeline", "cpu_s", "other_threads")),
        ("client procs CPU s", _fixed(1, "pipeline", "cpu_s", "client_processes")),
        ("host busy cores", _fixed(1, "pipeline", "host", "busy_cores")),
        # a gateway in other processes (--gateway-pid): where its share of the host went
        ("workers cores", _fixed(1, "pipeline", "server", "cores", "worker")),
        ("vllm API cores", _fixed(1, "pipeline", "server", "cores", "vllm")),
        ("engine core cores", _fixed(1, "pipeline", "server", "cores", "engine-core")),
        ("SNAC proc cores", _fixed(1, "pipeline", "server", "cores", "snac")),
        ("SNAC busy", _percent("pipeline", "snac", "busy_share")),
        ("SNAC batches", _fixed(0, "pipeline", "snac", "batches")),
        ("mean batch", _fixed(1, "pipeline", "snac", "mean_batch")),
        ("ms/batch", _fixed(0, "pipeline", "snac", "ms_per_batch")),
        ("held steps", _fixed(0, "pipeline", "snac", "held_steps")),
        ("bridge frames per new frame", _fixed(2, "pipeline", "snac", "bridge_frames_per_new_frame")),
        ("bridge busy", _percent("pipeline", "snac", "bridge_busy_share")),
        ("decoder wake-ups/s", _fixed(0, "pipeline", "snac", "worker_wakeups_per_s")),
        ("exact starts", _fixed(0, "pipeline", "snac", "exact_starts")),
        ("first audios", _fixed(0, "pipeline", "snac", "first_audios")),
        # the decoder's own view of a start: from the head ready to the first audio, and the pace it planned at
        ("start hold ms", _fixed(0, "pipeline", "snac", "start_hold_ms")),
        ("pace at start ms/frame", _fixed(0, "pipeline", "snac", "start_pace_ms")),
        ("longest tick ms", _fixed(0, "pipeline", "snac", "longest_tick_ms")),
        ("generation done p50 ms", _ms("summary", "generated_ms", "p50")),
        ("loop lag p95 ms", _fixed(1, "pipeline", "loop_lag_ms", "p95")),
        ("loop lag max ms", _fixed(1, "pipeline", "loop_lag_ms", "max")),
        # a gateway in other processes: its workers' loops (bucket bounds of their histogram, all workers' samples)
        ("workers loop lag p95 ms <=", _fixed(0, "pipeline", "workers_loop_lag", "p95_le_ms")),
        ("workers loop lag max ms <=", _fixed(0, "pipeline", "workers_loop_lag", "max_le_ms")),
        ("workers loop lags > 10 ms", _fixed(0, "pipeline", "workers_loop_lag", "over_10ms")),
        ("SNAC proc loop lag max ms <=", _fixed(0, "pipeline", "snac_loop_lag", "max_le_ms")),
    ]


def _render(title: str, cols: Sequence[Column], rows_from: Sequence[dict[str, Any]]) -> str:
    """A markdown table; columns with no value at all (e.g. TTFT over WebRTC) are left out."""
    rows = [[cell(source) for _, cell in cols] for source in rows_from]
    keep = [i for i in range(len(cols)) if any(row[i] != MISSING for row in rows)]
    header = [cols[i][0] for i in keep]
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
    return "\n".join(lines)


def markdown_table(scenario: str, level: str, points: Sequence[dict[str, Any]], buffers_ms: Sequence[int],
                   variant: str | None = None) -> str:
    """One scenario (and variant: a traffic split, the base or LoRA voice) at one level, with the seed's columns."""
    info = SCENARIO_INFO[scenario]
    label = scenario if variant is None else f"{scenario} {variant}"
    return _render(f"### {label} ({level}): {info.title}", columns(scenario, info.axis, buffers_ms),
                   [p["summary"] for p in points])


def pipeline_table(scenario: str, level: str, points: Sequence[dict[str, Any]], variant: str | None = None) -> str:
    info = SCENARIO_INFO[scenario]
    label = scenario if variant is None else f"{scenario} {variant}"
    return _render(f"#### {label} ({level}): where the time went", pipeline_columns(info.axis), points)


def write_json(run: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / JSON_NAME
    path.write_text(json.dumps(run, indent=1, default=str, ensure_ascii=False))
    return path
