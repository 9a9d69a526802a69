"""The remote backend (`--vllm-url`) against a REAL `vllm serve` subprocess on the tiny model (CPU).

One server starts per test session. A TCP forwarder in front of it plays a second server that can be made to
refuse connections or fail its health checks without touching vLLM; the last test kills the real server mid-stream
and starts it again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
import sys
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway import config as config_mod
from gateway.cli import build_parser
from gateway.config import ConfigError, GatewayConfig
from gateway.edge.app import create_app
from gateway.orpheus import END_OF_SPEECH_ID, SAMPLE_RATE, SAMPLES_PER_FRAME, build_prompt
from gateway.speech.engine import EngineState
from gateway.speech.errors import (
    ENGINE_RETRY_AFTER_S,
    EngineDeadError,
    EngineRequestError,
    EngineUnavailableError,
)
from gateway.speech.remote import RemoteEngine
from gateway.speech.synthesizer import Synthesizer, UtteranceStats
from tests.support import SERVER_START_TIMEOUT_S, VllmServer, free_port, tiny_config, wait_until

LONG_TEXT = "This utterance will lose its server."
LONG_SEED = 23
KILL_ATTEMPTS = 2  # the engine-core kill test tries again if the utterance was generated before the kill landed
LONG_TOKENS = 225  # what LONG_TEXT with LONG_SEED generates when left alone (~5 s on CPU): the same ids every run
READ_TIMEOUT_S = 5.0  # --vllm-read-timeout-s in the stalled-stream test: above a loaded 2-core machine's pauses
READ_TIMEOUT_SLACK_S = 4.0  # the close and the loop's wake-up after the timeout, on a loaded 2-core machine
# Tries at cancelling a request mid-generation: on two shared cores a try can see its first ids only after the
# server generated them all (a fresh-clone run had 3 such tries in a row); such a try says nothing.
CANCEL_ATTEMPTS = 5



class TcpForwarder:
    """A second address for the real server: stop it and that "server" refuses connections, start it again on
    the same port and it is back. `close_reused` is how many times a request on a connection that has already
    carried one is dropped unanswered with its connection: the server's keep-alive ending as the request comes.
    `cut_after_headers` is how many answers lose their connection right after the response headers (the server
    gone between its 200 and its first event); while `stalled`, nothing the server sends gets through and no
    connection closes (a host that vanished without closing its sockets)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.close_reused = 0
        self.cut_after_headers = 0
        self.stalled = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        answered = False  # a response went back on this connection: the next request reuses it

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
            nonlocal answered
            try:
                while data := await src.read(65536):
                    if upstream and answered and self.close_reused > 0:
                        self.close_reused -= 1
                        writer.transport.abort()
                        up_writer.transport.abort()
                        return
                    if not upstream and self.stalled:
                        continue  # read and dropped: the gateway hears nothing, and no connection closes
                    if not upstream and self.cut_after_headers > 0 and (end := data.find(b"\r\n\r\n")) >= 0:
                        self.cut_after_headers -= 1
                        dst.write(data[:end + 4])
                        await dst.drain()
                        writer.transport.abort()
                        up_writer.transport.abort()
                        return
                    answered = answered or not upstream
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True)
        self._writers -= {writer, up_writer}


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"


def metric_is(server: VllmServer, name: str, value: float) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await server.metric(name) == value

    return check


async def speak(synth: Synthesizer, text: str, seed: int, max_tokens: int | None = None) -> UtteranceStats:
    stats = UtteranceStats()
    async for _ in synth.utterance(text, "tara", seed=seed, max_tokens=max_tokens, stats=stats):
        pass
    assert stats.frames >= 1 and stats.samples == stats.frames * SAMPLES_PER_FRAME
    return stats


# --- configuration (no engine) ------------------------------------------------------------------------

def parse(argv: list[str]) -> GatewayConfig:
    return config_mod.from_sources(build_parser().parse_args(["serve", *argv]), env={})


