"""First audio and first word timings through each door that sends them: the streaming WebSocket (Cartesia's
protocol, `/tts/websocket`), WebRTC (the `control` channel and the audio track) and the speech route's SSE
(`word_timestamps`), on the tiny random model (CPU), on a model given (`--model`, `--snac-model`) or against a
gateway already running (`--gateway-url`, e.g. `serve --workers 8` on a GPU).

    .venv/bin/python -m gateway.benchmarks.text_doors                       # 10 utterances per door, one at a time
    .venv/bin/python -m gateway.benchmarks.text_doors --utterances 20 --json text_doors.json
    python -m gateway.benchmarks.text_doors --gateway-url http://127.0.0.1:8800 --concurrency 1,64 --utterances 64

Serves the gateway on loopback (unless `--gateway-url`) and, for each `--concurrency` N, speaks N utterances at once
through one door, the doors taken in turn (websocket, webrtc, http, websocket, ...) so that the machine's load
touches each alike, until each door has `--utterances` (rounded up to whole rounds of N); WebRTC uses N connected
peers. A first round of one utterance per door warms up and is not counted. Every utterance is two sentences of
the same text with the same length (random weights never stop by themselves: the local tiny gateway caps each at
`TINY_MAX_TOKENS`, a model given at `--max-tokens-per-char 6` as `serve` must be started for `--gateway-url`). Measured
per utterance, from the client's send:
- first audio: the first audio bytes (websocket `chunk`, SSE `speech.audio.delta`) or the first audible 20 ms frame
  decoded from the WebRTC track (jitter buffer 0, so the track holds nothing back on purpose);
- first words: the first sentence's word timings (websocket `timestamps`, SSE `speech.audio.words`, WebRTC `words`).
A sentence's words are made once its audio is complete, so they trail its first audio by about the sentence's
generation time; WebRTC sends them when the sentence starts playing. Prints p50, p95 and the fastest per door and
concurrency and writes the samples and summaries as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from gateway.benchmarks.models import tiny_fixed_length_config
from gateway.benchmarks.settings import positive_int_list
from gateway.benchmarks.timing import ORPHEUS_TOKENS_PER_CHAR
from gateway.benchmarks.webrtc_level import served
from gateway.config import from_sources
from gateway.devtools.client import HeadlessPeer
from gateway.edge.cartesia_ws import CARTESIA_PATH
from gateway.media.avthreads import use_one_ffmpeg_thread

TEXT = "Good morning, class. Today we read a story."
DOORS = ("websocket", "webrtc", "http")
TIMEOUT_S = 120.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=TIMEOUT_S)


async def websocket_door(http: aiohttp.ClientSession, base: str, n: int) -> tuple[float, float]:
    """(first audio, first words) seconds of one context on Cartesia's protocol."""
    first_audio = first_words = None
    async with http.ws_connect(base.replace("http", "ws", 1) + CARTESIA_PATH) as ws:
        started = time.perf_counter()
        await ws.send_str(json.dumps({"context_id": f"u{n}", "transcript": TEXT, "continue": False,
                                      "voice": {"mode": "id", "id": "tara"}, "add_timestamps": True}))
        while True:
            message = json.loads((await ws.receive(timeout=TIMEOUT_S)).data)
            now = time.perf_counter() - started
            if message["type"] == "chunk" and first_audio is None:
                first_audio = now
            elif message["type"] == "timestamps" and first_words is None:
                first_words = now
            elif message["done"]:
                break
    assert first_audio is not None and first_words is not None, "no audio or no words"
    return first_audio, first_words


async def http_door(http: aiohttp.ClientSession, base: str, n: int) -> tuple[float, float]:
    """(first audio, first words) seconds of one SSE request with word timings."""
    first_audio = first_words = None
    started = time.perf_counter()
    body = {"model": "any", "input": TEXT, "voice": "tara", "response_format": "pcm", "stream_format": "sse",
            "word_timestamps": True}
    async with http.post(base + "/v1/audio/speech", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            kind = json.loads(line[6:])["type"]
            now = time.perf_counter() - started
            if kind == "speech.audio.delta" and first_audio is None:
                first_audio = now
            elif kind == "speech.audio.words" and first_words is None:
                first_words = now
    assert first_audio is not None and first_words is not None, "no audio or no words"
    return first_audio, first_words


async def webrtc_door(peer: HeadlessPeer, n: int) -> tuple[float, float]:
    """(first audio, first words) seconds of one `speak` on a connected peer."""
    uid = f"u{n}"
    sent = peer.speak(uid, TEXT)
    await peer.wait_event("done", uid, timeout=TIMEOUT_S)
    audible = peer.audible_frames(since=sent)
    assert audible, "no audible frame"
    return audible[0].at - sent, peer.event_time("words", uid) - sent


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1] if len(values) > 1 else values[0]


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p95_ms": percentile(ms, 95), "min_ms": min(ms)}


@contextlib.asynccontextmanager
async def local_gateway(root: Path, model: str | None, snac_model: str | None,
                        most_at_once: int) -> AsyncIterator[str]:
    """The gateway on loopback, in this process, around the tiny test model or the model given: its base url."""
    if model is None:
        config = tiny_fixed_length_config(root, max(8, most_at_once))
    else:
        config = from_sources(env={}, model=model, snac_model=snac_model, max_num_seqs=max(64, most_at_once),
                              max_tokens_per_char=ORPHEUS_TOKENS_PER_CHAR, host="127.0.0.1", port=0)
    async with served(config) as base_url:
        yield base_url


