"""What the tests share: tiny-engine settings, a real `vllm serve`, the gateway on loopback, WebRTC helpers, frame
makers, a real coturn, and waiting for a condition. Test modules import from here, never from each other."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from aioice import stun
from aioice import turn as aioice_turn
from aioice.ice import get_host_addresses
from aiortc import RTCConfiguration, RTCPeerConnection

from gateway.cluster.supervisor import vllm_serve_command
from gateway.config import GatewayConfig, from_sources
from gateway.devtools.client import HeadlessPeer
from gateway.devtools.devmodels import random_frames
from gateway.edge.app import create_app
from gateway.edge.http import GATEWAY_KEY
from gateway.edge.state import GatewayState
from gateway.orpheus import Frame
from gateway.rtc.ice import turn_rest_credentials
from gateway.rtc.protocol import CONTROL_LABEL, protocol_schema
from gateway.rtc.session import Session
from gateway.speech.engine import sampling_settings, vllm_engine_settings
from gateway.speech.synthesizer import Synthesizer, decoder_settings


def assert_valid(entry: str, message: object) -> None:
    """`message` is valid against the protocol schema's `entry` (client_message, server_event, offer, answer)."""
    import jsonschema

    schema = protocol_schema()
    validator = jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{entry}"})
    errors = [error.message for error in validator.iter_errors(message)]
    assert not errors, f"{message!r} is not a valid {entry}: {errors}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_frames(n: int, seed: int = 0) -> list[Frame]:
    return random_frames(n, seed)


async def decoded_audio(chunks: asyncio.Queue[Any], timeout: float = 60.0) -> np.ndarray:
    """The PCM of a decode stream's `chunks` ((pcm, last) pairs, then None) concatenated; a failure it carries
    is raised. `timeout`: the longest wait for one item."""
    pieces: list[np.ndarray] = []
    while (item := await asyncio.wait_for(chunks.get(), timeout)) is not None:
        if isinstance(item, BaseException):
            raise item
        pieces.append(item[0])
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int16)


async def wait_until(predicate, timeout: float = 10.0,  # type: ignore[no-untyped-def]
                     message: str = "condition not met") -> None:
    """Polls `predicate` on this loop until it holds, failing with `message` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {message}")
        await asyncio.sleep(0.05)


class ManualClock:
    """An injectable clock (`PlayoutTrack(clock=)`, `StreamDecoder(clock=)`, ...) that stands still until the test
    moves it: a timing rule is tested on the times the test sets, whatever this machine's speed. Threads may read it."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def poll_until(predicate, message: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """`wait_until` for a test without an event loop: polls `predicate` from this thread, failing with `message`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {message}")
        time.sleep(0.01)


TOKEN = "static-token-for-tests-0123456789"


SECRET = "hmac-secret-for-tests-0123456789"


SCHOOL = "https://school.example"


EVIL = "https://evil.example"


EVENT_TIMEOUT_S = 60.0  # the engine is slow on a shared 2-core CPU


@contextlib.asynccontextmanager
async def running(config: GatewayConfig, synthesizer: Synthesizer) -> AsyncIterator[tuple[str, GatewayState]]:
    """The gateway app on 127.0.0.1 around the shared synthesizer: (base url, gateway)."""
    app = create_app(config, synthesizer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), app[GATEWAY_KEY]
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def connected_peers(base_url: str, count: int, jitter_buffer_ms: int = 0) -> AsyncIterator[list[HeadlessPeer]]:
    """`count` headless peers connected to the gateway at `base_url` (together), all closed at the end."""
    peers = [HeadlessPeer(base_url, jitter_buffer_ms=jitter_buffer_ms) for _ in range(count)]
    try:
        await asyncio.gather(*(peer.connect() for peer in peers))
        yield peers
    finally:
        await asyncio.gather(*(peer.close() for peer in peers))


