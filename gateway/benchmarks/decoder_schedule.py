"""The stream decoder's deadline scheduling under a steady load: N sentences at once, their frames arriving at a
generation pace (starts spread over one frame interval), each listener holding `--listener-ms` before it plays
what comes, each chunk reaching it `--delivery-ms` after the decoder hands it out (with the shared SNAC process: a
socket and a busy worker's event loop; the lead the decoder reads counts only what has arrived). Per hold (0: a
step whenever a frame is in, as the decoder did before; 0.05: the gateway's `MAX_HOLD_S`) and due lead
(`--due-ms`, the gateway's `DUE_LEAD_S` by default): the steps, streams per step, the decoder's busy share, and
the listeners' stalls. `--decoders in-process,remote` runs the same load through the decoder in this process and
through a `StreamCodecServer` on a Unix socket (the shared SNAC process's protocol, its server in a thread here),
and shows the decoder's own view of each start beside it (`start hold ms`, `pace at start ms`): whether the
remote path holds first audio longer for the same frames at the same pace.

    .venv/bin/python -m gateway.benchmarks.decoder_schedule            # CPU: a random-weight SNAC built here, 8 streams
    python -m gateway.benchmarks.decoder_schedule --snac DIR --device cuda --streams 64,256 --out decoder_schedule.json

No engine: the frames are random codes pushed on a clock, so this measures the decoder's own scheduling and
GPU time (on a GPU: graphs, compiled step), not its contention with generation (gateway.benchmarks.run does that).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.benchmarks.records import first_audio_starts
from gateway.benchmarks.start_policies import START_POLICIES
from gateway.benchmarks.timing import simulate_playback
from gateway.devtools.devmodels import random_frames
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME, Frame
from gateway.speech.codec.client import CodecStreamClient
from gateway.speech.codec.server import StreamCodecServer
from gateway.speech.decoder import Decoder
from gateway.speech.first_audio import EXACT_OR_BRIDGE
from gateway.speech.snac import StreamingSnac
from gateway.speech.step_timing import DUE_LEAD_S, MAX_HOLD_S
from gateway.speech.stream_decoder import StreamDecoder

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE
DECODERS = ("in-process", "remote")  # the decoder in this process, or behind the SNAC stream protocol
# The first frame is due this long after the sentences are set going, so that opening them all (256 tasks) is done
# by then: a clock that ran while they opened made each sentence's first frames late, then pushed them back to back,
# and the decoder read a pace far faster than the clock (docs/decisions/benchmark-clients.md).
SENTENCES_OPEN_S = 0.1


@dataclass
class ScheduleRun:
    streams: int
    listener_ms: int
    hold_ms: float
    due_ms: float  # a stream with less lead is stepped at once
    step_duty: float  # the most of the wall time steps take (the gateway's --snac-step-duty)
    start: str  # how a first audio starts (a name in `start_policies.START_POLICIES`)
    decoder: str  # DECODERS
    delivery_ms: float  # from the decoder to the listener
    pace: float  # generation speed, times real time
    frames: int  # per sentence
    wall_s: float
    steps: int
    held_steps: int  # steps taken because the hold ran out (no stream due)
    mean_batch: float
    steps_per_s: float
    busy_share: float  # the decoder's step time (its GPU time where it waits for the device) over wall time
    longest_tick_ms: float
    bridge_frames_per_frame: float  # the bridge's approximate decodes per new frame (the exact steps: 1 each)
    exact_starts: int  # sentences whose first audio came from the exact stream, no bridge
    first_audio_p50_ms: float
    start_hold_ms: float | None  # the decoder's mean, from a stream's head ready to its first audio
    start_pace_ms: float | None  # the decoder's mean generation pace its starts were planned at, ms per frame
    streams_stalled: int  # listeners whose playback paused at least once
    stalled_ms_max: float
    audio_complete: bool  # every sentence's audio came out whole


async def run_one(snac: StreamingSnac, streams: int, frames: int, pace: float, listener_s: float, hold_s: float,
                  due_s: float = DUE_LEAD_S, delivery_s: float = 0.0, start: str = EXACT_OR_BRIDGE.name,
                  where: str = DECODERS[0], step_duty: float = 1.0) -> ScheduleRun:
    decoder = StreamDecoder(snac, max_batch=streams, hold_s=hold_s, due_lead_s=due_s, start=START_POLICIES[start],
                            step_duty=step_duty)
    server: StreamCodecServer | None = None
    client: Decoder = decoder
    if where == "remote":
        server = StreamCodecServer(decoder, Path(tempfile.mkdtemp(prefix="decoder-schedule-")) / "snac.sock")
        server.start()
        client = CodecStreamClient(server.path)
    bridged_before = snac.stats.approx_frames
    interval = FRAME_S / pace
    codes = [random_frames(frames, seed=i) for i in range(streams)]  # before the clock (256 x 24 frames: ~90 ms)
    try:
        began = time.monotonic() + SENTENCES_OPEN_S
        results = await asyncio.gather(*(
            _sentence(client, codes[i], began + interval * i / streams, interval, listener_s, delivery_s)
            for i in range(streams)))
        wall = time.monotonic() - began
    finally:
        if server is not None:
            client.close()
            await asyncio.sleep(0)  # the link closes on this loop
            await asyncio.to_thread(server.close)  # closes the decoder too
        else:
            decoder.close()
    stats = decoder.stats
    starts = first_audio_starts(stats.first_audios, stats.start_hold_s, stats.paced_starts, stats.start_pace_s)
    playbacks = [simulate_playback(arrivals, listener_s) for _, arrivals, _ in results]
    return ScheduleRun(
        streams, round(listener_s * 1000), round(hold_s * 1000, 1), round(due_s * 1000, 1), step_duty, start, where,
        round(delivery_s * 1000, 1), pace, frames, round(wall, 2), stats.batches,
        stats.held_steps, round(stats.windows / stats.batches, 1) if stats.batches else 0.0,
        round(stats.batches / wall, 1), round(stats.busy_s / wall, 3), round(stats.longest_tick_s * 1000, 1),
        round((snac.stats.approx_frames - bridged_before) / max(1, streams * frames), 3), stats.exact_starts,
        round(statistics.median(first for first, _, _ in results) * 1000, 1),
        starts["start_hold_ms"], starts["start_pace_ms"],
        sum(1 for p in playbacks if p.stalls), round(max(p.stall_s for p in playbacks) * 1000, 1),
        all(samples == frames * SAMPLES_PER_FRAME for _, _, samples in results))


async def _sentence(decoder: Decoder, frames: list[Frame], start: float, interval: float,
                    listener_s: float, delivery_s: float) -> tuple[float, list[tuple[float, float]], int]:
    """One sentence: its frames pushed on the clock, its audio timed where the listener gets it (`delivery_s`
    after the decoder). Returns (first audio after its first frame, arrivals as (seconds, audio seconds),
    samples). The lead is the synthesizer's over what has arrived: audio in less the time since the first
    audio, plus what the listener holds."""
    arrivals: list[tuple[float, float]] = []
    samples = 0

    def lead_s() -> float:
        now = time.monotonic()
        if not arrivals or arrivals[0][0] > now:
            return listener_s  # before its first audio a listener holds its buffer (Synthesizer._lead_s)
        arrived = sum(duration for at, duration in arrivals if at <= now)
        return arrived - (now - arrivals[0][0]) + listener_s

    # The lead runs once the listener plays (`PlayoutTrack.lead_runs`): a remote decoder holds it until then.
    stream = decoder.open(lead_s, lead_runs=lambda: bool(arrivals) and arrivals[0][0] <= time.monotonic())

    async def feed() -> None:
        for k, frame in enumerate(frames):
            await asyncio.sleep(max(0.0, start + k * interval - time.monotonic()))
            decoder.push(stream, [frame])
        decoder.finish(stream)

    feeder = asyncio.create_task(feed())
    try:
        while (item := await stream.chunks.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            arrivals.append((time.monotonic() + delivery_s, len(item[0]) / SAMPLE_RATE))
            samples += len(item[0])
    finally:
        decoder.release(stream)
        await feeder
    return (arrivals[0][0] - start if arrivals else float("nan")), arrivals, samples


def load_snac(path: str | None, device: str, streams: int) -> StreamingSnac:
    """The checkpoint at `path` as the gateway loads it (graphs, and on CUDA the compiled step), or a random-weight
    SNAC built here on the CPU."""
    if path is not None:
        return StreamingSnac.load(path, device, max_streams=streams + 8, max_batch=streams)
    from snac import SNAC

    from gateway.devtools.devmodels import build_test_snac

    built = build_test_snac(Path(tempfile.mkdtemp(prefix="decoder-schedule-snac-")))
    return StreamingSnac(SNAC.from_pretrained(str(built)).eval(), "cpu", "float32", max_streams=streams + 8)


def table(runs: list[ScheduleRun]) -> str:
    head = ("streams", "listener ms", "hold ms", "due ms", "step duty", "start", "decoder", "delivery ms", "steps",
            "held", "mean batch", "steps/s", "busy", "longest tick ms", "bridge frames/frame", "exact starts",
            "first audio p50 ms", "start hold ms", "pace at start ms", "stalled", "stalled ms max", "complete")
    rows = [head] + [(str(r.streams), str(r.listener_ms), f"{r.hold_ms:g}", f"{r.due_ms:g}", f"{r.step_duty:g}",
                      r.start, r.decoder, f"{r.delivery_ms:g}",
                      str(r.steps), str(r.held_steps),
                      f"{r.mean_batch:.1f}", f"{r.steps_per_s:.1f}", f"{r.busy_share:.0%}", f"{r.longest_tick_ms:.0f}",
                      f"{r.bridge_frames_per_frame:.2f}", f"{r.exact_starts}/{r.streams}",
                      f"{r.first_audio_p50_ms:.0f}", _or_dash(r.start_hold_ms), _or_dash(r.start_pace_ms),
                      f"{r.streams_stalled}/{r.streams}", f"{r.stalled_ms_max:.0f}",
                      "yes" if r.audio_complete else "NO") for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def _or_dash(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _starts(text: str) -> list[str]:
    chosen = text.split(",")
    if unknown := [s for s in chosen if s not in START_POLICIES]:
        raise argparse.ArgumentTypeError(f"unknown start {unknown[0]!r}: one of {', '.join(START_POLICIES)}")
    return chosen


def _decoders(text: str) -> list[str]:
    chosen = text.split(",")
    if unknown := [d for d in chosen if d not in DECODERS]:
        raise argparse.ArgumentTypeError(f"unknown decoder {unknown[0]!r}: one of {', '.join(DECODERS)}")
    return chosen


async def main_async(args: argparse.Namespace, report: Callable[[str], None]) -> list[ScheduleRun]:
    snac = load_snac(args.snac, args.device, max(args.streams))
    runs = []
    for streams in args.streams:
        # Warm-up, not counted: each batch size's graphs and compiled shapes (the bridge's too) are made on first
        # use, and a warm-up at another size leaves the first counted run a long tick.
        await run_one(snac, streams, args.frames, args.pace, 0.0, MAX_HOLD_S)
        for listener_ms, hold_s, due_ms, duty, start, where in itertools.product(
                args.listener_ms, args.holds, args.due_ms, args.step_duty, args.starts, args.decoders):
            run = await run_one(snac, streams, args.frames, args.pace, listener_ms / 1000, hold_s, due_ms / 1000,
                                args.delivery_ms / 1000, start, where, duty)
            report(f"{streams} streams, {listener_ms:g} ms listener, hold {hold_s * 1000:g} ms, due {due_ms:g} ms, "
                   f"duty {duty:g}, start {start}, {where}: {run.steps} steps of {run.mean_batch:.1f}, "
                   f"{run.streams_stalled} stalled")
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[8])
    parser.add_argument("--frames", type=int, default=24, help="frames per sentence (24: 2 s of audio)")
    parser.add_argument("--pace", type=float, default=1.2, help="generation speed, times real time")
    parser.add_argument("--listener-ms", type=_floats, default=[0.0, 500.0])
    parser.add_argument("--holds", type=_floats, default=[0.0, MAX_HOLD_S], help="seconds (0: step at every frame)")
    parser.add_argument("--due-ms", type=_floats, default=[DUE_LEAD_S * 1000],
                        help="due leads to compare, ms (default: the gateway's DUE_LEAD_S)")
    parser.add_argument("--step-duty", type=_floats, default=[1.0],
                        help="step duties to compare (the gateway's --snac-step-duty; 1: no rest after a step)")
    parser.add_argument("--starts", type=_starts, default=[EXACT_OR_BRIDGE.name],
                        help=f"how first audio starts, to compare: {','.join(START_POLICIES)} "
                             "(`start_policies.START_POLICIES`; the first is the gateway's)")
    parser.add_argument("--decoders", type=_decoders, default=[DECODERS[0]],
                        help=f"where the decoder runs, to compare: {','.join(DECODERS)} (remote: behind the SNAC "
                             "stream protocol on a Unix socket, as the shared SNAC process)")
    parser.add_argument("--delivery-ms", type=float, default=0.0,
                        help="from the decoder to the listener, ms (0: in the same process, at once)")
    parser.add_argument("--snac", help="a SNAC 24 kHz checkpoint (default: a random-weight one, built here, on CPU)")
    parser.add_argument("--device", default="auto", help="with --snac: the gateway's --snac-device")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    runs = asyncio.run(main_async(args, lambda line: print(line, flush=True)))
    print(table(runs))
    if args.out:
        args.out.write_text(json.dumps({"runs": [asdict(r) for r in runs]}, indent=2))
    return 0 if all(r.audio_complete for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
