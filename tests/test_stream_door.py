"""The streaming text-in WebSocket door (Cartesia's `/tts/websocket` protocol) spoken raw, the OpenAI voice aliases,
and word timings on the speech route's SSE: on the real engine (tiny model).

The frameworks' own clients against the same door are in tests/test_frameworks.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from gateway.config import OPENAI_VOICES, ConfigError, from_sources
from gateway.edge.cartesia_ws import CARTESIA_PATH
from gateway.edge.state import GatewayState
from gateway.media.pcm_out import PCM_RATES, PcmOutput
from gateway.orpheus import ENGLISH_VOICES, SAMPLE_RATE
from gateway.speech.synthesizer import Synthesizer
from tests.support import EVENT_TIMEOUT_S, TOKEN, running, tiny_config, wait_until

LONG_TEXT = " ".join(f"Sentence {i} that will never be heard." for i in range(8))  # a request is always running


# --- no engine -----------------------------------------------------------------------------------------------

def test_openai_voice_names_are_aliases_by_default_and_flags_replace_them() -> None:
    config = from_sources(env={})
    assert set(config.voice_aliases) == set(OPENAI_VOICES)
    assert set(config.voice_aliases.values()) <= set(ENGLISH_VOICES)
    config = from_sources(env={"ORPHEUS_GATEWAY_VOICE_ALIAS": "alloy=leo, teacher=zoe"})
    assert config.voice_aliases["alloy"] == "leo" and config.voice_aliases["teacher"] == "zoe"
    assert from_sources(env={}, voice_alias=["nova=dan"]).voice_aliases["nova"] == "dan"
    french = from_sources(env={}, model="canopylabs/3b-fr-ft-research_release")
    assert set(french.voice_aliases.values()) == {"pierre", "amelie", "marie"}
    for bad in (["alloy"], ["=tara"], ["alloy=nobody"], ["tara=leo"]):
        with pytest.raises(ConfigError, match="voice_alias"):
            from_sources(env={}, voice_alias=bad)


@pytest.mark.parametrize("rate", PCM_RATES)
def test_pcm_output_resamples_a_tone_to_the_asked_rate(rate: int) -> None:
    """The samples out are the input's duration at the new rate, and a 1 kHz tone stays at 1 kHz."""
    tone = (np.sin(2 * np.pi * 1000 * np.arange(SAMPLE_RATE) / SAMPLE_RATE) * 8000).astype(np.int16)
    for encoding, dtype in (("pcm_s16le", "<i2"), ("pcm_f32le", "<f4")):
        output = PcmOutput(rate, encoding)
        data = b"".join(output.feed(piece) for piece in np.array_split(tone, 12)) + output.finish()
        out = np.frombuffer(data, dtype=dtype).astype(np.float64)
        assert abs(len(out) - rate) <= 1
        peak_hz = np.argmax(np.abs(np.fft.rfft(out))) * rate / len(out)
        assert abs(peak_hz - 1000) < 5
    with pytest.raises(ValueError, match="sample_rate"):
        PcmOutput(12345, "pcm_s16le")


# --- on the engine -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def door(test_config: Any, synthesizer: Synthesizer) -> AsyncIterator[tuple[str, GatewayState]]:
    async with running(test_config, synthesizer) as (base, gateway):
        yield base, gateway


