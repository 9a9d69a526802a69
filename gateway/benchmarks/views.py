"""Stall views of a finished run, read again from its kept arrivals: `python -m gateway.benchmarks.views RUN.json[.gz]
--buffers-ms 0,20,40,60` prints, for every streaming point, the streams that stalled and the real-time users at
each client buffer, without a GPU.

A run made with `--keep-arrivals` holds every stream's arrival times, so a view it did not ask for (a client that
holds one packet, 20 ms; one that holds 40) costs no new lease. Views are client buffers beyond what the gateway
held (`--listener-buffer-ms`); a stream the server ran dry counts as stalled in every view, as it does in the run's
own view of the gateway's buffer (`records.count_server_underruns`). The stall check is the run's own
(`records.apply_arrivals`, its `--stall-tolerance-ms`).

Over WebRTC it also splits the streams the server ran dry by how they started (`start_underruns`): a first audio
within `FAST_START_MS` of the first frame came from that frame alone (a fast start: no second frame could be in
so soon), the others waited for more (docs/decisions/first-audio-start.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.benchmarks.records import MS, RequestRecord, apply_arrivals, count_server_underruns, summarize
from gateway.benchmarks.settings import DEFAULT_STALL_TOLERANCE_MS


def load_run(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        return json.load(f)  # type: ignore[no-any-return]


def point_views(requests: Sequence[dict[str, Any]], users: int, client_buffers_ms: Sequence[int],
                tolerance_ms: float) -> dict[int, dict[str, Any]]:
    """Each client buffer's view of one point: streams stalled, real-time users, stall moments (`summarize`)."""
    records = []
    for kept in requests:
        arrivals = kept.get("arrivals")
        if arrivals is None and kept["ok"]:
            raise SystemExit("this run kept no arrivals: run it with --keep-arrivals")
        record = RequestRecord(user=kept["user"], index=kept["index"], lang=kept["lang"], size=kept["size"],
                               chars=kept["chars"], sent_at_s=kept["sent_at_s"], ok=kept["ok"],
                               client_process=kept.get("client_process"))
        # A failed request (a peer refused at its offer) has none, as in the run (`webrtc_level._failed`)
        apply_arrivals(record, [(t / MS, d / MS) for t, d in arrivals or ()], client_buffers_ms, tolerance_ms,
                       keep=False)
        record.server = kept.get("server")
        for buffer in client_buffers_ms:  # the server ran it dry: stalled in every view
            count_server_underruns(record, buffer)
        records.append(record)
    played = summarize(records, users, client_buffers_ms)["playback"]
    return {buffer: played[str(buffer)] for buffer in client_buffers_ms}


# A first audio this soon after the first frame came from that frame alone: a second frame takes at least ~35 ms
# (7 tokens at the fastest pace measured, ~5 ms a token at one stream).
FAST_START_MS = 20.0


def start_underruns(requests: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """Streams by how they started (fast: first audio within `FAST_START_MS` of the first frame; the others), and how
    many of each the server ran dry; None for a point without the server's figures (not WebRTC)."""
    counts = {"fast_starts": 0, "fast_starts_dry": 0, "other_starts": 0, "other_starts_dry": 0}
    seen = False
    for request in requests:
        server = request.get("server") or {}
        if server.get("ttfa_ms") is None or server.get("ttfw_ms") is None:
            continue
        seen = True
        kind = "fast_starts" if server["ttfa_ms"] - server["ttfw_ms"] <= FAST_START_MS else "other_starts"
        counts[kind] += 1
        counts[f"{kind}_dry"] += bool(server.get("underruns"))
    return counts if seen else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a bench.json or bench.json.gz made with --keep-arrivals")
    parser.add_argument("--buffers-ms", default="0,20,40,60", help="client buffers beyond the gateway's, ms")
    args = parser.parse_args(argv)
    buffers = [int(b) for b in args.buffers_ms.split(",")]
    run = load_run(args.run)
    tolerance = run.get("options", {}).get("stall_tolerance_ms", DEFAULT_STALL_TOLERANCE_MS)
    held = run.get("options", {}).get("listener_buffer_ms", 0)
    print(f"{args.run}: client buffers beyond the gateway's {held} ms, stall tolerance {tolerance} ms")
    header = " | ".join(f"stalled / real-time users @+{b} ms" for b in buffers)
    for scenario in run.get("scenarios", []):
        if scenario.get("scenario") != "streaming":
            continue
        print(f"\n### {scenario['level']}\n| users | {header} |\n|---|" + "---|" * len(buffers))
        for point in scenario["points"]:
            views = point_views(point["requests"], point["users"], buffers, tolerance)
            cells = " | ".join(f"{v['streams_stalled']} / {v['realtime_users']}" for v in views.values())
            print(f"| {point['users']} | {cells} |")
        starts = [(point["users"], start_underruns(point["requests"])) for point in scenario["points"]]
        if any(counts is not None for _, counts in starts):
            print(f"\nservers' underruns by start (fast: first audio <= {FAST_START_MS:g} ms after the first frame)\n"
                  "| users | fast starts | of them run dry | other starts | of them run dry |\n|---|---|---|---|---|")
            for users, c in starts:
                if c is not None:
                    print(f"| {users} | {c['fast_starts']} | {c['fast_starts_dry']} | {c['other_starts']} | "
                          f"{c['other_starts_dry']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
