"""CPU per received 20 ms frame of the benchmark's client side: `HeadlessPeer` (decoding in its event loop) against
aiortc's own audio receiver (a decoder thread per peer, frames through its track), N peers in one process.

    python -m gateway.benchmarks.client_cpu [--peers 32] [--seconds 8] [--out bench-results/client-cpu.json]

The WebRTC level runs hundreds of headless peers in a few client processes on the gateway's host, and a client
process that falls behind stamps frames late and takes cores from the server
(docs/decisions/benchmark-clients.md). Here one spawned process sends every peer paced speech through the gateway's own
media stage (`PlayoutTrack` + `OpusTrack`, mono Opus), another receives it; only the receiver's CPU is counted,
over `--seconds` of steady streaming, in the same run for both receivers. No engine: the audio is a tone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from gateway.media.output_frames import FRAME_SAMPLES
from gateway.orpheus import SAMPLE_RATE
from gateway.rtc.rtpclock import RTP_MODULO

RECEIVERS = ("headless peer", "aiortc track")
SPEECH_LEVEL = 3000
SETTLE_S = 2.0  # after every peer is connected and speaking, before the CPU is counted
CONNECT_TIMEOUT_S = 60.0


def _sender(conn: Connection, peers: int, seconds: float) -> None:
    """Answers `peers` offers (SDP over the pipe), then streams a tone to every peer until told to stop."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from gateway.media.avthreads import use_one_ffmpeg_thread
    from gateway.media.encoder import OpusTrack
    from gateway.media.playout import PlayoutTrack

    use_one_ffmpeg_thread()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pcs, tracks = [], []
        for _ in range(peers):
            offer = await loop.run_in_executor(None, conn.recv)
            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            playout = PlayoutTrack()
            pc.addTrack(OpusTrack(playout, bitrate=32000, complexity=5))
            await pc.setRemoteDescription(RTCSessionDescription(**offer))
            await pc.setLocalDescription(await pc.createAnswer())
            conn.send({"sdp": pc.localDescription.sdp, "type": "answer"})
            pcs.append(pc)
            tracks.append(playout)
        await loop.run_in_executor(None, conn.recv)  # every peer is connected
        t = np.arange(int(SAMPLE_RATE * (seconds + SETTLE_S + 5))) / SAMPLE_RATE
        tone = (SPEECH_LEVEL * np.sin(2 * np.pi * 180 * t)).astype(np.int16)
        for k, track in enumerate(tracks):
            track.begin_utterance(f"u{k}", 0)
            track.push_pcm(f"u{k}", tone)
            track.end_utterance(f"u{k}")
        await loop.run_in_executor(None, conn.recv)  # stop
        for pc in pcs:
            await pc.close()

    asyncio.run(main())


def _receiver(conn: Connection, receiver: str, peers: int, seconds: float) -> None:
    """Connects `peers` receivers of the given kind; reports CPU seconds, wall seconds and frames received."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from gateway.devtools.client import HeadlessPeer, frame_rms, set_receive_prefetch
    from gateway.media.avthreads import use_one_ffmpeg_thread

    use_one_ffmpeg_thread()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        received: list[list[tuple[float, float, int]]] = []  # (arrival, rms, pts) per aiortc-track peer
        pcs: list[RTCPeerConnection] = []
        headless: list[HeadlessPeer] = []
        tasks: list[asyncio.Task[None]] = []

        async def consume(track: Any, frames: list[tuple[float, float, int]]) -> None:
            while True:  # the headless peer's bookkeeping, on aiortc's decoded frames
                frame = await track.recv()
                mono = frame.to_ndarray().reshape(-1, len(frame.layout.channels))[:, 0]
                frames.append((time.monotonic(), frame_rms(mono), frame.pts))

        for _ in range(peers):
            if receiver == "headless peer":
                peer = HeadlessPeer("http://unused")  # negotiated here, not through a gateway
                headless.append(peer)
                pc = peer.pc
            else:
                pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
                set_receive_prefetch(pc.addTransceiver("audio", direction="recvonly").receiver)
                mine: list[tuple[float, float, int]] = []
                received.append(mine)
                pc.on("track", lambda track, mine=mine: tasks.append(asyncio.create_task(consume(track, mine))))
            pcs.append(pc)
            await pc.setLocalDescription(await pc.createOffer())
            conn.send({"sdp": pc.localDescription.sdp, "type": "offer"})
            answer = await loop.run_in_executor(None, conn.recv)
            await pc.setRemoteDescription(RTCSessionDescription(**answer))
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while any(pc.connectionState != "connected" for pc in pcs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{receiver}: peers not connected within {CONNECT_TIMEOUT_S} s")
            await asyncio.sleep(0.1)
        conn.send("connected")

        def lengths() -> list[int]:
            return [len(p.frames) for p in headless] + [len(r) for r in received]

        def stamps(peer: int, start: int, end: int) -> list[int]:
            """The RTP timestamps (aiortc track: pts, the same clock) of one peer's frames in a window."""
            if peer < len(headless):
                return [f.rtp_timestamp for f in headless[peer].frames[start:end] if f.rtp_timestamp is not None]
            return [pts for _, _, pts in received[peer - len(headless)][start:end]]

        await asyncio.sleep(SETTLE_S)
        proc = psutil.Process()
        cpu0, wall0, counts0 = sum(proc.cpu_times()[:2]), time.monotonic(), lengths()
        await asyncio.sleep(seconds)
        cpu1, wall1, counts1 = sum(proc.cpu_times()[:2]), time.monotonic(), lengths()
        conn.send({"cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0, "frames": sum(counts1) - sum(counts0),
                   "frames_sent": sum(_slots(stamps(i, a, b)) for i, (a, b) in enumerate(zip(counts0, counts1,
                                                                                             strict=True)))})
        for task in tasks:
            task.cancel()
        for peer in headless:
            await peer.close()
        for pc in pcs:
            await pc.close()

    asyncio.run(main())


