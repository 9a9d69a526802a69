"""A class following one scripted lesson, with the phrase cache off and on, in the same run (tiny random model,
CPU): engine tokens generated, time to first audio of hits and misses, and streams that kept real time.

    .venv/bin/python -m gateway.benchmarks.class_sim                          # 6 students, 20 lines, 20 % free
    .venv/bin/python -m gateway.benchmarks.class_sim --students 8 --free 0.2

Each student is one client of `POST /v1/audio/speech` (pcm), saying the lesson's lines in order from a random line
and after a random delay (0-2 s), one at a time; each line is, with probability `--free`, a free line instead (text
no other student says, sent with `cache: false`, as an LLM tutor's answer would be). Scripted lines are sent with
`cache: true`. A scripted request counts as a hit when an earlier request for its line had finished (client side;
the gateway's hit counter is printed beside). TTFA: request to its first body bytes. Real time: every byte arrived
before a listener that starts 500 ms after the first audio would play it. Engine tokens: every token id the engine
yielded (counted around its generate). The same seeds drive both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.config import from_sources
from gateway.edge.app import create_app
from gateway.edge.http import GATEWAY_KEY
from gateway.orpheus import SAMPLE_RATE
from gateway.speech.synthesizer import Synthesizer

LESSON = [
    "Bom dia! Como você está?", "Good morning! How are you?", "Eu me chamo Ana.", "And what is your name?",
    "Nice to meet you!", "Onde fica a estação?", "The station is near here.", "Turn left at the corner.",
    "Obrigado, até amanhã.", "Thank you, see you tomorrow.", "Quanto custa isso?", "How much is this?",
    "É muito caro!", "It is too expensive.", "Você fala inglês?", "Do you speak English?", "Um pouco.",
    "Just a little.", "Com licença.", "Excuse me, please.",
]
BUFFER_S = 0.5  # the lessons' listener buffer
MAX_TOKENS = 140  # 20 frames, 1.7 s of audio at most per sentence
BYTES_PER_SAMPLE = 2


@dataclass
class Result:
    kind: str  # "hit", "miss" (scripted, first of its line or beside it) or "free"
    ttfa_s: float
    real_time: bool


@dataclass
class Run:
    mode: str
    tokens: int = 0
    results: list[Result] = field(default_factory=list)
    hits_counted: float = 0.0
    wall_s: float = 0.0


async def one_request(http: aiohttp.ClientSession, url: str, text: str, cache: bool) -> tuple[float, bool]:
    started = time.perf_counter()
    first_at: float | None = None
    received = 0
    late = False
    async with http.post(url, json={"input": text, "response_format": "pcm", "cache": cache}) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            if first_at is None:
                first_at = now
            elif now > first_at + BUFFER_S + received / BYTES_PER_SAMPLE / SAMPLE_RATE:
                late = True
            received += len(chunk)
    return ((first_at or time.perf_counter()) - started), not late


async def student(index: int, http: aiohttp.ClientSession, url: str, free: float, seed: int, done_lines: set[str],
                  run: Run) -> None:
    rng = random.Random(seed * 1000 + index)
    await asyncio.sleep(rng.uniform(0, 2.0))
    start = rng.randrange(len(LESSON))
    for step in range(len(LESSON)):
        if rng.random() < free:
            text, cache, kind = f"Student {index} asks a free question number {step}.", False, "free"
        else:
            text, cache = LESSON[(start + step) % len(LESSON)], True
            kind = "hit" if run.mode == "on" and text in done_lines else "miss"
        ttfa_s, real_time = await one_request(http, url, text, cache)
        if cache:
            done_lines.add(text)
        run.results.append(Result(kind, ttfa_s, real_time))


def counting(synthesizer: Synthesizer, run: Run) -> Any:
    """The engine's generate, counting every token id it yields into `run`."""
    real = synthesizer.engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[list[int]]:
        async for ids in real(*args, **kwargs):
            run.tokens += len(ids)
            yield ids

    return generate


async def simulate(mode: str, synthesizer: Synthesizer, config: Any, students: int, free: float, seed: int,
                   folder: Path) -> Run:
    run = Run(mode)
    cfg = replace(config, phrase_cache="marked" if mode == "on" else "off", phrase_cache_dir=str(folder / mode))
    real = synthesizer.engine.generate
    synthesizer.engine.generate = counting(synthesizer, run)  # type: ignore[method-assign]
    runner = web.AppRunner(create_app(cfg, synthesizer))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/audio/speech"
    done_lines: set[str] = set()
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(student(k, http, url, free, seed, done_lines, run) for k in range(students)))
        gateway = runner.app[GATEWAY_KEY]
        run.hits_counted = gateway.metrics.registry.get_sample_value("orpheus_phrase_cache_hits_total") or 0.0
    finally:
        run.wall_s = time.perf_counter() - started
        synthesizer.engine.generate = real  # type: ignore[method-assign]
        await runner.cleanup()
    return run


def p(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def report(runs: list[Run], students: int, free: float) -> str:
    lines = [f"{students} students x {len(LESSON)} lines, {free:.0%} free lines; CPU {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f}",
             "",
             "| cache | engine tokens | TTFA p50 / p95 hits (ms) | TTFA p50 / p95 misses (ms) | TTFA p50 / p95 free "
             "(ms) | real-time requests | gateway hits | wall (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        def ms(kind: str, q: int, run: Run = run) -> str:
            values = [r.ttfa_s * 1000 for r in run.results if r.kind == kind]
            return "-" if not values else f"{p(values, q):.0f}"
        held = sum(r.real_time for r in run.results)
        lines.append(f"| {run.mode} | {run.tokens} | {ms('hit', 50)} / {ms('hit', 95)} | {ms('miss', 50)} / "
                     f"{ms('miss', 95)} | {ms('free', 50)} / {ms('free', 95)} | {held} of {len(run.results)} | "
                     f"{run.hits_counted:.0f} | {run.wall_s:.0f} |")
    return "\n".join(lines)


async def measure(students: int, free: float, seed: int, root: Path) -> str:
    from gateway.devtools.devmodels import build_test_model, build_test_snac

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_test_model(root / "model", shape="tiny", stop_probability=0.0)
    snac = build_test_snac(root / "snac")
    config = from_sources(env={}, model=str(model), snac_model=str(snac), snac_device="cpu", enforce_eager=True,
                          max_model_len=1024, max_num_seqs=max(8, students), max_tokens=MAX_TOKENS,
                          dtype="float32", warmup_batch_sizes=[1], gc_freeze=False, host="127.0.0.1", port=0,
                          seed=seed)
    synthesizer = Synthesizer.load(config)
    await synthesizer.start()
    try:
        runs = [await simulate(mode, synthesizer, config, students, free, seed, root) for mode in ("off", "on")]
    finally:
        await synthesizer.close()
    return report(runs, students, free)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=6)
    parser.add_argument("--free", type=float, default=0.2, help="share of free (uncached) lines")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.students < 1 or not 0 <= args.free <= 1:
        parser.error("--students must be >= 1 and --free within 0..1")
    with tempfile.TemporaryDirectory(prefix="orpheus-class-sim-") as tmp:
        print(asyncio.run(measure(args.students, args.free, args.seed, Path(tmp))))


if __name__ == "__main__":
    main()
