"""A class following one scripted lesson, with the phrase cache off and on, in the same run: engine tokens generated,
time to first audio of hits and misses, and streams that kept real time. On the tiny random model (CPU) by default,
or against a gateway already running (`--gateway-url`, e.g. `serve --workers 8` on a GPU).

    .venv/bin/python -m gateway.benchmarks.class_sim                          # 6 students, 20 lines, 20 % free
    .venv/bin/python -m gateway.benchmarks.class_sim --students 8 --free 0.2
    python -m gateway.benchmarks.class_sim --gateway-url http://127.0.0.1:8800 --students 64,128,256,384

Each student is one client of `POST /v1/audio/speech` (pcm), saying the lesson's lines (20, or the first `--lines`)
in order from a random line and after a random delay (0-2 s), one at a time; each line is, with probability
`--free`, a free line instead (text no other student says, sent with `cache: false`, as an LLM tutor's answer would
be). One gateway serves both modes: it runs with `--phrase-cache marked` (the local gateway here does;
`--gateway-url` needs it), and the cache-off run sends the scripted lines with `cache: false` (the route then
neither reads nor keeps them: the path a `--phrase-cache off` deployment takes), the cache-on run with `cache:
true`. Each class size speaks in its own voice (a voice is part of the cache key), so every cache-on run starts
cold, in its off run's voice. A scripted request counts as a hit when an earlier request for its line had finished
(client side; the gateway's hit counter is printed beside). TTFA: request to its first body bytes. Real time: every
byte arrived before a listener that starts 500 ms after the first audio would play it; a student held real time when
every one of its requests did. Engine tokens: the gateway's `orpheus_audio_tokens_total` over the run (a single
flight's tokens counted once). The same seeds drive both modes. Writes the runs as JSON and prints a table.

Without `--listen` a student sends its next line as soon as the last one's body arrived, so cache hits (which
arrive in a burst) make students race through the scripted lines and the engine carries mostly free lines; with it
each student first waits until the line would have finished playing (first audio + 500 ms + the audio's duration),
as a student who listens to the whole line would.

The scripted-once bound (issue 38): with the cache on, the class should generate no more audio tokens than its free
lines plus each scripted sentence once (the gateway caches per sentence). Given the gateway's caps
(`--tokens-per-char` > 0, `--max-tokens`), each run reports `token_bound`: every free line's capped tokens (each is
unique) plus each distinct scripted sentence's cap once, over what that run's students said, and `tokens_vs_bound`
(engine tokens / bound; the target is at most 1.05 with the cache on). A sentence's cap is
`orpheus.sentence_token_cap`; with the random model (it never stops) the off run's tokens equal the sum of every
line's cap, so with a model that stops by itself the bound is an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.benchmarks.settings import positive_int_list
from gateway.config import GatewayConfig
from gateway.orpheus import ENGLISH_VOICES, SAMPLE_RATE, sentence_token_cap, split_sentences

LESSON = [
    "Bom dia! Como você está?", "Good morning! How are you?", "Eu me chamo Ana.", "And what is your name?",
    "Nice to meet you!", "Onde fica a estação?", "The station is near here.", "Turn left at the corner.",
    "Obrigado, até amanhã.", "Thank you, see you tomorrow.", "Quanto custa isso?", "How much is this?",
    "É muito caro!", "It is too expensive.", "Você fala inglês?", "Do you speak English?", "Um pouco.",
    "Just a little.", "Com licença.", "Excuse me, please.",
]
MODES = ("off", "on")
BUFFER_S = 0.5  # the lessons' listener buffer
BYTES_PER_SAMPLE = 2
TOKENS_METRIC = "orpheus_audio_tokens_total"
HITS_METRIC = "orpheus_phrase_cache_hits_total"
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
GATEWAY_MAX_TOKENS: int = GatewayConfig.max_tokens  # the gateway's default --max-tokens


@dataclass(frozen=True)
class TokenCaps:
    """The gateway's audio-token caps per sentence: its `--max-tokens-per-char` and `--max-tokens`."""
    tokens_per_char: float
    max_tokens: int

    def sentence(self, sentence: str) -> int:
        return sentence_token_cap(len(sentence), self.tokens_per_char, self.max_tokens)

    def line(self, text: str) -> int:
        return sum(self.sentence(s) for s in split_sentences(text))


