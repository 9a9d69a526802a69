"""Shared fixtures: a tiny Orpheus-compatible model and SNAC built on the fly, and ONE real vLLM engine
(CPU) started once per test session and shared by every test that needs it; likewise ONE pair of tiny engines for the
tests of several models."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# vLLM CPU reserves this many GiB of KV cache; the tiny model needs far less than the 4 GiB default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from gateway.config import GatewayConfig
from gateway.media.avthreads import use_one_ffmpeg_thread
from tests.support import (  # noqa: F401
    TEST_STOP_PROBABILITY,
    VllmServer,
    bench_models_config,
    coturn_server,
    free_port,
    tiny_config,
)

use_one_ffmpeg_thread()  # the test process runs sessions, as a gateway process does after its start


# --- skips: in CI (CI=true) only these may skip; any other skip fails the run ---------------------------------

# (test id, or its start; why that skip is expected where CI runs)
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = (
    ("tests/test_avthreads.py::test_ffmpeg_would_start_thread_pools_without_the_setting",
     "FFmpeg starts no thread pools on a one-core machine: nothing to compare"),
)
_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def unexpected_skips() -> list[tuple[str, str]]:
    return [(nodeid, reason) for nodeid, reason in _skipped
            if not any(nodeid.startswith(allowed) for allowed, _ in ALLOWED_SKIPS)]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    unexpected = unexpected_skips()
    if unexpected and os.environ.get("CI") == "true":
        terminalreporter.section("unexpected skips (CI=true: they fail the run)", red=True)
        for nodeid, reason in unexpected:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") == "true" and unexpected_skips() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- session fixtures that end after their last test, not at the session's end ----------------------------------

# Engines left idle still take CPU from every later test: these end once no test left in this run (its order, its
# selection) uses them.
ENDS_AFTER_LAST_USER: tuple[str, ...] = ("two_tiny_engines",)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None:
        return  # the session's end finishes everything
    names = [name for name in ENDS_AFTER_LAST_USER if name in getattr(item, "fixturenames", ())]
    if not names:
        return
    items = item.session.items
    later = items[items.index(item) + 1:]
    for name in names:
        if not any(name in getattr(other, "fixturenames", ()) for other in later):
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):  # type: ignore[attr-defined]
                fixturedef.finish(item._request)  # type: ignore[attr-defined]  # its dependents first, as pytest does


@pytest.fixture(autouse=True)
def audited_endings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every `HeadlessPeer` a test makes is audited when the test ends: each utterance it was told of ended once,
    with nothing about it after its end (`HeadlessPeer.ending_problems`)."""
    from gateway.devtools.client import HeadlessPeer

    peers: list[HeadlessPeer] = []
    made = HeadlessPeer.__post_init__

    def record(peer: HeadlessPeer) -> None:
        made(peer)
        peers.append(peer)

    monkeypatch.setattr(HeadlessPeer, "__post_init__", record)
    yield
    problems = [f"peer {peer.session_id}: {problem}" for peer in peers for problem in peer.ending_problems()]
    assert not problems, "utterances did not end exactly once:\n" + "\n".join(problems)


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


@pytest.fixture(scope="session")
async def two_tiny_engines(tiny_model_dir: Path, tiny_snac_dir: Path, tmp_path_factory: pytest.TempPathFactory
                           ) -> AsyncIterator[object]:
    """Two real tiny engines in this process (en and pt, the tiny checkpoint served twice, a LoRA voice on en), as
    `bench --models 2 --lora-voice` serves them: every test of several models shares them, through its own table
    (`tests.support.on_shared_engines`); counts of requests per engine are read as deltas."""
    from gateway.speech.synthesizer import Synthesizer

    synth = Synthesizer.load(bench_models_config(tiny_model_dir, tiny_snac_dir, tmp_path_factory.mktemp("models")))
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