async def offer_sdp() -> str:
    """A valid browser-like offer (recvonly audio + `control` data channel); its peer is closed at once."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.createDataChannel(CONTROL_LABEL)
    pc.addTransceiver("audio", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


class _SilentTransport:
    """A UDP transport whose packets go nowhere (everything else is the real one)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def sendto(self, data: bytes, addr: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def vanish(peer: HeadlessPeer) -> None:
    """Cut the peer off the network without closing anything: its packets stop, as when a laptop sleeps."""
    for ice in peer.pc._RTCPeerConnection__iceTransports:  # type: ignore[attr-defined]
        for protocol in ice._connection._protocols:
            protocol.transport = _SilentTransport(protocol.transport)


@contextlib.asynccontextmanager
async def detached_session(gateway: GatewayState) -> AsyncIterator[Session]:
    """A session with no remote peer and no synthesis worker: `handle()` runs, nothing reaches the engine."""
    manager = gateway.sessions
    session = manager.session(RTCPeerConnection(RTCConfiguration(iceServers=[])), manager.new_session_id(),
                              gateway.config.voice, 0)
    for task in (session.speaker.worker, session._watchdog):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    try:
        yield session
    finally:
        await session.close()


def capture_pushed(session: Session) -> dict[str, list[np.ndarray]]:
    """The PCM the session pushes to its playout track, per utterance (what it plays, before Opus)."""
    pushed: dict[str, list[np.ndarray]] = {}
    original = session.track.push_pcm

    def spy(utterance_id: str, pcm: np.ndarray) -> bool:
        pushed.setdefault(utterance_id, []).append(pcm.copy())
        return original(utterance_id, pcm)

    session.track.push_pcm = spy  # type: ignore[method-assign]
    return pushed


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


TURN_SECRET = "turn-secret-for-tests-0123456789"


ROOT = Path(__file__).resolve().parent.parent


TURN_CONF = ROOT / "docker" / "turnserver.conf"


TURNSERVER = shutil.which("turnserver")


needs_coturn = pytest.mark.skipif(TURNSERVER is None, reason="coturn's `turnserver` is not on PATH "
                                  "(install.sh installs Debian's coturn; `apt-get install coturn`)")


TURN_START_TIMEOUT_S = 20.0


ALLOCATE_TIMEOUT_S = 5.0


def free_udp_tcp_port() -> int:
    # coturn listens on this port over UDP and TCP: one free on both.
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port


@dataclasses.dataclass
class Coturn:
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"turn:127.0.0.1:{self.port}?transport=udp"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


class _Nothing(asyncio.DatagramProtocol):
    pass


async def allocate(port: int, username: str, credential: str) -> aioice_turn.TurnTransport:
    transport, _ = await asyncio.wait_for(
        aioice_turn.create_turn_endpoint(_Nothing, ("127.0.0.1", port), username, credential), ALLOCATE_TIMEOUT_S)
    return transport


@pytest.fixture(scope="module", name="coturn")  # conftest imports it for test_turn and test_web
def coturn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coturn]:
    """`turnserver` with the repo's docker/turnserver.conf and the secret on the command line, as compose runs it.

    Overrides for a test machine only: loopback listener and a free port, state files in a temp dir, and the
    machine's own addresses allowed as peers (the conf denies private ranges, and both peers live here).
    """
    assert TURNSERVER is not None
    tmp = tmp_path_factory.mktemp("coturn")
    port = free_udp_tcp_port()
    peers = ["127.0.0.1", *get_host_addresses(use_ipv4=True, use_ipv6=False)]
    cmd = [TURNSERVER, "-c", str(TURN_CONF), "--listening-ip=127.0.0.1", f"--listening-port={port}",
           f"--static-auth-secret={TURN_SECRET}", "--allow-loopback-peers",
           *(f"--allowed-peer-ip={ip}" for ip in peers),
           f"--pidfile={tmp / 'turnserver.pid'}", f"--userdb={tmp / 'turndb'}"]
    log_path = tmp / "turnserver.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Coturn(port, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def wait_for_coturn(coturn: Coturn) -> None:
    """Until an allocation with fresh credentials works (coturn takes a moment to open its relay ports)."""
    deadline = time.monotonic() + TURN_START_TIMEOUT_S
    while True:
        try:
            (await allocate(coturn.port, *turn_rest_credentials(TURN_SECRET, 60, "probe"))).close()
            return
        except (TimeoutError, ConnectionError, stun.TransactionError, OSError):
            if time.monotonic() > deadline:
                raise AssertionError(f"coturn did not allocate within {TURN_START_TIMEOUT_S} s:\n"
                                     f"{coturn.log_tail()}") from None
            await asyncio.sleep(0.5)


