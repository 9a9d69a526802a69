"""Shared fixtures: a tiny Orpheus-compatible model and SNAC built on the fly, and ONE real vLLM engine
(CPU) started once per test session and shared by every test that needs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

# vLLM CPU reserves this many GiB of KV cache; the tiny model needs far less than the 4 GiB default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from gateway.codec_server import engine_codec_env
from gateway.config import GatewayConfig, from_sources
from gateway.synthesizer import codec_server_settings
from gateway.workers import vllm_serve_command

# Tiny-model stop rate per frame: utterances of ~1 s on average, still bounded by max_tokens.
TEST_STOP_PROBABILITY = 0.08
TEST_MAX_TOKENS = 140  # 20 frames = 1.7 s of audio at most per sentence


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.devmodels import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-orpheus"), shape="tiny",
                            stop_probability=TEST_STOP_PROBABILITY)


@pytest.fixture(scope="session")
def tiny_snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.devmodels import build_test_snac

    return build_test_snac(tmp_path_factory.mktemp("tiny-snac"))


def tiny_config(model_dir: Path, snac_dir: Path, **overrides: object) -> GatewayConfig:
    """Engine settings that start fastest on a 2-core CPU."""
    values: dict[str, object] = dict(
        model=str(model_dir), snac_model=str(snac_dir), snac_device="cpu", enforce_eager=True,
        max_model_len=1024, max_num_seqs=32, max_tokens=TEST_MAX_TOKENS, engine_health_interval_s=0.5,
        engine_restart_delay_s=0.2, gc_freeze=False, dtype="float32", warmup_batch_sizes=[2],
    )
    values.update(overrides)
    return from_sources(env={}, **values)


@pytest.fixture(scope="session")
def test_config(tiny_model_dir: Path, tiny_snac_dir: Path) -> GatewayConfig:
    return tiny_config(tiny_model_dir, tiny_snac_dir)


@pytest.fixture(scope="session")
async def synthesizer(test_config: GatewayConfig) -> AsyncIterator[object]:
    from gateway.synthesizer import Synthesizer

    synth = Synthesizer.load(test_config)
    await synth.start()
    yield synth
    await synth.close()


# --- a real `vllm serve` (remote backend, workers) -------------------------------------------------------

SERVER_START_TIMEOUT_S = 300.0  # ~40-60 s on an idle 2-core CPU; more while other engine tests share the cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve` in its own process group (the API server and its engine-core child die together)."""

    def __init__(self, config: GatewayConfig, port: int, log_path: Path) -> None:
        self.config, self.port, self.log_path = config, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None
        # Its engine core also serves SNAC here (gateway.vllm_plugin), as `serve --workers --snac-placement engine`.
        self.snac_socket = str(log_path.parent / "snac.sock")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # The command `serve --workers` runs when it starts its own server: the tiny model's CPU settings.
        cmd = vllm_serve_command(self.config, "127.0.0.1", self.port)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
               **engine_codec_env(codec_server_settings(self.config, self.snac_socket))}
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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
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


@pytest.fixture(scope="session")
async def vllm_server(test_config: GatewayConfig, tmp_path_factory: pytest.TempPathFactory
                      ) -> AsyncIterator[VllmServer]:
    """One real `vllm serve` (tiny model, CPU) for every test that needs a remote engine."""
    server = VllmServer(test_config, free_port(), tmp_path_factory.mktemp("vllm-serve") / "serve.log")
    server.start()
    try:
        await server.wait_healthy()
        print(f"\nvllm serve healthy after {server.start_s:.1f} s")
        yield server
    finally:
        server.kill(signal.SIGTERM)
