"""Shared fixtures: a tiny Orpheus-compatible model and SNAC built on the fly, and ONE real vLLM engine
(CPU) started once per test session and shared by every test that needs it."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# vLLM CPU reserves this many GiB of KV cache; the tiny model needs far less than the 4 GiB default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from gateway.config import GatewayConfig
from gateway.media.avthreads import use_one_ffmpeg_thread
from tests.support import TEST_STOP_PROBABILITY, VllmServer, coturn_server, free_port, tiny_config  # noqa: F401

use_one_ffmpeg_thread()  # the test process runs sessions, as a gateway process does after its start


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.devtools.devmodels import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-orpheus"), shape="tiny",
                            stop_probability=TEST_STOP_PROBABILITY)


@pytest.fixture(scope="session")
def tiny_snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.devtools.devmodels import build_test_snac

    return build_test_snac(tmp_path_factory.mktemp("tiny-snac"))




@pytest.fixture(scope="session")
def test_config(tiny_model_dir: Path, tiny_snac_dir: Path) -> GatewayConfig:
    return tiny_config(tiny_model_dir, tiny_snac_dir)


@pytest.fixture(scope="session")
async def synthesizer(test_config: GatewayConfig) -> AsyncIterator[object]:
    from gateway.speech.synthesizer import Synthesizer

    synth = Synthesizer.load(test_config)
    await synth.start()
    yield synth
    await synth.close()


# --- a real `vllm serve` (remote backend, workers) -------------------------------------------------------



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
