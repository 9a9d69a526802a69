"""Time to first audio byte of `POST /v1/audio/speech` by `response_format`, on the tiny random model (CPU).

    .venv/bin/python -m gateway.benchmarks.http_ttfb                       # pcm, mp3, opus; 10 requests each
    .venv/bin/python -m gateway.benchmarks.http_ttfb --formats pcm,flac --requests 20

Builds the tiny test model and SNAC (as `orpheus-gateway bench --tiny` does), serves the gateway on loopback and sends
one request at a time, the formats taken in turn (pcm, mp3, opus, pcm, ...) so that a change in the machine's load
touches every format alike; the first round is a warm-up and is not counted. Measured per request: from sending it
to the first body bytes, which carry audio in every format (wav's header and opus' Ogg headers come with the first
audio; the response's headers go out with them, as the route starts its response once the first PCM exists). Prints
p50, p90 and the fastest per format, and the load average, since a shared machine's load moves these figures.
Then, for scale, what the encoder alone adds: opening a `StreamEncoder` and encoding the first 2048-sample chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from gateway.benchmarks.models import tiny_fixed_length_config
from gateway.benchmarks.webrtc_level import served
from gateway.media.avthreads import use_one_ffmpeg_thread
from gateway.media.formats import FORMATS, StreamEncoder
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME

TEXT = "Good morning, class."


async def one_request(http: aiohttp.ClientSession, url: str, fmt: str) -> float:
    """Seconds from sending the request to its first body bytes."""
    started = time.perf_counter()
    async with http.post(url, json={"model": "orpheus", "input": TEXT, "response_format": fmt}) as resp:
        resp.raise_for_status()
        while not await resp.content.readany():
            pass
        first_at = time.perf_counter()
        await resp.read()
    return first_at - started


def encoder_first_chunk_ms(fmt: str, runs: int = 20) -> float:
    """Median ms to open a `StreamEncoder` and encode one SNAC frame of sound (what the route does first)."""
    chunk = (np.sin(np.arange(SAMPLES_PER_FRAME) * 2 * np.pi * 220 / SAMPLE_RATE) * 8000).astype(np.int16)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        encoder = StreamEncoder(fmt)
        encoder.encode(chunk)
        times.append(time.perf_counter() - started)
        encoder.close()
    return statistics.median(times) * 1000


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1] if len(values) > 1 else values[0]


async def measure(formats: list[str], requests: int, root: Path) -> None:
    config = tiny_fixed_length_config(root, 8)
    results: dict[str, list[float]] = {fmt: [] for fmt in formats}
    loads = []
    async with served(config) as base_url, aiohttp.ClientSession() as http:
        url = f"{base_url}/v1/audio/speech"
        for round_ in range(requests + 1):
            for fmt in formats:
                timing = await one_request(http, url, fmt)
                if round_:  # round 0 warms up each format's path (codec libraries, thread pool)
                    results[fmt].append(timing)
            loads.append(os.getloadavg()[0])
    print(f"{requests} requests per format, one at a time; text {TEXT!r}; load average during the run "
          f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")
    print(f"{'format':8} {'p50':>8} {'p90':>8} {'fastest':>8}   (ms to the first audio byte)")
    for fmt, seconds in results.items():
        ms = [s * 1000 for s in seconds]
        print(f"{fmt:8} {statistics.median(ms):8.0f} {percentile(ms, 90):8.0f} {min(ms):8.0f}")
    alone = ", ".join(f"{fmt} {encoder_first_chunk_ms(fmt):.2f} ms" for fmt in formats)
    print(f"the encoder alone, opened and given the first chunk: {alone}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="pcm,mp3,opus", help="comma-separated response_format values")
    parser.add_argument("--requests", type=int, default=10, help="counted requests per format")
    args = parser.parse_args()
    use_one_ffmpeg_thread()  # the gateway is served in this process
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or args.requests < 1:
        parser.error(f"formats must be among {list(FORMATS)} and --requests >= 1")
    with tempfile.TemporaryDirectory(prefix="orpheus-http-ttfb-") as tmp:
        asyncio.run(measure(formats, args.requests, Path(tmp)))


if __name__ == "__main__":
    main()