def test_vllm_url_flag_is_repeatable_and_env_is_comma_separated() -> None:
    config = parse(["--vllm-url", "http://gpu1:8001", "--vllm-url", "https://gpu2:8001/",
                    "--vllm-api-key", "k", "--vllm-model", "orpheus"])
    assert config.vllm_urls == ("http://gpu1:8001", "https://gpu2:8001/")
    assert (config.vllm_api_key, config.vllm_model) == ("k", "orpheus")
    env = {"ORPHEUS_GATEWAY_VLLM_URLS": "http://a:1, http://b:2"}
    assert config_mod.from_sources(None, env=env).vllm_urls == ("http://a:1", "http://b:2")
    args = build_parser().parse_args(["serve", "--vllm-url", "http://c:3"])
    assert config_mod.from_sources(args, env=env).vllm_urls == ("http://c:3",), "the flag wins over the variable"
    assert parse([]).vllm_urls == ()


@pytest.mark.parametrize("url", ["gpu1:8001", "ftp://gpu1:8001", "http://", "http://gpu1:99999", "http://a:1/?x=1"])
def test_bad_vllm_url_is_named(url: str) -> None:
    with pytest.raises(ConfigError, match="vllm_urls"):
        parse(["--vllm-url", url])


def test_same_vllm_url_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        parse(["--vllm-url", "http://a:1", "--vllm-url", "http://a:1/"])


# --- the real server --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def remote_config(vllm_server: VllmServer, tiny_model_dir: Path,
                  tiny_snac_dir: Path) -> Callable[..., GatewayConfig]:
    def make(*urls: str, **overrides: object) -> GatewayConfig:
        return tiny_config(tiny_model_dir, tiny_snac_dir, vllm_urls=urls or (vllm_server.url,), **overrides)

    return make


@pytest.fixture(scope="module")
async def remote_synth(remote_config: Callable[..., GatewayConfig]) -> AsyncIterator[Synthesizer]:
    synth = Synthesizer.load(remote_config())
    assert isinstance(synth.engine, RemoteEngine), "vllm_urls set: no in-process engine"
    await synth.start()
    assert synth.engine.ready
    yield synth
    await synth.close()


@contextlib.asynccontextmanager
async def other_engine(synth: Synthesizer, config: GatewayConfig) -> AsyncIterator[Synthesizer]:
    """A synthesizer on its own RemoteEngine, sharing the module's tokenizer and SNAC decoder."""
    engine = RemoteEngine(config)
    await engine.start()
    try:
        yield Synthesizer(config, engine, synth.tokenizer, synth.decoder)
    finally:
        await engine.close()


@pytest.mark.engine
async def test_server_is_warmed_up_before_it_takes_users(remote_synth: Synthesizer) -> None:
    """The start-up bursts (tests: one burst of 2) ran against the server before the engine was ready."""
    engine = remote_synth.engine
    assert isinstance(engine, RemoteEngine)
    assert engine.warmed_up == [2]
    assert all(server.warmed_up for server in engine.servers if server.healthy)
    assert engine.unfinished_requests() == 0


@pytest.mark.engine
async def test_remote_engine_streams_audio_ids(remote_synth: Synthesizer) -> None:
    prompt = build_prompt(remote_synth.tokenizer, "tara", "Hello.")
    deltas = [delta async for delta in remote_synth.engine.generate(prompt, max_tokens=70, seed=1)]
    ids = [i for d in deltas for i in d]
    assert len(deltas) > 1 and all(isinstance(d, list) and d for d in deltas), "DELTA chunks, as they come"
    assert 7 <= len(ids) <= 70
    audio = [i for i in ids if i != END_OF_SPEECH_ID]
    assert [(i - 128266) // 4096 for i in audio] == [k % 7 for k in range(len(audio))]
    assert remote_synth.engine.in_flight == 0 and remote_synth.engine.unfinished_requests() == 0


@pytest.mark.engine
async def test_same_ids_as_in_process_engine(remote_synth: Synthesizer, synthesizer: Synthesizer) -> None:
    """Same model, prompt and seed: the server and the in-process engine sample the same ids."""
    for text, seed, max_tokens in (("Hello.", 1, None), (LONG_TEXT, LONG_SEED, 700)):
        prompt = build_prompt(remote_synth.tokenizer, "tara", text)
        remote = [i async for d in remote_synth.engine.generate(prompt, seed=seed, max_tokens=max_tokens) for i in d]
        local = [i async for d in synthesizer.engine.generate(prompt, seed=seed, max_tokens=max_tokens) for i in d]
        assert remote == local
    assert len(remote) == LONG_TOKENS, "the abort tests below count on this length"


@pytest.mark.engine
async def test_remote_synthesizer_speaks_sentences_in_order(remote_synth: Synthesizer) -> None:
    stats = UtteranceStats()
    chunks = [c async for c in remote_synth.utterance("First one here. And a second!", "tara", seed=7,
                                                       stats=stats)]
    assert stats.sentences == 2 and stats.frames >= 2
    assert stats.samples == stats.frames * SAMPLES_PER_FRAME == sum(len(c.pcm) for c in chunks)
    assert [c.sentence_index for c in chunks] == sorted(c.sentence_index for c in chunks)
    assert max(abs(int(c.pcm.min())) for c in chunks) > 0
    assert stats.ttfa_s is not None and stats.ttft_s is not None and stats.ttfa_s >= stats.ttft_s


@pytest.mark.engine
async def test_eight_concurrent_utterances_spread_over_two_servers(
        remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig], vllm_server: VllmServer) -> None:
    forwarder = TcpForwarder(vllm_server.port)
    await forwarder.start()
    try:
        async with other_engine(remote_synth, remote_config(vllm_server.url, forwarder.url)) as synth:
            results = await asyncio.gather(*(speak(synth, f"Sentence number {i}.", 100 + i, max_tokens=56)
                                             for i in range(8)))
            assert len(results) == 8
            engine = synth.engine
            assert isinstance(engine, RemoteEngine)
            assert [s.requests for s in engine.servers] == [4, 4], "least loaded, ties in turn"
            assert [s.in_flight for s in engine.servers] == [0, 0]
            assert engine.in_flight == 0 and engine.unfinished_requests() == 0
    finally:
        await forwarder.stop()
    await eventually(metric_is(vllm_server, RUNNING, 0))