# Tiny-model stop rate per frame: utterances of ~1 s on average, still bounded by max_tokens.
TEST_STOP_PROBABILITY = 0.08


TEST_MAX_TOKENS = 140  # 20 frames = 1.7 s of audio at most per sentence


def tiny_config(model_dir: Path, snac_dir: Path, **overrides: object) -> GatewayConfig:
    """Engine settings that start fastest on a 2-core CPU."""
    values: dict[str, object] = dict(
        model=str(model_dir), snac_model=str(snac_dir), snac_device="cpu", enforce_eager=True,
        max_model_len=1024, max_num_seqs=32, max_tokens=TEST_MAX_TOKENS, engine_health_interval_s=0.5,
        engine_restart_delay_s=0.2, gc_freeze=False, dtype="float32", warmup_batch_sizes=[2],
    )
    values.update(overrides)
    return from_sources(env={}, **values)


# --- two tiny engines (several models on one process): one pair per test session ----------------------------------

# `bench --models 2 --lora-voice --lora-rank 8` on the tiny model: the table of the session's two engines.
BENCH_MODEL_ARGS = ["--models", "2", "--lora-voice", "--lora-rank", "8", "--scenario", "traffic,lora,mixed-spans",
                    "--level", "engine", "--traffic", "75/25", "--traffic-users", "4", "--lora-users", "2",
                    "--mixed-spans-users", "1,2", "--warmup", "0", "--cooldown-s", "0", "--tokens-per-char", "1",
                    "--no-plots"]


def bench_models_config(model_dir: Path, snac_dir: Path, folder: Path) -> GatewayConfig:
    """The table `--models 2 --lora-voice --lora-rank 8` builds (the checkpoint served twice, en and pt, a rank-8
    adapter of every projection beside the model on en), with the tests' engine settings and a small KV cache per
    engine."""
    from gateway.benchmarks.models import ModelChoice, bench_models_file
    from gateway.benchmarks.settings import build_parser

    args = build_parser().parse_args(BENCH_MODEL_ARGS)
    choice = ModelChoice(str(model_dir), str(snac_dir), {}, 0.0, "tiny")
    models_file = bench_models_file(args, choice, str(model_dir), folder)
    assert models_file is not None
    return tiny_config(model_dir, snac_dir, models_file=models_file, kv_cache_memory_gib=0.25)


def on_shared_engines(config: GatewayConfig, shared: Synthesizer) -> Synthesizer:
    """A synthesizer of `config`'s table (its voices, languages, defaults) on the started engines, tokenizers and SNAC
    decoder of `shared`. Each model of `config` must start and sample exactly as the engine of its name does, so the
    engines serve `config` as they would had it started them. Close `shared`, never this one."""
    table = config.model_table
    assert list(table.bases) == list(shared.engines), (list(table.bases), list(shared.engines))
    for name, engine in shared.engines.items():
        wanted = config.for_model(name)
        assert vllm_engine_settings(wanted, on_cpu=True) == vllm_engine_settings(engine.config, on_cpu=True), name
        assert sampling_settings(wanted) == sampling_settings(engine.config), name
        assert wanted.lora == engine.config.lora, name
    assert decoder_settings(config) == decoder_settings(shared.config)
    first = next(iter(table.bases))
    return Synthesizer(config, shared.engines[first], shared.tokenizers[first], shared.decoder,
                       engines=shared.engines, tokenizers=shared.tokenizers)


