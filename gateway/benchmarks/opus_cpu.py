"""CPU per 20 ms frame of the media encode path: aiortc's own encoder (as the gateway used it before
`gateway/media/encoder.py`) against the gateway's Opus stage, for speech and for silence, in the same run.

    python -m gateway.benchmarks.opus_cpu [--frames 2000] [--peers 32] [--out bench-results/opus-cpu.json]

"aiortc, thread pool" runs `OpusEncoder.encode` through `loop.run_in_executor` from `--peers` concurrent
senders, as aiortc's RTCRtpSender does; its CPU is the process's (all threads), divided by frames sent.
"gateway, in loop" runs `OpusTrack.encode` for the same frames. Only encoding is measured: RTP packetising,
SRTP and the socket are the same in both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import psutil
from aiortc.codecs.opus import OpusEncoder

from gateway.benchmarks.records import MS
from gateway.media.avthreads import use_one_ffmpeg_thread
from gateway.media.encoder import OpusTrack
from gateway.media.output_frames import FRAME_SAMPLES, SAMPLE_RATE_OUT
from gateway.media.playout import PlayoutTrack

SPEECH_LEVEL = 3000


def make_frames(count: int, silent: bool, seed: int = 0) -> list[av.AudioFrame]:
    rng = np.random.default_rng(seed)
    t = np.arange(count * FRAME_SAMPLES) / SAMPLE_RATE_OUT
    pcm = (np.zeros_like(t) if silent else SPEECH_LEVEL * np.sin(2 * np.pi * 180 * t)
           + 0.1 * SPEECH_LEVEL * rng.standard_normal(t.size)).astype(np.int16)
    frames = []
    for i in range(count):
        frame = av.AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(pcm[i * FRAME_SAMPLES:(i + 1) * FRAME_SAMPLES].tobytes())
        frame.pts, frame.sample_rate, frame.time_base = i * FRAME_SAMPLES, SAMPLE_RATE_OUT, Fraction(1, SAMPLE_RATE_OUT)
        frames.append(frame)
    return frames


def cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


async def aiortc_path(frames: list[av.AudioFrame], peers: int) -> float:
    """ms of CPU per frame: one encoder per peer, each frame through the default thread pool."""
    loop = asyncio.get_running_loop()

    async def sender() -> None:
        encoder = OpusEncoder()
        for frame in frames:
            await loop.run_in_executor(None, encoder.encode, frame, False)

    start = cpu_s()
    await asyncio.gather(*(sender() for _ in range(peers)))
    return (cpu_s() - start) / (len(frames) * peers) * MS


def gateway_path(frames: list[av.AudioFrame], peers: int, bitrate: int, complexity: int) -> float:
    tracks = [OpusTrack(PlayoutTrack(pace=False), bitrate=bitrate, complexity=complexity) for _ in range(peers)]
    start = cpu_s()
    for frame in frames:
        for track in tracks:
            track.encode(frame)
    return (cpu_s() - start) / (len(frames) * peers) * MS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.benchmarks.opus_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1000, help="frames per peer and variant")
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--bitrate", type=int, default=32000)
    parser.add_argument("--complexity", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench-results/opus-cpu.json"))
    use_one_ffmpeg_thread()  # as in the gateway's processes
    args = parser.parse_args(argv)

    rows: list[dict[str, Any]] = []
    for content in ("speech", "silence"):
        frames = make_frames(args.frames, silent=content == "silence")
        rows.append({"content": content, "path": "aiortc, thread pool",
                     "cpu_ms_per_frame": round(asyncio.run(aiortc_path(frames, args.peers)), 4)})
        rows.append({"content": content, "path": f"gateway, in loop (complexity {args.complexity})",
                     "cpu_ms_per_frame": round(gateway_path(frames, args.peers, args.bitrate, args.complexity), 4)})
    machine = {"cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(),
               "load_average": [round(x, 2) for x in psutil.getloadavg()],
               "python": platform.python_version(), "av": av.__version__}
    print(f"Opus encode CPU per 20 ms frame ({args.peers} peers x {args.frames} frames; {machine})\n")
    print("| content | path | CPU ms / frame | CPU % of one core per peer |\n|---|---|---|---|")
    for row in rows:
        share = row["cpu_ms_per_frame"] / 20 * 100
        print(f"| {row['content']} | {row['path']} | {row['cpu_ms_per_frame']:.3f} | {share:.2f}% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                                    "options": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
