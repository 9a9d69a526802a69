"""Host time of the exact streaming decoder's ticks, the GPU work left out (CPU):

    .venv/bin/python -m gateway.benchmarks.decoder_host                     # 384 streams, batches of 256, 40 ticks

What `StreamDecoder` does in Python per tick around the decode itself: take the pushed frames (one per stream),
pick the ready streams in deadline order, pack their rows, hand out each stream's audio (`_emit`), deliver it
to the event loop, and plan the next tick (`_next_tick_at`, after the pushes and after the tick). The decode
launch is replaced by preallocated zero output of the right shape, so the figure is the host's share only: on a
GPU the launch's own time comes on top (docs/benchmarks.md, "SNAC step"). Prints ms per tick and us per pushed frame.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from snac import SNAC

from gateway.devtools.devmodels import SNAC_24KHZ_CONFIG, random_frames
from gateway.orpheus import SAMPLES_PER_FRAME
from gateway.speech.snac import StreamingSnac
from gateway.speech.stream_decoder import DecodeStream, StreamDecoder


async def measure(streams: int, max_batch: int, ticks: int) -> dict[str, float]:
    snac = StreamingSnac(SNAC(**SNAC_24KHZ_CONFIG).eval(), "cpu", "float32", max_streams=streams + 8)
    audio = torch.zeros(max_batch, SAMPLES_PER_FRAME)
    pcm = torch.zeros(max_batch, SAMPLES_PER_FRAME, dtype=torch.int16)
    snac._launch = lambda packed, masked=True: (audio[:packed.shape[0]], pcm[:packed.shape[0]])  # type: ignore
    decoder = StreamDecoder(snac, max_batch=max_batch)
    decoder.close()  # its thread is not needed: this drives the ticks itself, in this thread
    loop = asyncio.get_running_loop()
    opened = [DecodeStream(loop, (lambda i=i: i * 0.001), 1) for i in range(streams)]
    frames = random_frames(ticks + 8, seed=1)
    for stream in opened:
        decoder._apply(("open", stream, None))
        decoder._apply(("push", stream, frames[:8]))
        stream.started, stream.bridging = True, False  # past the fast start: the steady state
    push_s = tick_s = 0.0
    for tick in range(ticks):
        t0 = time.perf_counter()
        touched = [decoder._apply(("push", stream, frames[8 + tick:9 + tick])) for stream in opened]
        decoder._finish_done(touched)  # what the worker does after a batch of commands (`_run`)
        decoder._next_tick_at(touched)
        t1 = time.perf_counter()
        decoder._tick()
        decoder._next_tick_at(decoder._streams)  # the worker's plan after each tick
        t2 = time.perf_counter()
        push_s, tick_s = push_s + t1 - t0, tick_s + t2 - t1
        await asyncio.sleep(0)  # the deliveries
    return {"streams": streams, "max_batch": max_batch, "tick_ms": round(tick_s / ticks * 1000, 3),
            "push_us_per_frame": round(push_s / (ticks * streams) * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=384)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--ticks", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = asyncio.run(measure(args.streams, args.max_batch, args.ticks))
    print(f"{result['streams']} streams, batches of {result['max_batch']}: {result['tick_ms']} ms per tick "
          f"(launch left out), {result['push_us_per_frame']} us per pushed frame")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
