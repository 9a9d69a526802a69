"""`POST /v1/audio/speech`: OpenAI's speech API, streamed as it is made.

Owns the route and what only it needs: the request body, checked in one place (`parse_speech_request`), one
response's audio chain (`AudioOutput`: pitch-preserving `speed` by `gateway.media.stretch.TimeStretcher`, then the
`response_format`'s `gateway.media.formats.StreamEncoder`), the SSE framing (`speech.audio.delta` events and a last
`speech.audio.done` with token usage), and errors in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`, `code` being the gateway's own (`missing_input`, `unknown_voice`,
`invalid_speed`, ...), `type` `invalid_request_error` for 4xx and `server_error` for 5xx.

Not OpenAI's: `response_format` defaults to `wav` (OpenAI's default is mp3; the gateway's clients relied on wav
before the other formats existed), `instructions` is accepted and ignored (Orpheus takes none), `seed` (an integer)
makes the tokens reproducible, a test and debugging aid, `cache` (true: a scripted line the phrase cache may keep
and share; false: a private line it never keeps; absent: the deployment's `--phrase-cache` choice), and
`word_timestamps: true` (with `stream_format: "sse"`)
adds a `speech.audio.words` event after each sentence's audio: `{"type": "speech.audio.words", "words": [{"word",
"start", "end"}]}`, seconds from the response's first sample (at its `speed`), for clients that drive an avatar.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from aiohttp import web

from gateway.edge.errors import SpeechRequestError
from gateway.edge.http import GATEWAY_KEY, read_json_object
from gateway.edge.word_times import TimedWord, WordClock
from gateway.media.errors import InvalidRateError
from gateway.media.formats import FORMATS, StreamEncoder
from gateway.media.stretch import SPEECH_SPEED_RANGE, TimeStretcher, check_rate
from gateway.orpheus import SAMPLE_RATE, build_prompt, split_sentences
from gateway.phrases.speech import cached_sentences
from gateway.service.errors import CapacityError
from gateway.speech.errors import ENGINE_RETRY_AFTER_S, EngineDeadError, EngineUnavailableError, InvalidRequestError
from gateway.speech.synthesizer import AudioChunk, Synthesizer, UtteranceStats
from gateway.speech.utterance_text import voiced_sentences

log = logging.getLogger(__name__)

SPEECH_PATH = "/v1/audio/speech"
DEFAULT_FORMAT = "wav"
STREAM_FORMATS = ("audio", "sse")
SSE_CONTENT_TYPE = "text/event-stream"
MAX_SEED = 2**63 - 1  # vLLM seeds a 64-bit generator
# Encoding these (and any speed change) costs CPU: it runs in a worker thread, off the event loop every stream
# and session shares. wav and pcm at speed 1 are a copy of the samples.
CODED_FORMATS = frozenset({"mp3", "opus", "aac", "flac"})


# --- errors --------------------------------------------------------------------------------------------

def openai_error(status: int, code: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> web.Response:
    """An error in OpenAI's shape; `code` is the gateway's (tests and clients match on it)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _reshaped(exc: web.HTTPException) -> web.Response:
    """A body-reading error (`read_json_object`: invalid JSON, too large) in OpenAI's shape."""
    try:
        error = json.loads(exc.text or "")["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = ("body_too_large" if exc.status == 413 else "invalid_body"), exc.reason
    return openai_error(exc.status, code, message)


async def ready_body(request: web.Request) -> tuple[dict[str, Any], Synthesizer] | web.Response:
    """A JSON route's body and the ready synthesizer, or the error to answer in OpenAI's shape: the body's
    (invalid JSON, too large), or 503 with Retry-After while the engine is not ready."""
    gateway = request.app[GATEWAY_KEY]
    try:
        body = await read_json_object(request, gateway.config.max_body_bytes)
    except web.HTTPException as exc:
        return _reshaped(exc)
    synthesizer = gateway.synthesizer
    if synthesizer is None or not gateway.ready:
        return openai_error(503, "engine_unavailable", "the speech engine is not ready",
                            headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})
    return body, synthesizer


# --- the request body ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeechRequest:
    """A checked body: text and resolved voice, output format and framing, speed and seed."""

    text: str
    voice: str
    response_format: str
    sse: bool
    speed: float
    seed: int | None
    word_timestamps: bool = False
    cache: bool | None = None  # the phrase cache: true a scripted line, false a private one, None not said


