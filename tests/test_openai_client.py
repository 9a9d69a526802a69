"""OpenAI's own Python client (`openai`) against the running gateway: `audio.speech.create` and its streaming form for
every `response_format`, decoded by PyAV (FFmpeg); SSE (`stream_format="sse"`) reassembled; `speed`; errors.

The tiny model speaks random sound, so the checks are structural: with one `seed` every request makes the same
tokens, hence the same number of samples, which each format must decode back to (exactly for the lossless ones and
Opus, within one codec frame of padding for MP3 and AAC).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator

import av
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.media.formats import FORMATS
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME
from gateway.speech.synthesizer import Synthesizer
from tests.support import running

pytestmark = pytest.mark.engine

TEXT = "Good morning, class."
SEED = 7
OPUS_RATE = 48000  # Ogg Opus always decodes at 48 kHz
# Decoded length beyond the input: MP3's encoder delay and padded last frame (1344 samples measured with PyAV 18),
# ADTS AAC's priming and padding (1600): both within one 2048-sample SNAC frame.
CODEC_PADDING_MAX = {"mp3": SAMPLES_PER_FRAME, "aac": SAMPLES_PER_FRAME}


@pytest.fixture(scope="module")
async def client(test_config: GatewayConfig, synthesizer: Synthesizer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with running(test_config, synthesizer) as (base, _):
        # The sync client would block the event loop the gateway runs on: the async one, as a server would use.
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused-auth-is-off", max_retries=0) as api:
            yield api


@pytest.fixture(scope="module")
async def reference_samples(client: openai.AsyncOpenAI) -> int:
    """Samples of TEXT at SEED, as raw PCM (also: `instructions` and any `model` name are accepted)."""
    audio = await client.audio.speech.create(model="tts-1", voice="tara", input=TEXT, response_format="pcm",
                                             instructions="Speak like a patient teacher.", extra_body={"seed": SEED})
    pcm = audio.content
    assert len(pcm) % 2 == 0 and len(pcm) >= 2 * SAMPLES_PER_FRAME, "at least one frame of audio"
    return len(pcm) // 2


def decode(data: bytes, fmt: str) -> tuple[int, int]:
    """(sample rate, samples) of one response as FFmpeg decodes it; raw pcm is read as 24 kHz mono s16le."""
    raw = fmt == "pcm"
    options = {"sample_rate": str(SAMPLE_RATE), "ch_layout": "mono"} if raw else {}
    with av.open(io.BytesIO(data), format="s16le" if raw else None, options=options) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        assert stream.codec_context.channels == 1
        return stream.codec_context.sample_rate, samples


def check_decoded(data: bytes, fmt: str, reference: int) -> None:
    rate, samples = decode(data, fmt)
    if fmt == "opus":
        assert (rate, samples) == (OPUS_RATE, 2 * reference)
        return
    assert rate == SAMPLE_RATE
    assert reference <= samples <= reference + CODEC_PADDING_MAX.get(fmt, 0), (fmt, samples, reference)


@pytest.mark.parametrize("fmt", list(FORMATS))
async def test_every_format_whole_and_streamed(client: openai.AsyncOpenAI, reference_samples: int, fmt: str) -> None:
    whole = await client.audio.speech.create(model="orpheus", voice="tara", input=TEXT, response_format=fmt,
                                             extra_body={"seed": SEED})
    assert whole.response.headers["content-type"] == FORMATS[fmt]
    check_decoded(whole.content, fmt, reference_samples)

    async with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input=TEXT, response_format=fmt, extra_body={"seed": SEED}) as streamed:
        assert streamed.headers.get("transfer-encoding") == "chunked", "sent as it is made, no length up front"
        data = b"".join([chunk async for chunk in streamed.iter_bytes()])
    check_decoded(data, fmt, reference_samples)


async def test_sse_reassembles_into_the_same_audio(client: openai.AsyncOpenAI, reference_samples: int) -> None:
    events = []
    async with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input=TEXT, response_format="pcm", stream_format="sse",
            extra_body={"seed": SEED}) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        async for line in streamed.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    *deltas, done = events
    assert deltas and all(event["type"] == "speech.audio.delta" for event in deltas)
    pcm = b"".join(base64.b64decode(event["audio"]) for event in deltas)
    assert len(pcm) == 2 * reference_samples
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] >= 7 * (reference_samples // SAMPLES_PER_FRAME)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_speed_two_gives_half_the_samples(client: openai.AsyncOpenAI, reference_samples: int) -> None:
    audio = await client.audio.speech.create(model="orpheus", voice="tara", input=TEXT, response_format="pcm",
                                             speed=2.0, extra_body={"seed": SEED})
    assert len(audio.content) // 2 == round(reference_samples / 2.0)  # TimeStretcher's exact length rule


async def test_errors_come_back_as_openai_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.audio.speech.create(model="orpheus", voice="tara", input=TEXT, speed=4.5)
    assert (info.value.code, info.value.param, info.value.type) == ("invalid_speed", "speed", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as info:
        await client.audio.speech.create(model="orpheus", voice="no-such-voice", input=TEXT)  # alloy is an alias now
    assert (info.value.code, info.value.param) == ("unknown_voice", "voice")