@dataclass
class Result:
    student: int
    kind: str  # "hit", "miss" (scripted, first of its line or beside it) or "free"
    ttfa_s: float
    real_time: bool
    text: str
    audio_s: float  # the audio received, at SAMPLE_RATE 16-bit mono


@dataclass
class Run:
    mode: str
    students: int
    voice: str
    tokens: float = 0.0
    results: list[Result] = field(default_factory=list)
    hits_counted: float = 0.0
    wall_s: float = 0.0
    token_bound: int | None = None  # known when the gateway's caps are


def token_bound(results: list[Result], caps: TokenCaps) -> int:
    """The scripted-once bound of what `results` said: every free line's cap (each is unique) plus each distinct
    scripted sentence's cap once."""
    free = sum(caps.line(r.text) for r in results if r.kind == "free")
    scripted = {sentence for r in results if r.kind != "free" for sentence in split_sentences(r.text)}
    return free + sum(caps.sentence(s) for s in scripted)


@dataclass
class Response:
    started: float  # perf_counter at the request
    first_at: float  # perf_counter at its first body bytes (at its end when it had none)
    audio_s: float
    real_time: bool

    @property
    def ttfa_s(self) -> float:
        return self.first_at - self.started

    @property
    def played_at(self) -> float:
        """When a listener who started BUFFER_S after the first audio has heard all of it."""
        return self.first_at + BUFFER_S + self.audio_s


async def one_request(http: aiohttp.ClientSession, url: str, text: str, voice: str, cache: bool) -> Response:
    started = time.perf_counter()
    first_at: float | None = None
    received = 0
    late = False
    body = {"input": text, "voice": voice, "response_format": "pcm", "cache": cache}
    async with http.post(url, json=body) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            if first_at is None:
                first_at = now
            elif now > first_at + BUFFER_S + received / BYTES_PER_SAMPLE / SAMPLE_RATE:
                late = True
            received += len(chunk)
    if first_at is None:
        first_at = time.perf_counter()
    return Response(started, first_at, received / BYTES_PER_SAMPLE / SAMPLE_RATE, not late)


async def student(index: int, http: aiohttp.ClientSession, url: str, lesson: list[str], free: float, seed: int,
                  done_lines: set[str], run: Run, listen: bool = False) -> None:
    rng = random.Random(seed * 1000 + index)
    await asyncio.sleep(rng.uniform(0, 2.0))
    start = rng.randrange(len(lesson))
    for step in range(len(lesson)):
        if rng.random() < free:
            text, cache, kind = f"Student {index} asks a free question number {step}.", False, "free"
        else:
            text, cache = lesson[(start + step) % len(lesson)], run.mode == "on"
            kind = "hit" if cache and text in done_lines else "miss"
        response = await one_request(http, url, text, run.voice, cache)
        done_lines.add(text)
        run.results.append(Result(index, kind, response.ttfa_s, response.real_time, text, response.audio_s))
        if listen:
            await asyncio.sleep(max(0.0, response.played_at - time.perf_counter()))


