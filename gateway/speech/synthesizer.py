"""Text in, 24 kHz PCM out: the one interface every front end (HTTP, WebRTC, CLI, benchmarks) uses.

text -> sentences -> prompt ids -> engine token ids -> SNAC frames -> the exact streaming SNAC decoder (in this
process or in the shared SNAC process) -> PCM chunks.

Sentences of one utterance play back to back: the next sentence's generation starts as soon as the
previous one has finished generating (its audio is still being decoded and played), so there is no gap
at the join, and a short fade at each join keeps it free of clicks. The request rules and the sentences a text is
cut into are `utterance_text`'s; what a configuration must find before it loads is `checkpoints`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from gateway.config import GatewayConfig
from gateway.orpheus import (
    SAMPLE_RATE,
    SLOTS_PER_FRAME,
    AudioTokenParser,
    Frame,
    build_prompt,
    sentence_token_cap,
)
from gateway.speech.checkpoints import require_checkpoints
from gateway.speech.codec.client import CodecStreamClient, wait_for_server
from gateway.speech.decoder import Decoder, DecoderSettings, load_stream_decoder
from gateway.speech.engine import EngineBase, OrpheusEngine
from gateway.speech.first_audio import FAST_START_BURST_WINDOW_S, fast_start_in_time, fast_start_margin_s
from gateway.speech.remote import RemoteEngine
from gateway.speech.stream_decoder import FIRST_AUDIO_LOOKAHEAD, DecodeStream
from gateway.speech.utterance_text import VoicedSentence, check_text, choose_voice, voiced_sentences

log = logging.getLogger(__name__)

_T = TypeVar("_T")
FIRST_TOKENS_KEPT = 1024  # recent first tokens a fast start looks back over: a larger burst still reads as one


@dataclass(frozen=True)
class ModelStats:
    """One served model's engine (`/metrics`): ready, requests running and sent, audio tokens generated."""

    ready: bool
    in_flight: int
    requests: int
    tokens: int


@dataclass
class AudioChunk:
    """A piece of an utterance's audio: 24 kHz mono int16."""

    pcm: np.ndarray
    sentence_index: int
    sentence_text: str
    first_of_sentence: bool
    last_of_sentence: bool = False  # its sentence's audio is complete (word timings can be made now)


# The lead of an utterance its listener's playout no longer has (a barge-in dropped it): nobody hears the rest,
# so its last frames wait for any step instead of being stepped first. Finite: the codec client sends leads as ms.
UNHEARD_LEAD_S = 60.0


@dataclass
class UtteranceStats:
    """What happened while one utterance was made (for events, metrics and benchmarks)."""

    started: float = field(default_factory=time.monotonic)
    # Audio the listener holds back before it plays (its jitter buffer): it counts toward the lead the decoder
    # orders streams by, so a buffered listener's stream waits for one that plays what it gets at once. A model of
    # a listener that starts a fixed time after the first audio; `playout_lead_s` replaces it where the playout
    # is known.
    listener_buffer_s: float = 0.0
    # The listener's own playout, when it is in this process (a WebRTC session's track): how long it can play on
    # from the audio it holds of this utterance (`PlayoutTrack.lead_s`); None once the utterance left it (then
    # nobody hears the rest). Called from the SNAC decoder's thread. It is the lead itself, not a model of it: a
    # buffer that fills fast starts playing sooner than a model says (docs/decisions/snac-step-timing.md).
    playout_lead_s: Callable[[], float | None] | None = None
    # Whether that lead is running down now (`PlayoutTrack.lead_runs`): not while the listener waits for this
    # utterance's first audio or its buffer to fill. The shared SNAC process models the lead between the reports
    # it gets, and without this ran a waiting listener's lead down, which held first audio longer.
    playout_lead_runs: Callable[[], bool] | None = None
    first_token_at: float | None = None
    first_window_at: float | None = None  # the first frames went to the SNAC decoder (first audio = this + decode)
    first_audio_at: float | None = None
    finished_at: float | None = None
    sentences: int = 0
    tokens: int = 0
    frames: int = 0
    samples: int = 0
    ignored_ids: int = 0
    dropped_tokens: int = 0

    @property
    def audio_s(self) -> float:
        return self.samples / SAMPLE_RATE

    @property
    def synthesis_s(self) -> float | None:
        """Request to last audio made (None while it is being made)."""
        return None if self.finished_at is None else self.finished_at - self.started

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def ttfa_s(self) -> float | None:
        return None if self.first_audio_at is None else self.first_audio_at - self.started


