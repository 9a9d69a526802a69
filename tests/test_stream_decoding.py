"""The exact streaming decoder as the synthesizer uses it in its own process: every sentence's audio equals a full
SNAC decode of the frames the engine made (after the fast start's bridge and its crossfade), every frame comes out
once, sentences share launches, and cancelled sentences give their slots back."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from snac import SNAC

from gateway.devtools.snac_reference import reference_decode
from gateway.orpheus import SAMPLES_PER_FRAME
from gateway.speech.stream_decoder import BRIDGE_CROSSFADE, DecodeStream, StreamDecoder
from gateway.speech.synthesizer import Synthesizer, UtteranceStats
from tests.support import wait_until

pytestmark = pytest.mark.engine
INT16_MAX = 32767


async def test_sentences_decode_exactly_and_every_frame_once(synthesizer: Synthesizer, tiny_snac_dir: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    streams = synthesizer.decoder
    assert isinstance(streams, StreamDecoder), "without --snac-socket the decoder runs in this process"
    pushed: dict[int, tuple[DecodeStream, list[Any]]] = {}
    real_push = streams.push

    def push(stream: DecodeStream, frames: Any) -> None:
        pushed.setdefault(id(stream), (stream, []))[1].extend(frames)
        real_push(stream, frames)

    monkeypatch.setattr(streams, "push", push)
    stats = UtteranceStats()
    chunks = [c async for c in synthesizer.utterance("Exactly this. And this too!", "tara", seed=3, stats=stats)]
    assert stats.sentences == 2 and len(pushed) == 2
    by_sentence: dict[int, list[np.ndarray]] = {}
    for chunk in chunks:
        by_sentence.setdefault(chunk.sentence_index, []).append(chunk.pcm)
    model = SNAC.from_pretrained(str(tiny_snac_dir)).eval()
    compared = 0
    for index, (stream, frames) in enumerate(pushed.values()):
        pcm = np.concatenate(by_sentence[index])
        assert len(pcm) == len(frames) * SAMPLES_PER_FRAME, "every frame's audio exactly once"
        assert stream.handle is not None
        want = reference_decode(model, [frames], [stream.handle.seed])[0]
        exact_from = stream.handle.handover + BRIDGE_CROSSFADE
        if len(frames) * SAMPLES_PER_FRAME > exact_from + 2048:
            got = pcm[exact_from:-synthesizer._fade_samples or None].astype(np.float32) / INT16_MAX
            ref = np.clip(want[exact_from:len(got) + exact_from], -1, 1)
            assert np.max(np.abs(got - ref)) <= 2.5 / INT16_MAX, "after the bridge, a full decode's samples"
            compared += len(got)
    assert compared > 0, "a sentence outlived the hand-over: the exact decoder's samples were compared"


async def test_concurrent_sentences_share_launches_and_give_slots_back(synthesizer: Synthesizer) -> None:
    streams = synthesizer.decoder
    assert isinstance(streams, StreamDecoder)
    free_before = len(streams.snac._free)
    launches, stepped = streams.stats.batches, streams.stats.windows  # since start-up: compare the differences
    texts = [f"Stream number {i} speaks now." for i in range(12)]
    results = await asyncio.gather(*(_audio(synthesizer, t, i) for i, t in enumerate(texts)))
    assert all(samples > 0 and samples % SAMPLES_PER_FRAME == 0 for samples in results)
    stepped = streams.stats.windows - stepped
    assert stepped > 0 and streams.stats.batches - launches < stepped, "several streams per launch"
    # Cancel mid-stream: the slot comes back and nothing is left behind.
    utterance = synthesizer.utterance("A long sentence we interrupt right after its first audio.", "tara",
                                      max_tokens=700, seed=2)
    await anext(utterance)
    await utterance.aclose()
    await wait_until(lambda: len(streams.snac._free) == free_before and not streams._streams, timeout=30)
    assert streams.snac.stats.decoded_per_new_frame < 2.0  # short test sentences; long ones approach 1.08


async def _audio(synthesizer: Synthesizer, text: str, seed: int) -> int:
    return sum([len(c.pcm) async for c in synthesizer.utterance(text, "leo", seed=seed)])