class Socket:
    """A raw client of the door: sends Cartesia messages, reads the gateway's, by context."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def send(self, message: Any) -> None:
        await self.ws.send_str(message if isinstance(message, str) else json.dumps(message))

    async def receive(self) -> dict[str, Any]:
        msg = await self.ws.receive(timeout=EVENT_TIMEOUT_S)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        message: dict[str, Any] = json.loads(msg.data)
        assert {"type", "context_id", "status_code", "done"} <= set(message), message
        return message

    async def error(self) -> dict[str, Any]:
        message = await self.receive()
        assert message["type"] == "error" and message["done"] is True and message["status_code"] >= 400, message
        return message

    async def until_end(self, context_id: str, into: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        """Messages until `context_id` ends (kept by context in `into`); its end message."""
        while True:
            message = await self.receive()
            into.setdefault(message["context_id"], []).append(message)
            if message["context_id"] == context_id and message["done"]:
                return message


def start(context_id: str, text: str, more: bool, **extra: Any) -> dict[str, Any]:
    return {"context_id": context_id, "transcript": text, "continue": more, "model_id": "any-model",
            "voice": {"mode": "id", "id": "tara"}, **extra}


def audio_of(messages: list[dict[str, Any]], dtype: str = "<i2") -> np.ndarray:
    data = b"".join(base64.b64decode(m["data"]) for m in messages if m["type"] == "chunk")
    return np.frombuffer(data, dtype=dtype)


def words_of(messages: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    return [word for m in messages if m["type"] == "timestamps"
            for word in zip(m["word_timestamps"]["words"], m["word_timestamps"]["start"],
                            m["word_timestamps"]["end"], strict=True)]


@pytest.mark.engine
async def test_bad_input_gets_cartesia_errors_and_the_socket_keeps_serving(
        door: tuple[str, GatewayState]) -> None:
    base, gateway = door
    async with aiohttp.ClientSession() as http, http.ws_connect(base + CARTESIA_PATH) as ws:
        socket = Socket(ws)
        cases: list[tuple[Any, str]] = [
            ("{not json", "invalid_json"),
            ("[1, 2]", "invalid_json"),
            (start("c1", "Hello.", False, voice={"mode": "id", "id": "nobody"}), "unknown_voice"),
            (start("c2", "x" * (gateway.config.max_text_chars + 1), False), "text_too_long"),
            ({"context_id": "nowhere", "cancel": True}, "unknown_context"),
            (start("c3", "Hello.", False, output_format={"container": "raw", "encoding": "pcm_s16le",
                                                         "sample_rate": 12345}), "invalid_output_format"),
            (start("c4", "Hello.", False, voice={"mode": "embedding", "embedding": [0.1]}), "invalid_voice"),
            ({"context_id": 7, "transcript": "Hi."}, "invalid_context_id"),
            ("x" * (gateway.config.max_body_bytes + 1), "message_too_large"),
        ]
        for message, code in cases:
            await socket.send(message)
            error = await socket.error()
            assert error["code"] == code, error
        await ws.send_bytes(b"\x00")
        assert (await socket.error())["code"] == "invalid_message"
        # Text that takes an open context over the limit ends that context with the error (and nothing after it).
        got: dict[str, list[dict[str, Any]]] = {}
        await socket.send(start("big", "Hello.", True))
        await socket.send(start("big", "x" * gateway.config.max_text_chars, True))
        while (message := await socket.receive())["type"] != "error":
            got.setdefault(message["context_id"], []).append(message)
        assert (message["code"], message["context_id"]) == ("text_too_long", "big")
        # A context that is fine still plays on the same socket, and the refused ones hold no admission slot.
        await socket.send(start("ok", "Good morning.", False))
        end = await socket.until_end("ok", got)
        assert not any(m["done"] for m in got.get("big", [])), "a context ends once"
        assert end["type"] == "done" and "cancelled" not in end
        assert len(audio_of(got["ok"])) > 0
        # Text for a context that has all its text is refused, and a finished context's id opens a new one.
        await socket.send(start("ok2", "One.", False))
        await socket.send(start("ok2", "Two.", False))
        error = await socket.error()
        assert error["code"] == "context_closed" and error["context_id"] == "ok2"
        assert (await socket.until_end("ok2", got))["type"] == "done"
    await wait_until(lambda: gateway.admission.streams == 0)


@pytest.mark.engine
async def test_contexts_share_a_socket_each_at_its_rate_with_word_timestamps_and_one_end(
        door: tuple[str, GatewayState]) -> None:
    """Two contexts at once on one socket, text in pieces: each ends once with `done`, its audio at the rate it
    asked for, and (where asked) words in the text's order, inside its audio."""
    base, gateway = door
    texts = {"a": ["Good morning, ", "class. Today we ", "read a story."], "b": ["Bom dia! ", "Tudo bem?"]}
    formats = {"a": (44100, "pcm_s16le", "<i2"), "b": (16000, "pcm_f32le", "<f4")}
    ended_before = {o: gateway.metrics.stream_contexts_total.labels(o)._value.get() for o in ("done", "cancelled")}
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(base + CARTESIA_PATH, headers={"X-API-Key": "unused"}) as ws:
        socket = Socket(ws)
        for piece in range(3):
            for cid, pieces in texts.items():
                if piece < len(pieces):
                    rate, encoding, _ = formats[cid]
                    await socket.send(start(cid, pieces[piece], True, add_timestamps=True,
                                            output_format={"container": "raw", "encoding": encoding,
                                                           "sample_rate": rate}))
        for cid in texts:
            await socket.send(start(cid, "", False))  # the flush: closes the context
        got: dict[str, list[dict[str, Any]]] = {}
        ends = [await socket.until_end("a", got)]
        if not got.get("b") or not got["b"][-1]["done"]:
            ends.append(await socket.until_end("b", got))
    for cid, pieces in texts.items():
        messages = got[cid]
        assert [m["type"] for m in messages].count("done") == 1 and messages[-1]["type"] == "done"
        rate, _, dtype = formats[cid]
        audio = audio_of(messages, dtype)
        assert len(audio) > 0
        words = words_of(messages)
        spoken = [w for w, _, _ in words]
        assert spoken == "".join(pieces).replace(",", "").replace(".", "").replace("!", "").replace("?", "").split()
        starts = [s for _, s, _ in words]
        assert starts == sorted(starts)
        assert all(0 <= s <= e <= len(audio) / rate + 0.01 for _, s, e in words)
    assert gateway.metrics.stream_contexts_total.labels("done")._value.get() == ended_before["done"] + 2
    assert gateway.metrics.stream_contexts_total.labels("cancelled")._value.get() == ended_before["cancelled"]