async def generated_since(server: VllmServer, generated_before: float) -> float:
    """The ids the server generated since `generated_before`, once it runs nothing."""
    await eventually(metric_is(server, RUNNING, 0), timeout=5)
    return await server.metric(GENERATED) - generated_before


async def assert_aborted(server: VllmServer, generated_before: float) -> None:
    """The request stopped early: the server runs nothing, and generated fewer ids than the request would have."""
    generated = await generated_since(server, generated_before)
    assert 0 < generated < LONG_TOKENS, generated


async def drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def long_utterance_under_way(synth: Synthesizer) -> tuple[asyncio.Task[None], UtteranceStats]:
    """LONG_TEXT being synthesised, its first ids already in: the task to await and its stats."""
    stats = UtteranceStats()
    task = asyncio.create_task(drain(synth.utterance(LONG_TEXT, "tara", max_tokens=700, seed=LONG_SEED,
                                                     stats=stats)))
    await wait_until(lambda: stats.tokens > 0)
    return task, stats


@pytest.mark.engine
async def test_closing_the_stream_aborts_the_request_on_the_server(remote_synth: Synthesizer,
                                                                   vllm_server: VllmServer) -> None:
    engine = remote_synth.engine
    before = await vllm_server.metric(GENERATED)
    ids = engine.generate(build_prompt(remote_synth.tokenizer, "tara", LONG_TEXT), max_tokens=700, seed=LONG_SEED)
    await anext(ids)  # the first chunk comes after one id: the rest is still being generated
    assert engine.in_flight == 1 and engine.unfinished_requests() == 1
    await ids.aclose()
    assert engine.in_flight == 0 and engine.unfinished_requests() == 0
    await assert_aborted(vllm_server, before)
    # An utterance closed after its first audio frees its request too (aborted, or finished if SNAC on these
    # shared cores was slower than the whole generation).
    stream = remote_synth.utterance(LONG_TEXT, "tara", max_tokens=700, seed=LONG_SEED)
    assert len((await anext(stream)).pcm) > 0
    await stream.aclose()
    assert engine.in_flight == 0 and engine.unfinished_requests() == 0
    await eventually(metric_is(vllm_server, RUNNING, 0), timeout=10)