def _slots(stamps: list[int]) -> int:
    """The 20 ms frames the sender sent from the first to the last of these RTP timestamps, both included."""
    return (stamps[-1] - stamps[0]) % RTP_MODULO // FRAME_SAMPLES + 1 if stamps else 0


def run_one(receiver: str, peers: int, seconds: float) -> dict[str, Any]:
    """One receiver kind: a sender and a receiver process, SDP and the start/stop through pipes."""
    context = multiprocessing.get_context("spawn")
    to_sender, sender_end = context.Pipe()
    to_receiver, receiver_end = context.Pipe()
    procs = [context.Process(target=_sender, args=(sender_end, peers, seconds), daemon=True),
             context.Process(target=_receiver, args=(receiver_end, receiver, peers, seconds), daemon=True)]
    for proc in procs:
        proc.start()
    try:
        for _ in range(peers):  # relay the offers and answers
            if not to_receiver.poll(CONNECT_TIMEOUT_S):
                raise RuntimeError(f"{receiver}: the receiver process made no offer")
            to_sender.send(to_receiver.recv())
            if not to_sender.poll(CONNECT_TIMEOUT_S):
                raise RuntimeError(f"{receiver}: the sender process gave no answer")
            to_receiver.send(to_sender.recv())
        if not to_receiver.poll(CONNECT_TIMEOUT_S + 5):
            raise RuntimeError(f"{receiver}: peers did not connect")
        to_sender.send(to_receiver.recv())  # connected: start speaking
        if not to_receiver.poll(seconds + SETTLE_S + 60):
            raise RuntimeError(f"{receiver}: no result")
        result = to_receiver.recv()
        to_sender.send("stop")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    frames = result["frames"]
    return {"receiver": receiver, "peers": peers, "wall_s": round(result["wall_s"], 2), "frames": frames,
            "frames_lost": result["frames_sent"] - frames,
            "frames_per_s": round(frames / result["wall_s"], 1),
            "cores": round(result["cpu_s"] / result["wall_s"], 3),
            "cpu_us_per_frame": round(result["cpu_s"] / frames * 1e6, 1) if frames else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.benchmarks.client_cpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=32, help="peers in the receiving process")
    parser.add_argument("--seconds", type=float, default=8.0, help="of steady streaming, counted")
    parser.add_argument("--out", type=Path, default=Path("bench-results/client-cpu.json"))
    args = parser.parse_args(argv)
    rows = [run_one(receiver, args.peers, args.seconds) for receiver in RECEIVERS]
    machine = {"cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(),
               "load_average": [round(x, 2) for x in psutil.getloadavg()], "python": platform.python_version()}
    print(f"Client CPU per received 20 ms frame ({args.peers} peers in one process, {args.seconds:g} s; {machine})\n")
    print("| receiver | frames/s | cores | CPU us / frame |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['receiver']} | {row['frames_per_s']:.0f} | {row['cores']:.2f} | {row['cpu_us_per_frame']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                                    "options": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    return 0 if all(row["frames"] > 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
