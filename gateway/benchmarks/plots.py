"""One PNG per scenario and level: latency percentiles and real-time streams against concurrency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

from gateway.benchmarks.scenarios import SCENARIO_INFO

FIGURE_SIZE = (11, 4.2)
DPI = 110
LATENCY_SERIES = (  # (label, summary key, statistic)
    ("TTFA p50", "ttfa_ms", "p50"),
    ("TTFA p95", "ttfa_ms", "p95"),
    ("TTFA max", "ttfa_ms", "max"),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFF p50", "ttff_ms", "p50"),
)


def _series(points: Sequence[dict[str, Any]], *path: str) -> tuple[list[int], list[float]]:
    """(x, y) of the points where the value exists."""
    xs: list[int] = []
    ys: list[float] = []
    for point in points:
        value: Any = point["summary"]
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            xs.append(point["users"])
            ys.append(float(value))
    return xs, ys


def _plot_latency(ax: Any, points: Sequence[dict[str, Any]]) -> None:
    for label, key, stat in LATENCY_SERIES:
        xs, ys = _series(points, key, stat)
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    xs, ys = _series(points, "server", "ttfa_ms", "p50")
    if xs:
        ax.plot(xs, ys, marker="s", linestyle=":", label="server TTFA p50")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ms")
    ax.set_title("latency percentiles")


def _plot_realtime(ax: Any, points: Sequence[dict[str, Any]], buffers_ms: Sequence[int]) -> None:
    users = [p["users"] for p in points]
    ax.plot(users, users, color="grey", linestyle="--", label="all users")
    xs, ys = _series(points, "realtime_users")
    if xs:
        ax.plot(xs, ys, marker="o", label="audio s / wall s")
    for buffer_ms in buffers_ms:
        xs, ys = _series(points, "playback", str(buffer_ms), "realtime_users")
        ax.plot(xs, ys, marker="^", label=f"no stall, {buffer_ms} ms buffer")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("real-time streams")
    ax.set_title("real-time streams")


def plot_scenario(scenario: str, level: str, points: Sequence[dict[str, Any]], buffers_ms: Sequence[int],
                  path: Path, variant: str | None = None) -> Path:
    info = SCENARIO_INFO[scenario]
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGURE_SIZE)
    _plot_latency(left, points)
    _plot_realtime(right, points, buffers_ms)
    for ax in (left, right):
        ax.set_xticks([p["users"] for p in points])
        ax.set_xlabel(info.axis)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{scenario}{'' if variant is None else ' ' + variant} ({level})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