@pytest.mark.engine
async def test_cancelled_task_aborts_the_request_on_the_server(remote_synth: Synthesizer,
                                                               vllm_server: VllmServer) -> None:
    generated = float(LONG_TOKENS)
    for _attempt in range(CANCEL_ATTEMPTS):
        before = await vllm_server.metric(GENERATED)
        # Ids arriving, not audio: on two shared cores the first audio can come after the generation ended.
        task, _ = await long_utterance_under_way(remote_synth)
        task.cancel()  # at once: a /metrics scrape first let the server finish the request (CI, 2026-12-05)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert remote_synth.engine.in_flight == 0 and remote_synth.engine.unfinished_requests() == 0
        generated = await generated_since(vllm_server, before)
        if generated < LONG_TOKENS:
            break
        # The test process, starved by its own SNAC thread on two cores, saw its first ids only after the server
        # had generated them all (225 of 225): nothing was left to abort, so this attempt says nothing.
    assert 0 < generated < LONG_TOKENS, generated


@pytest.mark.engine
async def test_unreachable_server_is_not_ready(remote_synth: Synthesizer,
                                               remote_config: Callable[..., GatewayConfig],
                                               caplog: pytest.LogCaptureFixture) -> None:
    config = remote_config(f"http://127.0.0.1:{free_port()}")
    async with other_engine(remote_synth, config) as synth:
        engine = synth.engine
        assert isinstance(engine, RemoteEngine)
        assert not engine.ready and engine.state is EngineState.STARTING
        assert "no vLLM server answers yet" in caplog.text, "the operator is told why it is not ready"
        assert engine.servers[0].healthy is False and engine.servers[0].last_error
        with pytest.raises(EngineUnavailableError) as info:
            await speak(synth, "Nobody home.", seed=1)
        assert info.value.code == "engine_unavailable"
        app = create_app(config, synth, webrtc=False)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/readyz")
            assert resp.status == 503 and (await resp.json())["status"] == "starting"
            resp = await client.post("/v1/audio/speech", json={"input": "Hello."})
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_unavailable"


@pytest.mark.engine
async def test_a_request_the_server_refuses_is_engine_rejected(remote_synth: Synthesizer) -> None:
    """A request `vllm serve` refuses as invalid (more tokens than the model's context) fails as `engine_rejected`
    (retrying will not help), and the server stays in use."""
    with pytest.raises(EngineRequestError) as info:
        await speak(remote_synth, "Too long an answer.", seed=2, max_tokens=remote_synth.config.max_model_len * 4)
    assert info.value.code == "engine_rejected" and "refused" in str(info.value)
    assert remote_synth.engine.ready
    await speak(remote_synth, "Still here.", seed=4)


@pytest.mark.engine
async def test_dead_server_is_skipped(remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig],
                                      vllm_server: VllmServer) -> None:
    async with other_engine(remote_synth, remote_config(f"http://127.0.0.1:{free_port()}", vllm_server.url)) as synth:
        engine = synth.engine
        assert isinstance(engine, RemoteEngine) and engine.ready
        dead, live = engine.servers
        await asyncio.gather(*(speak(synth, f"Still here {i}.", seed=20 + i, max_tokens=28) for i in range(3)))
        assert (dead.healthy, dead.requests) == (False, 0)
        assert (live.healthy, live.requests) == (True, 3)


@pytest.mark.engine
async def test_refused_connection_fails_over(remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig],
                                             vllm_server: VllmServer) -> None:
    """A server that passed its last check but now refuses: the utterance goes to the other, nothing is lost."""
    forwarder = TcpForwarder(vllm_server.port)
    await forwarder.start()
    # No background checks during the test: the refusal itself must take the server out.
    config = remote_config(forwarder.url, vllm_server.url, engine_health_interval_s=3600.0)
    async with other_engine(remote_synth, config) as synth:
        engine = synth.engine
        assert isinstance(engine, RemoteEngine)
        gone, live = engine.servers
        assert gone.healthy and live.healthy
        await forwarder.stop()
        for i in range(2):  # ties take turns: one of the two tries the refusing server first
            await speak(synth, f"Fail over {i}.", seed=30 + i, max_tokens=28)
        assert (gone.healthy, gone.requests, gone.taken_out) == (False, 1, 1)
        assert live.requests == 2 and engine.ready


