"""`POST /v1/audio/speech`: OpenAI-style speech over HTTP, streamed as it is made."""

from __future__ import annotations

import logging
import struct
import time

from aiohttp import web

from gateway.edge.http import GATEWAY_KEY, capacity_error, json_error, read_json_object
from gateway.orpheus import SAMPLE_RATE
from gateway.service.admission import CapacityError
from gateway.speech.engine import EngineDeadError, EngineUnavailableError
from gateway.speech.synthesizer import InvalidRequestError, UtteranceStats

log = logging.getLogger(__name__)

SPEECH_PATH = "/v1/audio/speech"
SPEECH_FORMATS = ("wav", "pcm")
WAV_STREAMING_SIZE = 0xFFFFFFFF  # unknown length: players read a streamed WAV up to the end
ENGINE_RETRY_AFTER_S = 5  # an engine (re)start takes tens of seconds; ask again soon, not in a tight loop


def wav_header(sample_rate: int = SAMPLE_RATE, data_bytes: int = WAV_STREAMING_SIZE) -> bytes:
    """RIFF/WAVE header for 16-bit mono PCM; `data_bytes` unknown while streaming."""
    riff_size = WAV_STREAMING_SIZE if data_bytes == WAV_STREAMING_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))



async def speech(request: web.Request) -> web.StreamResponse:
    """OpenAI-style speech: `{model?, input, voice?, response_format?: wav|pcm, speed? (ignored)}`.

    Audio streams as it is made (chunked transfer). The response starts only once the first audio exists,
    so an engine that is down still gets a clean 503 rather than a truncated 200.
    """
    gateway = request.app[GATEWAY_KEY]
    body = await read_json_object(request, gateway.config.max_body_bytes)
    synthesizer = gateway.synthesizer
    if synthesizer is None or not gateway.ready:
        gateway.metrics.speech_requests_total.labels("503").inc()
        return json_error(503, "engine_unavailable", "the speech engine is not ready",
                          {"Retry-After": str(ENGINE_RETRY_AFTER_S)})
    fmt = body.get("response_format", "wav")
    if fmt not in SPEECH_FORMATS:
        return json_error(400, "invalid_response_format", f"response_format must be one of {list(SPEECH_FORMATS)}")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        return json_error(400, "invalid_speed", "speed must be a number")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return json_error(400, "invalid_model", "model must be a string")
    voice = body.get("voice")
    if voice is not None and not isinstance(voice, str):
        return json_error(400, "invalid_voice", "voice must be a string")
    if "input" not in body:
        return json_error(400, "missing_input", "input (the text to speak) is required")
    try:
        synthesizer.check_text(body["input"])
        voice = synthesizer.resolve_voice(voice)
    except InvalidRequestError as exc:
        return json_error(400, exc.code, str(exc))
    try:
        slot = gateway.admission.admit_stream()
    except CapacityError as exc:
        gateway.metrics.speech_requests_total.labels("503").inc()
        gateway.metrics.rejections_total.labels(exc.code).inc()
        return capacity_error(exc)

    stats = UtteranceStats()
    chunks = synthesizer.utterance(body["input"], voice, stats=stats)
    response: web.StreamResponse | None = None
    try:
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except (EngineUnavailableError, EngineDeadError) as exc:  # (re)starting: worth retrying shortly
            gateway.metrics.speech_requests_total.labels("503").inc()
            return json_error(503, exc.code, str(exc), {"Retry-After": str(ENGINE_RETRY_AFTER_S)})
        except RuntimeError as exc:  # another engine error, or the SNAC worker failed this request's batch
            gateway.metrics.speech_requests_total.labels("500").inc()
            log.warning("speech request failed before its first audio: %s", exc)
            return json_error(500, getattr(exc, "code", "synthesis_failed"), str(exc))
        response = web.StreamResponse(headers={
            "Content-Type": "audio/wav" if fmt == "wav" else "audio/pcm",
            "X-Sample-Rate": str(SAMPLE_RATE), "Cache-Control": "no-store"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if fmt == "wav":
            await response.write(wav_header())
        if first is not None:
            gateway.metrics.ttfa_seconds.labels("http").observe(time.monotonic() - stats.started)
            await response.write(first.pcm.tobytes())
            async for chunk in chunks:
                await response.write(chunk.pcm.tobytes())
        await response.write_eof()
        gateway.metrics.speech_requests_total.labels("200").inc()
        gateway.metrics.observe_synthesis(stats.tokens, stats.audio_s, stats.synthesis_s)
        return response
    except RuntimeError:  # EngineError, or a failed SNAC decode
        # Mid-stream failure: the status is already sent; cut the connection so the client sees a truncated
        # transfer rather than a complete, shorter file.
        gateway.metrics.speech_requests_total.labels("500").inc()
        log.exception("speech stream failed")
        if request.transport is not None:
            request.transport.close()
        return response or json_error(500, "engine_error", "speech failed")
    finally:
        await chunks.aclose()
        slot.release()
