"""The synthesis core end to end on the real vLLM engine (CPU) and the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from gateway.orpheus import SAMPLES_PER_FRAME, build_prompt, sentence_token_cap
from gateway.speech.codec import DecodeWindow
from gateway.speech.engine import EngineDeadError, EngineState
from gateway.speech.synthesizer import InvalidRequestError, Synthesizer, UtteranceStats
from tests.support import wait_until

pytestmark = pytest.mark.engine




async def test_engine_warmed_up_before_ready(synthesizer: Synthesizer) -> None:
    """The start-up bursts ran (tests use one burst of 2) and left nothing behind in the engine."""
    assert synthesizer.engine.warmed_up == [2]
    assert synthesizer.engine.unfinished_requests() == 0


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

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(s.frames >= 1 and s.samples == s.frames * SAMPLES_PER_FRAME for s in results)
    assert synthesizer.engine.in_flight == 0
    stats = synthesizer.decoder.stats
    assert stats.batches < stats.windows, "streams were decoded together, several per launch"


async def test_cancel_mid_stream_aborts_engine_request(synthesizer: Synthesizer) -> None:
    stream = synthesizer.utterance("A long sentence that we will interrupt.", "tara", max_tokens=700, seed=11)
    first = await anext(stream)
    assert len(first.pcm) > 0
    assert synthesizer.engine.in_flight == 1
    await stream.aclose()
    assert synthesizer.engine.in_flight == 0
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


class SlowDecoder:
    """The shared SNAC decoder with every round coming back late, as from a busy GPU; records each round."""

    def __init__(self, decoder: Any, delay_s: float) -> None:
        self.decoder = decoder
        self.delay_s = delay_s
        self.rounds: list[list[int]] = []  # new frames of each window, per round
        self.lengths: list[int] = []  # frames of each window, in order
        self.in_flight = 0

    async def decode_many(self, windows: Sequence[DecodeWindow]) -> list[np.ndarray]:
        self.rounds.append([w.keep_count for w in windows])
        self.lengths += [w.length for w in windows]
        self.in_flight += 1
        try:
            await asyncio.sleep(self.delay_s)
            return await self.decoder.decode_many(windows)
        finally:
            self.in_flight -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decoder, name)


def sentence_tasks() -> list[asyncio.Task[Any]]:
    names = ("Synthesizer._sentence", "Synthesizer._decode", "Synthesizer._feed")
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_coro().__qualname__ in names]  # type: ignore[union-attr]


async def test_adaptive_hop_emits_every_frame_once_and_cancels_cleanly(windows_synthesizer: Synthesizer) -> None:
    """A slow decoder: frames pile up during each round and the next window takes them all (up to max hop);
    still exactly frames * 2048 samples, and a cancel mid-round leaves no task and no engine request behind."""
    windows = windows_synthesizer
    slow = SlowDecoder(windows.decoder, delay_s=0.25)
    synth = Synthesizer(windows.config, windows.engine, windows.tokenizer, slow)  # type: ignore[arg-type]
    max_hop = synth.config.decode_max_hop_frames
    for seed in range(20, 40):  # the tiny model stops at random: find an utterance of some length
        slow.rounds.clear()
        stats = UtteranceStats()
        pcm = [c.pcm async for c in synth.utterance("Hello there, slowly.", "tara", seed=seed, stats=stats)]
        assert stats.samples == stats.frames * SAMPLES_PER_FRAME == sum(len(p) for p in pcm)
        hops = [h for r in slow.rounds for h in r]
        assert sum(hops) == stats.frames, "every frame decoded exactly once"
        assert max(hops) <= max_hop
        if stats.frames >= 8:
            break
    assert stats.frames >= 8
    assert hops[0] == 1, "first audio from a one-frame window"
    assert max(hops) > 1, "windows grew while the decoder was busy"
    assert sentence_tasks() == []

    stream = synth.utterance("A long sentence that we will interrupt.", "tara", max_tokens=700, seed=11)
    await anext(stream)
    await wait_until(lambda: slow.in_flight == 1)  # a round is being decoded
    await stream.aclose()
    assert windows_synthesizer.engine.in_flight == 0
    assert sentence_tasks() == []
    await wait_until(lambda: slow.in_flight == 0, timeout=2)
    await wait_until(lambda: windows_synthesizer.engine.unfinished_requests() == 0)


async def test_a_stream_ahead_of_real_time_decodes_whole_windows(windows_synthesizer: Synthesizer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Far enough ahead (the lead is forced: the tiny model on 2 cores is slower than real time), every window
    after the first waits for max_hop new frames; all frames still come out exactly once."""
    windows = windows_synthesizer
    spy = SlowDecoder(windows.decoder, delay_s=0.0)
    synth = Synthesizer(windows.config, windows.engine, windows.tokenizer, spy)  # type: ignore[arg-type]
    monkeypatch.setattr(Synthesizer, "_lead_s", staticmethod(lambda stats: 60.0))
    max_hop = synth.config.decode_max_hop_frames
    for seed in range(20, 40):
        spy.rounds.clear()
        stats = UtteranceStats()
        pcm = [c.pcm async for c in synth.utterance("Hello there, patiently.", "tara", seed=seed, stats=stats)]
        assert stats.samples == stats.frames * SAMPLES_PER_FRAME == sum(len(p) for p in pcm)
        hops = [h for r in spy.rounds for h in r]
        assert sum(hops) == stats.frames
        if stats.frames >= 2 * max_hop + 2:
            break
    assert stats.frames >= 2 * max_hop + 2
    assert hops[0] == 1, "first audio still from a one-frame window"
    assert all(h == max_hop for h in hops[1:-2]), f"whole windows in between: {hops}"
    assert sentence_tasks() == []


@pytest.mark.parametrize(("fast_start_ms", "first_length"), [(0.0, 2), (1e6, 1)])
async def test_first_frame_starts_early_only_when_the_next_frames_come_in_time(
        windows_synthesizer: Synthesizer, fast_start_ms: float, first_length: int) -> None:
    """The first window skips its lookahead frame only when the token rate says frames 2 and 3 arrive within
    decode_fast_start_ms (forced here both ways: 0 = never, 1e6 ms = always); every frame still plays once."""
    windows = windows_synthesizer
    spy = SlowDecoder(windows.decoder, delay_s=0.0)
    config = dataclasses.replace(windows_synthesizer.config, decode_fast_start_ms=fast_start_ms)
    synth = Synthesizer(config, windows_synthesizer.engine, windows_synthesizer.tokenizer, spy)  # type: ignore[arg-type]
    for seed in range(20, 40):
        spy.lengths.clear()
        spy.rounds.clear()
        stats = UtteranceStats()
        pcm = [c.pcm async for c in synth.utterance("Hello there.", "tara", seed=seed, stats=stats)]
        if stats.frames >= 3:
            break
    assert stats.frames >= 3
    assert spy.lengths[0] == first_length and spy.rounds[0] == [1]
    assert sum(h for r in spy.rounds for h in r) == stats.frames
    assert stats.samples == stats.frames * SAMPLES_PER_FRAME == sum(len(p) for p in pcm)


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
