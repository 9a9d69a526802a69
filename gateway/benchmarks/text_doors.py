"""First audio and first word timings through each door that sends them: the streaming WebSocket (Cartesia's
protocol, `/tts/websocket`), WebRTC (the `control` channel and the audio track) and the speech route's SSE
(`word_timestamps`), on the tiny random model (CPU).

    .venv/bin/python -m gateway.benchmarks.text_doors                       # 10 utterances per door
    .venv/bin/python -m gateway.benchmarks.text_doors --utterances 20 --json text_doors.json

Builds the tiny test model and SNAC, serves the gateway on loopback and speaks one utterance at a time, the doors
taken in turn (websocket, webrtc, http, websocket, ...) so that the machine's load touches each alike; the first
round warms up and is not counted. Every utterance is two sentences of the same text with the same length (the
model never stops by itself: `MAX_TOKENS` per sentence). Measured per utterance, from the client's send:
- first audio: the first audio bytes (websocket `chunk`, SSE `speech.audio.delta`) or the first audible 20 ms frame
  decoded from the WebRTC track (jitter buffer 0, so the track holds nothing back on purpose);
- first words: the first sentence's word timings (websocket `timestamps`, SSE `speech.audio.words`, WebRTC `words`).
A sentence's words are made once its audio is complete, so they trail its first audio by about the sentence's
generation time; WebRTC sends them when the sentence starts playing. Prints p50, p90 and the fastest per door and
writes the samples and summaries as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.config import from_sources
from gateway.devtools.client import HeadlessPeer
from gateway.edge.app import create_app
from gateway.edge.cartesia_ws import CARTESIA_PATH
from gateway.media.avthreads import use_one_ffmpeg_thread
from gateway.speech.synthesizer import Synthesizer

TEXT = "Good morning, class. Today we read a story."
MAX_TOKENS = 140  # 20 frames, 1.7 s of audio per sentence: every utterance makes the same amount
DOORS = ("websocket", "webrtc", "http")
TIMEOUT_S = 120.0


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
    return {"p50_ms": statistics.median(ms), "p90_ms": percentile(ms, 90), "min_ms": min(ms)}


async def measure(utterances: int, root: Path) -> dict[str, Any]:
    from gateway.devtools.devmodels import build_test_model, build_test_snac

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_test_model(root / "model", shape="tiny", stop_probability=0.0)
    snac = build_test_snac(root / "snac")
    config = from_sources(env={}, model=str(model), snac_model=str(snac), snac_device="cpu", enforce_eager=True,
                          max_model_len=1024, max_num_seqs=8, max_tokens=MAX_TOKENS, dtype="float32",
                          warmup_batch_sizes=[1], gc_freeze=False, host="127.0.0.1", port=0)
    synthesizer = Synthesizer.load(config)
    await synthesizer.start()
    runner = web.AppRunner(create_app(config, synthesizer))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    samples: dict[str, dict[str, list[float]]] = {door: {"first_audio": [], "first_words": []} for door in DOORS}
    loads = []
    try:
        peer = HeadlessPeer(base, jitter_buffer_ms=0)
        await peer.connect()
        async with aiohttp.ClientSession() as http:
            for round_ in range(utterances + 1):
                for door in DOORS:
                    n = round_ * len(DOORS) + DOORS.index(door)
                    if door == "websocket":
                        audio, words = await websocket_door(http, base, n)
                    elif door == "http":
                        audio, words = await http_door(http, base, n)
                    else:
                        audio, words = await webrtc_door(peer, n)
                    if round_:  # round 0 warms each path up
                        samples[door]["first_audio"].append(audio)
                        samples[door]["first_words"].append(words)
                loads.append(os.getloadavg()[0])
        await peer.close()
    finally:
        await runner.cleanup()
        await synthesizer.close()
    return {"text": TEXT, "utterances": utterances, "max_tokens_per_sentence": MAX_TOKENS, "cpus": os.cpu_count(),
            "load_average": [min(loads), max(loads)],
            "doors": {door: {kind: summary(values) for kind, values in kinds.items()}
                      for door, kinds in samples.items()},
            "samples_s": samples}


def print_table(result: dict[str, Any]) -> None:
    low, high = result["load_average"]
    print(f"{result['utterances']} utterances per door, one at a time; text {result['text']!r}; load average "
          f"{low:.1f}-{high:.1f} on {result['cpus']} CPUs")
    print(f"{'door':10} {'first audio p50':>16} {'p90':>6} {'min':>6} {'first words p50':>16} {'p90':>6} {'min':>6}")
    for door, kinds in result["doors"].items():
        audio, words = kinds["first_audio"], kinds["first_words"]
        print(f"{door:10} {audio['p50_ms']:16.0f} {audio['p90_ms']:6.0f} {audio['min_ms']:6.0f} "
              f"{words['p50_ms']:16.0f} {words['p90_ms']:6.0f} {words['min_ms']:6.0f}")
    print("(ms from the client's send)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=10, help="counted utterances per door")
    parser.add_argument("--json", default="text_doors.json", help="where the samples and summaries go")
    args = parser.parse_args()
    if args.utterances < 1:
        parser.error("--utterances must be >= 1")
    use_one_ffmpeg_thread()  # the gateway is served in this process
    with tempfile.TemporaryDirectory(prefix="orpheus-text-doors-") as tmp:
        result = asyncio.run(measure(args.utterances, Path(tmp)))
    print_table(result)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
