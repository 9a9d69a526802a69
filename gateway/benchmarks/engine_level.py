"""Engine level: each user's phrases go straight into `Synthesizer.utterance` in this process (no network).
Bare level (`vllm`): the same phrases straight into the engine, no SNAC: the ceiling to compare with.

Every audio chunk's arrival time and length are recorded; so are the first generated token and the first
complete SNAC frame (7 audio tokens), which `TimedStats` notices as the synthesizer counts tokens. A request speaks
in its voice (routed to that voice's model, or LoRA adapter); in mixed-language text, the chunks that begin a span of
another voice are marked, so the stall check counts the underruns at span boundaries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.benchmarks.budget import prompt_of, spoken_sentences
from gateway.benchmarks.records import MS, PlannedRequest, RequestRecord, apply_arrivals, new_record
from gateway.benchmarks.settings import BenchOptions
from gateway.benchmarks.timing import FRAME_TOKENS
from gateway.orpheus import END_OF_SPEECH_ID, SAMPLE_RATE, SAMPLES_PER_FRAME
from gateway.speech.synthesizer import Synthesizer, UtteranceStats

START_FRAMES = 16  # frames whose arrival times a record keeps (with --keep-arrivals)


@dataclass
class TimedStats(UtteranceStats):
    """UtteranceStats that also notes when the first whole SNAC frame (7 tokens) and the last token arrived.

    The synthesizer adds each engine output's ids to `tokens`; the prompt ends with start-of-speech, so
    every generated id is an audio id until the stop id.
    """

    first_frame_at: float | None = None
    last_token_at: float | None = None
    # When each of the first START_FRAMES frames was whole: with the audio's arrivals they separate a slow
    # start of generation from a slow first decode (the 0 ms listeners' stalls come in the first pieces).
    frames_at: list[float] = field(default_factory=list)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "tokens" and value > 0:
            now = time.monotonic()
            object.__setattr__(self, "last_token_at", now)
            if value >= FRAME_TOKENS and self.first_frame_at is None:
                object.__setattr__(self, "first_frame_at", now)
            whole = min(value // FRAME_TOKENS, START_FRAMES)
            self.frames_at.extend([now] * (whole - len(self.frames_at)))


async def run_point(synth: Synthesizer, workload: Sequence[Sequence[PlannedRequest]], options: BenchOptions
                    ) -> list[RequestRecord]:
    """All users at once; each speaks its phrases one after the other."""
    origin = time.monotonic()
    per_user = await asyncio.gather(*(_run_user(synth, requests, options, origin) for requests in workload))
    return [record for records in per_user for record in records]


async def _run_user(synth: Synthesizer, requests: Sequence[PlannedRequest], options: BenchOptions, origin: float
                    ) -> list[RequestRecord]:
    return [await _run_request(synth, request, options, origin, _sent_at(k, origin))
            for k, request in enumerate(requests)]


def _sent_at(index: int, origin: float) -> float:
    """When a user's `index`-th phrase was asked for: its first at the point's start, each later one when the one
    before it ended (now). Not when this process got round to it: at both levels, a burst's requests then wait
    for those before them (the bare level builds and submits each prompt in turn, tens of ms for a burst of 256),
    and that wait is part of the time to first token a user sees."""
    return origin if index == 0 else time.monotonic()


async def _run_request(synth: Synthesizer, request: PlannedRequest, options: BenchOptions, origin: float,
                       sent_at: float, bare: bool = False) -> RequestRecord:
    """One request's record: through the gateway's synthesizer, or with `bare` the engine's tokens alone (a frame
    counts when its 7th token arrives)."""
    # The gateway's deadlines count the listener's buffer; the bare level has none.
    stats = (TimedStats(started=sent_at) if bare
             else TimedStats(started=sent_at, listener_buffer_s=options.listener_buffer_ms / MS))
    record = new_record(request, stats.started - origin)
    arrivals: list[tuple[float, float]] = []
    starts = span_starts(synth, request)
    record.boundaries = len(starts) if starts else None
    boundary_chunks: list[int] = []
    produce = _generate_bare if bare else _collect
    try:
        await asyncio.wait_for(produce(synth, request, stats, arrivals, starts, boundary_chunks),
                               options.request_timeout_s)
        record.ok = bool(arrivals)
        record.error = None if arrivals else "no_audio"
    except Exception as exc:  # one failed stream is a data point, not the end of the run
        record.error = f"{type(exc).__name__}: {exc}"
    _fill_engine_figures(record, stats, arrivals)
    if bare:
        record.ttfa_ms = None  # set by apply_arrivals from the first whole frame
    apply_arrivals(record, arrivals, options.buffers_ms, options.stall_tolerance_ms, options.keep_arrivals,
                   boundary_chunks=boundary_chunks if starts else None)
    return record


def span_starts(synth: Synthesizer, request: PlannedRequest) -> set[int]:
    """The indexes of the sentences that begin a span of another voice than the sentence before (none for text
    without `<lang>` spans)."""
    voices = [voice for _, voice in spoken_sentences(synth, request.phrase.text, synth.resolve_voice(request.voice))]
    return {k for k in range(1, len(voices)) if voices[k] != voices[k - 1]}


async def _collect(synth: Synthesizer, request: PlannedRequest, stats: TimedStats,
                   arrivals: list[tuple[float, float]], starts: set[int], boundary_chunks: list[int]) -> None:
    async for chunk in synth.utterance(request.phrase.text, request.voice, stats=stats):
        if chunk.first_of_sentence and chunk.sentence_index in starts:
            boundary_chunks.append(len(arrivals))
        arrivals.append((time.monotonic() - stats.started, len(chunk.pcm) / SAMPLE_RATE))


def _fill_engine_figures(record: RequestRecord, stats: TimedStats, arrivals: list[tuple[float, float]]) -> None:
    record.tokens = stats.tokens
    record.ttft_ms = _ms_after(stats.first_token_at, stats.started)
    record.ttff_ms = _ms_after(stats.first_frame_at, stats.started)
    record.ttfw_ms = _ms_after(stats.first_window_at, stats.started)
    record.generated_ms = _ms_after(stats.last_token_at, stats.started)
    record.frames_at_ms = [round((at - stats.started) * MS, 2) for at in stats.frames_at]
    if arrivals:
        record.done_ms = round(arrivals[-1][0] * MS, 2)


def _ms_after(at: float | None, start: float) -> float | None:
    return None if at is None else round((at - start) * MS, 2)


# --- bare engine: the same phrases and budgets, no SNAC, no playout ----------------------------------

async def run_point_bare(synth: Synthesizer, workload: Sequence[Sequence[PlannedRequest]], options: BenchOptions
                         ) -> list[RequestRecord]:
    """The vLLM engine alone, driven like the gateway drives it: the ceiling the gateway is compared with.

    Each sentence's prompt goes to `synth.engine.generate` (sentences of a phrase in turn, as the synthesizer
    does); frame j counts as arrived once its 7th token has, so a stream's arrivals are what an ideal,
    instant decoder would emit. The ratio gateway / bare at the same point is the gateway's overhead.
    """
    origin = time.monotonic()
    per_user = await asyncio.gather(*(_run_user_bare(synth, requests, options, origin) for requests in workload))
    return [record for records in per_user for record in records]


async def _run_user_bare(synth: Synthesizer, requests: Sequence[PlannedRequest], options: BenchOptions,
                         origin: float) -> list[RequestRecord]:
    return [await _run_request(synth, request, options, origin, _sent_at(k, origin), bare=True)
            for k, request in enumerate(requests)]


async def _generate_bare(synth: Synthesizer, request: PlannedRequest, stats: TimedStats,
                         arrivals: list[tuple[float, float]], starts: set[int], boundary_chunks: list[int]) -> None:
    frame_s = SAMPLES_PER_FRAME / SAMPLE_RATE
    voice = synth.resolve_voice(request.voice)
    for index, (sentence, sentence_voice) in enumerate(spoken_sentences(synth, request.phrase.text, voice)):
        model, lora = synth.table.engine_of(sentence_voice)
        prompt = prompt_of(synth, sentence_voice, sentence)
        sentence_tokens = 0
        if index in starts:
            boundary_chunks.append(len(arrivals))  # the sentence's first frame, whenever it comes
        async for ids in synth.engines[model].generate(prompt, lora=lora):
            now = time.monotonic()
            if stats.first_token_at is None:
                stats.first_token_at = now
            audio = [i for i in ids if i != END_OF_SPEECH_ID]
            frames_before = sentence_tokens // FRAME_TOKENS
            sentence_tokens += len(audio)
            stats.tokens += len(audio)
            arrivals += [(now - stats.started, frame_s)] * (sentence_tokens // FRAME_TOKENS - frames_before)
