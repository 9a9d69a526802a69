"""HTTP routes on the real engine: health, voices, streaming speech, metrics, bad bodies."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import wave
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.config import GatewayConfig
from gateway.edge.app import create_app
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME
from gateway.speech.synthesizer import Synthesizer
from tests.support import wait_until

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
async def client(test_config: GatewayConfig, synthesizer: Synthesizer) -> AsyncIterator[TestClient]:
    app = create_app(test_config, synthesizer)
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


async def error_of(resp) -> dict:  # type: ignore[no-untyped-def]
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body["error"]) == {"code", "message"}
    return body["error"]


async def speech_error_of(resp) -> dict:  # type: ignore[no-untyped-def]
    """The speech route's errors are OpenAI's shape, with the gateway's own `code`."""
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body["error"]) == {"code", "message", "type", "param"}
    assert body["error"]["type"] == ("invalid_request_error" if resp.status < 500 else "server_error")
    return body["error"]


async def test_health_and_ready(client: TestClient) -> None:
    assert (await client.get("/healthz")).status == 200
    resp = await client.get("/readyz")
    assert resp.status == 200
    assert (await resp.json())["status"] == "ready"


async def test_voices(client: TestClient) -> None:
    body = await (await client.get("/v1/voices")).json()
    assert body["voices"][:2] == ["tara", "leah"]
    assert body["default"] == "tara"


async def test_speech_wav_is_valid(client: TestClient) -> None:
    resp = await client.post("/v1/audio/speech", json={"model": "orpheus", "input": "Good morning!", "voice": "tara",
                                                       "response_format": "wav", "speed": 1.0})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "audio/wav"
    data = await resp.read()
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        frames = wav.readframes(10**9)
    assert len(frames) > 0 and len(frames) % (2 * SAMPLES_PER_FRAME) == 0


async def test_speech_streams_before_generation_ends(client: TestClient, synthesizer: Synthesizer) -> None:
    """The first audio bytes reach the client before the engine has even started the last sentence."""
    sentences = [f"Sentence {i} of this answer." for i in range(6)]
    before = synthesizer.engine.requests_started
    resp = await client.post("/v1/audio/speech", json={"input": " ".join(sentences), "response_format": "pcm"})
    assert resp.status == 200
    assert resp.headers["X-Sample-Rate"] == str(SAMPLE_RATE)
    first = await resp.content.readany()
    assert len(first) > 0
    started_at_first_bytes = synthesizer.engine.requests_started - before
    rest = await resp.read()
    assert started_at_first_bytes < len(sentences), "first bytes arrived only after generation ended"
    assert synthesizer.engine.requests_started - before == len(sentences)
    assert (len(first) + len(rest)) % (2 * SAMPLES_PER_FRAME) == 0


async def test_client_disconnect_aborts_request(client: TestClient, synthesizer: Synthesizer) -> None:
    """A client that hangs up mid-stream aborts the engine request it was waiting on (not: it ran to its end)."""
    engine = synthesizer.engine
    aborted = engine.requests_aborted
    text = " ".join(f"Sentence {i} that will never be heard." for i in range(8))  # a request is always running
    resp = await client.post("/v1/audio/speech", json={"input": text, "response_format": "pcm"})
    await resp.content.readany()
    resp.close()

    await wait_until(lambda: engine.in_flight == 0)
    await wait_until(lambda: engine.unfinished_requests() == 0)
    assert engine.requests_aborted == aborted + 1, "the running request was aborted, not finished"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (json.dumps({}).encode(), 400, "missing_input"),
        (json.dumps({"input": ""}).encode(), 400, "empty_text"),
        (json.dumps({"input": 5}).encode(), 400, "invalid_text"),
        (json.dumps({"input": "hi", "voice": "nobody"}).encode(), 400, "unknown_voice"),
        (json.dumps({"input": "hi", "voice": 3}).encode(), 400, "invalid_voice"),
        (json.dumps({"input": "hi", "response_format": "ogg"}).encode(), 400, "invalid_response_format"),
        (json.dumps({"input": "hi", "speed": "fast"}).encode(), 400, "invalid_speed"),
        (json.dumps({"input": "hi", "speed": 4.5}).encode(), 400, "invalid_speed"),
        (json.dumps({"input": "hi", "speed": 0.2}).encode(), 400, "invalid_speed"),
        (json.dumps({"input": "hi", "stream_format": "chunks"}).encode(), 400, "invalid_stream_format"),
        (json.dumps({"input": "hi", "seed": 1.5}).encode(), 400, "invalid_seed"),
        (json.dumps({"input": "hi", "instructions": 7}).encode(), 400, "invalid_instructions"),
        (json.dumps({"input": "hi", "model": 5}).encode(), 400, "invalid_model"),
        (json.dumps({"input": "x" * 5000}).encode(), 400, "text_too_long"),
        (json.dumps({"input": "x" * 70000}).encode(), 413, "body_too_large"),
        (b"\xff\xfe\x00garbage", 400, "invalid_json"),
    ],
)
async def test_speech_bad_bodies(client: TestClient, body: bytes, status: int, code: str) -> None:
    resp = await client.post("/v1/audio/speech", data=body, headers={"Content-Type": "application/json"})
    assert resp.status == status
    assert (await speech_error_of(resp))["code"] == code


async def test_unknown_route_and_method_are_json(client: TestClient) -> None:
    resp = await client.get("/nope")
    assert resp.status == 404
    assert (await error_of(resp))["code"] == "not_found"
    resp = await client.get("/v1/audio/speech")
    assert resp.status == 405
    assert (await error_of(resp))["code"] == "method_not_allowed"


@pytest.mark.parametrize("head", [
    b"GET /whep?voice=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: gateway\r\n\r\n",  # a request line over 8 KiB
    b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Padding: " + b"b" * 9000 + b"\r\n\r\n",  # a header over it
], ids=["request_line", "header"])
async def test_a_request_aiohttp_cannot_read_gets_a_json_error_and_no_traceback(
        client: TestClient, caplog: pytest.LogCaptureFixture, head: bytes) -> None:
    caplog.set_level(logging.INFO)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(head)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert 400 <= int(status_line.split()[1]) < 500, status_line
    assert b"content-type: application/json" in headers.lower(), headers
    error = json.loads(body)["error"]
    assert set(error) == {"code", "message"} and error["code"] == "line_too_long", error
    assert "refused a request" in caplog.text
    assert not [r for r in caplog.records if r.exc_info], "logged in one line, without a traceback"


async def test_metrics_exposes_speech_figures(client: TestClient) -> None:
    await (await client.post("/v1/audio/speech", json={"input": "Count me."})).read()
    text = await (await client.get("/metrics")).text()
    assert 'orpheus_speech_requests_total{status="200"}' in text
    count = next(line for line in text.splitlines() if line.startswith("orpheus_snac_batch_size_count"))
    assert float(count.split()[1]) > 0
    new_frames = next(line for line in text.splitlines() if line.startswith("orpheus_snac_new_frames_total"))
    assert float(new_frames.split()[1]) > 0
    assert 'orpheus_snac_windows_total{frames="' in text
    assert "orpheus_engine_requests_in_flight 0.0" in text