@pytest.mark.engine
async def test_cancel_aborts_the_engine_request_and_ends_the_context_once(
        door: tuple[str, GatewayState], synthesizer: Synthesizer) -> None:
    base, gateway = door
    engine: Any = synthesizer.engine
    async with aiohttp.ClientSession() as http, http.ws_connect(base + CARTESIA_PATH) as ws:
        socket = Socket(ws)
        started, aborted = engine.requests_started, engine.requests_aborted
        await socket.send(start("long", LONG_TEXT, True))
        first = await socket.receive()
        assert first["type"] == "chunk" and first["context_id"] == "long"
        await socket.send({"context_id": "long", "cancel": True})
        got: dict[str, list[dict[str, Any]]] = {}
        end = await socket.until_end("long", got)
        assert end == {"type": "done", "context_id": "long", "status_code": 200, "done": True, "cancelled": True}
        await wait_until(lambda: engine.in_flight == 0 and engine.unfinished_requests() == 0)
        assert engine.requests_aborted == aborted + 1, "the running request was aborted, not finished"
        assert engine.requests_started - started < 8, "the later sentences never reached the engine"
        # The socket goes on serving.
        await socket.send(start("next", "Hello.", False))
        assert (await socket.until_end("next", got))["type"] == "done"
    await wait_until(lambda: gateway.admission.streams == 0)


@pytest.mark.engine
async def test_closing_the_socket_cancels_its_contexts(door: tuple[str, GatewayState],
                                                       synthesizer: Synthesizer) -> None:
    base, gateway = door
    engine: Any = synthesizer.engine
    cancelled = gateway.metrics.stream_contexts_total.labels("cancelled")._value.get()
    aborted = engine.requests_aborted
    async with aiohttp.ClientSession() as http, http.ws_connect(base + CARTESIA_PATH) as ws:
        socket = Socket(ws)
        await socket.send(start("gone", LONG_TEXT, True))
        assert (await socket.receive())["type"] == "chunk"
    await wait_until(lambda: gateway.metrics.stream_contexts_total.labels("cancelled")._value.get() == cancelled + 1)
    await wait_until(lambda: engine.in_flight == 0 and engine.unfinished_requests() == 0)
    assert engine.requests_aborted == aborted + 1
    assert gateway.admission.streams == 0


@pytest.mark.engine
async def test_the_door_keeps_the_gateways_auth(tiny_model_dir: Any, tiny_snac_dir: Any,
                                                synthesizer: Synthesizer) -> None:
    config = tiny_config(tiny_model_dir, tiny_snac_dir, auth_token=[TOKEN])
    async with running(config, synthesizer) as (base, _), aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(base + CARTESIA_PATH, headers={"X-API-Key": "wrong-token-0123456789"})
        assert refused.value.status == 401
        for kwargs in ({"headers": {"X-API-Key": TOKEN}}, {"params": {"api_key": TOKEN}}):
            async with http.ws_connect(base + CARTESIA_PATH, **kwargs) as ws:
                await ws.send_str("{}")
                assert json.loads((await ws.receive(timeout=EVENT_TIMEOUT_S)).data)["type"] == "error"


@pytest.mark.engine
async def test_speech_route_sends_word_timings_beside_the_audio_when_asked(door: tuple[str, GatewayState]) -> None:
    base, _ = door
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-4o-mini-tts", "input": "Good morning, class. Open your books.", "voice": "alloy",
                "response_format": "pcm", "stream_format": "sse", "word_timestamps": True, "speed": 1.25}
        async with http.post(base + "/v1/audio/speech", json=body) as resp:
            assert resp.status == 200
            events = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: ")]
        async with http.post(base + "/v1/audio/speech", json={**body, "stream_format": "audio"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_word_timestamps"
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and types.count("speech.audio.words") == 2
    samples = sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta") // 2
    words = [w for e in events if e["type"] == "speech.audio.words" for w in e["words"]]
    assert [w["word"] for w in words] == ["Good", "morning", "class", "Open", "your", "books"]
    assert all(0 <= w["start"] <= w["end"] <= samples / SAMPLE_RATE + 0.01 for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)


@pytest.mark.engine
async def test_a_socket_holds_at_most_its_context_limit(door: tuple[str, GatewayState]) -> None:
    """Open contexts are bounded per socket (each holds an admission slot); closing the socket frees them all."""
    base, gateway = door
    limit = gateway.config.max_queued_utterances
    async with aiohttp.ClientSession() as http, http.ws_connect(base + CARTESIA_PATH) as ws:
        socket = Socket(ws)
        for n in range(limit):
            await socket.send(start(f"open{n}", "", True))  # open, no sentence yet: no engine request
        await wait_until(lambda: gateway.admission.streams == limit)
        await socket.send(start("one-too-many", "", True))
        error = await socket.error()
        assert (error["code"], error["context_id"]) == ("too_many_contexts", "one-too-many")
    await wait_until(lambda: gateway.admission.streams == 0)