class Doors:
    """One client of every door: an HTTP session (websocket and SSE) and the connected WebRTC peers."""

    def __init__(self, base: str, http: aiohttp.ClientSession) -> None:
        self.base, self.http = base, http
        self.peers: list[HeadlessPeer] = []
        self.count = 0

    async def connect_peers(self, n: int) -> None:
        while len(self.peers) < n:
            new = [HeadlessPeer(self.base, jitter_buffer_ms=0) for _ in range(n - len(self.peers))]
            self.peers.extend(new)  # closed by close() even if a connect fails
            await asyncio.gather(*(peer.connect() for peer in new))

    async def close(self) -> None:
        await asyncio.gather(*(peer.close() for peer in self.peers), return_exceptions=True)

    async def round(self, door: str, at_once: int) -> list[tuple[float, float]]:
        """`at_once` utterances through `door` at the same time: their (first audio, first words) seconds."""
        if door == "webrtc":
            await self.connect_peers(at_once)
        firsts = []
        for k in range(at_once):
            self.count += 1
            if door == "websocket":
                firsts.append(websocket_door(self.http, self.base, self.count))
            elif door == "http":
                firsts.append(http_door(self.http, self.base, self.count))
            else:
                firsts.append(webrtc_door(self.peers[k], self.count))
        return list(await asyncio.gather(*firsts))


async def measure(base: str, concurrencies: list[int], utterances: int) -> dict[str, Any]:
    """Per concurrency and door, first audio and first words over `utterances` (whole rounds)."""
    samples: dict[int, dict[str, dict[str, list[float]]]] = {
        at_once: {door: {"first_audio": [], "first_words": []} for door in DOORS} for at_once in concurrencies}
    loads = []
    connector = aiohttp.TCPConnector(limit=0)  # every utterance its own connection
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as http:
        doors = Doors(base, http)
        try:
            for door in DOORS:  # warm each path up, not counted
                await doors.round(door, 1)
            for at_once in concurrencies:
                for _ in range(math.ceil(utterances / at_once)):
                    for door in DOORS:
                        for audio, words in await doors.round(door, at_once):
                            samples[at_once][door]["first_audio"].append(audio)
                            samples[at_once][door]["first_words"].append(words)
                        loads.append(os.getloadavg()[0])
                for door in DOORS:  # each concurrency's figures as soon as they are in
                    kinds = samples[at_once][door]
                    print(f"{door} x{at_once}: first audio p50 {statistics.median(kinds['first_audio']) * 1000:.0f} "
                          f"ms, first words p50 {statistics.median(kinds['first_words']) * 1000:.0f} ms", flush=True)
        finally:
            await doors.close()
    return {"text": TEXT, "utterances": utterances, "concurrency": concurrencies, "cpus": os.cpu_count(),
            "load_average": [min(loads), max(loads)],
            "results": {str(at_once): {door: {kind: summary(values) for kind, values in kinds.items()}
                                       for door, kinds in by_door.items()}
                        for at_once, by_door in samples.items()},
            "samples_s": {str(at_once): by_door for at_once, by_door in samples.items()}}


def print_table(result: dict[str, Any]) -> None:
    low, high = result["load_average"]
    print(f"{result['utterances']} utterances per door and concurrency; text {result['text']!r}; client load "
          f"average {low:.1f}-{high:.1f} on {result['cpus']} CPUs")
    print(f"{'door':10} {'at once':>7} {'first audio p50':>16} {'p95':>6} {'min':>6} {'first words p50':>16} "
          f"{'p95':>6} {'min':>6}")
    for at_once, by_door in result["results"].items():
        for door, kinds in by_door.items():
            audio, words = kinds["first_audio"], kinds["first_words"]
            print(f"{door:10} {at_once:>7} {audio['p50_ms']:16.0f} {audio['p95_ms']:6.0f} {audio['min_ms']:6.0f} "
                  f"{words['p50_ms']:16.0f} {words['p95_ms']:6.0f} {words['min_ms']:6.0f}")
    print("(ms from the client's send)")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.gateway_url:
        result = await measure(args.gateway_url.rstrip("/"), args.concurrency, args.utterances)
    else:
        with tempfile.TemporaryDirectory(prefix="orpheus-text-doors-") as tmp:
            async with local_gateway(Path(tmp), args.model, args.snac_model, max(args.concurrency)) as base:
                result = await measure(base, args.concurrency, args.utterances)
    result["gateway_url"] = args.gateway_url
    result["model"] = args.model or ("tiny" if not args.gateway_url else None)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=10, help="counted utterances per door and concurrency")
    parser.add_argument("--concurrency", type=positive_int_list, default=[1],
                        help="utterances at once per door, e.g. 1,64")
    parser.add_argument("--gateway-url", help="measure this running gateway (for a random-weight model, started "
                                              "with --max-tokens-per-char 6)")
    parser.add_argument("--model", help="serve this model here instead of the tiny one (e.g. a random-weight "
                                        "Orpheus-3B from `orpheus-gateway make-test-model --snac`)")
    parser.add_argument("--snac-model", help="the SNAC decoder of --model")
    parser.add_argument("--json", default="text_doors.json", help="where the samples and summaries go")
    args = parser.parse_args(argv)
    if args.utterances < 1:
        parser.error("--utterances must be >= 1")
    if args.gateway_url and args.model:
        parser.error("--gateway-url measures a gateway already running: leave --model out")
    if args.snac_model and not args.model:
        parser.error("--snac-model goes with --model")
    if not args.gateway_url:
        use_one_ffmpeg_thread()  # the gateway is served in this process
    result = asyncio.run(run(args))
    print_table(result)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