async def counters(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The gateway's tokens and phrase-cache hits so far, summed over its processes (its merged /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"{base}/metrics") as resp:
        resp.raise_for_status()
        exposition = await resp.text()
    sums = dict.fromkeys((TOKENS_METRIC, HITS_METRIC), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


async def simulate(base: str, mode: str, students: int, voice: str, lesson: list[str], free: float,
                   seed: int, caps: TokenCaps | None = None, listen: bool = False) -> Run:
    run = Run(mode, students, voice)
    done_lines: set[str] = set()
    connector = aiohttp.TCPConnector(limit=0)  # every student its own connection
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as http:
        before = await counters(http, base)
        started = time.perf_counter()
        await asyncio.gather(*(student(k, http, f"{base}/v1/audio/speech", lesson, free, seed, done_lines, run,
                                       listen) for k in range(students)))
        run.wall_s = time.perf_counter() - started
        after = await counters(http, base)
    run.tokens = after[TOKENS_METRIC] - before[TOKENS_METRIC]
    run.hits_counted = after[HITS_METRIC] - before[HITS_METRIC]
    if caps is not None:
        run.token_bound = token_bound(run.results, caps)
    return run


async def measure(base: str, sizes: list[int], lines: int, free: float, seed: int,
                  save: Callable[[list[Run]], None] | None = None, *, caps: TokenCaps | None = None,
                  listen: bool = False) -> list[Run]:
    """Each class size, cache off then on, in its own voice, on the lesson's first `lines` lines; `save` gets the
    runs so far after each (a run cut short by a time limit keeps those). With the gateway's `caps`, each run gets
    its `token_bound`; with `listen`, each student hears every line out before its next."""
    runs = []
    for size, voice in zip(sizes, ENGLISH_VOICES, strict=False):
        for mode in MODES:
            runs.append(await simulate(base, mode, size, voice, LESSON[:lines], free, seed, caps, listen))
            print(report([runs[-1]], lines, free, listen).splitlines()[-1], flush=True)
            if save is not None:
                save(runs)
    return runs


@contextlib.asynccontextmanager
async def local_gateway(max_students: int, seed: int, root: Path, caps: TokenCaps) -> AsyncIterator[str]:
    """The tiny random model served on loopback with `--phrase-cache marked` and `caps`: its base url."""
    from gateway.benchmarks.models import tiny_fixed_length_config
    from gateway.benchmarks.webrtc_level import served

    config = tiny_fixed_length_config(root, max(8, max_students), seed=seed, phrase_cache="marked",
                                      phrase_cache_dir=str(root / "phrases"), max_tokens=caps.max_tokens,
                                      max_tokens_per_char=caps.tokens_per_char)
    async with served(config) as base_url:
        yield base_url


def p(values: list[float], q: int) -> float | None:
    if not values:
        return None  # JSON null
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(run: Run) -> dict[str, Any]:
    """The run's figures: tokens, TTFA p50/p95 (ms) per kind, real-time requests and students held."""
    ttfa = {}
    for kind in ("hit", "miss", "free"):
        values = [r.ttfa_s * 1000 for r in run.results if r.kind == kind]
        ttfa[kind] = {"n": len(values), "p50_ms": p(values, 50), "p95_ms": p(values, 95)}
    bound = run.token_bound
    return {"mode": run.mode, "students": run.students, "voice": run.voice, "engine_tokens": run.tokens,
            "token_bound": bound, "tokens_vs_bound": run.tokens / bound if bound else None, "ttfa": ttfa,
            "requests": len(run.results), "real_time_requests": sum(r.real_time for r in run.results),
            "real_time_students": run.students - len({r.student for r in run.results if not r.real_time}),
            "gateway_hits": run.hits_counted, "wall_s": run.wall_s}


def report(runs: list[Run], lesson_lines: int, free: float, listen: bool = False) -> str:
    bounded = any(run.token_bound is not None for run in runs)
    lines = [f"{lesson_lines} lines per student, {free:.0%} free lines"
             f"{', each heard out before the next' if listen else ''}; client host {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f}; real time at a {BUFFER_S * 1000:.0f} ms buffer",
             "",
             "| students | cache | engine tokens |" + (" token bound | tokens / bound |" if bounded else "") +
             " TTFA p50 / p95 hits (ms) | TTFA p50 / p95 misses (ms) | TTFA p50 / p95 free (ms) | real-time requests |"
             " real-time students | gateway hits | wall (s) |",
             "|---|---|---|" + ("---|---|" if bounded else "") + "---|---|---|---|---|---|---|"]
    for run in runs:
        figures = summary(run)

        def ms(kind: str, figures: dict[str, Any] = figures) -> str:
            row = figures["ttfa"][kind]
            return "-" if not row["n"] else f"{row['p50_ms']:.0f} / {row['p95_ms']:.0f}"
        bound = "" if not bounded else (" - | - |" if figures["tokens_vs_bound"] is None else
                                        f" {run.token_bound} | {figures['tokens_vs_bound']:.2f} |")
        lines.append(f"| {run.students} | {run.mode} | {run.tokens:.0f} |{bound} {ms('hit')} | {ms('miss')} | "
                     f"{ms('free')} | {figures['real_time_requests']} of {figures['requests']} | "
                     f"{figures['real_time_students']} of {run.students} | {run.hits_counted:.0f} | {run.wall_s:.0f} |")
    return "\n".join(lines)


def save_json(args: argparse.Namespace, runs: list[Run]) -> None:
    Path(args.json).write_text(json.dumps({"free": args.free, "lines": args.lines, "buffer_s": BUFFER_S,
                                           "listen": args.listen, "tokens_per_char": args.tokens_per_char,
                                           "max_tokens": gateway_caps(args).max_tokens,
                                           "gateway_url": args.gateway_url, "runs": [summary(r) for r in runs],
                                           "samples": [[asdict(x) for x in r.results] for r in runs]},
                                          indent=1, allow_nan=False))


def gateway_caps(args: argparse.Namespace) -> TokenCaps:
    """The caps the gateway runs with: the flags', `--max-tokens` defaulting to the gateway's own default (the
    local gateway's: the tiny model's sentence length)."""
    from gateway.benchmarks.models import TINY_MAX_TOKENS

    default = GATEWAY_MAX_TOKENS if args.gateway_url else TINY_MAX_TOKENS
    return TokenCaps(args.tokens_per_char, default if args.max_tokens is None else args.max_tokens)


async def main_async(args: argparse.Namespace) -> list[Run]:
    def save(runs: list[Run]) -> None:
        save_json(args, runs)

    caps = gateway_caps(args)
    known = caps if caps.tokens_per_char > 0 else None
    if args.gateway_url:
        return await measure(args.gateway_url.rstrip("/"), args.students, args.lines, args.free, args.seed, save,
                             caps=known, listen=args.listen)
    with tempfile.TemporaryDirectory(prefix="orpheus-class-sim-") as tmp:
        async with local_gateway(max(args.students), args.seed, Path(tmp), caps) as base:
            return await measure(base, args.students, args.lines, args.free, args.seed, save, caps=known,
                                 listen=args.listen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=positive_int_list, default=[6], help="class sizes, e.g. 64,128,256,384")
    parser.add_argument("--lines", type=int, default=len(LESSON), help="the lesson's length (its first lines)")
    parser.add_argument("--free", type=float, default=0.2, help="share of free (uncached) lines")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gateway-url", help="measure this running gateway (started with --phrase-cache marked "
                                              "and, for a random-weight model, --max-tokens-per-char 6: "
                                              "pass it as --tokens-per-char)")
    parser.add_argument("--tokens-per-char", type=float, default=0.0,
                        help="the gateway's --max-tokens-per-char (0: unknown); > 0 reports the scripted-once bound")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"the gateway's --max-tokens (default: its default, {GATEWAY_MAX_TOKENS}; the local "
                             "gateway's: the tiny model's sentence length)")
    parser.add_argument("--listen", action="store_true",
                        help="each student hears every line out (first audio + buffer + its duration) before its next")
    parser.add_argument("--json", default="class_sim.json", help="where the runs go")
    args = parser.parse_args(argv)
    if args.tokens_per_char < 0:
        parser.error("--tokens-per-char must be >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error("--max-tokens must be positive")
    if not 0 <= args.free <= 1:
        parser.error("--free must be within 0..1")
    if not 1 <= args.lines <= len(LESSON):
        parser.error(f"--lines must be within 1..{len(LESSON)}")
    if len(args.students) > len(ENGLISH_VOICES):
        parser.error(f"at most {len(ENGLISH_VOICES)} class sizes (each speaks in its own voice)")
    runs = asyncio.run(main_async(args))
    print(report(runs, args.lines, args.free, args.listen))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
