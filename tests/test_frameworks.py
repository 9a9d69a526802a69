"""The voice-agent frameworks' own TTS classes, unchanged, against the gateway on the real engine (tiny model):
pipecat (`OpenAITTSService`, `CartesiaTTSService` in a real pipeline) and LiveKit Agents (`openai.TTS`,
`cartesia.TTS` streams), pointed at the gateway by `base_url` / `url` alone.

What is checked: audio arrives; word frames / timed transcripts arrive, cover the text in order and lie inside the
audio; text streamed in pieces is one utterance (one context, one engine request per sentence); an interruption
(pipecat's `InterruptionFrame`, LiveKit's `aclose` of a stream) aborts the running engine request and ends the
gateway's context once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.edge.cartesia_ws import CARTESIA_PATH
from gateway.edge.state import GatewayState
from gateway.speech.synthesizer import Synthesizer
from tests.support import EVENT_TIMEOUT_S, running, wait_until

pipecat_frames = pytest.importorskip("pipecat.frames.frames")
lk_agents = pytest.importorskip("livekit.agents")

from livekit.agents import APIConnectOptions, utils  # noqa: E402
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402
from livekit.plugins import cartesia as lk_cartesia  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.task import PipelineParams  # noqa: E402
from pipecat.pipeline.worker import PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.cartesia.tts import CartesiaTTSService  # noqa: E402
from pipecat.services.openai.tts import OpenAITTSService  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

pytestmark = pytest.mark.engine

F = pipecat_frames
API_KEY = "unused-auth-is-off"
RATE = 16000  # what the agents ask for (a telephony-friendly rate, not the gateway's own 24 kHz)
SENTENCES = [f"Sentence {i} of a long answer that will be interrupted." for i in range(8)]


@pytest.fixture(scope="module")
async def gateway_url(test_config: GatewayConfig, synthesizer: Synthesizer
                      ) -> AsyncIterator[tuple[str, GatewayState]]:
    async with running(test_config, synthesizer) as (base, gateway):
        yield base, gateway


def contexts_ended(gateway: GatewayState, outcome: str) -> float:
    return gateway.metrics.stream_contexts_total.labels(outcome)._value.get()


# --- pipecat -------------------------------------------------------------------------------------------------

class Collector(FrameProcessor):
    """The pipeline's last processor: keeps every frame that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[Any] = []
        self.audio = asyncio.Event()
        self.stopped = asyncio.Event()

    async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.frames.append(frame)
        if isinstance(frame, F.TTSAudioRawFrame):
            self.audio.set()
        if isinstance(frame, (F.TTSStoppedFrame, F.ErrorFrame)):
            self.stopped.set()
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list[Any]:
        return [f for f in self.frames if isinstance(f, kind)]


