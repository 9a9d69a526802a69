"""The exact streaming decoder's fast start, in model time on the CPU: when a sentence's first audio comes out, and
whether a listener who plays what arrives at once (0 ms buffer) runs dry when the exact stream takes over.

    .venv/bin/python -m gateway.benchmarks.fast_start              # paces 3, 1.5 and 1.1x real time; table + JSON
    .venv/bin/python -m gateway.benchmarks.fast_start --paces 1.2 --frames 40 --dilation 8 --out fast_start.json

The gateway's own `StreamDecoder` (its thread, the real `StreamingSnac`, a random-weight 24 kHz SNAC) decodes one
sentence whose frames arrive at a steady generation pace: 3x real time is one stream on a fast GPU (~28 ms a
frame), 1.1x a loaded engine. Wall time runs `--dilation` times slower than model time, so this CPU's decode time counts
1/dilation of itself: the figures are those of a decoder that many times faster than this CPU (a GPU is faster
still), i.e. they show what each start policy (`POLICIES`) costs in frames and lead, not what a GPU's decode
adds.

Reported per policy and pace: first audio (model ms after the first frame arrived, and frames in by then), stalls
and stalled ms of a 0 ms-buffer listener (`benchmarks.timing.simulate_playback`), and the decoder's work: bridge frames
decoded and exact frames stepped per frame of the sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gateway.benchmarks.start_policies import BRIDGE_AT_ONCE
from gateway.benchmarks.timing import simulate_playback
from gateway.devtools.devmodels import random_frames
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME, Frame
from gateway.speech.snac import StreamingSnac
from gateway.speech.stream_decoder import StreamDecoder

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE  # 85.3 ms of audio per frame
# The start policies compared. bridge-la0: the gateway's when tokens come fast (`--decode-fast-start-ms`): first
# audio from one frame (lookahead 0), the bridge going on with each frame until the lead covers the hand-over
# (`StreamDecoder.handover_lead_s`); bridge-la1: the gateway's otherwise, lookahead 1 (first audio once two frames
# are in); first-only: the decoder before the bridge went on (first audio once two frames are in, then the exact
# stream at once).
POLICIES: dict[str, tuple[int, bool]] = {  # name: (lookahead, the bridge goes on after the first audio)
    "bridge-la0": (0, True),
    "bridge-la1": (1, True),
    "first-only": (1, False),
}


@dataclass
class FastStartRun:
    policy: str
    pace: float  # generation speed, times real time
    frames: int
    first_audio_ms: float  # model time from the first frame's arrival to the first audio
    frames_at_first_audio: int
    stalls: int  # 0 ms buffer
    stalled_ms: float
    handover_ms: float  # audio the bridge handed out before the exact stream took over
    bridge_frames_per_frame: float
    exact_frames_per_frame: float


async def run_one(decoder: StreamDecoder, frames: list[Frame], policy: str, pace: float, dilation: float
                  ) -> FastStartRun:
    """One sentence through `decoder`: frames pushed every FRAME_S / pace of model time, its audio timed."""
    lookahead, bridge_on = POLICIES[policy]
    interval = FRAME_S / pace * dilation  # wall seconds between frames
    start = time.monotonic()
    arrivals: list[tuple[float, float]] = []  # (model seconds, audio seconds)
    pushed = 0

    def model_now() -> float:
        return (time.monotonic() - start) / dilation

    def lead_s() -> float:
        if not arrivals:
            return 0.0
        if not bridge_on:
            return 1e9  # the exact stream takes over at once
        return sum(d for _, d in arrivals) - (model_now() - arrivals[0][0])

    snac = decoder.snac
    approx_before, stepped_before = snac.stats.approx_frames, snac.stats.stepped_frames
    stream = decoder.open(lead_s, lookahead)

    async def feed() -> None:
        nonlocal pushed
        for k, frame in enumerate(frames):
            await asyncio.sleep(max(0.0, start + k * interval - time.monotonic()))
            decoder.push(stream, [frame])
            pushed = k + 1
        decoder.finish(stream)

    feeder = asyncio.create_task(feed())
    frames_at_first = 0
    while (item := await stream.chunks.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        if not arrivals:
            frames_at_first = pushed
        arrivals.append((model_now(), len(item[0]) / SAMPLE_RATE))
    await feeder
    assert stream.handle is not None
    playback = simulate_playback(arrivals, 0.0)
    n = len(frames)
    return FastStartRun(policy, pace, n, round(arrivals[0][0] * 1000, 1), frames_at_first, playback.stalls,
                        round(playback.stall_s * 1000, 1), round(stream.handle.handover / SAMPLE_RATE * 1000, 1),
                        round((snac.stats.approx_frames - approx_before) / n, 3),
                        round((snac.stats.stepped_frames - stepped_before) / n, 3))


def load_snac(path: str | None) -> StreamingSnac:
    from snac import SNAC

    from gateway.devtools.devmodels import build_test_snac

    if path is None:
        path = str(build_test_snac(Path(tempfile.mkdtemp(prefix="fast-start-snac-"))))
    return StreamingSnac(SNAC.from_pretrained(path).eval(), "cpu", "float32", max_streams=4)


def table(runs: list[FastStartRun]) -> str:
    head = ("policy", "pace", "first audio ms", "frames in", "stalls @0ms", "stalled ms", "bridge audio ms",
            "bridge fr/fr", "exact fr/fr")
    rows = [head] + [(r.policy, f"{r.pace:g}x", f"{r.first_audio_ms:.0f}", str(r.frames_at_first_audio),
                      str(r.stalls), f"{r.stalled_ms:.0f}", f"{r.handover_ms:.0f}", f"{r.bridge_frames_per_frame:.2f}",
                      f"{r.exact_frames_per_frame:.2f}") for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


async def main_async(args: argparse.Namespace, report: Callable[[str], None]) -> list[FastStartRun]:
    decoder = StreamDecoder(load_snac(args.snac), start=BRIDGE_AT_ONCE)  # wall-clock pace: not the model's
    runs = []
    try:
        await run_one(decoder, random_frames(8, seed=99), "bridge-la0", 3.0, args.dilation)  # warm-up, not counted
        for pace in args.paces:
            for policy in args.policies:
                run = await run_one(decoder, random_frames(args.frames, seed=len(runs)), policy, pace, args.dilation)
                report(f"{policy} at {pace:g}x: first audio {run.first_audio_ms:.0f} ms, {run.stalls} stalls")
                runs.append(run)
    finally:
        decoder.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paces", type=lambda s: [float(x) for x in s.split(",")], default=[3.0, 1.5, 1.1])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--frames", type=int, default=24, help="frames of the sentence (24: 2 s of audio)")
    parser.add_argument("--dilation", type=float, default=8.0, help="wall seconds per model second")
    parser.add_argument("--snac", help="a SNAC 24 kHz checkpoint (default: a random-weight one, built here)")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    if unknown := set(args.policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    runs = asyncio.run(main_async(args, lambda line: print(line, flush=True)))
    print(table(runs))
    if args.out:
        args.out.write_text(json.dumps({"dilation": args.dilation, "runs": [asdict(r) for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