_END = object()  # end of one sentence's chunk queue
# Stream slots beyond the engine's sequences: a sentence's slot is freed only after its last audio is out, while
# the next sentence of the same utterance may already be generating.
STREAM_SLOT_SPARE = 64


class Synthesizer:
    """Owns the engine, the tokenizer and the SNAC decoder; hands out audio streams."""

    def __init__(self, config: GatewayConfig, engine: EngineBase, tokenizer: Any, decoder: Decoder, *,
                 engines: Mapping[str, EngineBase] | None = None, tokenizers: Mapping[str, Any] | None = None
                 ) -> None:
        self.config = config
        self.table = config.model_table
        first = next(iter(self.table.bases))
        # One engine and tokenizer per model of the table (`engine`, `tokenizer`: the first model's); each sentence
        # goes to its voice's model's engine.
        self.engines: dict[str, EngineBase] = dict(engines) if engines else {first: engine}
        self.tokenizers: dict[str, Any] = dict(tokenizers) if tokenizers else {first: tokenizer}
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_tokens = dict.fromkeys(self.engines, 0)  # audio tokens generated per model (`/metrics`)
        self.decoder = decoder
        self.voices = list(config.voice_list)
        self.voice_aliases = config.voice_aliases  # OpenAI's names and --voice-alias (HTTP and streaming doors)
        self._fade_samples = int(SAMPLE_RATE * config.seam_fade_ms / 1000)
        self._fast_start_s = config.decode_fast_start_ms / 1000
        # When recent sentences got their first tokens (monotonic, oldest first): whether a burst starts beside one
        # decides its fast start's margin (`_next_frames_in_time`). Bounded: a burst larger than this reads as one.
        self._first_tokens: deque[float] = deque(maxlen=FIRST_TOKENS_KEPT)
        # Sentences whose request went to the engine and whose first token has not come: their prefills are still
        # ahead of it, so no sentence takes the fast start meanwhile (`first_audio.fast_start_margin_s`).
        self._awaiting_first_token = 0
        # A decoder in this process is ready once built; a shared SNAC process once it listens (`start`).
        self.decoder_ready = not config.snac_socket

    @classmethod
    def load(cls, config: GatewayConfig) -> Synthesizer:
        """Load tokenizer and SNAC (fast); the engine still has to be started with `start()`.

        With `vllm_urls` set, tokens come from those `vllm serve` servers and no in-process engine is made.
        """
        from transformers import AutoTokenizer

        require_checkpoints(config)
        engines: dict[str, EngineBase] = {}
        tokenizers: dict[str, Any] = {}
        loaded: dict[str, Any] = {}  # tokenizer path -> tokenizer (models of one base share it)
        for name in config.model_table.bases:  # LoRA adapters run on their base's engine
            model_config = config.for_model(name) if config.model_table.several else config
            path = config.tokenizer or model_config.model
            if path not in loaded:
                loaded[path] = AutoTokenizer.from_pretrained(path)
            tokenizers[name] = loaded[path]
            engines[name] = RemoteEngine(model_config) if model_config.vllm_urls else OrpheusEngine(model_config)
        decoder = _stream_decoder(config)
        first = next(iter(engines))
        return cls(config, engines[first], tokenizers[first], decoder, engines=engines, tokenizers=tokenizers)

    async def start(self) -> None:
        """Start the engine and, beside it, wait for the shared SNAC process (`snac_socket`) to listen."""
        waiting = asyncio.create_task(self.wait_for_decoder())
        try:
            await asyncio.gather(*(self._start_engine(name, engine) for name, engine in self.engines.items()))
            await waiting
        finally:
            waiting.cancel()  # the engine failed or start was cancelled: stop waiting too (no-op once done)

    async def _start_engine(self, name: str, engine: EngineBase) -> None:
        """Start one model's engine; one that fails fails the start-up, naming its model."""
        try:
            await engine.start()
        except Exception:
            if self.table.several:
                log.error("the engine of model %r (%s) did not start", name, self.table.models[name].path)
            raise

    async def wait_for_decoder(self) -> None:
        if not self.decoder_ready and self.config.snac_socket:
            await wait_for_server(self.config.snac_socket)
        self.decoder_ready = True

    @property
    def ready(self) -> bool:
        """Both halves can take sentences: the engine is up and the SNAC decoder reachable."""
        return self.decoder_ready and all(engine.ready for engine in self.engines.values())

    def model_stats(self) -> dict[str, ModelStats]:
        """Each model's engine for `/metrics`: ready, requests running and sent, audio tokens generated."""
        return {name: ModelStats(engine.ready, engine.in_flight, engine.requests_started,
                                       self.model_tokens[name]) for name, engine in self.engines.items()}

    def not_ready_engines(self) -> dict[str, str]:
        """Model -> engine state of the models whose engine is not ready (`/readyz`)."""
        return {name: engine.state.value for name, engine in self.engines.items() if not engine.ready}

    async def close(self) -> None:
        await asyncio.gather(*(engine.close() for engine in self.engines.values()))
        await asyncio.to_thread(self.decoder.close)

    # --- validation -------------------------------------------------------------------------------
    def resolve_voice(self, voice: str | None, language: str | None = None) -> str:
        return choose_voice(self.config, voice, language, self.voice_aliases)


    def check_text(self, text: Any) -> str:
        return check_text(text, self.config.max_text_chars)

    # --- streaming --------------------------------------------------------------------------------
    async def stream(self, text: str, voice: str | None = None, *, max_tokens: int | None = None,
                     seed: int | None = None) -> AsyncIterator[np.ndarray]:
        """PCM chunks (24 kHz mono int16) of `text`, as they are made."""
        async for chunk in self.utterance(text, voice, max_tokens=max_tokens, seed=seed):
            yield chunk.pcm

    async def utterance(self, text: str | Iterable[str | VoicedSentence] | AsyncIterable[str | VoicedSentence],
                        voice: str | None = None, *,
                        max_tokens: int | None = None, seed: int | None = None,
                        stats: UtteranceStats | None = None) -> AsyncIterator[AudioChunk]:
        """Audio chunks of one utterance; `text` is a whole text (`<lang>` spans by their languages' voices) or an
        (async) stream of sentences (a `VoicedSentence` by its own voice).

        Closing the iterator (cancel, barge-in) aborts whatever the engine is generating for it.
        """
        voice = self.resolve_voice(voice)
        if isinstance(text, (Iterable, AsyncIterable)) and not isinstance(text, str):
            sentences: Any = text
        else:
            sentences = voiced_sentences(self.config, self.check_text(text), voice)
        stats = stats if stats is not None else UtteranceStats()
        # One queue per sentence, played in order; the feeder starts sentence k+1 once k has generated.
        order: asyncio.Queue[asyncio.Queue[Any] | None] = asyncio.Queue()
        feeder = asyncio.create_task(self._feed(sentences, voice, max_tokens, seed, stats, order))
        try:
            while (chunks := await order.get()) is not None:
                while (item := await chunks.get()) is not _END:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            await feeder  # re-raise a feeder error (e.g. a bad sentence)
        finally:
            if not feeder.done():
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
            stats.finished_at = time.monotonic()

    async def _feed(self, sentences: Iterable[str | VoicedSentence] | AsyncIterable[str | VoicedSentence],
                    voice: str, max_tokens: int | None, seed: int | None, stats: UtteranceStats,
                    order: asyncio.Queue[Any]) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            index = 0
            async for item in aiter_of(sentences):
                sentence, sentence_voice = (item.text, item.voice) if isinstance(item, VoicedSentence) \
                    else (item, voice)
                sentence = sentence.strip()
                if not sentence:
                    continue
                chunks: asyncio.Queue[Any] = asyncio.Queue()
                generated = asyncio.Event()
                order.put_nowait(chunks)
                tasks.append(asyncio.create_task(
                    self._sentence(index, sentence, sentence_voice, max_tokens, seed, stats, chunks, generated)))
                index += 1
                stats.sentences = index
                await generated.wait()
            order.put_nowait(None)
            await asyncio.gather(*tasks)
        finally:
            order.put_nowait(None)  # wake the consumer even if this feeder failed (it re-raises the error)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _sentence(self, index: int, sentence: str, voice: str, max_tokens: int | None, seed: int | None,
                        stats: UtteranceStats, chunks: asyncio.Queue[Any], generated: asyncio.Event) -> None:
        """Generate, parse and decode one sentence into `chunks`; set `generated` when the engine is done.

        Generation runs here; the decoded audio comes beside it in `_decode_stream`.
        """
        parser = AudioTokenParser()
        feed: _StreamFeed | None = None  # inside the try: a decoder that cannot open a stream fails the sentence
        awaiting_first_token = False  # counted in `_awaiting_first_token` (uncounted on every way out)
        try:
            feed = self._sentence_feed(index, sentence, stats, chunks)  # (left outside, it hung the utterance)
            decoding = feed.task
            model, lora = self.table.engine_of(voice)
            engine, tokenizer = self.engines[model], self.tokenizers[model]
            prompt = build_prompt(tokenizer, voice, sentence)
            if self.config.max_tokens_per_char > 0:
                max_tokens = sentence_token_cap(len(sentence), self.config.max_tokens_per_char,
                                                max_tokens or self.config.max_tokens)
            first_token_at: float | None = None
            tokens = 0
            self._awaiting_first_token += 1
            awaiting_first_token = True
            async with contextlib.aclosing(engine.generate(prompt, max_tokens=max_tokens, seed=seed,
                                                           lora=lora)) as ids:
                async for token_ids in ids:
                    now = time.monotonic()
                    if first_token_at is None:
                        first_token_at = now
                        self._first_tokens.append(now)
                        self._awaiting_first_token -= 1
                        awaiting_first_token = False
                        if stats.first_token_at is None:
                            stats.first_token_at = now
                    tokens += len(token_ids)
                    stats.tokens += len(token_ids)
                    self.model_tokens[model] += len(token_ids)
                    frames = parser.feed(token_ids)
                    if frames:
                        early = feed.received == 0 and stats.first_audio_at is None and \
                            self._next_frames_in_time(tokens, first_token_at, now)
                        feed.push(frames, early)
                    if decoding.done():  # a decode failed: stop generating (awaiting it below raises the error)
                        break
            generated.set()
            parser.finish()
            feed.end()
            await decoding
        except BaseException as exc:
            generated.set()
            if feed is not None:
                feed.task.cancel()
                await asyncio.wait([feed.task])  # leave no task behind; a second cancel still propagates
                if not feed.task.cancelled():
                    feed.task.exception()  # retrieved: the error that matters is `exc`
            if not isinstance(exc, asyncio.CancelledError):
                chunks.put_nowait(exc)
            raise
        finally:
            if awaiting_first_token:  # ended before its first token: an error, a cancel, an empty generation
                self._awaiting_first_token -= 1
            if feed is not None:
                feed.release()
            stats.frames += parser.stats.frames
            stats.ignored_ids += parser.stats.ignored_ids
            stats.dropped_tokens += parser.stats.dropped_tokens
            chunks.put_nowait(_END)

    async def _decode_stream(self, stream: DecodeStream, index: int, sentence: str, stats: UtteranceStats,
                             chunks: asyncio.Queue[Any]) -> None:
        """One sentence's audio from the exact streaming decoder into `chunks`, in order, as it comes."""
        first = True
        while (item := await stream.chunks.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            pcm, last = item
            first = self._put(chunks, pcm, index, sentence, first, stats, last=last)

    def _sentence_feed(self, index: int, sentence: str, stats: UtteranceStats,
                       chunks: asyncio.Queue[Any]) -> _StreamFeed:
        """A stream of the decoder for this sentence's frames, and the task that puts its audio into `chunks`."""
        stream = self.decoder.open(lambda: self._lead_s(stats), lead_runs=lambda: self._lead_runs(stats))
        task = asyncio.create_task(self._decode_stream(stream, index, sentence, stats, chunks))
        return _StreamFeed(self.decoder, stream, task, stats)

    def _next_frames_in_time(self, tokens: int, first_token_at: float, now: float) -> bool:
        """Early start: at this token rate, do the tokens the second frame's audio needs (that frame and the
        `FIRST_AUDIO_LOOKAHEAD` after it) arrive within the fast start's margin (`decode_fast_start_ms`, more for a
        sentence that starts alone: `first_audio.fast_start_margin_s`)? The first frame plays 85 ms, so then the
        second is decoded before the first has played out."""
        since = first_token_at - FAST_START_BURST_WINDOW_S
        beside = sum(1 for _ in itertools.takewhile(lambda at: at >= since, reversed(self._first_tokens))) - 1
        margin_s = fast_start_margin_s(self._fast_start_s, beside, self._awaiting_first_token)
        needed = (2 + FIRST_AUDIO_LOOKAHEAD) * SLOTS_PER_FRAME
        return fast_start_in_time(tokens, now - first_token_at, needed, margin_s)

    @staticmethod
    def _lead_s(stats: UtteranceStats) -> float:
        """How far the utterance's audio out runs ahead of its listener's playback: the listener's playout says so
        where it is known, else the audio out since the first, less the time since, plus the listener's buffer
        (the buffer alone before its first audio, as a playout that has not started counts it)."""
        if stats.playout_lead_s is not None:
            held = stats.playout_lead_s()
            return UNHEARD_LEAD_S if held is None else held
        if stats.first_audio_at is None:
            return stats.listener_buffer_s
        return stats.samples / SAMPLE_RATE - (time.monotonic() - stats.first_audio_at) + stats.listener_buffer_s

    @staticmethod
    def _lead_runs(stats: UtteranceStats) -> bool:
        """Whether `_lead_s` runs down now: as the playout says where it is known, else once the first audio is
        out (before, the modelled listener waits for it)."""
        if stats.playout_lead_runs is not None:
            return stats.playout_lead_runs()
        return stats.first_audio_at is not None

    def _put(self, chunks: asyncio.Queue[Any], pcm: np.ndarray, index: int, sentence: str, first: bool,
             stats: UtteranceStats, last: bool) -> bool:
        if len(pcm) == 0:
            return first
        if self._fade_samples and (first or last):
            pcm = pcm.copy()
            n = min(self._fade_samples, len(pcm))
            ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
            if first and index > 0:  # the first sentence starts from Orpheus' own silence
                pcm[:n] = (pcm[:n] * ramp).astype(np.int16)
            if last:
                pcm[-n:] = (pcm[-n:] * ramp[::-1]).astype(np.int16)
        if stats.first_audio_at is None:
            stats.first_audio_at = time.monotonic()
        stats.samples += len(pcm)
        chunks.put_nowait(AudioChunk(pcm, index, sentence, first, last))
        return False


@dataclass
class _StreamFeed:
    """A sentence's frames into the exact streaming decoder."""

    decoder: Decoder
    stream: DecodeStream
    task: asyncio.Task[None]
    stats: UtteranceStats
    received: int = 0

    def push(self, frames: list[Frame], early: bool) -> None:
        if self.received == 0:
            # Fast tokens: the first audio as soon as one frame is here; else once its lookahead frame is.
            self.stream.lookahead = 0 if early else FIRST_AUDIO_LOOKAHEAD
            if self.stats.first_window_at is None:
                self.stats.first_window_at = time.monotonic()
        self.received += len(frames)
        self.decoder.push(self.stream, frames)

    def end(self) -> None:
        self.decoder.finish(self.stream)

    def release(self) -> None:
        self.decoder.release(self.stream)


def _stream_decoder(config: GatewayConfig) -> Decoder:
    """The streaming decoder in this process, or a client of the shared one (`--snac-socket`)."""
    if config.snac_socket:
        return CodecStreamClient(config.snac_socket)
    return load_stream_decoder(decoder_settings(config))


def _stream_slots(config: GatewayConfig) -> int:
    """Streams open at once: a sentence per engine sequence, and the spare for sentences whose audio is still out."""
    engines = len(config.model_table.bases)  # one per served model, each with its own sequences
    return config.max_num_seqs * config.data_parallel_size * engines + STREAM_SLOT_SPARE


def decoder_settings(config: GatewayConfig) -> DecoderSettings:
    """The SNAC decoder of this configuration: this process's own, or the shared one."""
    return DecoderSettings(snac_model=config.snac_model, device=config.snac_device, snac_dtype=config.snac_dtype,
                           cuda_graphs=config.snac_cuda_graphs, max_batch=config.decode_max_batch,
                           max_streams=_stream_slots(config), compile=config.snac_compile,
                           kernels=config.snac_kernels, step_duty=config.snac_step_duty)


async def aiter_of(items: Iterable[_T] | AsyncIterable[_T]) -> AsyncIterator[_T]:
    """The items of a plain or an async iterable, asynchronously (a text given whole or streamed in pieces)."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