@pytest.mark.engine
async def test_a_pooled_connection_closed_under_a_request_does_not_take_the_server_out(
        remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig], vllm_server: VllmServer) -> None:
    """`vllm serve` closes a connection idle for its keep-alive (5 s); a request sent on it that moment gets no
    answer. The request goes again on a new connection: the only server stays in, the sentence is spoken."""
    forwarder = TcpForwarder(vllm_server.port)
    await forwarder.start()
    config = remote_config(forwarder.url, engine_health_interval_s=3600.0)
    async with other_engine(remote_synth, config) as synth:
        engine = synth.engine
        assert isinstance(engine, RemoteEngine) and engine.ready  # its check and warm-up left pooled connections
        forwarder.close_reused = 1
        await speak(synth, "Still here.", seed=3, max_tokens=28)
        assert forwarder.close_reused == 0, "no request met a reused connection"
        (server,) = engine.servers
        assert (server.healthy, server.taken_out, server.requests) == (True, 0, 1)
    await forwarder.stop()


@pytest.mark.engine
async def test_failed_health_checks_take_the_only_server_out_and_back(
        remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig], vllm_server: VllmServer) -> None:
    forwarder = TcpForwarder(vllm_server.port)
    await forwarder.start()
    async with other_engine(remote_synth, remote_config(forwarder.url)) as synth:
        engine = synth.engine
        assert engine.ready and engine.restarts == 0
        await forwarder.stop()
        await wait_until(lambda: engine.state is EngineState.RESTARTING, timeout=10)
        with pytest.raises(EngineUnavailableError):
            await speak(synth, "Not now.", seed=1)
        await forwarder.start()  # the same port
        await engine.wait_ready(timeout=10)
        assert engine.restarts == 1
        await speak(synth, "Back again.", seed=2, max_tokens=28)
        await forwarder.stop()


@pytest.mark.engine
async def test_a_server_silent_mid_stream_ends_the_utterance_after_the_read_timeout(
        remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig], vllm_server: VllmServer) -> None:
    """--vllm-read-timeout-s: a server that stops sending mid-stream without closing its connection (a host gone
    silent) ends the utterance `engine_dead` once it has been silent that long (not at the 60 s default, nor never),
    and is taken out of routing."""
    forwarder = TcpForwarder(vllm_server.port)
    await forwarder.start()
    config = remote_config(forwarder.url, engine_health_interval_s=3600.0, vllm_read_timeout_s=READ_TIMEOUT_S)
    try:
        async with other_engine(remote_synth, config) as synth:
            consumer, stats = await long_utterance_under_way(synth)
            forwarder.stalled = True
            stalled_at = time.monotonic()
            with pytest.raises(EngineDeadError) as info:
                await asyncio.wait_for(consumer, READ_TIMEOUT_S + READ_TIMEOUT_SLACK_S)
            silent_s = time.monotonic() - stalled_at
            assert stats.tokens < LONG_TOKENS, "stalled mid-stream"
            assert info.value.code == "engine_dead", info.value
            # The silence began at the last chunk before the stall (chunks come every few ms): not much sooner.
            assert silent_s >= READ_TIMEOUT_S / 2, f"ended {silent_s:.2f} s into a {READ_TIMEOUT_S} s timeout"
            (server,) = synth.engine.servers
            assert (server.healthy, server.taken_out) == (False, 1)
            assert synth.engine.unfinished_requests() == 0
    finally:
        await forwarder.stop()
    await eventually(metric_is(vllm_server, RUNNING, 0))


@pytest.mark.engine
async def test_speech_route_whose_server_dies_before_audio_is_a_503_engine_dead(
        remote_synth: Synthesizer, remote_config: Callable[..., GatewayConfig], vllm_server: VllmServer) -> None:
    """The speech route's promise: a server that dies after accepting the request (its 200 sent) but before the
    first audio is answered 503 `engine_dead` in OpenAI's error shape, with Retry-After: not a 500, nor a 200."""
    forwarder = TcpForwarder(vllm_server.port)
    await forwarder.start()
    config = remote_config(forwarder.url, engine_health_interval_s=3600.0)
    try:
        async with other_engine(remote_synth, config) as synth:
            app = create_app(config, synth, webrtc=False)
            async with TestClient(TestServer(app)) as client:
                forwarder.cut_after_headers = 1
                resp = await client.post("/v1/audio/speech", json={"input": "Nobody hears this.", "voice": "tara"})
                assert forwarder.cut_after_headers == 0, "the server's answer was cut"
                assert resp.status == 503, await resp.text()
                assert resp.headers["Retry-After"] == str(ENGINE_RETRY_AFTER_S)
                error = (await resp.json())["error"]
                assert (error["code"], error["type"]) == ("engine_dead", "server_error"), error
                assert synth.engine.in_flight == 0
                metrics = await (await client.get("/metrics")).text()
                assert 'orpheus_speech_requests_total{status="503"} 1.0' in metrics
    finally:
        await forwarder.stop()


