"""Shared fixtures: a tiny Orpheus-compatible model and SNAC built on the fly, and ONE real vLLM engine
(CPU) started once per test session and shared by every test that needs it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# vLLM CPU reserves this many GiB of KV cache; the tiny model needs far less than the 4 GiB default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from gateway.config import GatewayConfig, from_sources

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
        engine_restart_delay_s=0.2, gc_freeze=False, dtype="float32",
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