@contextlib.asynccontextmanager
async def pipeline(tts: Any) -> AsyncIterator[tuple[PipelineWorker, Collector]]:
    collector = Collector()
    worker = PipelineWorker(Pipeline([tts, collector]), params=PipelineParams(audio_out_sample_rate=RATE),
                            enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running_task = asyncio.create_task(runner.run())
    try:
        yield worker, collector
    finally:
        await worker.queue_frame(F.EndFrame())
        await asyncio.wait_for(running_task, EVENT_TIMEOUT_S)


def cartesia_service(base: str) -> CartesiaTTSService:
    # stop_frame_timeout_s: pipecat ends a context that is silent this long; the tiny model on a shared 2-core CPU
    # can take longer than pipecat's 3 s default to its first audio.
    return CartesiaTTSService(api_key=API_KEY, url=base.replace("http", "ws", 1) + CARTESIA_PATH,
                              settings=CartesiaTTSService.Settings(voice="tara"), sample_rate=RATE,
                              stop_frame_timeout_s=EVENT_TIMEOUT_S)


async def test_pipecat_openai_tts_with_an_openai_voice_name(gateway_url: tuple[str, GatewayState]) -> None:
    base, _ = gateway_url
    tts = OpenAITTSService(api_key=API_KEY, base_url=base + "/v1", voice="alloy", sample_rate=24000)
    async with pipeline(tts) as (worker, collector):
        await worker.queue_frame(F.TTSSpeakFrame("Good morning, class."))
        await asyncio.wait_for(collector.stopped.wait(), EVENT_TIMEOUT_S)
    assert not collector.of(F.ErrorFrame), collector.of(F.ErrorFrame)
    assert sum(len(f.audio) for f in collector.of(F.TTSAudioRawFrame)) > 0


async def test_pipecat_cartesia_streams_text_in_and_word_frames_out(gateway_url: tuple[str, GatewayState],
                                                                    synthesizer: Synthesizer) -> None:
    base, gateway = gateway_url
    engine: Any = synthesizer.engine
    started, done = engine.requests_started, contexts_ended(gateway, "done")
    pieces = ["Hello there, ", "my friend. How ", "are you ", "today?"]
    async with pipeline(cartesia_service(base)) as (worker, collector):
        await worker.queue_frames([F.LLMFullResponseStartFrame(), *(F.LLMTextFrame(p) for p in pieces),
                                   F.LLMFullResponseEndFrame()])
        await asyncio.wait_for(collector.stopped.wait(), EVENT_TIMEOUT_S)
    assert not collector.of(F.ErrorFrame), collector.of(F.ErrorFrame)
    audio = collector.of(F.TTSAudioRawFrame)
    assert audio and {f.sample_rate for f in audio} == {RATE}
    assert len({f.context_id for f in audio}) == 1, "the pieces are one utterance: one context"
    assert engine.requests_started - started == 2, "one engine request per sentence"
    assert contexts_ended(gateway, "done") == done + 1
    # One word frame per word (pipecat times each from the gateway's timestamps; untimed words would come as one
    # frame of the rest at the end), in the text's order, timed inside the audio.
    words = collector.of(F.TTSTextFrame)
    assert [w.text for w in words] == ["Hello", "there", "my", "friend", "How", "are", "you", "today"]
    pts = [w.pts for w in words]
    assert pts == sorted(pts)
    audio_ns = sum(len(f.audio) for f in audio) / 2 / RATE * 1e9
    assert pts[-1] - pts[0] <= audio_ns


async def test_pipecat_interruption_aborts_the_engine_request(gateway_url: tuple[str, GatewayState],
                                                              synthesizer: Synthesizer) -> None:
    base, gateway = gateway_url
    engine: Any = synthesizer.engine
    started, aborted = engine.requests_started, engine.requests_aborted
    cancelled = contexts_ended(gateway, "cancelled")
    async with pipeline(cartesia_service(base)) as (worker, collector):
        await worker.queue_frames([F.LLMFullResponseStartFrame(), *(F.LLMTextFrame(s + " ") for s in SENTENCES)])
        await asyncio.wait_for(collector.audio.wait(), EVENT_TIMEOUT_S)
        await worker.queue_frame(F.InterruptionFrame())
        await wait_until(lambda: contexts_ended(gateway, "cancelled") == cancelled + 1, EVENT_TIMEOUT_S)
    await wait_until(lambda: engine.in_flight == 0 and engine.unfinished_requests() == 0, EVENT_TIMEOUT_S)
    assert engine.requests_aborted == aborted + 1, "the running request was aborted, not finished"
    assert engine.requests_started - started < len(SENTENCES)
    assert contexts_ended(gateway, "cancelled") == cancelled + 1, "the context ended once"
    assert gateway.admission.streams == 0


# --- LiveKit Agents ------------------------------------------------------------------------------------------

async def test_livekit_openai_tts(gateway_url: tuple[str, GatewayState]) -> None:
    base, _ = gateway_url
    async with utils.http_context.open():
        tts = lk_openai.TTS(base_url=base + "/v1", api_key=API_KEY, voice="alloy", model="gpt-4o-mini-tts")
        events = [ev async for ev in tts.synthesize("Good morning, class.",
                                                    conn_options=APIConnectOptions(timeout=EVENT_TIMEOUT_S))]
        await tts.aclose()
    assert sum(ev.frame.samples_per_channel for ev in events) > 0


async def test_livekit_cartesia_streams_text_in_and_timed_words_out(gateway_url: tuple[str, GatewayState],
                                                                     synthesizer: Synthesizer) -> None:
    base, gateway = gateway_url
    engine: Any = synthesizer.engine
    started, done = engine.requests_started, contexts_ended(gateway, "done")
    async with utils.http_context.open():
        tts = lk_cartesia.TTS(api_key=API_KEY, base_url=base, voice="tara", sample_rate=RATE)
        stream = tts.stream(conn_options=APIConnectOptions(timeout=EVENT_TIMEOUT_S))
        for piece in ["Good morning, ", "class. Today we ", "read a story."]:
            stream.push_text(piece)
        stream.end_input()
        events = [ev async for ev in stream]
        await stream.aclose()
        await tts.aclose()
    assert {ev.frame.sample_rate for ev in events} == {RATE}
    assert len({ev.segment_id for ev in events}) == 1
    assert engine.requests_started - started == 2
    assert contexts_ended(gateway, "done") == done + 1
    timed = [t for ev in events for t in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    # The plugin re-attaches the text's spaces and punctuation to the words it was sent: compare the words.
    assert [w for t in timed for w in re.findall(r"\w+", t)] == ["Good", "morning", "class", "Today", "we", "read",
                                                                 "a", "story"]
    starts = [t.start_time for t in timed]
    assert starts == sorted(starts)
    audio_s = sum(ev.frame.samples_per_channel for ev in events) / RATE
    assert all(0 <= t.start_time <= t.end_time <= audio_s + 0.01 for t in timed)


async def test_livekit_interruption_aborts_the_engine_request(gateway_url: tuple[str, GatewayState],
                                                              synthesizer: Synthesizer) -> None:
    """An agent's interrupted speech closes its stream; the plugin drops that socket when it next speaks (or
    closes), which cancels the context on the gateway and aborts its engine request. The next turn plays."""
    base, gateway = gateway_url
    engine: Any = synthesizer.engine
    aborted, cancelled = engine.requests_aborted, contexts_ended(gateway, "cancelled")
    async with utils.http_context.open():
        tts = lk_cartesia.TTS(api_key=API_KEY, base_url=base, voice="tara", sample_rate=RATE)
        options = APIConnectOptions(timeout=EVENT_TIMEOUT_S)
        stream = tts.stream(conn_options=options)
        for sentence in SENTENCES:
            stream.push_text(sentence + " ")
        first = await asyncio.wait_for(anext(aiter(stream)), EVENT_TIMEOUT_S)
        assert first.frame.samples_per_channel > 0
        await stream.aclose()  # the interruption
        answer = tts.stream(conn_options=options)  # the next turn
        answer.push_text("Yes?")
        answer.end_input()
        events = [ev async for ev in answer]
        await answer.aclose()
        await tts.aclose()
    assert sum(ev.frame.samples_per_channel for ev in events) > 0
    await wait_until(lambda: contexts_ended(gateway, "cancelled") == cancelled + 1, EVENT_TIMEOUT_S)
    await wait_until(lambda: engine.in_flight == 0 and engine.unfinished_requests() == 0, EVENT_TIMEOUT_S)
    assert engine.requests_aborted == aborted + 1
    assert contexts_ended(gateway, "cancelled") == cancelled + 1


# --- the examples --------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("command", [["pipecat_lesson_bot.py"], ["livekit_agent.py", "offline"]])
async def test_examples_speak_a_lesson_through_the_gateway(gateway_url: tuple[str, GatewayState],
                                                           command: list[str], tmp_path: Path) -> None:
    """Each example, run as a lesson developer would (the tutor's lines on stdin), writes the audio and prints the
    words as they are timed."""
    base, _ = gateway_url
    out = tmp_path / "lesson.wav"
    args = [sys.executable, str(EXAMPLES / command[0]), *command[1:], "-o", str(out)]
    if command[0].startswith("pipecat"):
        args += ["--gateway", base]
    process = await asyncio.create_subprocess_exec(
        *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "GATEWAY_URL": base})
    output, _ = await asyncio.wait_for(process.communicate(b"Good morning, class. Open your books.\n"), 300)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000 and wav.getnframes() > 0
    assert "books" in text and "audio:" in text, text[-3000:]