@pytest.mark.engine
async def test_serve_cli_with_vllm_url(vllm_server: VllmServer, tiny_model_dir: Path, tiny_snac_dir: Path,
                                      tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "gateway.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--vllm-url", vllm_server.url, "--model", str(tiny_model_dir), "--snac-model", str(tiny_snac_dir),
        "--snac-device", "cpu", "--max-tokens", "140", "--no-gc-freeze",
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                assert proc.returncode is None, (tmp_path / "gateway.log").read_text()[-3000:]
                try:
                    async with http.get(f"{base}/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await eventually(ready, timeout=180)
            async with http.post(f"{base}/v1/audio/speech", json={"input": "Served remotely.", "voice": "leo"}) as r:
                assert r.status == 200
                with wave.open(io.BytesIO(await r.read())) as wav:
                    assert wav.getframerate() == SAMPLE_RATE
                    frames = wav.readframes(10**9)  # a streamed WAV's header cannot know its length
                assert frames and len(frames) % (2 * SAMPLES_PER_FRAME) == 0
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
        log.close()


@pytest.mark.engine
async def test_server_killed_mid_stream_fails_clearly_and_comes_back(remote_synth: Synthesizer,
                                                                     vllm_server: VllmServer) -> None:
    """Kill the real server (API server and engine core) mid-utterance, then start it on the same port."""
    engine = remote_synth.engine
    app = create_app(remote_synth.config, remote_synth, webrtc=False)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/readyz")).status == 200
        consumer, stats = await long_utterance_under_way(remote_synth)
        vllm_server.kill()
        with pytest.raises(EngineDeadError) as info:
            await consumer
        assert stats.tokens < LONG_TOKENS, "killed mid-stream"
        assert info.value.code == "engine_dead"
        assert engine.state is EngineState.RESTARTING, "the broken stream takes the only server out at once"
        resp = await client.get("/readyz")
        assert resp.status == 503 and (await resp.json())["status"] == "restarting"
        with pytest.raises(EngineUnavailableError):
            await speak(remote_synth, "Nobody to speak.", seed=3)

        t0 = time.monotonic()
        vllm_server.start()
        await engine.wait_ready(timeout=SERVER_START_TIMEOUT_S)
        print(f"\nvllm serve back after {time.monotonic() - t0:.1f} s")
        assert engine.restarts == 1
        assert (await client.get("/readyz")).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert "orpheus_engine_ready 1.0" in metrics and "orpheus_engine_restarts_total 1.0" in metrics
        await speak(remote_synth, "Back again.", seed=14)


@pytest.mark.engine
async def test_engine_core_killed_mid_stream_is_engine_dead(remote_synth: Synthesizer,
                                                            vllm_server: VllmServer) -> None:
    """Last: SIGKILL of `vllm serve`'s engine core only (what an OOM kill or a GPU fault does): vLLM reports it inside
    the stream (an error event, code 500) and shuts its API server down. The utterance ends `engine_dead`, not as
    a bug (`engine_error`: found by gateway.benchmarks.faults on an H200), and the restarted server serves again."""
    error: EngineDeadError | None = None
    for _ in range(KILL_ATTEMPTS):
        assert vllm_server.proc is not None
        (core,) = [p for p in psutil.Process(vllm_server.proc.pid).children(recursive=True)
                   if "EngineCore" in p.name()]
        try:
            consumer, stats = await long_utterance_under_way(remote_synth)
            core.kill()
            await consumer
        except EngineDeadError as exc:
            error = exc
        finally:  # what is left of it (under `serve --workers` the supervisor restarts it); later tests need it
            vllm_server.kill()
            vllm_server.start()
            await remote_synth.engine.wait_ready(timeout=SERVER_START_TIMEOUT_S)
        if error is not None:
            break
        # The whole utterance was out before the kill landed (a busy machine delayed its first chunk): again.
        assert stats.tokens == LONG_TOKENS
    assert error is not None, "the engine core's death ended the utterance"
    assert stats.tokens < LONG_TOKENS, "killed mid-stream"
    assert error.code == "engine_dead", error
    await speak(remote_synth, "Back again.", seed=14)