def cli_env() -> dict[str, str]:
    """The environment of an `orpheus-gateway` command run by a test: the tiny model's fast CPU settings."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "ORPHEUS_GATEWAY_ENFORCE_EAGER": "true",
            "ORPHEUS_GATEWAY_MAX_MODEL_LEN": "1024", "ORPHEUS_GATEWAY_MAX_NUM_SEQS": "8",
            "ORPHEUS_GATEWAY_DTYPE": "float32", "ORPHEUS_GATEWAY_MAX_TOKENS": "140"}


# --- a real headless Chromium (the avatar page) -----------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at "
                                    "/usr/bin/chromium (install.sh installs it; `apt-get install chromium`)")
CHROMIUM_ARGS = [
    "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    """Debian's Chromium driven by playwright (its own browsers are not used), sound on."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                                                   ignore_default_args=["--mute-audio"])
        try:
            yield browser
        finally:
            await browser.close()


async def open_page(browser: Any, base_url: str, width: int = 1100, height: int = 900) -> tuple[Any, list[str]]:
    """A fresh page on the avatar page, its voices listed; also returns the list its uncaught script errors go to."""
    context = await browser.new_context(viewport={"width": width, "height": height})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"{base_url}/")
    await page.wait_for_function("document.querySelectorAll('#voice option').length > 0")
    return page, errors


def start_process_group(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`cmd` in a process group of its own (`stop_process_group` ends it and its children), its output in `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
    """Sends `sig` to the process group `proc` leads (started with `start_new_session=True`) and waits for it to
    exit; SIGKILL after `timeout` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


SERVER_START_TIMEOUT_S = 300.0  # ~40-60 s on an idle 2-core CPU; more while other engine tests share the cores


class VllmServer:
    """`vllm serve` in its own process group (the API server and its engine-core child die together)."""

    def __init__(self, config: GatewayConfig, port: int, log_path: Path) -> None:
        self.config, self.port, self.log_path = config, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # The command `serve --workers` runs when it starts its own server: the tiny model's CPU settings.
        from gateway.speech.engine import RPC_FOLDER_ENV, own_rpc_folder

        cmd = vllm_serve_command(self.config, "127.0.0.1", self.port)
        # its ipc sockets in this test process's own folder, removed when the tests end
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", RPC_FOLDER_ENV: own_rpc_folder()}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_healthy(self, timeout: float = SERVER_START_TIMEOUT_S) -> None:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - t0 < timeout:
                assert self.proc is not None and self.proc.poll() is None, f"vllm serve exited:\n{self.log_tail()}"
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            self.start_s = time.monotonic() - t0
                            return
                await asyncio.sleep(0.5)
        raise AssertionError(f"vllm serve not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_process_group(self.proc, sig, timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the engine core, should it outlive its parent
            os.killpg(self.proc.pid, signal.SIGKILL)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    async def metric(self, name: str) -> float:
        """Sum of a Prometheus metric over its label sets, e.g. vllm:num_requests_running."""
        async with aiohttp.ClientSession() as http, http.get(f"{self.url}/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


# Each change of the page's state, recorded in the page as it happens (with the status line, the error box and the
# time), for the tests of reconnecting: a state that lasts a fraction of a second is easily missed by polling.
RECORD_STATES_JS = """() => {
  window.__states = [];
  const text = (id) => document.getElementById(id).textContent;
  new MutationObserver(() => window.__states.push({
    state: document.body.dataset.state, at: performance.now(), now: text('now'), error: text('error'),
  })).observe(document.body, { attributes: true, attributeFilter: ['data-state'] });
}"""


async def reached(page: Any, state: str, timeout_s: float = 20) -> dict[str, Any]:
    """The first record of `state` since RECORD_STATES_JS, waited for."""
    found = await page.wait_for_function("(state) => window.__states.find((s) => s.state === state)", arg=state,
                                         timeout=timeout_s * 1000)
    return await found.json_value()