def parse_speech_request(body: dict[str, Any], synthesizer: Synthesizer) -> SpeechRequest:
    """Every rule of the body in one place; `SpeechRequestError` for the first field that breaks one."""
    if "input" not in body:
        raise SpeechRequestError("missing_input", "input (the text to speak) is required", "input")
    model = body.get("model")
    if model is not None and not isinstance(model, str):  # any name: this gateway serves one model
        raise SpeechRequestError("invalid_model", "model must be a string", "model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise SpeechRequestError("invalid_instructions", "instructions must be a string", "instructions")
    fmt = body.get("response_format", DEFAULT_FORMAT)
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise SpeechRequestError("invalid_response_format", f"response_format must be one of {list(FORMATS)}",
                                 "response_format")
    stream_format = body.get("stream_format", "audio")
    if not isinstance(stream_format, str) or stream_format not in STREAM_FORMATS:
        raise SpeechRequestError("invalid_stream_format", f"stream_format must be one of {list(STREAM_FORMATS)}",
                                 "stream_format")
    try:
        speed = check_rate(body.get("speed", 1.0), *SPEECH_SPEED_RANGE, "speed")
    except InvalidRateError as exc:
        raise SpeechRequestError("invalid_speed", str(exc), "speed") from None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise SpeechRequestError("invalid_seed", f"seed must be an integer in 0..{MAX_SEED}", "seed")
    word_timestamps = body.get("word_timestamps", False)
    if not isinstance(word_timestamps, bool) or (word_timestamps and stream_format != "sse"):
        raise SpeechRequestError("invalid_word_timestamps", 'word_timestamps must be true or false; true needs '
                                 'stream_format "sse"', "word_timestamps")
    cache = body.get("cache")
    if cache is not None and not isinstance(cache, bool):
        raise SpeechRequestError("invalid_cache", "cache must be true (a scripted line) or false (a private one)",
                                 "cache")
    voice = body.get("voice")
    if isinstance(voice, dict) and set(voice) == {"id"}:  # OpenAI's custom-voice form: {"id": "leo"}
        voice = voice["id"]
    if voice is not None and not isinstance(voice, str):
        raise SpeechRequestError("invalid_voice", "voice must be a string (or {\"id\": string})", "voice")
    try:
        text = synthesizer.check_text(body["input"])
    except InvalidRequestError as exc:
        raise SpeechRequestError(exc.code, str(exc), "input") from None
    language = body.get("language")
    if language is not None and (not isinstance(language, str) or not language):
        raise SpeechRequestError("invalid_language", "language must be a BCP-47 tag such as en-US or pt-BR",
                                 "language")
    try:
        voice = synthesizer.resolve_voice(voice, language)
    except InvalidRequestError as exc:
        raise SpeechRequestError(exc.code, str(exc), "language" if exc.code == "unknown_language" else "voice"
                                 ) from None
    try:
        voiced_sentences(synthesizer.config, text, voice)  # mixed-language markup: checked before any audio
    except InvalidRequestError as exc:
        raise SpeechRequestError(exc.code, str(exc), "input") from None
    return SpeechRequest(text, voice, fmt, stream_format == "sse", speed, seed, word_timestamps, cache)


# --- audio out -----------------------------------------------------------------------------------------

class AudioOutput:
    """One response's audio chain: PCM chunks in, the bytes of its format out, `speed` applied first."""

    def __init__(self, fmt: str, speed: float) -> None:
        self.stretcher = TimeStretcher(speed)
        self.encoder = StreamEncoder(fmt)
        self.in_thread = fmt in CODED_FORMATS or not self.stretcher.passthrough
        self._running: asyncio.Future[bytes] | None = None

    @property
    def content_type(self) -> str:
        return self.encoder.content_type

    async def feed(self, pcm: npt.NDArray[np.int16]) -> bytes:
        return await self._call(lambda: self.encoder.encode(self.stretcher.process(pcm)))

    async def finish(self) -> bytes:
        return await self._call(lambda: self.encoder.encode(self.stretcher.flush()) + self.encoder.finish())

    async def _call(self, work: Callable[[], bytes]) -> bytes:
        if not self.in_thread:
            return work()
        self._running = asyncio.get_running_loop().run_in_executor(None, work)
        # Shielded: a client that hangs up cancels the route, not the encoder half way through a frame.
        return await asyncio.shield(self._running)

    async def aclose(self) -> None:
        """Release the codec once no call is running in its thread (PyAV objects are not to be shared)."""
        if self._running is not None and not self._running.done():
            await asyncio.wait([self._running])
        self.encoder.close()


def sse_event(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def audio_delta(audio: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")})


def audio_words(words: list[TimedWord]) -> bytes:
    return sse_event({"type": "speech.audio.words",
                      "words": [{"word": w.text, "start": round(w.start_s, 3), "end": round(w.end_s, 3)}
                                for w in words]})


def audio_done(usage: dict[str, int]) -> bytes:
    return sse_event({"type": "speech.audio.done", "usage": usage})


def usage(synthesizer: Synthesizer, request: SpeechRequest, stats: UtteranceStats) -> dict[str, int]:
    """OpenAI's token usage, counted for real: the prompt ids the engine was given (one prompt per sentence, as
    `Synthesizer.utterance` builds them) and the token ids it generated."""
    sentences = [s.strip() for s in split_sentences(request.text, synthesizer.config.max_sentence_chars)]
    input_tokens = sum(len(build_prompt(synthesizer.tokenizer, request.voice, s)) for s in sentences if s)
    return {"input_tokens": input_tokens, "output_tokens": stats.tokens,
            "total_tokens": input_tokens + stats.tokens}


async def stream_audio(response: web.StreamResponse, output: AudioOutput, first: AudioChunk | None,
                       chunks: AsyncIterator[AudioChunk], sse: bool, clock: WordClock | None = None) -> None:
    """Every chunk through the audio chain to the client, raw or as `speech.audio.delta` events (and, with a
    `clock`, each sentence's `speech.audio.words` once its audio is complete)."""
    async def send(audio: bytes) -> None:
        if audio:  # an encoder may hold a chunk back (its frame is not full yet): nothing to send
            await response.write(audio_delta(audio) if sse else audio)

    async def send_chunk(chunk: AudioChunk) -> None:
        await send(await output.feed(chunk.pcm))
        if clock is not None and (words := await clock.add(chunk)):
            await response.write(audio_words(words))

    if first is not None:
        await send_chunk(first)
        async for chunk in chunks:
            await send_chunk(chunk)
    await send(await output.finish())


# --- the route -----------------------------------------------------------------------------------------

async def speech(request: web.Request) -> web.StreamResponse:
    """OpenAI's `POST /v1/audio/speech`: `{model, input, voice, response_format?, stream_format?, speed?,
    instructions?, seed?}`.

    Audio streams as it is made (chunked transfer). The response starts only once the first audio exists, so an
    engine that is down still gets a clean 503 rather than a truncated 200; a failure after that cuts the
    connection, so the client sees a truncated transfer (and, over SSE, no `speech.audio.done`).
    """
    gateway = request.app[GATEWAY_KEY]
    metrics = gateway.metrics
    ready = await ready_body(request)
    if isinstance(ready, web.Response):
        if ready.status == 503:
            metrics.speech_requests_total.labels("503").inc()
        return ready
    body, synthesizer = ready
    try:
        speech_request = parse_speech_request(body, synthesizer)
    except SpeechRequestError as exc:
        return openai_error(400, exc.code, str(exc), exc.param)
    try:
        slot = gateway.admission.admit_stream(speech_request.voice)
    except CapacityError as exc:
        metrics.speech_requests_total.labels("503").inc()
        metrics.refused(exc)
        return openai_error(503, exc.code, str(exc), headers={"Retry-After": str(exc.retry_after_s)})

    stats = UtteranceStats()
    phrases = gateway.phrases
    chunks: AsyncGenerator[AudioChunk, None]
    if phrases is not None and phrases.applies(speech_request.cache):  # hits from the cache, misses made once
        # `<lang>` spans: each span's sentences keyed and made by its own voice
        sentences = voiced_sentences(synthesizer.config, speech_request.text, speech_request.voice)
        chunks = cached_sentences(phrases, synthesizer, sentences, speech_request.voice, stats=stats,
                                  seed=speech_request.seed)
    else:
        chunks = synthesizer.utterance(speech_request.text, speech_request.voice, seed=speech_request.seed,
                                       stats=stats)
    output = AudioOutput(speech_request.response_format, speech_request.speed)
    response: web.StreamResponse | None = None
    try:
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except (EngineUnavailableError, EngineDeadError) as exc:  # (re)starting: worth retrying shortly
            metrics.speech_requests_total.labels("503").inc()
            return openai_error(503, exc.code, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
        except RuntimeError as exc:  # another engine error, or the SNAC worker failed this request's batch
            metrics.speech_requests_total.labels("500").inc()
            log.warning("speech request failed before its first audio: %s", exc)
            return openai_error(500, getattr(exc, "code", "synthesis_failed"), str(exc))
        response = web.StreamResponse(headers={
            "Content-Type": SSE_CONTENT_TYPE if speech_request.sse else output.content_type,
            "X-Sample-Rate": str(SAMPLE_RATE), "Cache-Control": "no-store"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if first is not None:
            metrics.ttfa_seconds.labels("http").observe(time.monotonic() - stats.started)
        clock = WordClock(synthesizer.config, speech_request.voice, speech_request.speed) \
            if speech_request.word_timestamps else None
        await stream_audio(response, output, first, chunks, speech_request.sse, clock)
        if speech_request.sse:
            await response.write(audio_done(usage(synthesizer, speech_request, stats)))
        await response.write_eof()
        metrics.speech_requests_total.labels("200").inc()
        metrics.observe_synthesis(stats.tokens, stats.audio_s, stats.synthesis_s)
        return response
    except RuntimeError:  # EngineError, or a failed SNAC decode
        # Mid-stream failure: the status is already sent; cut the connection so the client sees a truncated
        # transfer rather than a complete, shorter file.
        metrics.speech_requests_total.labels("500").inc()
        log.exception("speech stream failed")
        if request.transport is not None:
            request.transport.close()
        return response or openai_error(500, "engine_error", "speech failed")
    finally:
        await chunks.aclose()
        await output.aclose()
        slot.release()
